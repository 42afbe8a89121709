"""chv-browser's test build for `chv-cell audit --counter-proof`
(chv_guest/browser/testbuild.py): the reply to an open carries the page's
HTML, beside the installed Engine's reply to the same page (the control),
both judged by BRW-04 as the audit judges them; and the wrapper refuses any
start but the counter-proof's, as root, before it drops to the service's
user."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from testpaths import SRC

from chv_guest.browser import server, testbuild
from chv_guest.cell import catalog, doorbuild
from chv_guest.cell.catalog import facts as factsmod
from chv_guest.wire import testbuild as guard

SLOT = "slot0"
HTML = ("<html><head><title>chv-audit</title></head><body><h1>chv-audit</h1>"
        "<!-- %s --><script>var marker = '%s';</script></body></html>" % (factsmod.RAW_MARKER, factsmod.RAW_MARKER))


class Page:
    """What an open uses of a Playwright page, on the audit's page."""

    url = "http://10.99.20.1:18770/"

    async def goto(self, url, wait_until=None):
        return type("Response", (), {"status": 200})()

    def locator(self, _selector):
        return self

    async def aria_snapshot(self):
        return '- heading "chv-audit" [level=1]'

    async def title(self):
        return "chv-audit"

    async def content(self):
        return HTML


class Context:
    async def close(self):
        pass


def _open(cls):
    eng = cls(dict(server.DEFAULTS))
    try:
        eng.contexts[SLOT] = {"context": Context(), "page": Page(), "used": 0.0, "cell": None, "pages": set(),
                              "popups_closed": 0}
        return eng.loop.run_until_complete(eng.op_open(SLOT, Page.url))
    finally:
        eng.loop.close()


def _brw04(result):
    """BRW-04's verdict on an open of the allowed page that returned ``result``."""
    reply = {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": result})}
    facts = {"a": {"browser": {"allowed": reply, "denied": {}}}, "guest": {}, "slot_a": {"address": "10.99.20.6"}}
    return catalog.BY_ID["BRW-04"].verdict(facts)


def test_the_installed_engine_returns_the_snapshot_only_and_brw04_passes():
    result = _open(server.Engine)
    assert set(result) == factsmod.SNAPSHOT_KEYS
    assert _brw04(result)["verdict"] == "pass"


def test_the_raw_html_build_returns_the_pages_html_and_brw04_fails():
    result = _open(testbuild.RawHtmlEngine)
    assert result.pop("html") == HTML
    assert result == _open(server.Engine)  # nothing else changed
    verdict = _brw04(dict(result, html=HTML))
    assert verdict["verdict"] == "fail" and "raw HTML in the reply: yes" in verdict["probe"], verdict


def test_drop_to_refuses_root():
    with pytest.raises(SystemExit, match="never runs as root"):
        testbuild.drop_to("root")


@pytest.mark.skipif(os.geteuid() != 0, reason="the guard's counter-proof directory is root's under /run")
def test_the_wrapper_refuses_a_start_that_is_not_the_counter_proofs():
    """The counter-proof's own directory, but another parent than the one its
    owner file names (as a start by systemd or a shell would be): refused
    before anything is bound."""
    d = doorbuild.make_run_dir()
    try:
        with open(os.path.join(d, doorbuild.OWNER_FILE), "w") as fh:
            fh.write("1\n")
        config = os.path.join(d, "browser.json")
        with open(config, "w") as fh:
            json.dump({"socket": os.path.join(d, "sock", "browser.sock"), "shots_dir": os.path.join(d, "shots")}, fh)
        p = subprocess.run([sys.executable, "-I", "-c", doorbuild.ENTRY % (SRC, "browser"), "--run-dir", d,
                            "--variant", "raw-html", "--user", "nobody", "--config", config],
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == guard.EXIT_REFUSED and "not started by the counter-proof" in p.stderr, p.stderr
        assert not os.path.exists(os.path.join(d, "sock"))
    finally:
        shutil.rmtree(d)


def test_the_replies_describe_runs_on_every_open_and_snapshot():
    """RawHtmlEngine replaces _describe: both replies of a page go through it."""
    eng = testbuild.RawHtmlEngine(dict(server.DEFAULTS))
    try:
        eng.contexts[SLOT] = {"context": Context(), "page": Page(), "used": 0.0, "cell": None, "pages": set(),
                              "popups_closed": 0}
        snap = eng.loop.run_until_complete(eng.op_snapshot(SLOT))
    finally:
        eng.loop.close()
    assert snap["html"] == HTML
