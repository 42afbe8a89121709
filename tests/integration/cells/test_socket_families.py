"""The socket family filter (policy socket_families, chv_guest/cell/families.py)
in real cells on this machine, with the guest (this host) as the control.

In one cell: AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK sockets work (the
controls) while AF_VSOCK (socket and bind), AF_PACKET, AF_ALG, AF_KEY and
others fail with EAFNOSUPPORT, a family with high bits set is denied too,
and a 32-bit (i386) system call ends the process.  The same probe outside
any cell (the guest) binds an AF_VSOCK socket and makes i386 calls, and a
cell of a policy with socket_families "any" (the counter-proof: only this
boundary loosened) creates and binds an AF_VSOCK socket again, which is
what every cell could do before the filter.  The broker's socket still
works in a filtered cell (a real chv-broker answers the cell's ping), and
a warm cell is filtered as a cold one is.  Every run checks the payload's
own exit code (never 125: the cell really started).

Needs root, systemd-nspawn, ip, nsenter and python3-seccomp.  Own veths
lsf0/lsf1, subnets 10.231.64.0/24 and 10.231.65.0/24, a private state dir.
"""

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from broker_helpers import BrokerProc, make_listener
from cellrt import ENTRY, NEEDS_REAL_CELLS, NOISE
from testpaths import SRC
from chv_guest.cell import families

pytestmark = [pytest.mark.cells] + NEEDS_REAL_CELLS

TAG = "sf%d" % os.getpid()
PAYLOAD_RC = 3  # the probe's own exit code: the payload ran to its end
VMADDR_CID_ANY = VMADDR_PORT_ANY = 0xFFFFFFFF

# (family, type, protocol) the probe tries; the allowed ones are controls.
TRIES = {
    "AF_UNIX": (socket.SOCK_STREAM, 0),
    "AF_INET": (socket.SOCK_STREAM, 0),
    "AF_INET6": (socket.SOCK_STREAM, 0),
    "AF_NETLINK": (socket.SOCK_RAW, 0),  # NETLINK_ROUTE
    "AF_VSOCK": (socket.SOCK_STREAM, 0),
    "AF_PACKET": (socket.SOCK_RAW, 0),
    "AF_ALG": (socket.SOCK_SEQPACKET, 0),
    "AF_KEY": (socket.SOCK_RAW, 2),  # PF_KEY_V2
    "AF_TIPC": (socket.SOCK_RDM, 0),
    "AF_RDS": (socket.SOCK_SEQPACKET, 0),
    "AF_XDP": (socket.SOCK_RAW, 0),
    "AF_BLUETOOTH": (socket.SOCK_RAW, 0),
    "AF_CAN": (socket.SOCK_RAW, 1),
    "AF_QIPCRTR": (socket.SOCK_DGRAM, 0),
    "AF_MCTP": (socket.SOCK_DGRAM, 0),
}
ALLOWED = set(families.DEFAULT_FAMILIES)

# Runs in a cell (and on the guest, as the control) with `python3 -I -c`.
# i386: 64-bit code may still enter the kernel through int 0x80 with the
# 32-bit ABI (CONFIG_IA32_EMULATION); the stub is
#   push rbx; mov eax,edi; mov ebx,esi; xchg edx,ecx; int 0x80; pop rbx; ret
# i.e. f(nr, a, b, c) -> i386 syscall nr(a, b, c).  Each i386 call runs in a
# child process: under the filter it is killed (SIGSYS).
PROBE = r'''
import ctypes, errno, json, mmap, os, socket, subprocess, sys
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
out = {"socket": {}, "socketpair": {}}

def name(e):
    return errno.errorcode.get(e, str(e))

for fam, (num, typ, proto) in args["tries"].items():
    try:
        s = socket.socket(num, typ, proto)
    except OSError as exc:
        out["socket"][fam] = name(exc.errno)
    else:
        out["socket"][fam] = "ok"
        s.close()
    fds = (ctypes.c_int * 2)()
    r = libc.syscall(53, ctypes.c_long(num), typ, proto, fds)  # socketpair
    out["socketpair"][fam] = "ok" if r == 0 else name(ctypes.get_errno())
    if r == 0:
        os.close(fds[0]); os.close(fds[1])
try:
    v = socket.socket(40, socket.SOCK_STREAM)
except OSError as exc:
    out["vsock_bind"] = "socket: " + name(exc.errno)
else:
    try:
        v.bind((0xFFFFFFFF, 0xFFFFFFFF))
        out["vsock_bind"] = "ok"
    except OSError as exc:
        out["vsock_bind"] = "bind: " + name(exc.errno)
    v.close()
fd = libc.syscall(41, ctypes.c_long((1 << 32) | 40), socket.SOCK_STREAM, 0)  # AF_VSOCK | 1 << 32
out["vsock_high_bits"] = "ok" if fd >= 0 else name(ctypes.get_errno())
if fd >= 0:
    os.close(fd)
STUB = r"""
import ctypes, mmap, sys
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes.fromhex("5389f889f387cacd805bc3"))
f = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_int] * 4)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print(f(*[int(x) for x in sys.argv[1:]]))
"""
for key, call in (("i386_getpid", [20, 0, 0, 0]), ("i386_socket_vsock", [359, 40, 1, 0])):
    r = subprocess.run([sys.executable, "-I", "-c", STUB] + [str(x) for x in call], capture_output=True, text=True)
    out[key] = {"rc": r.returncode, "out": r.stdout.strip()}
if args.get("broker"):
    r = subprocess.run([sys.executable, "-I", "-c", args["broker"]["client"], json.dumps({"op": "ping"})],
                       capture_output=True, text=True, env={"CHV_BROKER_SOCKET": args["broker"]["sock"]})
    out["broker"] = {"rc": r.returncode, "out": r.stdout, "err": r.stderr[-500:]}
print(json.dumps(out))
sys.exit(%d)
''' % PAYLOAD_RC


