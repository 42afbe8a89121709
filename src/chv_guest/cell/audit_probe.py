"""The in-cell half of `chv-cell audit` (chv_cell/audit.py, the catalog):
run inside a cell as a plain script, ``python3 -I audit_probe.py in-cell
REQUEST`` (cell A: every probe and its control) or ``in-cell-listener
REQUEST`` (cell B: a listener cell A must not reach). Standard library
only; it never imports the package. Each attempt reports "ok" or the errno
name it raised, so the guest side judges what happened, not an exit code."""

from __future__ import annotations

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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

CONNECT_TIMEOUT = 3.0
LISTENER_PORT = 18799  # cell B's listener, for cell A and the doors to miss
GUEST_PORT = 18798  # the guest's listener (every guest address), for the cells and the doors to miss
MARKER = "chv-audit-guest-process"
APPEND = "open-append:"  # a write spec that opens an existing file for writing and changes nothing


def _errname(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, "E%s" % code) if code else type(exc).__name__


# called without arguments (`...`: the callers' lambdas bind loop values as parameter defaults)
def _try(fn: Callable[..., object]) -> str:
    """"ok", or the errno name the attempt raised."""
    try:
        fn()
    except OSError as exc:
        return _errname(exc)
    return "ok"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _checked(result: int) -> int:
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _read_any(path: str) -> None:
    """List a directory, read a file."""
    if os.path.isdir(path):
        os.listdir(path)
    else:
        _read(path)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _write(spec: str) -> None:
    """Create a new file, or (APPEND + path) open an existing one for
    writing without changing it."""
    if spec.startswith(APPEND):
        os.close(os.open(spec[len(APPEND):], os.O_WRONLY | os.O_APPEND))
        return
    with open(spec, "w") as fh:
        fh.write("chv-audit\n")


def connect(host: str, port: int, family: int = socket.AF_INET, timeout: float = CONNECT_TIMEOUT) -> str:
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


