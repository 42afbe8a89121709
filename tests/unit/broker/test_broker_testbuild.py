"""chv-broker's test builds for `chv-cell audit --counter-proof`
(chv_guest/broker/testbuild.py; the guard, chv_guest/wire/testbuild.py):
each replaced check beside the installed one on the same request, and the
guard refusing every start but the counter-proof's.

The processes are started as chv_guest/cell/doorbuild.py starts them (its
ENTRY), without the systemd scope (no systemd here), by the test process,
whose pid the run directory's owner file names: the counter-proof's place."""
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from broker_helpers import CELL_UID, SYNC_PYTHON, client_argv, client_env, needs_root, write_record
from testpaths import SRC

from chv_guest.broker import peer, server, testbuild
from chv_guest.cell import doorbuild
from chv_guest.wire import testbuild as guard


# ------------------------------------------------------------------ the replaced checks, in process
class Conn:
    """What PeerChecker.identify reads of a connection: SO_PEERCRED (and no SO_PEERPIDFD)."""

    def __init__(self, pid, uid):
        self.pid, self.uid = pid, uid

    def getsockopt(self, level, opt, size=None):
        if size is None:
            raise OSError("no SO_PEERPIDFD")
        return peer._UCRED.pack(self.pid, self.uid, self.uid)


def test_any_peer_lets_in_the_peer_the_installed_check_refuses(tmp_path):
    real, loose = peer.PeerChecker(str(tmp_path)), testbuild.AnyPeer(str(tmp_path))
    guest_root = Conn(os.getpid(), 0)  # a guest process outside every cell: no record holds it
    with pytest.raises(peer.PeerRejected, match="uid outside every live cell's range"):
        real.identify(guest_root)
    assert loose.identify(guest_root) == {"slot": testbuild.UNCHECKED_SLOT, "pid": os.getpid(), "uid_base": 0,
                                          "uid_size": 1}


def test_any_peer_still_gives_a_cells_process_its_own_cell(tmp_path):
    """The control: a live cell's peer is its cell's in both (the per-slot quotas
    and the replies of the other cases stay as installed)."""
    write_record(str(tmp_path), "slot0", os.getpid(), uid_base=0, uid_size=CELL_UID)
    conn = Conn(os.getpid(), 0)
    want = peer.PeerChecker(str(tmp_path)).identify(conn)
    assert want["slot"] == "slot0"
    assert testbuild.AnyPeer(str(tmp_path)).identify(conn) == want


CELL = {"slot": "slot0", "pid": 4242, "uid_base": 100000, "uid_size": 65536}


def _broker(cls, tmp_path):
    cfg = server.merge(server.DEFAULTS, {"cells_dir": str(tmp_path), "slots": 2})
    return cls(cfg, log=open(os.devnull, "w"))


def test_any_op_answers_the_unknown_op_the_installed_dispatch_refuses(tmp_path):
    req = {"op": "chv-audit-no-such-op"}
    with pytest.raises(server.OpError, match="unknown or disabled op: 'chv-audit-no-such-op'"):
        _broker(server.Broker, tmp_path).dispatch(CELL, req)
    assert _broker(testbuild.AnyOpBroker, tmp_path).dispatch(CELL, req) == {"accepted": "chv-audit-no-such-op",
                                                                           "slot": "slot0"}
    # the control: a known op is dispatched as installed
    assert _broker(testbuild.AnyOpBroker, tmp_path).dispatch(CELL, {"op": "ping"}) == \
        _broker(server.Broker, tmp_path).dispatch(CELL, {"op": "ping"}) == {"pong": True, "slot": "slot0"}


def test_the_guard_and_the_cell_side_agree_on_the_directory():
    assert (guard.RUN_DIR_PARENT, guard.RUN_DIR_PREFIX, guard.OWNER_FILE) == \
        (doorbuild.RUN_DIR_PARENT, doorbuild.RUN_DIR_PREFIX, doorbuild.OWNER_FILE)


# ------------------------------------------------------------------ the guard
@pytest.fixture
def run_root(tmp_path, monkeypatch):
    """A stand-in for /run (the guard's and doorbuild's RUN_DIR_PARENT)."""
    root = tmp_path / "run"
    root.mkdir()
    monkeypatch.setattr(guard, "RUN_DIR_PARENT", str(root))
    return root


