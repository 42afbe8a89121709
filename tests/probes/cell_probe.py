"""The in-cell isolation probe, shared by the real-cell integration tests
(tests/integration/cells) and Molecule (molecule/shared/tests): both run
this file's text inside a cell with `python3 -I -c`, never import it.

Argument: one JSON object
  read:  {key: path}     open the file for reading
  write: {key: path}     create/truncate the file and write to it
  gate:  path            open the start gate FIFO for writing and for reading
  tcp:   {key: [host, port]}  connect and read up to 16 bytes
  neigh: address         `ip neigh show` of that address (L2 reachability)
Prints one JSON object: the cell's identity (uid, uid_map, CapEff, CapBnd,
NoNewPrivs, env, cwd, home), two syscalls (io_uring_setup, refused by the
seccomp filter, and getpid, its control) and, per key, "ok" or the errno
name (or the bytes read, for tcp)."""
import ctypes
import errno
import json
import os
import socket
import subprocess
import sys

libc = ctypes.CDLL(None, use_errno=True)
args = json.loads(sys.argv[1])
out = {}


def attempt(key, fn):
    try:
        fn()
        out[key] = "ok"
    except OSError as e:
        out[key] = errno.errorcode.get(e.errno, str(e.errno))


def rd(p):
    with open(p) as fh:
        return fh.read()


def wr(p):
    with open(p, "w") as fh:
        fh.write("x")


def gate(p, flags):
    os.close(os.open(p, flags | os.O_NONBLOCK))


def tcp(key, addr):
    try:
        s = socket.create_connection((addr[0], int(addr[1])), timeout=5)
        out[key] = s.recv(16).decode()
        s.close()
    except OSError as e:
        out[key] = "error: %s" % e


out["uid"] = os.getuid()
out["uid_map"] = rd("/proc/self/uid_map").split()
status = dict(line.split(":", 1) for line in rd("/proc/self/status").splitlines() if ":" in line)
for k in ("CapEff", "CapBnd", "NoNewPrivs"):
    out[k] = status[k].strip()
r = libc.syscall(425, 8, ctypes.create_string_buffer(120))  # io_uring_setup(8, params)
out["io_uring_setup"] = "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
out["getpid"] = "ok" if libc.syscall(39) == os.getpid() else "bad"
out["env"] = {k: os.environ.get(k) for k in ("CHV_CELL", "CHV_SLOT")}
out["home"] = os.environ.get("HOME")
out["cwd"] = os.getcwd()
for key, path in args.get("read", {}).items():
    attempt(key, lambda p=path: rd(p))
for key, path in args.get("write", {}).items():
    attempt(key, lambda p=path: wr(p))
if "gate" in args:
    attempt("gate_write", lambda: gate(args["gate"], os.O_WRONLY))
    attempt("gate_read", lambda: gate(args["gate"], os.O_RDONLY))
for key, addr in args.get("tcp", {}).items():
    tcp(key, addr)
if "neigh" in args:
    out["neigh"] = subprocess.run(["ip", "neigh", "show", args["neigh"]], capture_output=True, text=True,
                                  check=False).stdout
print(json.dumps(out))