def connect_all(targets: Mapping[str, Sequence[Any]], family: int = socket.AF_INET) -> Dict[str, str]:
    """{key: connect(host, port)} for {key: [host, port]}, all at once."""
    out: Dict[str, str] = {}
    threads: List[threading.Thread] = []
    for key, (host, port) in targets.items():
        def attempt(key: str = key, host: str = host, port: int = int(port)) -> None:
            out[key] = connect(host, port, family)
        threads.append(threading.Thread(target=attempt, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(CONNECT_TIMEOUT + 5)
    return dict((key, out.get(key, "no result")) for key in targets)


def dns_query(server: str, name: str, timeout: float = CONNECT_TIMEOUT) -> str:
    """One DNS query (the A record of ``name``, over UDP to ``server`` port
    53): "answered" when a reply with the query's id came back, else the
    error's name (a dropped query is a TimeoutError)."""
    qid = os.urandom(2)
    labels = b"".join(bytes([len(part)]) + part.encode("ascii") for part in name.rstrip(".").split("."))
    query = qid + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + labels + b"\x00\x00\x01\x00\x01"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.connect((server, 53))
            s.send(query)
            while s.recv(4096)[:2] != qid:
                pass
            return "answered"
    except OSError as exc:
        return _errname(exc)


def proxy_connect(proxy: str, host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str:
    """``CONNECT host:port`` through the proxy ``http://ADDR:PORT`` (the
    cell's HTTPS_PROXY): "status NNN" from the proxy's answer, or the
    error's name (no proxy, a dropped or refused connection)."""
    addr, sep, pport = proxy.rstrip("/").rpartition("://")[2].rpartition(":")
    if not proxy.startswith("http://") or not sep or not pport.isdigit():
        return "no proxy: %r" % proxy
    target = "%s:%d" % (host, port)
    try:
        with socket.create_connection((addr, int(pport)), timeout) as s:
            s.settimeout(timeout + 5)
            s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode("ascii"))
            head = b""
            while b"\r\n" not in head and len(head) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            words = head.split(b"\r\n", 1)[0].split()
            return "status %s" % words[1].decode("ascii", "replace") if len(words) > 1 else "no answer"
    except OSError as exc:
        return _errname(exc)


def egress_probe(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """Proxy mode (EGR cases): CONNECTs through the proxy the cell's own
    HTTPS_PROXY names, direct connections past it and DNS queries to every
    resolver the guest knows."""
    proxy = os.environ.get("HTTPS_PROXY", "")
    out: Dict[str, Any] = {"proxy": proxy, "direct": connect_all(spec["direct"]),
                           "dns": dict((server, dns_query(server, spec["qname"])) for server in spec["dns"])}
    out["connect"] = dict((key, proxy_connect(proxy, host, int(port)))
                          for key, (host, port) in sorted(spec["connect"].items()))
    return out


def _run(argv: List[str]) -> Dict[str, Any]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        return {"rc": p.returncode, "err": (p.stderr or p.stdout).strip()[-300:]}
    except OSError as exc:
        return {"rc": None, "err": _errname(exc)}


_GETPID = {"x86_64": 39, "aarch64": 172}
_IO_URING_SETUP = 425  # the same number on x86_64 and aarch64
_CLONE_NEWUSER = 0x10000000
_PTRACE_ATTACH = 16


def _ptrace_attach(libc: ctypes.CDLL, pid: int) -> None:
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    _checked(libc.ptrace(_PTRACE_ATTACH, pid, None, None))


def _own_child_signal() -> str:
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


def _kernel_probes(req: Mapping[str, Any]) -> Dict[str, Any]:
    libc = _libc()
    scratch = "/tmp/chv-audit-%s" % req["nonce"]
    out: Dict[str, Any] = {}
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
    seen: List[int] = []
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

    def setns_own() -> None:
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
    if req.get("families"):
        out["families"] = families_probe(req["families"], libc)
    return out


_SYS_SOCKET = {"x86_64": 41, "aarch64": 198}
VMADDR_ANY = 0xFFFFFFFF  # VMADDR_CID_ANY, VMADDR_PORT_ANY


def vsock_bind(family: int = 40) -> str:
    """An AF_VSOCK socket bound to any CID and port: "ok" or where it failed."""
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        return "socket: " + _errname(exc)
    try:
        s.bind((VMADDR_ANY, VMADDR_ANY))
        return "ok"
    except OSError as exc:
        return "bind: " + _errname(exc)
    finally:
        s.close()


def families_probe(spec: Mapping[str, Any], libc: Optional[ctypes.CDLL] = None) -> Dict[str, Any]:
    """socket() of each family of spec["allowed"] (the controls) and
    spec["denied"] ({name: [number, type, protocol]}), an AF_VSOCK bind and
    the high-bit form of AF_VSOCK (the family with bit 32 set, which the
    kernel truncates to an int) through syscall()."""
    libc = libc or _libc()
    out: Dict[str, Any] = {"allowed": {}, "denied": {}}
    for group in ("allowed", "denied"):
        for name, (num, typ, proto) in sorted(spec[group].items()):
            out[group][name] = _try(lambda num=num, typ=typ, proto=proto: socket.socket(num, typ, proto).close())
    out["vsock_bind"] = vsock_bind()
    nr = _SYS_SOCKET.get(platform.machine())
    if nr is None:
        out["high_bits"] = "no socket() number for %s" % platform.machine()
    else:
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(ctypes.c_long(nr), ctypes.c_long((1 << 32) | 40), ctypes.c_long(socket.SOCK_STREAM),
                          ctypes.c_long(0))
        if fd >= 0:
            os.close(fd)
            out["high_bits"] = "ok"
        else:
            out["high_bits"] = errno.errorcode.get(ctypes.get_errno(), "E%d" % ctypes.get_errno())
    return out


def disk_probe(directory: str) -> Dict[str, Any]:
    """The file system of ``directory`` (statvfs: size and what an
    unprivileged user may still take), a small write, and fallocate(2) of
    that free space and 1 MiB more (no fallback that writes zeros: only the
    kernel's allocation, which the file system refuses at once when the room
    is not there). Both files are removed again."""
    st = os.statvfs(directory)
    out: Dict[str, Any] = {"size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
    out["asked"] = out["free"] + (1 << 20)
    small, big = os.path.join(directory, ".chv-audit-disk-small"), os.path.join(directory, ".chv-audit-disk-big")

    def write_small() -> None:
        with open(small, "wb") as fh:
            fh.write(b"x" * 65536)
            fh.flush()
            os.fsync(fh.fileno())

    def allocate() -> None:
        libc = _libc()
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _checked(libc.fallocate(fd, 0, 0, out["asked"]))
        finally:
            os.close(fd)
    out["small"] = _try(write_small)
    t0 = time.monotonic()
    out["big"] = _try(allocate)
    out["big_seconds"] = round(time.monotonic() - t0, 3)
    for path in (small, big):
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def _ask(client: str, request: Mapping[str, Any], keep: int = 300) -> Dict[str, Any]:
    """One request through chv-broker's client: exit status, the reply's tail."""
    p = subprocess.run([sys.executable, "-I", client, json.dumps(request)], capture_output=True, text=True,
                       timeout=90, check=False)
    return {"rc": p.returncode, "out": p.stdout.strip()[-keep:], "err": p.stderr.strip()[-300:]}


def _broker(client: str) -> Dict[str, Any]:
    return {"ping": _ask(client, {"op": "ping"}), "unknown": _ask(client, {"op": "chv-audit-no-such-op"}),
            "ping_after": _ask(client, {"op": "ping"})}


def _browser(client: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
    """chv-browser's open, for this cell, of the allowed page (the control)
    and of each URL it must not reach."""
    def open_url(url: str) -> Dict[str, Any]:
        return _ask(client, {"op": "browser", "action": "open", "url": url}, keep=200000)
    return {"allowed": open_url(spec["allowed"]) if spec.get("allowed") else None,
            "denied": dict((key, open_url(url)) for key, url in sorted(spec["denied"].items()))}


# The sections of cell A's report (each the key of its results), run when
# the request's "probes" names them (every one when it names none): the
# cases of a run name theirs (catalog/, Case.probes).
SECTIONS = ("read", "write", "kernel", "tcp", "tcp6", "disk", "plant", "broker", "browser", "cookie", "sync", "quota",
            "egress")


def in_cell(req: Mapping[str, Any]) -> Dict[str, Any]:
    """Cell A: every probe and control of the request; returns the report."""
    want = set(req["probes"] if "probes" in req else SECTIONS)
    out: Dict[str, Any] = {"uid": os.getuid(), "pid": os.getpid(), "uid_map": _read("/proc/self/uid_map").decode().split()}
    status = dict(line.split(":", 1) for line in _read("/proc/self/status").decode().splitlines() if ":" in line)
    for key in ("CapEff", "CapBnd", "NoNewPrivs"):
        out[key] = status.get(key, "").strip()
    if "read" in want:
        out["read"] = {k: _try(lambda p=p: _read_any(p)) for k, p in req["read"].items()}
    if "write" in want:
        out["write"] = {k: _try(lambda p=p: _write(p)) for k, p in req["write"].items()}
    if "kernel" in want:
        out["kernel"] = _kernel_probes(req)
    if "tcp" in want:
        out["tcp"] = connect_all(req["tcp"])
    if "tcp6" in want:
        out["tcp6"] = connect_all(req["tcp6"], socket.AF_INET6)
    out["neigh_out"] = subprocess.run([req["ip"], "neigh", "show", req["gateway"]], capture_output=True, text=True,
                                      check=False).stdout.strip()
    try:
        out["resolv"] = _read("/etc/resolv.conf").decode()
    except OSError as exc:
        out["resolv"] = _errname(exc)
    if req.get("disk") and "disk" in want:
        out["disk"] = disk_probe(req["disk"])
    if req.get("plant") and "plant" in want:
        out["plant"] = plant(req["plant"])
    client = req.get("broker_client")
    if client and "broker" in want:
        out["broker"] = _broker(client)
    if client and req.get("browser") and "browser" in want:
        out["browser"] = _browser(client, req["browser"])
    if client and req.get("cookie") and "cookie" in want:
        out["cookie"] = [_ask(client, {"op": "browser", "action": "open", "url": req["cookie"]}, keep=20000)
                         for dummy in range(2)]
    if client and req.get("sync") and "sync" in want:
        out["sync"] = sync_probe(client, req["sync"])
    if client and req.get("quota") and "quota" in want:
        out["quota"] = quota_probe(client, req["quota"])
    if req.get("egress") and "egress" in want:
        out["egress"] = egress_probe(req["egress"])
    return out


def plant(spec: Mapping[str, Any]) -> Dict[str, str]:
    """What the cell leaves for a reader of its files (chv-cell read): a
    regular file, symbolic links (to another slot's file by its guest path,
    to /etc/shadow) and a FIFO; {name: "ok" or the errno name}."""
    out: Dict[str, str] = {}
    for name, (kind, path, arg) in sorted(spec.items()):
        if kind == "file":
            out[name] = _try(lambda path=path, arg=arg: open(path, "w").write(arg))
        elif kind == "symlink":
            out[name] = _try(lambda path=path, arg=arg: os.symlink(arg, path))
        else:
            out[name] = _try(lambda path=path: os.mkfifo(path))
    return out


def sync_probe(client: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
    """The sync door for repositories of this cell's workspace: a clean one
    (the control) and each hostile one, whose git directory names another
    slot's files (a packed-refs link, an alternates file); the replies."""
    out: Dict[str, Any] = {"setup": {}, "replies": {}}
    for name, r in sorted(spec["repos"].items()):
        path = r["path"]
        init = _run(["git", "-c", "init.defaultBranch=main", "init", "-q", path])
        if init["rc"] != 0:
            out["setup"][name] = "git init: rc %s %s" % (init["rc"], init["err"][-100:])
            continue
        gd = os.path.join(path, ".git")
        if r.get("packed_refs_link"):
            out["setup"][name] = _try(lambda gd=gd, r=r: os.symlink(r["packed_refs_link"], os.path.join(gd, "packed-refs")))
        elif r.get("alternates"):
            out["setup"][name] = _try(lambda gd=gd, r=r: _write_text(
                os.path.join(gd, "objects", "info", "alternates"), r["alternates"] + "\n"))
        else:
            out["setup"][name] = "ok"
        out["replies"][name] = _ask(client, {"op": "sync", "action": "status", "repo": r["repo"]}, keep=20000)
    return out


def _door_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _pending_reply(s: socket.socket, wait: float) -> str:
    """The first line the door sent on ``s`` within ``wait`` seconds, or "idle"."""
    import select  # noqa: PLC0415
    if not select.select([s], [], [], wait)[0]:
        return "idle"
    try:
        data = s.recv(4096)
    except OSError as exc:
        return _errname(exc)
    return data.decode("utf-8", "replace").strip() or "closed"


def quota_probe(client: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
    """Hold the door: ``limit`` idle connections and ``extra`` more, each
    opened after the one before; the replies of the ones past the quota.
    Then the ready file (the guest has another slot ping), a wait for the go
    file, whether the held connections were still held then, and, after
    closing them, this cell's own ping (retried while the door has not
    counted the closes yet)."""
    held: List[socket.socket] = []
    out: Dict[str, Any] = {"replies": []}
    try:
        for dummy in range(spec["limit"] + spec["extra"]):
            held.append(_door_connect(spec["socket"]))
            time.sleep(0.05)  # the door's accept loop admits each before the next arrives
        out["replies"] = [_pending_reply(s, 1.0 if i >= spec["limit"] else 0.2) for i, s in enumerate(held)]
    except OSError as exc:
        out["error"] = "connect %d: %s" % (len(held) + 1, _errname(exc))
    with open(spec["ready"] + ".tmp", "w") as fh:
        json.dump(out["replies"], fh)
    os.rename(spec["ready"] + ".tmp", spec["ready"])
    deadline = time.monotonic() + spec.get("wait", 30)
    while not os.path.exists(spec["go"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["go"] = os.path.exists(spec["go"])
    out["still_held"] = sum(1 for s in held[:spec["limit"]] if _pending_reply(s, 0) == "idle")
    for s in held:
        s.close()
    for attempt in range(20):
        out["ping_after"] = _ask(client, {"op": "ping"})
        out["ping_attempts"] = attempt + 1
        if "busy" not in out["ping_after"]["out"]:
            break
        time.sleep(0.2)
    return out


def in_cell_run2(req: Mapping[str, Any]) -> Dict[str, Any]:
    """Cell A's next run (TEN-03): the browser's snapshot (no page may be
    open) and the cookie page again."""
    client = req["broker_client"]
    return {"snapshot": _ask(client, {"op": "browser", "action": "snapshot"}, keep=20000),
            "open": _ask(client, {"op": "browser", "action": "open", "url": req["cookie"]}, keep=20000)}


def in_cell_listener(req: Mapping[str, Any]) -> None:
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
    peers: List[str] = []

    def serve() -> None:
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
    pinged = False
    while not os.path.exists(req["done"]) and time.monotonic() < deadline:
        if req.get("ping") and not pinged and os.path.exists(req["ping"]):
            # another slot holds the door at its quota now (TEN-02): this slot's ping
            reply = _ask(req["broker_client"], {"op": "ping"})
            with open(req["pinged"] + ".tmp", "w") as fh:
                json.dump(reply, fh)
            os.rename(req["pinged"] + ".tmp", req["pinged"])
            pinged = True
        time.sleep(0.05)
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
if __name__ == "__main__" and sys.argv[1:2] == ["in-cell-run2"]:
    print(json.dumps(in_cell_run2(json.loads(sys.argv[2]))))
    sys.stdout.flush()
    sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["in-cell-listener"]:
    in_cell_listener(json.loads(sys.argv[2]))
    sys.exit(0)
