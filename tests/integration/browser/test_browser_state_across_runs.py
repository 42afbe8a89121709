"""A slot's browser state does not outlive its cell's run; a slot's popups are capped.

Real parts end to end: `chv-cell run` starts real cells (nspawn) of a
throwaway policy (veth lbs50, subnet 10.231.50.0/24, its own state dir);
in the cell, a payload talks to a real chv-broker (its peer check reads the
launcher's cell records) through the socket bound at /run/chv; the broker
forwards to a real chv-browser (Debian's chromium, as `nobody`) that opens
pages of a site on 127.0.0.1 outside the cell.

Run 1 of slot0 opens a page that sets a cookie and localStorage (its
positive control: a second page of run 1 sees both); run 1 ends; run 2 of
slot0 must find no page (snapshot), and a page it opens (positive control:
open works) sees no cookie (neither in document.cookie nor in the request
chromium sent) and no storage. The counter-proof is the same two runs with
the launcher's end switched off (policy browser_socket ""), as the code
before this change behaved (the broker's reaper is off here, as it would
not have run within 15 s): run 2 then gets run 1's page, cookie and storage.
"""
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from broker_helpers import BrokerProc, make_listener
from browser_helpers import QuietHandler, running_browser, serving
from cellrt import ENTRY, NEEDS_REAL_CELLS, NOISE
from chv_guest.broker import client as broker_client

pytestmark = NEEDS_REAL_CELLS

TAG = "bs%d" % os.getpid()
SLOT = {"name": "slot0", "index": 0, "machine": "lbs-slot0", "host_ifname": "lbs50", "cell_ifname": "eth0",
        "subnet": "10.231.50.0/24", "gateway": "10.231.50.1", "address": "10.231.50.2", "prefixlen": 24,
        "uid_base": 3500000, "uid_size": 65536}

SET_STATE = b"""<!doctype html><html><head><title>state set</title></head><body><h1>set</h1>
<script>localStorage.setItem("token", "run1-storage-secret");</script></body></html>"""
# shows what the context holds: the cookie header chromium sent (filled in by the server),
# document.cookie and localStorage, as headings in the page's accessibility tree
SHOW_STATE = """<!doctype html><html><head><title>state shown</title></head><body>
<h1>sent:[%s]</h1><h2 id="c"></h2><h3 id="s"></h3>
<script>document.getElementById("c").textContent = "cookie:[" + document.cookie + "]";
document.getElementById("s").textContent = "storage:[" + (localStorage.getItem("token") || "") + "]";</script>
</body></html>"""
POPUPS = b"""<!doctype html><html><head><title>popups</title></head><body><h1>many popups</h1>
<script>for (let i = 0; i < 50; i++) { window.open("/child?id=" + i, "_blank"); }
setInterval(() => fetch("/beacon?id=main"), 50);</script></body></html>"""
CHILD = b"""<!doctype html><html><head><title>child</title></head><body><h1>child</h1>
<script>setInterval(() => fetch("/beacon?id=" + new URLSearchParams(location.search).get("id")), 50);</script>
</body></html>"""


class Site(QuietHandler):
    beacons = []
    beacon_seen = threading.Condition()

    def do_GET(self):  # noqa: N802 (stdlib name)
        path, _, query = self.path.partition("?")
        extra = {}
        if path == "/set":
            body, extra = SET_STATE, {"Set-Cookie": "sid=run1-cookie-secret; Path=/; Max-Age=3600"}
        elif path == "/show":
            body = (SHOW_STATE % (self.headers.get("Cookie") or "")).encode()
        elif path == "/popups":
            body = POPUPS
        elif path == "/child":
            body = CHILD
        elif path == "/beacon":
            with Site.beacon_seen:
                Site.beacons.append(query.partition("=")[2])
                Site.beacon_seen.notify_all()
            body = b"ok"
        else:
            body = b"not found"
        self.reply(200, body, "text/html" if body.startswith(b"<") else "text/plain", extra)


@pytest.fixture(scope="module")
def site():
    with serving(Site) as url:
        yield url


