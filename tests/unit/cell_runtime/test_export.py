"""A task's bounded export (chv_guest/cell/export.py, tasks.export): a tar
of the slot's regular files, never a link followed, a FIFO opened or a
file of another owner taken, capped in bytes, its task's owner only.  Each
refusal beside the control that passes in the same slot."""

import io
import os
import signal
import socket
import tarfile

import pytest

from chv_guest.cell import exits, export, taskrec, tasks
from test_slotfiles import ROOT, put, slotpol, ws  # noqa: F401 (the fixture)

SLOT = "slot0"


def slot_of(pol):
    return next(s for s in pol["slots"] if s["name"] == SLOT)


def run_export(pol, paths, max_bytes=None):
    """export.export into memory, with a deadline (a FIFO must never block
    it): (exit code, {member: bytes}, log lines)."""
    out, logs = io.BytesIO(), []
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the export blocked"))
    signal.alarm(10)
    try:
        rc = export.export(pol, slot_of(pol), paths, max_bytes or pol["read_max_bytes"], out, logs.append)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    members = {}
    if out.getvalue():
        with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
            for m in tar.getmembers():
                assert m.isreg() and m.mode == 0o644 and m.uid == 0, m
                members[m.name] = tar.extractfile(m).read()
    return rc, members, logs, out.getvalue()


def own(pol, path):
    if ROOT:
        os.lchown(path, slot_of(pol)["uid_base"], slot_of(pol)["uid_base"])
    return path


@pytest.fixture
def planted(slotpol, tmp_path):
    """The slot's workspace as a cell could leave it: results beside a
    symlink to a host file, a symlink to a directory, a FIFO, a socket and a
    hard link to a world-readable file of root."""
    pol = slotpol
    uid = slot_of(pol)["uid_base"]
    out = ws(pol, SLOT, "out")
    os.mkdir(out)
    own(pol, out)
    os.mkdir(os.path.join(out, "sub"))
    own(pol, os.path.join(out, "sub"))
    put(os.path.join(out, "report.json"), b'{"ok": true}\n', uid)
    put(os.path.join(out, "sub", "b.txt"), b"bee\n", uid)
    host = tmp_path / "host-secret"
    host.write_bytes(b"HOST SECRET\n")
    os.chmod(host, 0o644)  # world-readable: chv-cell read would take it; the export takes only the slot's
    os.symlink(str(host), os.path.join(out, "link"))
    os.symlink("/", os.path.join(out, "dirlink"))
    os.mkfifo(os.path.join(out, "fifo"))
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(out, "sock"))
    s.close()
    os.link(str(host), os.path.join(out, "hardlink"))
    return pol


def test_regular_files_of_the_slot_only(planted):
    rc, members, logs, _raw = run_export(planted, ["/workspace/out"])
    assert rc == 0, logs
    assert members == {"workspace/out/report.json": b'{"ok": true}\n', "workspace/out/sub/b.txt": b"bee\n"}
    said = "\n".join(logs)
    for name, why in (("link", "symbolic link"), ("dirlink", "symbolic link"), ("fifo", "FIFO"), ("sock", "socket")):
        assert "skipped workspace/out/%s: a %s" % (name, why) in said, said
    if ROOT:
        assert "skipped workspace/out/hardlink: owned by uid 0" in said


def test_a_named_link_fifo_or_missing_path_refuses_the_whole_export(planted):
    for path, code in (("/workspace/out/link", export.EXIT_REFUSED), ("out/dirlink/etc/passwd", export.EXIT_REFUSED),
                       ("/workspace/out/fifo", export.EXIT_REFUSED), ("/workspace/out/nothing", export.EXIT_MISSING),
                       ("/etc/passwd", exits.EXIT_CONFIG), ("/workspace/../x", exits.EXIT_CONFIG)):
        rc, members, logs, raw = run_export(planted, ["/workspace/out/report.json", path])
        assert rc == code and raw == b"", (path, rc, logs)
    if ROOT:
        rc, members, logs, raw = run_export(planted, ["/workspace/out/hardlink"])
        assert rc == export.EXIT_REFUSED and raw == b"" and "not the slot's file" in logs[0]
    # control: the same export without the bad path
    rc, members, logs, _raw = run_export(planted, ["/workspace/out/report.json", "out/sub"])
    assert rc == 0 and sorted(members) == ["workspace/out/report.json", "workspace/out/sub/b.txt"]


def test_the_export_is_capped_before_a_byte_is_written(planted):
    rc, members, logs, raw = run_export(planted, ["/workspace/out"], max_bytes=16)  # 13 + 4 bytes of files
    assert rc == export.EXIT_TOO_BIG and raw == b"" and "more than --max-bytes 16" in logs[-1]
    rc, members, logs, _raw = run_export(planted, ["/workspace/out"], max_bytes=17)  # control: exactly fits
    assert rc == 0 and len(members) == 2
    with pytest.raises(ValueError, match="read_max_bytes"):
        export.effective_max(planted, planted["read_max_bytes"] + 1)
    assert export.effective_max(planted, None) == planted["read_max_bytes"]