def _counter_proof_dir(run_root, owner):
    d = doorbuild.make_run_dir(parent=str(run_root))
    with open(os.path.join(d, doorbuild.OWNER_FILE), "w") as fh:
        fh.write("%d\n" % owner)
    return d


@needs_root
def test_the_guard_lets_in_the_counter_proofs_own_start_only(run_root):
    d = _counter_proof_dir(run_root, 4242)
    sock = os.path.join(d, "run", "broker.sock")
    assert guard.refusal(d, [sock], euid=0, ppid=4242) is None  # the control: the counter-proof's start
    assert "root only" in guard.refusal(d, [sock], euid=1000, ppid=4242)
    assert "not started by the counter-proof" in guard.refusal(d, [sock], euid=0, ppid=1)  # e.g. systemd
    assert "lies outside" in guard.refusal(d, ["/run/chv/broker.sock"], euid=0, ppid=4242)
    os.chmod(d, 0o777)
    assert "only root may write" in guard.refusal(d, [sock], euid=0, ppid=4242)
    os.chmod(d, 0o755)
    other = str(run_root / "elsewhere")
    os.mkdir(other)
    assert "not a counter-proof's directory" in guard.refusal(other, [], euid=0, ppid=4242)
    link = str(run_root / (doorbuild.RUN_DIR_PREFIX + "link"))
    os.symlink(d, link)
    assert "only root may write" in guard.refusal(link, [], euid=0, ppid=4242)


# ------------------------------------------------------------------ the wrapper as the counter-proof starts it
def _start(run_dir, variant, config, sock):
    argv = [sys.executable, "-I", "-c", doorbuild.ENTRY % (SRC, "broker"), "--run-dir", run_dir,
            "--variant", variant, "--config", config, "--listen", sock]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ping(sock, uid=None):
    kw = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    # the guest's own interpreter, as the audit's pings (a cell's uid cannot reach the test venv's)
    p = subprocess.run([SYNC_PYTHON] + client_argv(sock, {"op": "ping"})[1:], env=client_env(sock),
                       capture_output=True, text=True, timeout=30, check=False, **kw)
    return json.loads(p.stdout) if p.stdout.strip() else {"rc": p.returncode, "err": p.stderr}


@pytest.fixture
def build_dir():
    """A counter-proof's directory under the real /run (the wrapper runs in a
    process of its own: its guard reads the real RUN_DIR_PARENT), owned by
    this test process, as cell A's slot's group would have it."""
    d = doorbuild.make_run_dir(group=CELL_UID, mode=0o750)
    os.mkdir(os.path.join(d, "run"), 0o755)
    cells = os.path.join(d, "cells")
    os.mkdir(cells, 0o700)
    config = os.path.join(d, "broker.json")
    with open(config, "w") as fh:
        json.dump({"cells_dir": cells, "slots": 2, "read_timeout": 2.0, "sync": {"enabled": False},
                   "browser": {"enabled": False}}, fh)
    yield {"dir": d, "config": config, "sock": os.path.join(d, "run", "broker.sock")}
    shutil.rmtree(d, ignore_errors=True)


def _serving(proc, sock):
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@needs_root
@pytest.mark.parametrize("variant, root_answered", [("as-installed", False), ("any-peer", True)])
def test_the_any_peer_build_answers_guest_root_and_a_cells_uid_that_the_installed_check_refuses(
        build_dir, variant, root_answered):
    """IPC-02 and IPC-03 as the audit asks them (the broker's client, as
    guest root and as a cell's uid, outside every cell): refused by the
    installed check (the control), answered by the any-peer build."""
    proc = _start(build_dir["dir"], variant, build_dir["config"], build_dir["sock"])
    try:
        _serving(proc, build_dir["sock"])
        for uid in (None, CELL_UID):
            reply = _ping(build_dir["sock"], uid)
            if root_answered:
                assert reply == {"ok": True, "result": {"pong": True, "slot": testbuild.UNCHECKED_SLOT}}
            else:
                assert reply == {"ok": False, "error": "peer is not a process of a live chv cell"}
    finally:
        proc.terminate()
        proc.wait(10)