# the payload in the cell: each argument is one request to chv-broker, sent by the in-cell client's
# request(); prints the replies (the client's source goes along: /usr is all a cell sees of the host's files)
CLIENT = r"""
import json, sys
client = {"__name__": "chv_broker_client"}
exec(%r, client)
print(json.dumps([json.loads(client["request"](arg, timeout=60)) for arg in sys.argv[1:]]))
""" % open(broker_client.__file__, encoding="utf-8").read()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("bstate")
    os.chmod(root, 0o755)
    door = root / "door"
    door.mkdir(mode=0o755)
    state_dir = "/run/chv-fleet-%s" % TAG
    with running_browser(navigation_timeout=15.0, request_timeout=40.0) as browser:
        bcfg = {"cells_dir": os.path.join(state_dir, "cells"), "workspaces_dir": str(root / "ws"),
                "read_timeout": 5.0, "sync": {"enabled": False},
                "browser": {"socket": browser.cfg["socket"], "timeout": 45.0, "reap_interval": 0}}
        config = root / "broker.json"
        config.write_text(json.dumps(bcfg))
        listener = make_listener(str(door / "broker.sock"))
        broker = BrokerProc(listener, str(config)).start()
        pol = {"version": 1, "state_dir": state_dir, "workspace_root": str(root / "ws"),
               "agent_state_root": str(root / "state"), "inaccessible": ["/etc/chv"],
               "writable_binds": [{"source": str(door), "target": "/run/chv", "optional": False}],
               "dns_servers": ["192.0.2.53"], "claim_timeout": 30, "stop_grace": 1, "require_ruleset": False,
               "browser_socket": browser.cfg["socket"], "slots": [SLOT]}
        policies = {}
        for name, extra in (("ends", {}), ("old", {"browser_socket": ""})):
            path = root / ("%s.json" % name)
            path.write_text(json.dumps(dict(pol, **extra)))
            policies[name] = str(path)
        try:
            yield {"browser": browser, "broker": broker, "policy": policies, "state_dir": state_dir}
        finally:
            broker.stop()
            listener.close()
            shutil.rmtree(state_dir, ignore_errors=True)


def cell_run(policy, *requests):
    """One run of slot0 whose payload sends ``requests`` to chv-broker; their replies."""
    argv = [sys.executable, "-I", ENTRY, "--policy", policy, "-v", "run", "--slot", "slot0", "--",
            "/usr/bin/python3", "-I", "-c", CLIENT] + [json.dumps(r) for r in requests]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    err = "".join(ln for ln in r.stderr.splitlines(True) if not ln.startswith(NOISE))
    assert r.returncode == 0, (r.returncode, r.stdout, err)  # 125 would be a setup failure, never a pass
    return json.loads(r.stdout.strip().splitlines()[-1]), err


def browser_op(action, **fields):
    return dict({"op": "browser", "action": action}, **fields)


def two_runs(lab, site, policy):
    """Run 1 sets state and checks it sees it; run 2 looks for it. Returns run 2's replies and logs."""
    run1, log1 = cell_run(policy, browser_op("open", url=site + "/set"), browser_op("open", url=site + "/show"),
                          browser_op("snapshot"))
    assert [r["ok"] for r in run1] == [True, True, True], run1
    shown = run1[1]["result"]["aria_snapshot"]
    # positive control: the detection works: run 1's own context has the cookie and the storage
    assert "sid=run1-cookie-secret" in shown and "storage:[run1-storage-secret]" in shown, shown
    run2, log2 = cell_run(policy, browser_op("snapshot"), browser_op("open", url=site + "/show"))
    return run2, log1 + log2


def test_the_next_run_of_a_slot_sees_no_page_cookie_or_storage_of_the_previous_one(lab, site):
    run2, log = two_runs(lab, site, lab["policy"]["ends"])
    assert "browser state: ended" in log, log
    snap, opened = run2
    assert snap["ok"] is False and "no page open for this slot" in snap["error"], snap
    assert opened["ok"] is True, opened  # positive control: run 2 gets a working page of its own
    tree = opened["result"]["aria_snapshot"]
    assert "sent:[]" in tree and "cookie:[]" in tree and "storage:[]" in tree, tree
    assert "run1" not in tree
    ends = [e for e in audit(lab["browser"]) if e.get("action") == "end"]
    assert ends and all(e["verdict"] == "ok" for e in ends), ends


