"""The in-cell half of `chv-cell audit` (chv_cell/audit.py, the catalog):
run inside a cell as a plain script, ``python3 -I audit_probe.py in-cell
REQUEST`` (cell A: every probe and its control) or ``in-cell-listener
REQUEST`` (cell B: a listener cell A must not reach). Standard library
only; it never imports the package. Each attempt reports "ok" or the errno
name it raised, so the guest side judges what happened, not an exit code."""

import ctypes
import errno
import json
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

CONNECT_TIMEOUT = 3.0
LISTENER_PORT = 18799  # cell B's listener, for cell A and the doors to miss
GUEST_PORT = 18798  # the guest's listener (every guest address), for the cells and the doors to miss
MARKER = "chv-audit-guest-process"
APPEND = "open-append:"  # a write spec that opens an existing file for writing and changes nothing


def _errname(exc):
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, "E%s" % code) if code else type(exc).__name__


def _try(fn):
    """"ok", or the errno name the attempt raised."""
    try:
        fn()
    except OSError as exc:
        return _errname(exc)
    return "ok"


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _checked(result):
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def _read_any(path):
    """List a directory, read a file."""
    if os.path.isdir(path):
        os.listdir(path)
    else:
        _read(path)


def _write(spec):
    """Create a new file, or (APPEND + path) open an existing one for
    writing without changing it."""
    if spec.startswith(APPEND):
        os.close(os.open(spec[len(APPEND):], os.O_WRONLY | os.O_APPEND))
        return
    with open(spec, "w") as fh:
        fh.write("chv-audit\n")


def connect(host, port, family=socket.AF_INET, timeout=CONNECT_TIMEOUT):
    """"connected: <first bytes>" or the error's name: a dropped packet
    is a TimeoutError, a refused one ECONNREFUSED."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect((host, port))
            try:
                data = s.recv(16).decode("ascii", "replace")
            except OSError:
                data = ""
            return "connected: %s" % data.strip()
    except OSError as exc:
        return _errname(exc)


def connect_all(targets, family=socket.AF_INET):
    """{key: connect(host, port)} for {key: [host, port]}, all at once."""
    out, threads = {}, []
    for key, (host, port) in targets.items():
        def attempt(key=key, host=host, port=int(port)):
            out[key] = connect(host, port, family)
        threads.append(threading.Thread(target=attempt, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(CONNECT_TIMEOUT + 5)
    return dict((key, out.get(key, "no result")) for key in targets)


def _run(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        return {"rc": p.returncode, "err": (p.stderr or p.stdout).strip()[-300:]}
    except OSError as exc:
        return {"rc": None, "err": _errname(exc)}


_GETPID = {"x86_64": 39, "aarch64": 172}
_IO_URING_SETUP = 425  # the same number on x86_64 and aarch64
_CLONE_NEWUSER = 0x10000000
_PTRACE_ATTACH = 16


def _ptrace_attach(libc, pid):
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    _checked(libc.ptrace(_PTRACE_ATTACH, pid, None, None))


def _own_child_signal():
    """The control of the ptrace case: the probe signals its own child
    (nspawn's seccomp filter refuses ptrace() itself without CAP_SYS_PTRACE,
    so attaching to the child cannot be the control)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        return _try(lambda: os.kill(pid, 0))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _kernel_probes(req):
    libc = _libc()
    scratch = "/tmp/chv-audit-%s" % req["nonce"]
    out = {}
    buf = ctypes.create_string_buffer(120)
    out["io_uring_setup"] = _try(lambda: _checked(libc.syscall(_IO_URING_SETUP, 8, buf)))
    nr = _GETPID.get(platform.machine())
    out["syscall_getpid"] = "ok" if nr and libc.syscall(nr) == os.getpid() else "bad"
    out["unshare_user"] = _try(lambda: _checked(libc.unshare(_CLONE_NEWUSER)))
    out["unshare_none"] = _try(lambda: _checked(libc.unshare(0)))
    out["mkdir"] = _try(lambda: os.mkdir(scratch))
    out["mount_tmpfs"] = _try(lambda: _checked(libc.mount(b"none", scratch.encode(), b"tmpfs", 0, None)))
    out["mknod_chr"] = _try(lambda: os.mknod(scratch + "/null", 0o600 | stat.S_IFCHR, os.makedev(1, 3)))
    out["mkfifo"] = _try(lambda: os.mkfifo(scratch + "/fifo"))
    out["raw_socket"] = _try(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close())
    out["dgram_socket"] = _try(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())
    out["kill0_own_child"] = _own_child_signal()
    guest_pid = req["guest_pid"]
    out["ptrace_guest"] = _try(lambda: _ptrace_attach(libc, guest_pid))
    out["kill0_guest"] = _try(lambda: os.kill(guest_pid, 0))
    seen = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if MARKER.encode() in _read("/proc/%s/cmdline" % entry):
                    seen.append(int(entry))
            except OSError:
                pass
    out["marker_seen"] = seen
    out["own_pid_listed"] = str(os.getpid()) in os.listdir("/proc")
    out["open_guest_ns"] = _try(lambda: os.close(os.open("/proc/%d/ns/net" % guest_pid, os.O_RDONLY)))

    def setns_own():
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            _checked(libc.setns(fd, 0))
        finally:
            os.close(fd)
    out["open_own_ns"] = _try(lambda: os.close(os.open("/proc/self/ns/net", os.O_RDONLY)))
    out["setns_own"] = _try(setns_own)
    out["nsenter_guest"] = _run(["nsenter", "-t", str(guest_pid), "-n", "-m", "true"])
    out["nsenter_init"] = _run(["nsenter", "-t", "1", "-n", "-m", "true"])
    out["nsenter_version"] = _run(["nsenter", "--version"])
    ifname = req["cell_ifname"]
    out["ip_addr_add"] = _run([req["ip"], "addr", "add", "192.0.2.77/32", "dev", ifname])
    out["ip_addr_show"] = _run([req["ip"], "-4", "addr", "show", "dev", ifname])
    out["ip_route_add"] = _run([req["ip"], "route", "add", "192.0.2.0/24", "dev", ifname])
    out["ip_route_show"] = _run([req["ip"], "-4", "route", "show"])
    return out