def test_home_files_are_members_under_home(planted):
    put(os.path.join(planted["agent_state_root"], SLOT, "state.json"), b"{}\n", slot_of(planted)["uid_base"])
    rc, members, logs, _raw = run_export(planted, ["/home/chv/state.json", "/home/chv/workspace/out/sub/b.txt"])
    assert rc == 0 and members == {"home/state.json": b"{}\n", "workspace/out/sub/b.txt": b"bee\n"}


def test_only_the_tasks_owner_exports(planted, monkeypatch, tmp_path):
    pol = dict(planted, state_dir=str(tmp_path / "state"), claim_timeout=0.2, task_ttl=100.0)
    rec = taskrec.new_record(taskrec.new_id(), SLOT, 1000, 100.0, __import__("time").time())
    taskrec.write(pol, rec)
    os.makedirs(os.path.join(pol["state_dir"], "locks"), exist_ok=True)
    out = io.BytesIO()
    assert tasks.export(pol, rec["task"], 1001, ["/workspace/out"], None, out=out) == exits.EXIT_NO_TASK
    assert out.getvalue() == b""
    assert tasks.export(pol, "f" * 32, 1000, ["/workspace/out"], None, out=out) == exits.EXIT_NO_TASK
    assert tasks.export(pol, rec["task"], 1000, ["/workspace/out"], 10 ** 12, out=out) == exits.EXIT_CONFIG
    assert tasks.export(pol, rec["task"], 1000, ["/workspace/out"], None, out=out) == 0  # control: its owner
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert sorted(tar.getnames()) == ["workspace/out/report.json", "workspace/out/sub/b.txt"]


def test_a_file_changed_after_the_walk_keeps_its_walked_size_and_a_swapped_one_is_skipped(planted):
    logs = []
    entries = export.collect(planted, slot_of(planted), ["/workspace/out"], logs.append)
    report = ws(planted, SLOT, "out", "report.json")
    with open(report, "ab") as fh:
        fh.write(b"grown far beyond what the walk saw\n")
    b = ws(planted, SLOT, "out", "sub", "b.txt")
    put(b + ".new", b"other inode\n", slot_of(planted)["uid_base"])
    os.rename(b + ".new", b)  # another inode under the same name
    out = io.BytesIO()
    assert export.write_tar(planted, slot_of(planted), entries, out, logs.append) == 1
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert tar.getnames() == ["workspace/out/report.json"]
        assert tar.extractfile("workspace/out/report.json").read() == b'{"ok": true}\n'  # cut at the walk's size
    said = "\n".join(logs)
    assert "report.json changed while it was read" in said and "sub/b.txt: replaced while the export ran" in said


def test_the_agent_takes_task_export():
    from chv_guest.cell import agent

    tid = "0123456789abcdef0123456789abcdef"
    req = agent.parse_agent_args(["task", "export", tid, "--max-bytes", "1000", "--", "-odd", "/workspace/r"])
    assert (req.verb, req.task, req.max_bytes, req.paths) == ("export", tid, 1000, ("-odd", "/workspace/r"))
    assert agent.parse_agent_args(agent.render_agent_args(req)) == req
    for args, says in ((["task", "export", tid], "1 to 64 PATHs"), (["task", "export"], "needs a task ID"),
                       (["task", "export", tid, "--max-bytes", "0", "x"], "above 0"),
                       (["task", "export", tid, "--max-bytes", "1e3", "x"], "above 0"),
                       (["task", "export", tid, "--policy", "/p", "x"], "not allowed for task export"),
                       (["task", "export", tid, "-x"], "not allowed for task export"),
                       (["task", "export", "x" * 32, "p"], "not a task id"),
                       (["task", "export", tid] + ["p"] * 65, "1 to 64 PATHs")):
        with pytest.raises(agent.Refused, match=says):
            agent.parse_agent_args(args)


def test_a_whole_workspace_or_home(planted):
    put(os.path.join(planted["agent_state_root"], SLOT, "state.json"), b"{}\n", slot_of(planted)["uid_base"])
    rc, members, logs, _raw = run_export(planted, ["/workspace"])
    assert rc == 0 and sorted(members) == ["workspace/out/report.json", "workspace/out/sub/b.txt"], logs
    rc, members, logs, _raw = run_export(planted, ["/home/chv/", "."])
    assert rc == 0 and sorted(members) == ["home/state.json", "workspace/out/report.json", "workspace/out/sub/b.txt"]
