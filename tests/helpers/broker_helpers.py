"""Fixtures for chv-broker tests: real Unix sockets, real pid namespaces, real uids.

The tests need root (SO_PEERCRED of other uids, setuid for the sync worker,
`unshare --pid`), as the broker does in production.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import procs
from testpaths import SRC

from chv_guest.broker import server
from chv_guest.wire import wire

CELL_UID = 100000
# the sync worker runs as a cell uid: it needs an interpreter outside /root (pyenv lives there)
SYNC_PYTHON = "/usr/bin/python3"
CELL_UID_SIZE = 65536

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the broker's peer check and setuid sync need root")


def _free_root():
    d = tempfile.mkdtemp(prefix="chvb-")
    os.chmod(d, 0o755)  # the sync worker runs as a cell uid and must traverse
    return d


@pytest.fixture
def scratch():
    d = _free_root()
    yield d
    if not os.environ.get("CHV_KEEP"):
        shutil.rmtree(d, ignore_errors=True)


def write_record(cells_dir, slot, pid, uid_base=CELL_UID, uid_size=CELL_UID_SIZE):
    os.makedirs(cells_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(cells_dir, slot + ".json"), "w") as fh:
        json.dump({"slot": slot, "pid": pid, "uid_base": uid_base, "uid_size": uid_size,
                   "started": time.time()}, fh)


def git(cwd, *args):
    """git as root on trees the cells' uids own (safe.directory), with an identity for commits."""
    subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "safe.directory=*", "-c", "user.name=t",
                    "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True)


def new_repo(env, slot="slot0"):
    """An empty git repository "repo" in ``slot``'s new workspace (root's until chown_tree): (workspace, repo)."""
    ws = os.path.join(env["ws"], slot)
    repo = os.path.join(ws, "repo")
    os.makedirs(repo)
    git(repo, "init", "-q")
    return ws, repo


def chown_tree(path, uid):
    """``path`` and all below it to uid:uid (links themselves, not what they name)."""
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, uid)
    os.lchown(path, uid, uid)


class CellCgroup:
    """A cgroup v2 directory named as the launcher names a cell's (``chv-cell-<slot>``), under a
    scratch parent of its own: chv-broker freezes it while the slot's sync runs (freeze.py)."""

    def __init__(self, slot, pids=()):
        from chv_guest.broker.freeze import cgroup2_root  # pylint: disable=import-outside-toplevel
        self.root = cgroup2_root()
        assert self.root, "no cgroup2 hierarchy mounted"
        self.parent = os.path.join(self.root, "chv-broker-test-%d-%s" % (os.getpid(), os.urandom(4).hex()))
        self.path = os.path.join(self.parent, "chv-cell-" + slot)
        os.makedirs(self.path)
        for pid in pids:
            self.add(pid)

    def add(self, pid):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))

    def frozen(self):
        with open(os.path.join(self.path, "cgroup.events")) as fh:
            return "frozen 1" in fh.read().split("\n")

    def close(self):
        with open(os.path.join(self.path, "cgroup.freeze"), "w") as fh:
            fh.write("0")
        with open(os.path.join(self.path, "cgroup.procs")) as fh:
            left = [int(p) for p in fh.read().split()]
        for pid in left:  # back to the test's own cgroup
            try:
                with open(os.path.join(self.root, "cgroup.procs"), "w") as fh:
                    fh.write(str(pid))
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.rmdir(self.path)
                os.rmdir(self.parent)
                return
            except OSError:
                time.sleep(0.05)


class Cell:
    """A process tree in a fresh pid namespace, standing for a chv cell."""

    def __init__(self):
        self.unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "600"])
        deadline = time.monotonic() + 5
        self.pid = None
        while time.monotonic() < deadline and self.pid is None:
            try:
                with open("/proc/%d/task/%d/children" % (self.unshare.pid, self.unshare.pid)) as fh:
                    kids = fh.read().split()
                if kids:
                    self.pid = int(kids[0])
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        assert self.pid, "unshare did not start its child"
        # wait until the child really is in its own namespace (after exec)
        while os.readlink("/proc/%d/ns/pid" % self.pid) == os.readlink("/proc/self/ns/pid"):
            time.sleep(0.01)
        # in a cgroup named as slot0's cell (chv-broker freezes it for a sync of the slot)
        self.cgroup = CellCgroup("slot0", [self.pid])

    def run(self, argv, uid=CELL_UID, **kw):
        """Run argv inside this cell's pid namespace as ``uid``."""
        cmd = ["nsenter", "-t", str(self.pid), "--pid", "--",
               "setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups", "--"] + argv
        return subprocess.run(cmd, capture_output=True, text=True, timeout=15, **kw, check=False)

    def close(self):
        # --kill-child: the namespace's init dies with unshare, and the kernel kills the rest
        self.unshare.kill()
        self.unshare.wait()
        self.cgroup.close()


