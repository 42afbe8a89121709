"""chv-browser in proxy mode (issue 33, docs/network.md "Egress by name"):
the real service with Debian's chromium, run as nobody in the guest
namespace of tests/helpers/egress_lab.py (nobody a door_uids member by a
drop-in, as the browser role writes chv-browser's), with the real squid
and the role's rendered configuration. The request carries the proxy
chv-broker forwards from the cell's record; squid applies the slot's list
to the door by its source address, the slot's gateway."""

import json
import os
import shutil
import tempfile

import pytest

import browser_helpers
import egress_lab

_SKIP = egress_lab.lab_available() or browser_helpers.SKIP_REASON
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def plab():
    with egress_lab.running_lab({"chv-browser.nft": "add element inet chv_cell door_uids { 65534 }\n"}) as lab:
        yield lab


def test_chv_browser_opens_an_allowed_name_and_is_refused_a_denied_one_through_the_slots_proxy(plab):
    """chv-browser (the real service, Debian's chromium, as nobody in the guest: a door_uids member by a
    drop-in as the browser role writes one) with the proxy chv-broker forwards from the cell record."""
    lab = plab
    root = tempfile.mkdtemp(prefix="chvbr-")
    os.chmod(root, 0o755)
    try:
        b = browser_helpers.BrowserProc(root, netns=lab.guest)
        try:
            proxy = lab.door_url(0)
            ok = b.call({"slot": "slot0", "action": "open", "url": "http://allowed.test/", "proxy": proxy})
            assert ok.get("ok") is True and ok["result"]["status"] == 200, (ok, b.log_tail())
            assert "hello from 198.20.1.1:80" in json.dumps(ok["result"])            # control: the page arrived
            refused = b.call({"slot": "slot0", "action": "open", "url": "http://denied.test/", "proxy": proxy})
            assert refused.get("ok") is True and refused["result"]["status"] == 403, refused
            assert lab.reached("198.20.2.1:80") == []                                 # not a byte reached it
            # without the proxy (a request that names none) the kernel lets chromium nowhere (drop_door_direct)
            seen = len(lab.reached("198.20.1.1:80"))
            direct = b.call({"slot": "slot1", "action": "open", "url": "http://198.20.1.1/"})
            assert direct.get("ok") is False, direct
            assert len(lab.reached("198.20.1.1:80")) == seen
        finally:
            b.stop()
        hosts = [(r["slot"], r["src"], r["method"], r["host"], r["verdict"]) for r in lab.log_lines()]
        gateway = lab.slots[0]["gateway"]
        assert ("slot0", gateway, "GET", "allowed.test", "allowed") in hosts
        assert ("slot0", gateway, "GET", "denied.test", "denied") in hosts
        assert {h[1] for h in hosts} == {gateway}
    finally:
        shutil.rmtree(root, ignore_errors=True)
