"""Peer check over a real socket, with real pid namespaces and uids."""
import json
import os

from broker_helpers import CELL_UID, client_argv, client_env, needs_root, write_record

pytestmark = needs_root


def _reply(proc):
    assert proc.stdout, "no reply; stderr=%r" % proc.stderr
    return json.loads(proc.stdout)


def test_cell_peer_accepted_guest_process_rejected(env, broker_proc, cell):
    write_record(env["cells"], "slot0", cell.pid)
    inside = cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"]))
    assert _reply(inside) == {"ok": True, "result": {"pong": True, "slot": "slot0"}}
    assert inside.returncode == 0

    # the same request, same uid, from a guest process outside any cell
    import subprocess
    outside = subprocess.run(["setpriv", "--reuid=%d" % CELL_UID, "--regid=%d" % CELL_UID, "--clear-groups", "--"]
                             + client_argv(env["sock"], {"op": "ping"}),
                             env=client_env(env["sock"]), capture_output=True, text=True, timeout=30, check=False)
    rep = _reply(outside)
    assert rep["ok"] is False and "not a process of a live chv cell" in rep["error"]
    assert outside.returncode == 1

    audit = broker_proc.audit()
    assert any(a["verdict"] == "ok" and a["slot"] == "slot0" and a["op"] == "ping" for a in audit)
    rejected = [a for a in audit if a["verdict"] == "rejected"]
    assert rejected and rejected[-1]["reason"] == "pid namespace is not a live cell's"
    assert rejected[-1]["peer_uid"] == CELL_UID
    assert all("duration_ms" in a for a in audit)


def test_uid_outside_range_rejected_in_cell_namespace(env, broker_proc, cell):
    write_record(env["cells"], "slot0", cell.pid)
    ok = cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"]))
    assert _reply(ok)["ok"] is True
    # right namespace, uid just past the range (and uid 0): rejected
    for uid in (CELL_UID + 65536, 0, CELL_UID - 1):
        bad = cell.run(client_argv(env["sock"], {"op": "ping"}), uid=uid, env=client_env(env["sock"]))
        assert _reply(bad)["ok"] is False, uid
    reasons = [a.get("reason") for a in broker_proc.audit() if a["verdict"] == "rejected"]
    assert reasons == ["uid outside every live cell's range"] * 3


def test_other_pid_namespace_rejected(env, broker_proc, cell, other_ns):
    write_record(env["cells"], "slot0", cell.pid)
    assert _reply(cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))["ok"] is True
    other = other_ns.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"]))
    assert _reply(other)["ok"] is False


def test_slot_follows_the_namespace(env, broker_proc, cell, other_ns):
    write_record(env["cells"], "slot0", cell.pid)
    write_record(env["cells"], "slot1", other_ns.pid)
    a = _reply(cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))
    b = _reply(other_ns.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))
    assert a["result"]["slot"] == "slot0" and b["result"]["slot"] == "slot1"


def test_stale_and_forged_records_do_not_admit(env, broker_proc, cell):
    # record whose leader has exited: the namespace cannot be confirmed
    write_record(env["cells"], "slot0", cell.pid)
    assert _reply(cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))["ok"] is True
    os.unlink(os.path.join(env["cells"], "slot0.json"))
    assert _reply(cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))["ok"] is False
    # malformed records and records whose file name disagrees with their slot are ignored
    with open(os.path.join(env["cells"], "slot0.json"), "w") as fh:
        fh.write("{not json")
    with open(os.path.join(env["cells"], "slot9.json"), "w") as fh:
        json.dump({"slot": "slot0", "pid": cell.pid, "uid_base": CELL_UID, "uid_size": 65536}, fh)
    with open(os.path.join(env["cells"], "slot8.json"), "w") as fh:
        json.dump({"slot": "slot8", "pid": str(cell.pid), "uid_base": CELL_UID, "uid_size": 65536}, fh)
    assert _reply(cell.run(client_argv(env["sock"], {"op": "ping"}), env=client_env(env["sock"])))["ok"] is False


def test_match_cell_is_pure():
    from chv_guest.broker.peer import PeerRejected, match_cell
    cells = [{"slot": "a", "pid": 10, "uid_base": 1000, "uid_size": 10},
             {"slot": "b", "pid": 20, "uid_base": 2000, "uid_size": 10}]
    ns = {10: "pid:[1]", 20: "pid:[2]", 99: "pid:[2]", 98: "pid:[3]"}.__getitem__
    assert match_cell(99, 2009, cells, ns)["slot"] == "b"
    for pid, uid in ((99, 2010), (99, 1005), (98, 2001)):
        try:
            match_cell(pid, uid, cells, ns)
        except PeerRejected:
            continue
        raise AssertionError((pid, uid))
