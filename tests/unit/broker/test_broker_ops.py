"""The shared table of operations (chv_guest/wire/protocol.py) and chv-broker's dispatch on it.

Refusal messages are compared to the letter: they are what a cell sees.
"""
import copy
import io
import json

import pytest

import broker_helpers  # noqa: F401  # pylint: disable=unused-import  # puts chv_broker on sys.path
from chv_guest.broker import server
from chv_guest.wire import protocol

CELL = {"slot": "slot0", "pid": 4242, "uid_base": 100000, "uid_size": 65536}


def broker(**over):
    """A Broker on a deep copy of the defaults (merge shares nested dicts with DEFAULTS)."""
    return server.Broker(server.merge(copy.deepcopy(server.DEFAULTS), over), log=io.StringIO())


def refusal(b, req):
    with pytest.raises(server.OpError) as exc:
        b.dispatch(CELL, req)
    return str(exc.value)


def test_every_op_has_its_handler():
    b = broker()
    assert set(b.ops) == set(protocol.OPS) == {"ping", "sync", "browser"}
    for op, handler in b.ops.items():
        assert handler == getattr(b, "op_" + op)


def test_an_op_without_a_handler_stops_the_start():
    class Partial:
        def op_ping(self):
            pass

        op_browser = None  # not callable: no handler either

    with pytest.raises(TypeError, match="Partial has no op_ method for sync, browser"):
        protocol.handlers(Partial(), protocol.OPS)


def test_ping_goes_to_its_handler():
    assert broker().dispatch(CELL, {"op": "ping"}) == {"pong": True, "slot": "slot0"}


@pytest.mark.parametrize("req, message", [
    ({"op": "evaluate"}, "unknown or disabled op: 'evaluate'"),
    ({"op": "PING"}, "unknown or disabled op: 'PING'"),
    ({"op": "op_ping"}, "unknown or disabled op: 'op_ping'"),
    ({"op": "__init__"}, "unknown or disabled op: '__init__'"),
    ({}, "missing op"),
    ({"op": None}, "missing op"),
    ({"op": ["ping"]}, "missing op"),
    ({"op": {"ping": 1}}, "missing op"),
    ({"op": 1}, "missing op"),
])
def test_unknown_ops_are_refused(req, message):
    assert refusal(broker(), req) == message


@pytest.mark.parametrize("op", ["sync", "browser"])
def test_a_switched_off_op_is_refused_like_an_unknown_one(op):
    off = broker(**{op: {"enabled": False}})
    assert refusal(off, {"op": op, "action": "status" if op == "sync" else "snapshot"}) \
        == "unknown or disabled op: %r" % op
    assert off.dispatch(CELL, {"op": "ping"})["pong"] is True  # ping has no switch
    # control: the other op is still on (its refusal is about the request, not the op)
    other = "browser" if op == "sync" else "sync"
    assert not refusal(off, {"op": other, "action": "nope"}).startswith("unknown or disabled op")


@pytest.mark.parametrize("action", ["evaluate", "content", "goto", "", "OPEN", None, 3, ["open"], {"open": 1}])
def test_unknown_browser_actions_are_refused(action):
    req = {"op": "browser", "url": "http://x/"}
    if action is not None:
        req["action"] = action
    assert refusal(broker(), req) == "browser action must be one of close, open, screenshot, snapshot"


@pytest.mark.parametrize("req, message", [
    ({"action": "open"}, "browser open needs a string 'url'"),
    ({"action": "open", "url": ["http://x/"]}, "browser open needs a string 'url'"),
    ({"action": "screenshot", "name": 5}, "browser screenshot needs a string 'name'"),
    ({"action": "open", "url": "file:///etc/passwd"}, "only http and https URLs may be opened"),
    ({"action": "open", "url": "javascript:alert(1)"}, "only http and https URLs may be opened"),
    ({"action": "open", "url": "chrome://version"}, "only http and https URLs may be opened"),
])
def test_browser_fields_are_checked_before_forwarding(req, message):
    assert refusal(broker(), dict(req, op="browser")) == message


@pytest.mark.parametrize("action, fields", sorted(protocol.BROWSER_ACTIONS.items()))
def test_allowed_browser_actions_are_forwarded(tmp_path, action, fields):
    """Past the table's checks the request goes to chv-browser's socket (absent here)."""
    b = broker(browser={"socket": str(tmp_path / "absent.sock"), "timeout": 1.0})
    req = {"op": "browser", "action": action, "url": "https://example.invalid/", "name": "front"}
    assert refusal(b, req).startswith("browser unavailable: ")
    assert b.slots_seen == {"slot0"}
    for field in fields:  # control: without its required field the same action is refused
        assert refusal(b, {k: v for k, v in req.items() if k != field}) == \
            "browser %s needs a string %r" % (action, field)


