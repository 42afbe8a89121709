"""chv-browser serves slots concurrently, each request within request_timeout (real chromium, real socket).

Only ordering and completion are asserted, never durations: a page on the
test server (/stall/<key>) does not answer until the test releases it.
"""
import json
import os
import threading
import time

from browser_helpers import STALL, needs_browser, running_browser
from chv_guest.wire.wire import WireError

pytestmark = needs_browser


def _call_in_thread(b, replies, name, req):
    def run():
        try:
            replies[name] = b.call(req, timeout=600)
        except (OSError, WireError) as exc:  # the service went away without answering
            replies[name] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_stuck_slot_does_not_hold_up_another(site):
    # both timeouts far beyond the test: slot0's page stays pending until the test releases it
    with running_browser(navigation_timeout=500.0, request_timeout=500.0) as b:
        key = "concurrent"
        replies = {}
        t_open = _call_in_thread(b, replies, "open0", {"slot": "slot0", "action": "open",
                                                       "url": site + "/stall/" + key})
        t_snap = None
        try:
            # generous: chromium's first start on a loaded 2-core machine (make test runs lanes at once)
            assert STALL.arrived(key).wait(300), ("slot0's navigation never reached the test server", replies,
                                                  b.log_tail())
            # same slot: must wait for slot0's open, not run alongside it
            t_snap = _call_in_thread(b, replies, "snap0", {"slot": "slot0", "action": "snapshot"})
            rep1 = b.call({"slot": "slot1", "action": "open", "url": site + "/"})
            shot1 = b.call({"slot": "slot1", "action": "screenshot", "name": "meanwhile"})
            # slot1 was answered, twice, while both of slot0's requests are still pending
            assert "open0" not in replies and "snap0" not in replies, replies
            assert rep1["ok"] is True and rep1["result"]["title"] == "Cell test page", rep1
            assert shot1["ok"] is True, shot1
        finally:
            STALL.release(key)
            t_open.join(120)
            if t_snap is not None:
                t_snap.join(120)
        assert isinstance(replies["open0"], dict) and replies["open0"]["ok"] is True, replies["open0"]
        assert replies["open0"]["result"]["title"] == "Slow page"
        # the queued snapshot ran after the open had finished, on the page it loaded
        assert isinstance(replies["snap0"], dict) and replies["snap0"]["ok"] is True, replies["snap0"]
        assert replies["snap0"]["result"]["title"] == "Slow page"
        assert '- heading "Finally here" [level=1]' in replies["snap0"]["result"]["aria_snapshot"]


def test_request_past_deadline_errors_and_the_slot_works_afterwards(site):
    with running_browser(navigation_timeout=500.0, request_timeout=5.0) as b:
        # chromium starts with the first request; a launch that outlives its request's deadline
        # carries on for the next one, so this settles after at most a few attempts
        for dummy in range(20):
            warm = b.call({"slot": "warmup", "action": "open", "url": site + "/"})
            if warm["ok"]:
                break
        assert warm["ok"] is True, warm
        key = "deadline"
        try:
            rep = b.call({"slot": "slot0", "action": "open", "url": site + "/stall/" + key})
            assert STALL.arrived(key).is_set()
            assert rep["ok"] is False
            assert rep["error"].startswith("deadline passed: no answer within request_timeout (5s)"), rep
            # the timed-out page was closed, not left loading: chromium hung up on the stalled request
            assert STALL.abandoned(key).wait(120), "chromium kept loading the timed-out page"
            gone = b.call({"slot": "slot0", "action": "snapshot"})
            assert gone["ok"] is False and "open first" in gone["error"], gone
            again = b.call({"slot": "slot0", "action": "open", "url": site + "/"})
            assert again["ok"] is True and again["result"]["title"] == "Cell test page", again
            assert b.call({"slot": "slot0", "action": "snapshot"})["result"]["title"] == "Cell test page"
            assert b.call({"slot": "slot0", "action": "screenshot", "name": "after"})["ok"] is True
            assert os.path.exists(os.path.join(b.cfg["shots_dir"], "slot0", "after.png"))
            assert b.call({"slot": "slot0", "action": "close"})["result"] == {"closed": True}
        finally:
            STALL.release(key)
        with open(b.log, encoding="utf-8") as fh:
            events = [json.loads(line) for line in fh if line.startswith("{")]
        assert {"event": "chv-browser", "slot": "slot0", "action": "close", "verdict": "deadline"} in events
        failed = [e for e in events
                  if e.get("slot") == "slot0" and e.get("action") == "open" and e["verdict"] == "error"]
        assert len(failed) == 1 and "request_timeout" in failed[0]["reason"]


def _descendants(pid):
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/stat" % p) as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            kids.setdefault(int(fields[1]), []).append(int(p))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _running(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def test_idle_contexts_are_reaped_and_shutdown_closes_chromium(site):
    with running_browser(idle_timeout=1.0) as b:
        assert b.call({"slot": "slotI", "action": "open", "url": site + "/"})["ok"] is True
        assert b.call({"slot": "slotK", "action": "open", "url": site + "/"})["ok"] is True
        reaped = set()
        for dummy in range(1200):  # ~60 s at most; the reaper looks every 0.5 s here
            with open(b.log, encoding="utf-8") as fh:
                reaped = {e.get("slot") for e in map(json.loads, (ln for ln in fh if ln.startswith("{")))
                          if e.get("verdict") == "idle-timeout"}
            if {"slotI", "slotK"} <= reaped:
                break
            time.sleep(0.05)
        assert {"slotI", "slotK"} <= reaped
        gone = b.call({"slot": "slotI", "action": "snapshot"})
        assert gone["ok"] is False and "open first" in gone["error"]
        # a reaped slot opens again
        assert b.call({"slot": "slotI", "action": "open", "url": site + "/"})["ok"] is True
        # shut down with a request in flight: its client gets an answer, the service still exits cleanly
        key = "shutdown"
        replies = {}
        t_open = _call_in_thread(b, replies, "open", {"slot": "slotS", "action": "open",
                                                      "url": site + "/stall/" + key})
        try:
            assert STALL.arrived(key).wait(300), ("slotS's navigation never reached the test server", replies,
                                                  b.log_tail())
            chromium = [p for p in _descendants(b.proc.pid) if _running(p)]
            assert chromium, "no chromium below the service"
            b.stop()
            t_open.join(120)
        finally:
            STALL.release(key)
        assert b.proc.returncode == 0  # SIGTERM ended it; stop() did not have to SIGKILL
        assert isinstance(replies["open"], dict) and replies["open"]["ok"] is False, replies
        for dummy in range(600):
            if not any(_running(p) for p in chromium):
                break
            time.sleep(0.05)
        assert not [p for p in chromium if _running(p)], "chromium outlived chv-browser"
