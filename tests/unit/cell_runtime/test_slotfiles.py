"""chv-cell read (chv_guest/cell/slotfiles.py): a slot's file opened beneath the
slot's directory without following anything the cell planted, both with
openat2(2) and with the component walk that replaces it where the kernel
has none; the launcher's verdict record (status.status_record and the
status fd); the slot directories' ownership (fsutil.ensure_slot_dir).

Every refusal runs beside its control (a regular file of the same slot
read in the same test).  Tests that make device nodes or files of other
uids need root and say so when skipped."""

import copy
import errno
import json
import os
import signal
import stat

import pytest

from chv_guest.cell import claim as claimmod
from chv_guest.cell import errors
from chv_guest.cell import exits
from chv_guest.cell import policy as policymod
from chv_guest.cell import fsutil, runner, status
from chv_guest.cell import slotfiles

ROOT = os.geteuid() == 0
HOW = ["openat2", "walk"]


@pytest.fixture
def slotpol(policy, tmp_path):
    """The unit policy with its slot directories under tmp_path, owned by
    the slot's uid when root (else by the test's own uid, as the slot's)."""
    pol = copy.deepcopy(policy)
    pol["workspace_root"] = str(tmp_path / "ws")
    pol["agent_state_root"] = str(tmp_path / "state")
    pol["agent_state_mount"] = "/home/chv"
    pol["workspace_aliases"] = ["/home/chv/workspace"]
    pol["read_max_bytes"] = 1000
    for s in pol["slots"]:
        if not ROOT:
            s["uid_base"] = os.getuid()
            s["uid_size"] = 1
        for top in (pol["workspace_root"], pol["agent_state_root"]):
            d = os.path.join(top, s["name"])
            os.makedirs(d)
            if ROOT:
                os.chown(d, s["uid_base"], s["uid_base"])
            os.chmod(d, 0o700)
    return pol


def ws(pol, slot="slot0", *rest):
    return os.path.join(pol["workspace_root"], slot, *rest)


def put(path, data=b"result\n", owner=None):
    with open(path, "wb") as fh:
        fh.write(data)
    if owner is not None and ROOT:
        os.chown(path, owner, owner)
    os.chmod(path, 0o600)
    return path