@pytest.fixture
def cell():
    c = Cell()
    yield c
    c.close()


@pytest.fixture
def other_ns():
    c = Cell()
    yield c
    c.close()


CLIENT = os.path.join(SRC, "chv_guest", "broker", "client.py")


def client_argv(sock, request):
    return [sys.executable, "-I", "-c",
            "import sys; sys.argv=['c', sys.argv[1]]; exec(open(%r).read())" % CLIENT,
            json.dumps(request) if not isinstance(request, str) else request]


def client_env(sock):
    return {"CHV_BROKER_SOCKET": sock, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


class BrokerProc:
    """chv-broker as systemd runs it: a separate process handed a listening socket on fd 3."""

    def __init__(self, listener, config_path):
        self.listener = listener
        self.config_path = config_path
        self.proc = None
        self.stderr_path = config_path + ".log"

    def start(self):
        fd = self.listener.fileno()
        code = ("import os, sys; sys.path.insert(0, %r); os.environ['LISTEN_PID'] = str(os.getpid()); "
                "from chv_guest.broker.server import main; sys.exit(main(['--config', %r]))") % (SRC, self.config_path)

        def to_fd3():
            os.dup2(fd, 3)
            os.set_inheritable(3, True)
        err = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=to_fd3, pass_fds=(fd, 3),
                                     env={"LISTEN_FDS": "1", "PATH": os.environ["PATH"]}, stderr=err)
        err.close()
        return self

    def audit(self):
        with open(self.stderr_path) as fh:
            return [json.loads(line) for line in fh if line.startswith("{")]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            procs.stop(self.proc, 5)


def make_listener(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o666)
    s.listen(64)
    return s


@pytest.fixture
def env(scratch):
    """Directory layout + config for a broker, as the role renders it."""
    cells = os.path.join(scratch, "cells")
    ws = os.path.join(scratch, "workspaces")
    os.makedirs(cells, mode=0o700)
    os.makedirs(ws, mode=0o755)
    cfg = {"cells_dir": cells, "workspaces_dir": ws, "read_timeout": 2.0,
           "sync": {"credentials_file": os.path.join(scratch, "no-credentials"),
                    "python": SYNC_PYTHON, "timeout": 30.0,
                    # no systemd as PID 1 here: the worker is the broker's child
                    # (isolation "unit" is verified on lab guests by Molecule)
                    "isolation": "child"},
           "browser": {"socket": os.path.join(scratch, "browser.sock"), "timeout": 10.0,
                       "reap_interval": 0}}
    path = os.path.join(scratch, "broker.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return {"root": scratch, "cells": cells, "ws": ws, "config": path,
            "sock": os.path.join(scratch, "broker.sock")}


@pytest.fixture
def broker_proc(env):
    listener = make_listener(env["sock"])
    b = BrokerProc(listener, env["config"]).start()
    yield b
    b.stop()
    listener.close()


class InProcess:
    """chv-broker's Broker in a thread of the test process, on a real socket.

    The test process itself is made a cell peer: a record whose leader is a
    child in the test's own pid namespace and whose uid range holds uid 0.
    Fast enough for property-based fuzzing; the peer check still runs for real.
    """

    def __init__(self, env, uid_base=0, uid_size=CELL_UID + CELL_UID_SIZE):
        self.env = env
        self.leader = subprocess.Popen(["sleep", "600"])
        # the cell's cgroup: chv-broker freezes it while a sync of the slot runs
        self.cgroup = CellCgroup("slot0", [self.leader.pid])
        write_record(env["cells"], "slot0", self.leader.pid, uid_base, uid_size)
        self.cfg = server.load_config(env["config"])
        self.log = open(os.path.join(env["root"], "inproc.log"), "w")
        self.broker = server.Broker(self.cfg, log=self.log)
        self.listener = make_listener(env["sock"])
        self.thread = threading.Thread(target=self.broker.serve, args=(self.listener,), daemon=True)
        self.thread.start()

    def raw(self, data, timeout=10):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.env["sock"])
            s.sendall(data)
            return wire.parse_object(wire.read_line(s, 1 << 22, timeout))

    def call(self, req):
        return self.raw(wire.encode(req))

    def close(self):
        self.broker.stop()
        self.thread.join(5)
        self.listener.close()
        self.leader.kill()
        self.leader.wait()
        self.cgroup.close()
        self.log.close()


