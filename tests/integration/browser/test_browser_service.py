"""chv-browser end to end: real socket, real Playwright, Debian's chromium, a page on 127.0.0.1."""
import os
import struct

import pytest

import procs
from browser_helpers import needs_browser

pytestmark = needs_browser


def test_open_returns_heading_in_aria_snapshot(browser, site):
    rep = browser.call({"slot": "slot0", "action": "open", "url": site + "/"})
    assert rep["ok"] is True, rep
    res = rep["result"]
    assert res["title"] == "Cell test page" and res["url"] == site + "/" and res["status"] == 200
    assert '- heading "Hello from the guest" [level=1]' in res["aria_snapshot"]
    assert res["truncated"] is False
    snap = browser.call({"slot": "slot0", "action": "snapshot"})
    assert snap["ok"] is True and snap["result"]["aria_snapshot"] == res["aria_snapshot"]


def test_screenshot_writes_png_and_returns_cell_path(browser, site):
    assert browser.call({"slot": "slot0", "action": "open", "url": site + "/"})["ok"] is True
    rep = browser.call({"slot": "slot0", "action": "screenshot", "name": "front"})
    assert rep["ok"] is True, rep
    assert rep["result"]["path"] == "/run/chv/shots/front.png"
    path = os.path.join(browser.cfg["shots_dir"], "slot0", "front.png")
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1280, 800)
    assert os.stat(path).st_mode & 0o777 == 0o644
    bad = browser.call({"slot": "slot0", "action": "screenshot", "name": "../../etc/x"})
    assert bad["ok"] is False


@pytest.mark.parametrize("url", ["file:///etc/passwd", "data:text/html,<h1>x</h1>", "javascript:alert(1)",
                                 "chrome://version"])
def test_non_http_urls_rejected(browser, site, url):
    assert browser.call({"slot": "slot0", "action": "open", "url": site + "/"})["ok"] is True  # control
    rep = browser.call({"slot": "slot0", "action": "open", "url": url})
    assert rep["ok"] is False and "http" in rep["error"]


@pytest.mark.parametrize("action", ["evaluate", "content", "cdp", "goto", "set_content", "pdf"])
def test_only_four_actions(browser, action):
    rep = browser.call({"slot": "slot0", "action": action, "expression": "document.title", "url": "http://x/"})
    assert rep == {"ok": False, "error": "action must be one of open, snapshot, screenshot, close"}


def test_truncation_is_marked(browser, site):
    rep = browser.call({"slot": "slot1", "action": "open", "url": site + "/long"})
    res = rep["result"]
    assert res["truncated"] is True
    assert len(res["aria_snapshot"].split("\n")) <= 50 and len(res["aria_snapshot"].encode()) <= 4096
    assert "item 0" in res["aria_snapshot"] and "item 399" not in res["aria_snapshot"]


def test_contexts_are_per_slot_and_close(browser, site):
    assert browser.call({"slot": "slotA", "action": "open", "url": site + "/long"})["ok"] is True
    assert browser.call({"slot": "slotB", "action": "open", "url": site + "/"})["ok"] is True
    a = browser.call({"slot": "slotA", "action": "snapshot"})["result"]
    b = browser.call({"slot": "slotB", "action": "snapshot"})["result"]
    assert a["title"] == "Long" and b["title"] == "Cell test page"
    assert browser.call({"slot": "slotA", "action": "close"})["result"] == {"closed": True}
    gone = browser.call({"slot": "slotA", "action": "snapshot"})
    assert gone["ok"] is False and "open first" in gone["error"]
    assert browser.call({"slot": "slotB", "action": "snapshot"})["ok"] is True
    fresh = browser.call({"slot": "slotC", "action": "snapshot"})
    assert fresh["ok"] is False


def test_page_that_leaves_http_is_not_shown(browser, site):
    rep = browser.call({"slot": "slot2", "action": "open", "url": site + "/escape"})
    # Chromium blocks top-level navigation to data: URLs; either way nothing but http(s) is described
    if rep["ok"]:
        assert rep["result"]["url"].startswith("http")
    else:
        assert "left http" in rep["error"]


def test_downloads_are_not_saved(browser, site):
    rep = browser.call({"slot": "slot3", "action": "open", "url": site + "/download"})
    assert rep["ok"] is False  # navigation turns into a download, which is refused
    for root, _dirs, files in os.walk(browser.root):
        assert not any(f.endswith(".zip") for f in files)


def test_chromium_runs_sandboxed_as_the_service_user(browser):
    kids = []
    for p, argv in procs.cmdlines():
        cmd = b"\0".join(argv)
        if b"--type=renderer" in cmd and b"chromium" in cmd:
            try:
                kids.append((p, os.stat("/proc/" + p).st_uid, cmd))
            except OSError:
                continue
    assert kids, "no renderer found"
    for pid, uid, cmd in kids:
        assert b"--no-sandbox" not in cmd
        assert os.readlink("/proc/%s/ns/user" % pid) != os.readlink("/proc/self/ns/user")  # namespace sandbox
    assert b"--remote-debugging-port" not in b"".join(c for dummy, dummy, c in kids)