def read(pol, path, how, slot="slot0", tmp=None):
    """read_file into a file; (exit code, bytes written, log lines)."""
    logs = []
    out = os.open(os.path.join(pol["workspace_root"], "..", "out-%d" % os.getpid()),
                  os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the reader blocked"))
    signal.alarm(10)  # a FIFO must never block it
    try:
        rc = slotfiles.read_file(pol, slot, path, out_fd=out, log=logs.append, use_openat2=(how == "openat2"))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    os.lseek(out, 0, os.SEEK_SET)
    data = os.read(out, 1 << 20)
    os.close(out)
    return rc, data, logs


# ---------------------------------------------------------------- the path
def test_cell_paths_map_to_the_slots_two_directories(slotpol):
    s = slotpol["slots"][0]
    w, h = ws(slotpol), os.path.join(slotpol["agent_state_root"], "slot0")
    assert slotfiles.locate(slotpol, s, "result.txt") == ("workspace", w, ["result.txt"])
    assert slotfiles.locate(slotpol, s, "./a//b/./c") == ("workspace", w, ["a", "b", "c"])
    assert slotfiles.locate(slotpol, s, "/workspace/out/r.json") == ("workspace", w, ["out", "r.json"])
    # the alias inside the home is the workspace (the longest match wins), the rest of the home is the home
    assert slotfiles.locate(slotpol, s, "/home/chv/workspace/r") == ("workspace", w, ["r"])
    assert slotfiles.locate(slotpol, s, "/home/chv/.codex/host-state.json") == ("home", h, [".codex", "host-state.json"])
    assert slotfiles.locate(slotpol, s, "/home/chv/workspaceX") == ("home", h, ["workspaceX"])


@pytest.mark.parametrize("path, says", [
    ("/etc/shadow", "outside the slot's workspace"),
    ("/workspacex/a", "outside the slot's workspace"),
    ("/var/lib/chv-fleet/workspaces/slot1/x", "outside the slot's workspace"),
    ("../slot1/result.txt", "contains '..'"),
    ("/workspace/a/../../slot1/x", "contains '..'"),
    ("/workspace", "names the slot's directory itself"),
    ("/home/chv/", "names the slot's directory itself"),
    ("", "1 to 4096"),
    ("a" * 4097, "1 to 4096"),
])
def test_paths_outside_the_slot_are_refused_as_requests(slotpol, path, says):
    with pytest.raises(slotfiles.Refused) as exc:
        slotfiles.locate(slotpol, slotpol["slots"][0], path)
    assert exc.value.code == exits.EXIT_CONFIG and says in str(exc.value)


# ---------------------------------------------------------------- opening, both ways
def test_openat2_is_used_where_the_kernel_has_it_and_the_walk_otherwise(slotpol, monkeypatch):
    put(ws(slotpol, "slot0", "r.txt"), owner=slotpol["slots"][0]["uid_base"])
    s = slotpol["slots"][0]
    fd, st, how = slotfiles.open_slot_file(slotpol, s, "r.txt", 1000)
    os.close(fd)
    assert how == "openat2" and stat.S_ISREG(st.st_mode)  # this machine's kernel (>= 5.6) has it
    fd, st, how = slotfiles.open_slot_file(slotpol, s, "r.txt", 1000, use_openat2=False)
    os.close(fd)
    assert how == "walk"

    def no_openat2(*args):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(slotfiles, "openat2", no_openat2)
    fd, st, how = slotfiles.open_slot_file(slotpol, s, "r.txt", 1000)
    os.close(fd)
    assert how == "walk"  # ENOSYS: the walk, not a failure


@pytest.mark.parametrize("how", HOW)
def test_a_regular_file_of_the_slot_is_read(slotpol, how):
    uid = slotpol["slots"][0]["uid_base"]
    os.makedirs(ws(slotpol, "slot0", "out"))
    put(ws(slotpol, "slot0", "out", "r.json"), b'{"ok": true}\n', owner=uid)
    assert read(slotpol, "/workspace/out/r.json", how) == (0, b'{"ok": true}\n', [])
    os.makedirs(os.path.join(slotpol["agent_state_root"], "slot0", ".codex"))
    put(os.path.join(slotpol["agent_state_root"], "slot0", ".codex", "host-state.json"), b"state", owner=uid)
    assert read(slotpol, "/home/chv/.codex/host-state.json", how)[:2] == (0, b"state")
    put(ws(slotpol, "slot0", "empty"), b"", owner=uid)
    assert read(slotpol, "empty", how)[:2] == (0, b"")


@pytest.mark.parametrize("how", HOW)
def test_symlinks_are_never_followed(slotpol, how):
    uid = slotpol["slots"][0]["uid_base"]
    theirs = put(ws(slotpol, "slot1", "secret.txt"), b"slot1's secret\n", owner=slotpol["slots"][1]["uid_base"])
    put(ws(slotpol, "slot0", "mine.txt"), b"mine\n", owner=uid)
    os.symlink(theirs, ws(slotpol, "slot0", "abs-link"))          # to another slot's file
    os.symlink("../slot1/secret.txt", ws(slotpol, "slot0", "rel-link"))
    os.symlink("/etc/shadow", ws(slotpol, "slot0", "shadow"))     # to a file cells never see
    os.symlink("mine.txt", ws(slotpol, "slot0", "own-link"))     # even to the slot's own file
    os.symlink(ws(slotpol, "slot1"), ws(slotpol, "slot0", "dir-link"))  # a directory on the way
    os.symlink("/proc/self/root/etc", ws(slotpol, "slot0", "magic"))
    for path in ("abs-link", "rel-link", "shadow", "own-link", "dir-link/secret.txt", "magic/shadow"):
        rc, data, logs = read(slotpol, path, how)
        assert rc == slotfiles.EXIT_REFUSED and data == b"", (path, logs)
        assert "symbolic link" in logs[0] and "(never followed)" in logs[0], logs
    assert read(slotpol, "mine.txt", how)[:2] == (0, b"mine\n")  # control


@pytest.mark.parametrize("how", HOW)
def test_a_fifo_a_directory_and_a_socket_are_refused_without_blocking(slotpol, how):
    import socket

    put(ws(slotpol, "slot0", "mine.txt"), b"mine\n", owner=slotpol["slots"][0]["uid_base"])
    os.mkfifo(ws(slotpol, "slot0", "fifo"))  # no writer: an open for reading would block
    os.mkdir(ws(slotpol, "slot0", "dir"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(ws(slotpol, "slot0", "sock"))
    try:
        for path, kind in (("fifo", "a FIFO"), ("dir", "a directory"), ("sock", "a socket")):
            rc, data, logs = read(slotpol, path, how)
            assert (rc, data) == (slotfiles.EXIT_REFUSED, b""), (path, logs)
            assert "is %s: only regular files are read" % kind in logs[0]
    finally:
        sock.close()
    assert read(slotpol, "mine.txt", how)[:2] == (0, b"mine\n")


@pytest.mark.skipif(not ROOT, reason="making a device node needs root")
@pytest.mark.parametrize("how", HOW)
def test_a_device_is_refused_and_never_opened(slotpol, how):
    put(ws(slotpol, "slot0", "mine.txt"), b"mine\n", owner=slotpol["slots"][0]["uid_base"])
    os.mknod(ws(slotpol, "slot0", "zero"), 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless
    rc, data, logs = read(slotpol, "zero", how)
    assert (rc, data) == (slotfiles.EXIT_REFUSED, b"") and "a character device" in logs[0]
    assert read(slotpol, "mine.txt", how)[:2] == (0, b"mine\n")


@pytest.mark.parametrize("how", HOW)
def test_missing_files_and_paths_through_files(slotpol, how):
    put(ws(slotpol, "slot0", "mine.txt"), b"mine\n", owner=slotpol["slots"][0]["uid_base"])
    for path in ("nope", "nope/x", "mine.txt/x"):
        rc, data, logs = read(slotpol, path, how)
        assert (rc, data) == (slotfiles.EXIT_MISSING, b""), (path, logs)
        assert "no such file" in logs[0]


@pytest.mark.parametrize("how", HOW)
def test_a_file_above_the_limit_is_refused_before_a_byte_is_written(slotpol, how):
    uid = slotpol["slots"][0]["uid_base"]
    put(ws(slotpol, "slot0", "big"), b"x" * 1001, owner=uid)
    put(ws(slotpol, "slot0", "exact"), b"y" * 1000, owner=uid)
    rc, data, logs = read(slotpol, "big", how)
    assert (rc, data) == (slotfiles.EXIT_TOO_BIG, b"") and "more than read_max_bytes 1000" in logs[0]
    assert read(slotpol, "exact", how)[:2] == (0, b"y" * 1000)


def test_a_file_that_grows_while_it_is_copied_is_cut_at_the_limit(tmp_path):
    src = tmp_path / "growing"
    src.write_bytes(b"z" * 50)
    out = tmp_path / "out"
    with open(src, "rb") as fh, open(out, "wb") as dst:
        assert slotfiles.copy_bounded(fh.fileno(), dst.fileno(), 20) == (20, True)
    assert out.read_bytes() == b"z" * 20
    with open(src, "rb") as fh, open(out, "wb") as dst:
        assert slotfiles.copy_bounded(fh.fileno(), dst.fileno(), 50) == (50, False)


@pytest.mark.skipif(not ROOT, reason="files of another uid need root")
@pytest.mark.parametrize("how", HOW)
def test_a_hard_link_to_a_file_that_is_not_the_slots_is_refused(slotpol, how):
    """The cell cannot make such a link (test_slot_files.py shows it); should
    one appear anyway (root made it, or a host with fs.protected_hardlinks
    off), the reader still refuses an inode the cell could not read."""
    mine = put(ws(slotpol, "slot0", "mine.txt"), b"mine\n", owner=slotpol["slots"][0]["uid_base"])
    theirs = put(ws(slotpol, "slot1", "secret.txt"), b"slot1's secret\n", owner=slotpol["slots"][1]["uid_base"])
    root_only = put(os.path.join(os.path.dirname(slotpol["workspace_root"]), "root-only"), b"root\n", owner=0)
    os.link(theirs, ws(slotpol, "slot0", "theirs-hard"))
    os.link(root_only, ws(slotpol, "slot0", "root-hard"))
    os.link(mine, ws(slotpol, "slot0", "mine-hard"))
    for path in ("theirs-hard", "root-hard"):
        rc, data, logs = read(slotpol, path, how)
        assert (rc, data) == (slotfiles.EXIT_REFUSED, b""), (path, logs)
        assert "not the slot's file" in logs[0]
    assert read(slotpol, "mine-hard", how)[:2] == (0, b"mine\n")  # a link of the slot's own file: its own
    os.chmod(root_only, 0o644)  # world-readable: the cell could read it too
    assert read(slotpol, "root-hard", how)[:2] == (0, b"root\n")


def test_an_unknown_slot_is_a_refused_request(slotpol):
    rc, data, logs = read(slotpol, "x", "openat2", slot="slot9")
    assert rc == exits.EXIT_CONFIG and "no slot named 'slot9'" in logs[0]


def test_the_walk_refuses_a_mount_point_on_the_way(slotpol, monkeypatch):
    """RESOLVE_NO_XDEV's counterpart in the walk: a directory of another device."""
    put(ws(slotpol, "slot0", "mine.txt"), owner=slotpol["slots"][0]["uid_base"])
    os.mkdir(ws(slotpol, "slot0", "sub"))
    put(ws(slotpol, "slot0", "sub", "f"), owner=slotpol["slots"][0]["uid_base"])
    real = os.fstat
    sub_ino = os.stat(ws(slotpol, "slot0", "sub")).st_ino

    def fstat(fd):
        st = real(fd)
        if st.st_ino == sub_ino:  # pretend sub is another file system mounted there
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1) + tuple(st)[3:])
        return st

    monkeypatch.setattr(slotfiles.os, "fstat", fstat)
    rc, data, logs = read(slotpol, "sub/f", "walk")
    assert rc == slotfiles.EXIT_REFUSED and "crosses a mount point" in logs[0]
    assert read(slotpol, "mine.txt", "walk")[0] == 0


def test_policy_read_max_bytes_is_checked(raw_policy):
    assert policymod.merged(raw_policy)["read_max_bytes"] == 64 * 1024 * 1024
    for bad in (0, -1, 1.5, True, "10", policymod.READ_MAX_BYTES_LIMIT + 1):
        raw_policy["read_max_bytes"] = bad
        assert any(e.startswith("read_max_bytes:") and "chv_cell_read_max_bytes" in e
                   for e in policymod.validate(raw_policy)), bad
    raw_policy["read_max_bytes"] = 1
    assert policymod.validate(raw_policy) == []


# ---------------------------------------------------------------- slot directories
@pytest.mark.skipif(not ROOT, reason="chown to a slot's uid needs root")
def test_slot_directories_are_the_slots_own_and_corrected(tmp_path):
    uid = 3456789
    d = str(tmp_path / "ws" / "slot0")
    fsutil.ensure_slot_dir(d, uid)
    st = os.stat(d)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o700)
    # a directory of an older release: the agent group, setgid 2750; or a cell's chmod 0777
    for gid, mode in ((1000, 0o2750), (uid, 0o777)):
        os.chown(d, uid, gid)
        os.chmod(d, mode)
        fsutil.ensure_slot_dir(d, uid)
        st = os.stat(d)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o700), (gid, mode)
    # a symlink where the slot directory goes is refused, its target untouched
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    os.symlink(str(target), str(tmp_path / "ws" / "slot1"))
    with pytest.raises(errors.SetupError):
        fsutil.ensure_slot_dir(str(tmp_path / "ws" / "slot1"), uid)
    assert os.stat(target).st_uid == 0 and stat.S_IMODE(os.stat(target).st_mode) == 0o755