@needs_root
def test_the_wrapper_stops_when_the_counter_proof_is_gone(build_dir):
    """Started by a process that then dies (a killed audit): the build notices
    and stops by itself."""
    with open(os.path.join(build_dir["dir"], doorbuild.OWNER_FILE), "w") as fh:
        fh.write("0\n")  # the middle process writes its own pid below
    # the middle process (the audit): writes its pid, starts the build, waits until it serves, dies
    code = ("import os, subprocess, sys, time; open(sys.argv[1], 'w').write('%d\\n' % os.getpid()); "
            "p = subprocess.Popen(sys.argv[3:]); print(p.pid, flush=True)\n"
            "while not os.path.exists(sys.argv[2]) and p.poll() is None: time.sleep(0.05)\n"
            "print(p.poll(), flush=True)")
    argv = [sys.executable, "-I", "-c", doorbuild.ENTRY % (SRC, "broker"), "--run-dir", build_dir["dir"],
            "--variant", "any-peer", "--config", build_dir["config"], "--listen", build_dir["sock"]]
    mid = subprocess.run([sys.executable, "-c", code, os.path.join(build_dir["dir"], doorbuild.OWNER_FILE),
                          build_dir["sock"]] + argv, capture_output=True, text=True, timeout=30, check=True)
    pid, exited = mid.stdout.split()
    pid = int(pid)
    assert exited == "None" and os.path.exists(build_dir["sock"])  # it served while the audit lived
    deadline = time.monotonic() + 20
    try:
        while os.path.exists("/proc/%d" % pid) and open("/proc/%d/stat" % pid).read().split()[2] != "Z":
            assert time.monotonic() < deadline, "the build outlived its counter-proof"
            time.sleep(0.1)
    finally:
        if os.path.exists("/proc/%d" % pid):
            os.kill(pid, 9)


@needs_root
@pytest.mark.parametrize("why, setup", [
    ("not started by the counter-proof", lambda d: open(os.path.join(d, doorbuild.OWNER_FILE), "w").write("1\n")),
    ("not a counter-proof's directory", None),
])
def test_the_wrapper_refuses_any_other_start_and_serves_nothing(build_dir, why, setup):
    if setup is None:
        d = tempfile.mkdtemp(prefix="chv-audit-elsewhere.")
        sock = os.path.join(d, "broker.sock")
    else:
        d, sock = build_dir["dir"], build_dir["sock"]
        setup(d)
    try:
        proc = _start(d, "any-peer", build_dir["config"], sock)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == guard.EXIT_REFUSED and why in err, err
        assert not os.path.exists(sock)
    finally:
        if setup is None:
            shutil.rmtree(d)


def test_no_production_path_imports_a_test_build():
    """The services' entry points and units (the roles' templates) run the
    servers; no module of the package but the test builds themselves
    imports one (doorbuild.py starts them by name, in a process of their own)."""
    from testpaths import ROOT  # noqa: PLC0415

    for role, name in (("broker", "chv-broker"), ("browser", "chv-browser")):
        for template in (name + ".j2", name + ".service.j2"):
            with open(os.path.join(ROOT, "roles", role, "templates", template)) as fh:
                assert "testbuild" not in fh.read(), template
    def imports_a_test_build(path):
        with open(path) as fh:
            tree = ast.parse(fh.read())
        return any(isinstance(n, ast.ImportFrom) and ("testbuild" in (n.module or "") or
                                                      any(a.name == "testbuild" for a in n.names))
                   for n in ast.walk(tree))
    modules = [os.path.join(d, f) for d, _dirs, files in os.walk(os.path.join(SRC, "chv_guest")) for f in files
               if f.endswith(".py")]
    importers = [m for m in modules if imports_a_test_build(m)]
    # only the test builds, each importing the guard (the control: the reader sees an import of one)
    assert sorted(os.path.relpath(m, SRC) for m in importers) == ["chv_guest/broker/testbuild.py",
                                                                 "chv_guest/browser/testbuild.py"]