def test_without_the_launchers_end_the_run_binding_still_closes_the_previous_context(lab, site):
    """The first counter-proof: the launcher's end switched off (policy browser_socket ""). The
    second guard holds: chv-broker names each request's run (cell), so chv-browser closes run 1's
    context when run 2 asks (verdict stale-context) instead of serving it."""
    before = len([e for e in audit(lab["browser"]) if e.get("verdict") == "stale-context"])
    run2, log = two_runs(lab, site, lab["policy"]["old"])
    assert "browser state: no-browser" in log, log
    snap, opened = run2
    assert snap["ok"] is False and "no page open for this slot" in snap["error"], snap
    assert opened["ok"] is True, opened
    tree = opened["result"]["aria_snapshot"]
    assert "sent:[]" in tree and "cookie:[]" in tree and "storage:[]" in tree and "run1" not in tree, tree
    stale = [e for e in audit(lab["browser"]) if e.get("verdict") == "stale-context"]
    assert len(stale) > before and stale[-1]["slot"] == "slot0", stale


def test_counter_proof_without_the_end_and_the_run_binding_the_next_run_gets_the_previous_state(lab, site):
    """Both guards off: no end, and requests that name no run (as chv-broker sent them before it
    named the run): the slot's next requests get run 1's page, cookie and storage."""
    b = lab["browser"]
    for url in (site + "/set", site + "/show"):
        r = b.call({"slot": "slot0", "action": "open", "url": url}, timeout=90)
        assert r["ok"] is True, r
    shown = r["result"]["aria_snapshot"]
    assert "sid=run1-cookie-secret" in shown and "storage:[run1-storage-secret]" in shown, shown  # control
    snap = b.call({"slot": "slot0", "action": "snapshot"}, timeout=90)
    assert snap["ok"] is True and snap["result"]["title"] == "state shown", snap  # run 1's page
    opened = b.call({"slot": "slot0", "action": "open", "url": site + "/show"}, timeout=90)
    tree = opened["result"]["aria_snapshot"]
    assert "sid=run1-cookie-secret" in tree and "storage:[run1-storage-secret]" in tree, tree
    # leave the slot clean for the other tests: what the launcher does at every end
    assert cell_run(lab["policy"]["ends"])[0] == []


def audit(browser):
    with open(browser.log) as fh:
        return [json.loads(ln) for ln in fh if ln.startswith("{")]


def test_fifty_popups_leave_at_most_the_cap_and_the_slots_next_request_works(site):
    """Browser only (no cell needed): a page that opens 50 popups on load. At most pages_per_slot
    pages stay open while the request runs, the rest are closed at once (counted in the log), and
    all popups are closed when the request ends: afterwards only the slot's own page is alive
    (control: its beacons keep coming, the popups' do not)."""
    with running_browser(pages_per_slot=3, navigation_timeout=20.0, request_timeout=60.0) as b:
        r = b.call({"slot": "slot0", "action": "open", "url": site + "/popups"}, timeout=90)
        assert r["ok"] is True and r["result"]["title"] == "popups", r
        closes = [e for e in audit(b) if e.get("action") == "close-popups"]
        assert len(closes) == 1, b.log_tail()
        assert closes[0]["popups"] == 50 and closes[0]["over_cap"] >= 50 - 2, closes
        # a popup whose close was under way when the reply went out may still send a beacon that was
        # in flight: the first window lets those arrive, the second one must hear the slot's own page only
        with Site.beacon_seen:
            for dummy_window in range(2):
                del Site.beacons[:]
                assert Site.beacon_seen.wait_for(lambda: Site.beacons.count("main") >= 5, timeout=30), Site.beacons
            after = set(Site.beacons)
        assert after == {"main"}, (Site.beacons, [e for e in audit(b) if e.get("action") in ("close-page", "close-popups")])
        snap = b.call({"slot": "slot0", "action": "snapshot"})
        assert snap["ok"] is True and snap["result"]["title"] == "popups", snap
        again = b.call({"slot": "slot1", "action": "open", "url": site + "/show"})
        assert again["ok"] is True, again  # another slot is served as usual