def _ask(client, request, keep=300):
    """One request through chv-broker's client: exit status, the reply's tail."""
    p = subprocess.run([sys.executable, "-I", client, json.dumps(request)], capture_output=True, text=True,
                       timeout=90, check=False)
    return {"rc": p.returncode, "out": p.stdout.strip()[-keep:], "err": p.stderr.strip()[-300:]}


def _broker(client):
    return {"ping": _ask(client, {"op": "ping"}), "unknown": _ask(client, {"op": "chv-audit-no-such-op"}),
            "ping_after": _ask(client, {"op": "ping"})}


def _browser(client, spec):
    """chv-browser's open, for this cell, of the allowed page (the control)
    and of each URL it must not reach."""
    def open_url(url):
        return _ask(client, {"op": "browser", "action": "open", "url": url}, keep=200000)
    return {"allowed": open_url(spec["allowed"]) if spec.get("allowed") else None,
            "denied": dict((key, open_url(url)) for key, url in sorted(spec["denied"].items()))}


def in_cell(req):
    """Cell A: every probe and control of the request; returns the report."""
    out = {"uid": os.getuid(), "pid": os.getpid(), "uid_map": _read("/proc/self/uid_map").decode().split()}
    status = dict(line.split(":", 1) for line in _read("/proc/self/status").decode().splitlines() if ":" in line)
    for key in ("CapEff", "CapBnd", "NoNewPrivs"):
        out[key] = status.get(key, "").strip()
    out["read"] = {k: _try(lambda p=p: _read_any(p)) for k, p in req["read"].items()}
    out["write"] = {k: _try(lambda p=p: _write(p)) for k, p in req["write"].items()}
    out["kernel"] = _kernel_probes(req)
    out["tcp"] = connect_all(req["tcp"])
    out["tcp6"] = connect_all(req["tcp6"], socket.AF_INET6)
    out["neigh_out"] = subprocess.run([req["ip"], "neigh", "show", req["gateway"]], capture_output=True, text=True,
                                      check=False).stdout.strip()
    try:
        out["resolv"] = _read("/etc/resolv.conf").decode()
    except OSError as exc:
        out["resolv"] = _errname(exc)
    if req.get("broker_client"):
        out["broker"] = _broker(req["broker_client"])
        if req.get("browser"):
            out["browser"] = _browser(req["broker_client"], req["browser"])
    return out


def in_cell_listener(req):
    """Cell B: answer on LISTENER_PORT until the guest drops the done file
    into the slot's workspace; the control (B reaches its own listener on
    its own address) and B's uid_map go into the ready file, the peers of
    every later connection into the seen file."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", LISTENER_PORT))
    srv.listen(16)
    srv.settimeout(0.5)
    stop = threading.Event()
    peers = []

    def serve():
        while not stop.is_set():
            try:
                conn, peer = srv.accept()
            except OSError:
                continue
            with conn:
                peers.append(peer[0])
                conn.sendall(b"hello\n")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready = {"uid_map": _read("/proc/self/uid_map").decode().split(),
             "self": connect(req["address"], LISTENER_PORT)}
    del peers[:]  # the control's own connection
    with open(req["ready"] + ".tmp", "w") as fh:
        json.dump(ready, fh)
    os.rename(req["ready"] + ".tmp", req["ready"])
    deadline = time.monotonic() + req.get("wait", 120)
    while not os.path.exists(req["done"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    thread.join(2)
    srv.close()
    if req.get("seen"):
        with open(req["seen"] + ".tmp", "w") as fh:
            json.dump(peers, fh)
        os.rename(req["seen"] + ".tmp", req["seen"])


if __name__ == "__main__" and sys.argv[1:2] == ["in-cell"]:
    print(json.dumps(in_cell(json.loads(sys.argv[2]))))
    sys.stdout.flush()
    sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["in-cell-listener"]:
    in_cell_listener(json.loads(sys.argv[2]))
    sys.exit(0)