@pytest.mark.parametrize("action", ["fetch", "STATUS", None, ["status"], 7])
def test_unknown_sync_actions_are_refused(action):
    assert refusal(broker(), {"op": "sync", "action": action}) == "sync action must be one of status, pull, push"


def test_sync_actions_without_a_configured_command_are_refused(tmp_path):
    b = broker(workspaces_dir=str(tmp_path))
    b.cfg["sync"]["commands"] = {"status": ["git", "status"], "pull": ["git", "pull"]}
    assert refusal(b, {"op": "sync", "action": "push"}) == "sync action must be one of status, pull"
    # control: a configured action passes the table (and then fails on the missing workspace)
    assert refusal(b, {"op": "sync", "action": "pull"}) == "slot workspace does not exist"


@pytest.mark.parametrize("url, allowed", [
    ("http://x/", True), ("HTTPS://x/", True), ("https:x", True), ("ftp://x/", False), ("file:///x", False),
    ("data:text/html,hi", False), ("x/y", False), ("", False),
])
def test_url_scheme_rule(url, allowed):
    assert protocol.url_scheme_allowed(url) is allowed


def test_audit_writes_one_json_line_per_event():
    out = io.StringIO()
    protocol.audit(out, "chv-broker.audit", slot="slot0", op="ping", verdict="ok")
    protocol.audit(out, "chv-broker.audit", verdict="busy")
    lines = out.getvalue().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"event": "chv-broker.audit", "slot": "slot0", "op": "ping", "verdict": "ok"},
        {"event": "chv-broker.audit", "verdict": "busy"}]
    assert lines[0] == json.dumps(json.loads(lines[0]), sort_keys=True)


def test_audit_to_a_closed_stream_is_not_an_error():
    out = io.StringIO()
    out.close()
    protocol.audit(out, "chv-broker.audit", verdict="ok")  # raises nothing


def test_browser_requests_name_the_run_they_are_for(tmp_path):
    """chv-broker forwards the cell's incarnation (leader pid and start time of the root-owned
    record), so chv-browser can close a context an earlier run of the slot made."""
    import socket
    import threading

    from chv_guest.broker import peer

    path = str(tmp_path / "browser.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    got = []

    def serve(n):
        for dummy in range(n):
            conn, dummy_addr = srv.accept()
            with conn:
                got.append(json.loads(conn.makefile("rb").readline()))
                conn.sendall(b'{"ok": true, "result": {}}\n')
    t = threading.Thread(target=serve, args=(3,), daemon=True)
    t.start()
    b = broker(browser={"socket": path, "timeout": 5.0})
    run1 = dict(CELL, pid=4242, started=1764645000.123)
    run2 = dict(CELL, pid=4242, started=1764645007.5)  # the same pid, reused by the next run
    run3 = dict(run2, egress_proxy="http://10.200.0.1:3128")  # proxy mode: the record's proxy URL
    for cell in (run1, run2, run3):
        assert b.dispatch(cell, {"op": "browser", "action": "snapshot"}) == {}
    t.join(5)
    srv.close()
    assert [r["cell"] for r in got] == ["4242.1764645000123", "4242.1764645007500", "4242.1764645007500"]
    assert [r.get("proxy") for r in got] == [None, None, "http://10.200.0.1:3128"]
    assert got[0]["slot"] == "slot0" and got[0]["action"] == "snapshot"
    assert peer.incarnation({"pid": 7}) == "7"  # a record without its start time: the pid alone


def test_cell_records_carry_their_start_time_to_the_broker(tmp_path):
    from chv_guest.broker import peer

    rec = {"slot": "slot0", "pid": 4242, "uid_base": 100000, "uid_size": 65536, "started": 1764645000.123}
    (tmp_path / "slot0.json").write_text(json.dumps(rec))
    (tmp_path / "slot1.json").write_text(json.dumps(dict(rec, slot="slot1", started="soon")))
    (tmp_path / "slot2.json").write_text(json.dumps(dict(rec, slot="slot2", egress_proxy="http://10.200.2.1:3128")))
    (tmp_path / "slot3.json").write_text(json.dumps(dict(rec, slot="slot3", egress_proxy="socks5://10.0.0.1:1")))
    cells = peer.load_cells(str(tmp_path))
    assert cells[0]["started"] == 1764645000.123
    assert "started" not in cells[1]  # not a number: left out, the record still counts
    assert cells[2]["egress_proxy"] == "http://10.200.2.1:3128"  # proxy mode: for the doors acting for it
    assert "egress_proxy" not in cells[3] and "egress_proxy" not in cells[0]  # not the launcher's form: left out