@pytest.fixture
def inproc(env):
    b = InProcess(env)
    yield b
    b.close()


# ------------------------------------------------------------------ slots with their own uids (issue 29)
_SLOT_CALL = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(float(sys.argv[2]))\n"
    "s.connect(sys.argv[1]); s.sendall(sys.stdin.buffer.read())\n"
    "buf = b''\n"
    "while not buf.endswith(b'\\n'):\n"
    "    chunk = s.recv(65536)\n"
    "    if not chunk: break\n"
    "    buf += chunk\n"
    "sys.stdout.buffer.write(buf)\n")


class SlotInProcess(InProcess):
    """InProcess for a real slot: a record with the slot's own uid range (uid_base > 0,
    as the launcher writes it), and every request sent by a process running as
    ``peer_uid`` (default: the slot's uid_base, the cell's root) in the test's pid
    namespace, so the peer check passes as it does for a cell's process. What the sync
    door derives from the slot (the worker's uid and gid) is then what production uses.
    """

    def __init__(self, env, slot="slot0", uid_base=CELL_UID, uid_size=CELL_UID_SIZE, peer_uid=None):
        super().__init__(env, uid_base, uid_size)
        if slot != "slot0":
            os.rename(os.path.join(env["cells"], "slot0.json"), os.path.join(env["cells"], slot + ".json"))
            with open(os.path.join(env["cells"], slot + ".json")) as fh:
                rec = json.load(fh)
            rec["slot"] = slot
            with open(os.path.join(env["cells"], slot + ".json"), "w") as fh:
                json.dump(rec, fh)
            self.cgroup.close()
            self.cgroup = CellCgroup(slot, [self.leader.pid])
        self.peer_uid = uid_base if peer_uid is None else peer_uid

    def raw(self, data, timeout=60):
        proc = subprocess.run([SYNC_PYTHON, "-I", "-c", _SLOT_CALL, self.env["sock"], str(timeout)], input=data,
                              capture_output=True, timeout=timeout + 5, user=self.peer_uid, group=self.peer_uid,
                              extra_groups=[], check=False)
        assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
        return wire.parse_object(proc.stdout.rstrip(b"\n"))


@pytest.fixture
def slot_inproc(env):
    """chv-broker in-process, its peer a process of slot0 (uid_base CELL_UID) as a cell's would be."""
    b = SlotInProcess(env)
    yield b
    b.close()


# ------------------------------------------------------------------ door fairness (issue 29)
# A second slot's uid range, apart from CELL_UID's: peers of two slots differ by uid and pid namespace.
OTHER_UID = 300000

# Driven by JSON lines on stdin, one JSON answer line each, from inside a cell (DoorClient):
#   {"cmd": "idle", "n": N}          open N connections and send nothing (held idle)
#   {"cmd": "send", "req": R}        open a connection, send R, keep it (its reply is read by "state")
#   {"cmd": "call", "req": R, "n": N} N times: connect, send R, read the reply and the broker's
#                                    close (client.py's request); the replies and each call's
#                                    milliseconds (connect to close)
#   {"cmd": "state"}                 each held connection: "open" (nothing came yet), its reply, or "closed"
#   {"cmd": "close"}                 close every held connection
_DOOR_CLIENT = r'''
import json, select, socket, sys, time
path, held = sys.argv[1], []
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s
def line(s, timeout):
    s.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    return json.loads(buf) if buf.endswith(b"\n") else "closed"
def closed(s):
    s.settimeout(120)
    try:
        while s.recv(1 << 20):
            pass
    except OSError:  # reset: a connection refused unread is closed with the request still queued
        pass
def send(s, req):
    try:
        s.sendall(json.dumps(req).encode() + b"\n")
    except OSError:  # refused at once: the door's reply is waiting on the socket
        pass
def state(s):
    if s.fileno() < 0:
        return "closed"
    if not select.select([s], [], [], 0)[0]:
        return "open"
    return line(s, 5)
for cmd in map(json.loads, sys.stdin):
    if cmd["cmd"] == "idle":
        held += [connect() for _ in range(cmd["n"])]
        out = {"held": len(held)}
    elif cmd["cmd"] == "send":
        s = connect()
        send(s, cmd["req"])
        held.append(s)
        out = {"held": len(held)}
    elif cmd["cmd"] == "call":
        replies, ms = [], []
        for _ in range(cmd.get("n", 1)):
            t0 = time.monotonic()
            with connect() as s:
                send(s, cmd["req"])
                replies.append(line(s, 120))
                closed(s)  # the broker gives the slot's connection back before it closes
            ms.append((time.monotonic() - t0) * 1000)
        out = {"replies": replies, "ms": ms}
    elif cmd["cmd"] == "state":
        states = [state(s) for s in held]
        for s, st in zip(held, states):
            if st != "open":
                s.close()
        out = {"states": states}
    elif cmd["cmd"] == "close":
        for s in held:
            s.close()
        out = {"closed": len(held)}
        held = []
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
'''


