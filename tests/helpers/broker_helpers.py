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

from testpaths import BROKER_FILES as FILES

sys.path.insert(0, FILES)

from chv_broker import server, wire  # noqa: E402

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

    def run(self, argv, uid=CELL_UID, **kw):
        """Run argv inside this cell's pid namespace as ``uid``."""
        cmd = ["nsenter", "-t", str(self.pid), "--pid", "--",
               "setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups", "--"] + argv
        return subprocess.run(cmd, capture_output=True, text=True, timeout=15, **kw, check=False)

    def close(self):
        # --kill-child: the namespace's init dies with unshare, and the kernel kills the rest
        self.unshare.kill()
        self.unshare.wait()


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


CLIENT = os.path.join(FILES, "chv_broker", "client.py")


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
                "from chv_broker.server import main; sys.exit(main(['--config', %r]))") % (FILES, self.config_path)

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
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
        self.log.close()


@pytest.fixture
def inproc(env):
    b = InProcess(env)
    yield b
    b.close()