def slot(i):
    return {"name": "slot%d" % i, "index": i, "machine": "lsf-slot%d" % i, "host_ifname": "lsf%d" % i,
            "cell_ifname": "eth0", "subnet": "10.231.6%d.0/24" % (4 + i), "gateway": "10.231.6%d.1" % (4 + i),
            "address": "10.231.6%d.2" % (4 + i), "prefixlen": 24, "uid_base": 3400000 + i * 65536,
            "uid_size": 65536}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    run_dir = root / "run-chv"  # the cell's /run/chv: the broker's socket
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    pol = {
        "version": 1,
        "state_dir": "/run/chv-fleet-%s" % TAG,
        "workspace_root": str(root / "ws"),
        "agent_state_root": str(root / "state"),
        "writable_binds": [{"source": str(run_dir), "target": "/run/chv"}],
        "claim_timeout": 0,
        "stop_grace": 1,
        "require_ruleset": False,
        "slots": [slot(0), slot(1)],
    }
    paths = {}
    for name, extra in (("policy", {}), ("any", {"socket_families": "any"}), ("warm", {"warm_slots": ["slot0"]})):
        p = copy.deepcopy(pol)
        p.update(extra)
        paths[name] = str(root / (name + ".json"))
        with open(paths[name], "w") as fh:
            json.dump(p, fh)
    yield dict(paths, pol=pol, root=root, run_dir=str(run_dir))
    shutil.rmtree(pol["state_dir"], ignore_errors=True)


def run(policy, *args, timeout=90):
    r = subprocess.run([sys.executable, "-I", ENTRY, "--policy", policy, "run", *args], capture_output=True,
                       text=True, timeout=timeout, check=False)
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True) if not ln.startswith(NOISE))
    return r


def probe_args(broker=None):
    tries = {f: (families.FAMILIES[f],) + t for f, t in TRIES.items()}
    return json.dumps({"tries": tries, "broker": broker})


def probe_cell(policy, broker=None, slot_name="slot0"):
    r = run(policy, "--slot", slot_name, "--", "python3", "-I", "-c", PROBE, probe_args(broker))
    assert r.returncode == PAYLOAD_RC, (r.returncode, r.stderr)  # the payload ran (125 would be the launcher)
    return json.loads(r.stdout)


