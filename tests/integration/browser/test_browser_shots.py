"""chv-browser's screenshot quota and a full file system, on a real tmpfs.

The slot's screenshot directory is a tmpfs of 256 KiB of its own (as
/run is a tmpfs on a guest): the real service with Debian's chromium takes
screenshots of one page until the quota prunes, then a filler file takes
every free byte of the tmpfs.
"""
import errno
import os
import subprocess

import pytest

from browser_helpers import needs_browser, running_browser

pytestmark = needs_browser

KEEP = 3
SLOT = "slotQ"


@pytest.fixture(scope="module")
def quota_browser():
    with running_browser(shots_keep=KEEP) as b:
        yield b


@pytest.fixture
def small_tmpfs(quota_browser):
    """The slot's screenshot directory as a 256 KiB tmpfs owned by the service's user (nobody)."""
    d = os.path.join(quota_browser.cfg["shots_dir"], SLOT)
    os.makedirs(d, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,uid=65534,gid=65534,mode=0755", "tmpfs", d], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)


def fill(path):
    """Write zeros to ``path`` until the file system is full; return the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as fh:
        chunk = b"\0" * 4096
        while True:
            try:
                written += fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return written


def shot(b, name, slot=SLOT):
    return b.call({"slot": slot, "action": "screenshot", "name": name})


def test_a_full_shots_tmpfs_is_an_error_the_quota_prunes_and_the_service_goes_on(quota_browser, site, small_tmpfs):
    b, d = quota_browser, small_tmpfs
    assert b.call({"slot": SLOT, "action": "open", "url": site + "/"})["ok"] is True
    # the quota: never more than KEEP screenshots, the oldest go first
    sizes = []
    for i in range(1, 6):
        rep = shot(b, "s%d" % i)
        assert rep["ok"] is True, rep
        sizes.append(rep["result"]["bytes"])
        assert sorted(os.listdir(d)) == ["s%d.png" % j for j in range(max(1, i - KEEP + 1), i + 1)], b.log_tail()
    assert len(set(sizes)) == 1, sizes  # one page, one picture: each takes the room the oldest leaves
    before = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}

    # the tmpfs full: a new screenshot takes the room of the oldest one, removed first
    filler = os.path.join(d, "filler")
    assert fill(filler) > 0
    rep = shot(b, "s6")
    assert rep["ok"] is True, rep
    assert sorted(os.listdir(d)) == ["filler", "s4.png", "s5.png", "s6.png"]
    # ... but replacing one leaves nothing to remove: no space, an error naming where
    rep = shot(b, "s6")
    assert rep == {"ok": False, "error": "screenshot /run/chv/shots/s6.png not saved: no space left on device "
                                         "(host directory %s)" % d}, b.log_tail()
    assert sorted(os.listdir(d)) == ["filler", "s4.png", "s5.png", "s6.png"]  # no .s6.png.tmp left
    assert {n: open(os.path.join(d, n), "rb").read() for n in ("s4.png", "s5.png")} == \
        {n: before[n] for n in ("s4.png", "s5.png")}
    assert os.path.getsize(os.path.join(d, "s6.png")) == sizes[0]  # the one written before stays whole

    # the service goes on: the page of that slot, and another slot's screenshot
    snap = b.call({"slot": SLOT, "action": "snapshot"})
    assert snap["ok"] is True and snap["result"]["title"] == "Cell test page", snap
    assert b.call({"slot": "slotR", "action": "open", "url": site + "/"})["ok"] is True
    assert shot(b, "other", slot="slotR")["ok"] is True
    assert os.path.exists(os.path.join(b.cfg["shots_dir"], "slotR", "other.png"))

    # room again: the same screenshot succeeds
    os.unlink(filler)
    rep = shot(b, "s6")
    assert rep["ok"] is True, rep
    assert sorted(os.listdir(d)) == ["s4.png", "s5.png", "s6.png"]
