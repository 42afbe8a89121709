"""Protocol: framing, limits, malformed input, allow-list; fuzzed with hypothesis."""
import json
import os
import signal
import socket
import subprocess
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import procs
from broker_helpers import BrokerProc, client_argv, client_env, needs_root, write_record, wire
from chv_guest.broker import peer

pytestmark = needs_root


def test_ping_and_unknown_ops(inproc):
    assert inproc.call({"op": "ping"}) == {"ok": True, "result": {"pong": True, "slot": "slot0"}}
    for req in ({}, {"op": "evaluate", "expression": "1"}, {"op": "shell", "argv": ["id"]},
                {"op": ["ping"]}, {"op": None}):
        rep = inproc.call(req)
        assert rep["ok"] is False and set(rep) == {"ok", "error"}, req
    assert inproc.call({"op": "ping"})["ok"] is True


def test_malformed_lines_get_an_error_reply(inproc):
    for data in (b"not json\n", b"[1,2]\n", b"\"ping\"\n", b"\xff\xfe\n", b"\n", b"{\"op\": \"ping\"\x00}\n",
                 b"[" * 60000 + b"\n"):
        rep = inproc.raw(data)
        assert rep["ok"] is False, data[:20]
    assert inproc.call({"op": "ping"})["ok"] is True


def test_size_limit_and_read_timeout(inproc):
    big = json.dumps({"op": "ping", "pad": "x" * 70000}).encode() + b"\n"
    rep = inproc.raw(big)
    assert rep == {"ok": False, "error": "request too large"}
    just_fits = json.dumps({"op": "ping", "pad": ""}).encode()
    pad = 65536 - len(just_fits) - 1
    rep = inproc.raw(json.dumps({"op": "ping", "pad": "x" * pad}).encode() + b"\n")
    assert rep["ok"] is True
    # no newline within read_timeout (2 s in the fixture): error reply, not a hang
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(inproc.env["sock"])
        s.sendall(b'{"op": "pi')
        rep = wire.parse_object(wire.read_line(s, 65536, 10))
    assert rep == {"ok": False, "error": "read timeout"}
    # half-closed before the newline
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(inproc.env["sock"])
        s.sendall(b'{"op": "ping"}')
        s.shutdown(socket.SHUT_WR)
        rep = wire.parse_object(wire.read_line(s, 65536, 10))
    assert rep["ok"] is False and "closed" in rep["error"]


def test_browser_evaluate_and_bad_urls_rejected_at_broker(inproc):
    for req in ({"op": "browser", "action": "evaluate", "expression": "document.cookie"},
                {"op": "browser", "action": "content"},
                {"op": "browser", "action": "open", "url": "file:///etc/passwd"},
                {"op": "browser", "action": "open", "url": "javascript:alert(1)"},
                {"op": "browser", "action": "open", "url": "data:text/html,hi"},
                {"op": "browser", "action": "open", "url": "chrome://version"},
                {"op": "browser", "action": "open"},
                {"op": "browser", "action": "screenshot", "name": 5}):
        rep = inproc.call(req)
        assert rep["ok"] is False, req
    # an allowed action reaches the forwarder (no browser is listening in this test)
    rep = inproc.call({"op": "browser", "action": "open", "url": "http://127.0.0.1/"})
    assert rep["ok"] is False and rep["error"].startswith("browser unavailable")


def test_browser_forward_carries_the_slot(inproc, env):
    """A fake chv-browser on the configured socket sees the slot the broker matched."""
    seen = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(env["root"] + "/browser.sock")
    srv.listen(1)
    import threading

    def fake():
        c, dummy = srv.accept()
        with c:
            req = wire.parse_object(wire.read_line(c, 65536, 5))
            seen.append(req)
            c.sendall(wire.encode(wire.ok({"title": "t"})))
    t = threading.Thread(target=fake)
    t.start()
    rep = inproc.call({"op": "browser", "action": "open", "url": "https://example.invalid/", "slot": "slot7",
                       "cell": "1.1", "extra": "dropped"})
    t.join(5)
    srv.close()
    assert rep == {"ok": True, "result": {"title": "t"}}
    # the run it is for: the matched cell record's leader pid and start time, never the request's
    cells = peer.load_cells(env["cells"])
    assert len(cells) == 1
    assert seen == [{"slot": "slot0", "action": "open", "url": "https://example.invalid/",
                     "cell": peer.incarnation(cells[0])}]
    assert seen[0]["cell"] != "1.1" and "." in seen[0]["cell"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                 max_leaves=12).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"op": st.sampled_from(["ping", "sync", "browser", "x"])},
                          optional={"action": st.text(max_size=12) | st.integers(),
                                    "repo": st.text(max_size=40) | st.none(),
                                    "url": st.text(max_size=40)}).map(lambda v: json.dumps(v).encode()),
))
def test_fuzz_one_reply_never_a_crash(inproc, payload):
    rep = inproc.raw(payload.replace(b"\n", b" ") + b"\n")
    assert isinstance(rep["ok"], bool)
    assert set(rep) == ({"ok", "result"} if rep["ok"] else {"ok", "error"})
    assert inproc.thread.is_alive()


def _find_pids(marker):
    return [int(pid) for pid, argv in procs.cmdlines() if argv[:2] == [b"sleep", marker.encode()]]


def test_killed_mid_request_then_restarted(env, cell):
    """The client of a broker killed mid-request gets an error; the restarted broker serves the next."""
    from broker_helpers import make_listener
    cfg = json.load(open(env["config"]))
    marker = "29.%d" % os.getpid()
    cfg["sync"]["commands"] = {"status": ["sleep", marker]}
    json.dump(cfg, open(env["config"], "w"))
    ws = os.path.join(env["ws"], "slot0")
    os.makedirs(ws)
    os.chown(ws, 100000, 100000)
    write_record(env["cells"], "slot0", cell.pid)
    listener = make_listener(env["sock"])
    first = BrokerProc(listener, env["config"]).start()
    try:
        client = subprocess.Popen(["nsenter", "-t", str(cell.pid), "--pid", "--", "setpriv", "--reuid=100000",
                                   "--regid=100000", "--clear-groups", "--"]
                                  + client_argv(env["sock"], {"op": "sync", "action": "status", "repo": "."}),
                                  env=client_env(env["sock"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        deadline = time.monotonic() + 20
        while not _find_pids(marker):  # the request is being served
            assert time.monotonic() < deadline and client.poll() is None, client.communicate()
            time.sleep(0.05)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        out, err = client.communicate(timeout=20)
        assert client.returncode == 2 and "without a reply" in err
        second = BrokerProc(listener, env["config"]).start()  # what systemd does on the next connection
        try:
            again = cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"]))
            assert json.loads(again.stdout)["ok"] is True
        finally:
            second.stop()
    finally:
        first.stop()
        for pid in _find_pids(marker):
            os.kill(pid, signal.SIGKILL)
        listener.close()