def probe_guest():
    r = subprocess.run(["python3", "-I", "-c", PROBE, probe_args()], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == PAYLOAD_RC, r.stderr
    return json.loads(r.stdout)


def guest_has_vsock():
    try:
        s = socket.socket(families.FAMILIES["AF_VSOCK"], socket.SOCK_STREAM)
    except OSError:
        return False
    s.close()
    return True


def assert_filtered(p):
    """What a cell of the default policy must show, each beside its control."""
    for fam in TRIES:
        if fam in ALLOWED:
            assert p["socket"][fam] == "ok", (fam, p["socket"][fam])  # control
        else:
            assert p["socket"][fam] == "EAFNOSUPPORT", (fam, p["socket"][fam])
            assert p["socketpair"][fam] == "EAFNOSUPPORT", (fam, p["socketpair"][fam])
    assert p["socketpair"]["AF_UNIX"] == "ok"  # control of socketpair
    assert p["vsock_bind"] == "socket: EAFNOSUPPORT"
    assert p["vsock_high_bits"] == "EAFNOSUPPORT"
    # any i386 system call ends the process (SIGSYS), so socketcall is no way around
    assert p["i386_getpid"]["rc"] == -31 and p["i386_socket_vsock"]["rc"] == -31


def test_a_cell_creates_only_the_allowed_families_the_guest_any(env):
    if not guest_has_vsock():
        pytest.skip("this host has no AF_VSOCK transport: the guest control cannot bind one")
    guest = probe_guest()
    cell = probe_cell(env["policy"])
    loose = probe_cell(env["any"])  # counter-proof: the same cell without the filter
    # the guest (control): AF_VSOCK socket + bind work, so do 32-bit calls
    assert guest["socket"]["AF_VSOCK"] == "ok" and guest["vsock_bind"] == "ok"
    assert guest["i386_getpid"]["rc"] == 0 and guest["i386_getpid"]["out"].isdigit()
    assert guest["vsock_high_bits"] == "ok"  # the kernel truncates the family to an int
    assert_filtered(cell)
    # without the filter (what every cell had before): vsock socket + bind,
    # the high-bit form and an i386 socket() of AF_VSOCK all work in the cell
    assert loose["socket"]["AF_VSOCK"] == "ok" and loose["vsock_bind"] == "ok"
    assert loose["vsock_high_bits"] == "ok"
    assert loose["i386_socket_vsock"]["rc"] == 0 and int(loose["i386_socket_vsock"]["out"]) >= 0
    for fam in ALLOWED:
        assert loose["socket"][fam] == "ok"
    # A family this kernel lacks (a module not loaded) fails with
    # EAFNOSUPPORT with or without the filter: evidence of the filter are
    # the families the unfiltered cell gets another answer for (here at
    # least AF_VSOCK; AF_PACKET and AF_XDP give EPERM there, no CAP_NET_RAW)
    evidence = [f for f in TRIES if f not in ALLOWED and loose["socket"][f] != "EAFNOSUPPORT"]
    assert "AF_VSOCK" in evidence and all(cell["socket"][f] == "EAFNOSUPPORT" for f in evidence)
    assert loose["socketpair"]["AF_VSOCK"] != "EAFNOSUPPORT"  # socketpair: the filter's answer, not the kernel's


def test_the_broker_socket_works_in_a_filtered_cell(env):
    """A real chv-broker on the cell's /run/chv/broker.sock answers the
    filtered cell's ping with the cell's slot (AF_UNIX, the peer check)."""
    cfg = {"cells_dir": os.path.join(env["pol"]["state_dir"], "cells"), "workspaces_dir": env["pol"]["workspace_root"],
           "read_timeout": 5.0,
           "sync": {"credentials_file": str(env["root"] / "no-credentials"), "python": "/usr/bin/python3",
                    "timeout": 30.0, "isolation": "child"},
           "browser": {"socket": str(env["root"] / "browser.sock"), "timeout": 10.0, "reap_interval": 0}}
    cfg_path = str(env["root"] / "broker.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    sock = os.path.join(env["run_dir"], "broker.sock")
    listener = make_listener(sock)
    broker = BrokerProc(listener, cfg_path).start()
    try:
        with open(os.path.join(SRC, "chv_guest", "broker", "client.py")) as fh:
            client = fh.read()
        p = probe_cell(env["policy"], broker={"client": client, "sock": "/run/chv/broker.sock"})
    finally:
        broker.stop()
        listener.close()
        os.unlink(sock)
    assert p["socket"]["AF_VSOCK"] == "EAFNOSUPPORT"  # the same cell is filtered
    assert p["broker"]["rc"] == 0, p["broker"]
    assert json.loads(p["broker"]["out"]) == {"ok": True, "result": {"pong": True, "slot": "slot0"}}


def test_a_warm_cell_is_filtered_as_a_cold_one(env):
    """chv-cell warm starts its cell through the same spawn: the payload it
    takes over sees the same filter (control: the allowed families work)."""
    sock = os.path.join(env["pol"]["state_dir"], "warm", "slot0.sock")
    w = subprocess.Popen([sys.executable, "-I", ENTRY, "--policy", env["warm"], "-v", "warm", "--slot", "slot0"],
                         stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        while not os.path.exists(sock):
            assert w.poll() is None, w.communicate()
            assert time.monotonic() < end
            time.sleep(0.02)
        p = probe_cell(env["warm"])
        log = w.communicate(timeout=30)[1]
    finally:
        if w.poll() is None:
            w.terminate()
            w.communicate(timeout=30)
    assert "took a payload" in log, log
    assert_filtered(p)


def test_without_the_binding_the_launcher_refuses_and_the_payload_never_runs(env, tmp_path):
    """Fail closed: where the libseccomp binding cannot be found, `run`
    exits 125 naming the package and the policy key; the payload (which
    would create a file in the workspace) never ran.  Control: the same
    launcher with socket_families "any" runs the payload."""
    code = ("import sys; sys.path.insert(0, %r); import chv_guest.cell.families as f; f.SECCOMP_DIRS = ('/nonexistent',); "
            "sys.modules.pop('seccomp', None); from chv_guest.cell.cli import main; sys.exit(main(sys.argv[1:]))" % SRC)
    marker = os.path.join(env["pol"]["workspace_root"], "slot1", "ran-%s" % TAG)
    payload = ["--slot", "slot1", "--", "sh", "-c", "touch /workspace/%s; exit 4" % os.path.basename(marker)]
    r = subprocess.run([sys.executable, "-I", "-c", code, "--policy", env["policy"], "run"] + payload,
                       capture_output=True, text=True, timeout=90, check=False)
    assert r.returncode == 125, (r.returncode, r.stderr)
    assert "python3-seccomp" in r.stderr and "socket_families" in r.stderr and "refusing" in r.stderr, r.stderr
    assert not os.path.exists(marker)
    ok = subprocess.run([sys.executable, "-I", "-c", code, "--policy", env["any"], "run"] + payload,
                        capture_output=True, text=True, timeout=90, check=False)
    assert ok.returncode == 4, ok.stderr
    assert os.path.exists(marker)
    os.unlink(marker)