class DoorClient:
    """A process of ``cell`` running as ``uid`` that holds connections to the Unix socket
    ``sock`` open and sends requests on command, as a tenant's cell would (see _DOOR_CLIENT)."""

    def __init__(self, cell, uid, sock):
        argv = ["nsenter", "-t", str(cell.pid), "--pid", "--", "setpriv", "--reuid=%d" % uid,
                "--regid=%d" % uid, "--clear-groups", "--", SYNC_PYTHON, "-I", "-c", _DOOR_CLIENT, sock]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _do(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, "the door client in the cell died (exit %s)" % self.proc.poll()
        return json.loads(out)

    def idle(self, n):
        return self._do(cmd="idle", n=n)

    def send(self, req):
        return self._do(cmd="send", req=req)

    def call(self, req, n=1):
        """(replies, milliseconds of each call)."""
        out = self._do(cmd="call", req=req, n=n)
        return out["replies"], out["ms"]

    def state(self):
        return self._do(cmd="state")["states"]

    def close_all(self):
        return self._do(cmd="close")

    def stop(self):
        if self.proc.poll() is None:
            procs.stop(self.proc, 10, end=self.proc.stdin.close)


def busy_for(reply, quota, slot):
    """Whether ``reply`` is a door's "busy" refusal naming ``quota`` for ``slot``."""
    return (isinstance(reply, dict) and reply.get("ok") is False and reply["error"].startswith("busy: ")
            and "(%s)" % quota in reply["error"] and "slot %s " % slot in reply["error"])


def write_config(env, **over):
    """Rewrite the broker configuration of ``env`` with top-level keys ``over`` (sections merged)."""
    with open(env["config"]) as fh:
        cfg = json.load(fh)
    for key, value in over.items():
        cfg[key] = dict(cfg.get(key, {}), **value) if isinstance(value, dict) else value
    with open(env["config"], "w") as fh:
        json.dump(cfg, fh)
    return cfg


class StubBrowser:
    """A stand-in for chv-browser's socket: answers every request at once, except those of
    ``hold_slot``, which it holds (unanswered) until release(). ``seen(slot)`` counts the
    requests of a slot that reached it, ``arrived`` is set at each one."""

    def __init__(self, path, hold_slot):
        self.hold_slot = hold_slot
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.listener.settimeout(0.2)
        self.released = threading.Event()
        self.arrived = threading.Condition()
        self.requests = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, dummy = self.listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            try:
                req = wire.parse_object(wire.read_line(conn, 65536, 30))
            except wire.WireError:
                return
            with self.arrived:
                self.requests.append(req)
                self.arrived.notify_all()
            if req.get("slot") == self.hold_slot:
                self.released.wait(300)
            wire.send_quietly(conn, wire.ok({"title": "stub", "url": req.get("url"), "slot": req.get("slot")}))

    def seen(self, slot):
        with self.arrived:
            return sum(1 for r in self.requests if r.get("slot") == slot)

    def wait_seen(self, slot, n, timeout=60):
        with self.arrived:
            return self.arrived.wait_for(lambda: sum(1 for r in self.requests if r.get("slot") == slot) >= n,
                                         timeout)

    def close(self):
        self.released.set()
        self._stop.set()
        self.thread.join(5)
        self.listener.close()


def median_ms(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