# ---------------------------------------------------------------- the verdict record
@pytest.mark.parametrize("args, verdict", [
    ((0, "claimed", "slot0", True, 0), "ran"),
    ((75, "claimed", "slot0", True, 75), "ran"),      # a payload's 75 is the payload's
    ((125, "claimed", "slot0", True, 125), "ran"),    # and so is its 125
    ((124, "claimed", "slot0", True, None), "runtime"),
    ((124, "claimed", "slot0", True, 124), "ran"),    # the payload's own 124
    ((129, "claimed", "slot0", True, None), "signal"),
    ((143, "claimed", "slot0", False, None), "signal"),
    ((125, "claimed", "slot0", False, None), "setup"),
    ((125, "claimed", "slot0", True, 0), "setup"),    # ran, then the teardown failed
    ((75, "busy", None, False, None), "busy"),
    ((78, "config", None, False, None), "config"),
    ((125, "setup", None, False, None), "setup"),
    ((130, "signal", None, False, None), "signal"),
    ((3, "warm", None, False, None), "unknown"),
])
def test_status_record(args, verdict):
    rec = status.status_record(*args)
    assert rec == {"verdict": verdict, "exit": args[0], "slot": args[2], "payload_started": args[3],
                   "payload_exit": args[4]}
    assert rec["verdict"] in status.VERDICTS


def test_status_fd_must_be_a_writable_fd_above_2(tmp_path):
    r, w = os.pipe()
    ro = os.open(str(tmp_path), os.O_RDONLY)
    closed = os.dup(w)
    os.close(closed)
    try:
        assert status.status_fd_problem(w) is None
        for fd, says in ((1, "3 or more"), (2, "3 or more"), (r, "not open for writing"), (ro, "not open for writing"),
                         (closed, "not open (through sudo")):
            assert says in status.status_fd_problem(fd), fd
    finally:
        for fd in (r, w, ro):
            os.close(fd)


def test_write_status_writes_one_line_and_closes(tmp_path):
    r, w = os.pipe()
    status.write_status(w, status.status_record(75, "busy"))
    assert json.loads(os.read(r, 4096).decode()) == {"verdict": "busy", "exit": 75, "slot": None,
                                                      "payload_started": False, "payload_exit": None}
    with pytest.raises(OSError):
        os.fstat(w)  # closed: nothing else can be written there
    os.close(r)
    r, w = os.pipe()
    os.close(r)
    status.write_status(w, status.status_record(0, "config"))  # no reader: logged, not raised


@pytest.mark.skipif(not ROOT, reason="a run (even a refused one) takes the state dir and slot locks as root")
def test_a_real_busy_gives_the_busy_verdict_and_a_refusal_the_config_verdict(policy, tmp_path):
    pol = copy.deepcopy(policy)
    pol["state_dir"] = str(tmp_path / "state")
    pol["slots"] = pol["slots"][:1]
    from chv_guest.cell import argv as argvmod

    lock = argvmod.cell_paths(pol, pol["slots"][0])["lock"]
    os.makedirs(os.path.dirname(lock), 0o700)
    held = claimmod.try_claim(lock)
    assert held is not None
    try:
        for kwargs, verdict, rc in (({"timeout": 0}, "busy", exits.EXIT_BUSY),
                                    ({"shared_network": True}, "config", exits.EXIT_CONFIG),
                                    ({"slot_name": "nope"}, "config", exits.EXIT_CONFIG)):
            r, w = os.pipe()
            la = runner.Launcher(pol)
            la.status_fd = w
            assert la.run(["true"], **kwargs) == rc
            assert os.get_inheritable(r) is False
            assert json.loads(os.read(r, 4096)) == {"verdict": verdict, "exit": rc, "slot": None,
                                                    "payload_started": False, "payload_exit": None}
            os.close(r)
    finally:
        held.release()
