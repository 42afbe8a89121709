"""Real cells through `chv-cell run` on this machine.

Needs root, systemd-nspawn, ip and nsenter.  Uses its own throwaway policy:
veths lth20/lth21, subnets 10.231.20.0/24 and 10.231.21.0/24, a private
state dir, and touches nothing else.  Every negative check runs beside its
positive control in the same cell, and the inaccessible boundary has a
counter-proof (same cell without it: the file is readable).

This host's main network namespace has no cell_nat table, so the policy of
the tests that are not about it says require_ruleset: false; the ruleset
tests load a minimal `table inet chv_cell` into the host's namespace for
their duration (and skip when one is already there: never touch a table
the tests did not create).
"""

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ENTRY

pytestmark = [
    pytest.mark.cells,
    pytest.mark.skipif(os.geteuid() != 0, reason="real cells need root"),
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("systemd-nspawn", "ip", "nsenter")),
        reason="systemd-nspawn, ip and nsenter are needed for real cells",
    ),
]

TAG = "lt%d" % os.getpid()
NOISE = 'Attempted to remove disk file system under "/run/systemd/nspawn/propagate/'
CAP_BITS = {"CAP_CHOWN": 0, "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17,
            "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_MKNOD": 27}
DROPPED = [c for c in CAP_BITS if c != "CAP_CHOWN"]


def slot(i):
    return {"name": "slot%d" % i, "index": i, "machine": "lt-slot%d" % i, "host_ifname": "lth2%d" % i,
            "cell_ifname": "eth0", "subnet": "10.231.2%d.0/24" % i, "gateway": "10.231.2%d.1" % i,
            "address": "10.231.2%d.2" % i, "prefixlen": 24, "uid_base": 3000000 + i * 65536, "uid_size": 65536}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cells")
    secret_dir = "/etc/chv-celltest-%s" % TAG
    os.mkdir(secret_dir, 0o755)
    with open(secret_dir + "/secret", "w") as fh:
        fh.write("s3cret\n")
    os.chmod(secret_dir + "/secret", 0o644)  # readable by anyone: only the policy hides it
    pol = {
        "version": 1,
        "state_dir": "/run/chv-fleet-%s" % TAG,
        "workspace_root": str(root / "ws"),
        "agent_state_root": str(root / "state"),
        "inaccessible": [secret_dir + "/secret", "/etc/chv"],
        "writable_binds": [],
        "dns_servers": ["192.0.2.53"],
        "claim_timeout": 0,
        "stop_grace": 1,
        "require_ruleset": False,
        "slots": [slot(0), slot(1)],
    }

    def write(name, p):
        path = str(root / name)
        with open(path, "w") as fh:
            json.dump(p, fh)
        return path

    counter = copy.deepcopy(pol)
    counter["inaccessible"] = []
    badnet = copy.deepcopy(pol)
    badnet["nsenter"] = "/bin/false"
    variants = {
        "ruleset": {"require_ruleset": True},
        "shared": {"allow_shared_network": True},
        "userns": {"allow_user_namespaces": True},
        "runtime": {"runtime_max": 1},
        "limits": {"properties": {"MemoryMax": "1G", "TasksMax": 100, "CPUQuota": "100%"}},
        "limits_warn": {"properties": {"MemoryMax": "1G", "TasksMax": 100, "CPUQuota": "100%"},
                        "require_limits": False},
    }
    e = {"policy": write("policy.json", pol), "counter": write("counter.json", counter),
         "badnet": write("badnet.json", badnet), "pol": pol, "secret": secret_dir + "/secret"}
    for name, extra in variants.items():
        v = copy.deepcopy(pol)
        v.update(extra)
        e[name] = write(name + ".json", v)
    yield e
    shutil.rmtree(secret_dir, ignore_errors=True)
    shutil.rmtree(pol["state_dir"], ignore_errors=True)


def cmd(policy, *args):
    return [sys.executable, "-I", ENTRY, "--policy", policy, "run", *args]


def run(policy, *args, timeout=60):
    r = subprocess.run(cmd(policy, *args), capture_output=True, text=True, timeout=timeout, check=False)
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True) if not ln.startswith(NOISE))
    return r


def leftovers(pol):
    out = []
    for s in pol["slots"]:
        if os.path.exists("/sys/class/net/" + s["host_ifname"]):
            out.append("veth " + s["host_ifname"])
        for sub in ("locks/%s.lock", "cells/%s.json", "net/%s", "gate/%s"):
            p = os.path.join(pol["state_dir"], sub % s["name"])
            if os.path.lexists(p):
                out.append(p)
        for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"):
            if os.path.isdir(os.path.join(base, "chv-cell-" + s["name"])):
                out.append("cgroup %s/chv-cell-%s" % (base, s["name"]))
        if os.path.lexists("/run/systemd/nspawn/propagate/" + s["machine"]):
            out.append("propagate " + s["machine"])
    return out


@pytest.fixture(autouse=True)
def clean_after(env):
    yield
    assert leftovers(env["pol"]) == []


def test_exit_code_and_separate_streams(env):
    r = run(env["policy"], "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7
    assert r.stdout == "out\n"
    assert "err\n" in r.stderr and "out" not in r.stderr
    assert run(env["policy"], "--", "true").returncode == 0


def test_network_is_up_before_the_payload_starts(env):
    # No waiting loop: the very first thing the payload does is look.
    r = run(env["policy"], "--slot", "slot0", "--", "sh", "-c",
            "ip -4 -o addr show eth0; ip -4 route show default; cat /etc/resolv.conf /etc/hosts; hostname")
    assert r.returncode == 0, r.stderr
    assert "10.231.20.2/24" in r.stdout
    assert "default via 10.231.20.1 dev eth0" in r.stdout
    assert "nameserver 192.0.2.53" in r.stdout and "127.0.0.53" not in r.stdout
    assert "10.231.20.2\tlt-slot0" in r.stdout


PROBE = r'''
import ctypes, errno, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(key, fn):
    try:
        fn(); out[key] = "ok"
    except OSError as e:
        out[key] = errno.errorcode.get(e.errno, str(e.errno))
def rd(p):
    with open(p) as fh: return fh.read()
def wr(p):
    with open(p, "w") as fh: fh.write("x")
out["uid"] = os.getuid()
out["uid_map"] = rd("/proc/self/uid_map").split()
st = dict(l.split(":", 1) for l in rd("/proc/self/status").splitlines() if ":" in l)
for k in ("CapEff", "CapBnd", "NoNewPrivs"): out[k] = st[k].strip()
r = libc.syscall(425, 8, ctypes.create_string_buffer(120)); out["io_uring_setup"] = "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
r = libc.syscall(39); out["getpid"] = "ok" if r == os.getpid() else "bad"
attempt("read_secret", lambda: rd(sys.argv[1]))
attempt("read_ordinary", lambda: rd("/etc/os-release"))
attempt("write_usr", lambda: wr("/usr/chv-celltest"))
attempt("write_workspace", lambda: wr("/workspace/probe.txt"))
attempt("gate_write", lambda: os.close(os.open("/run/chv-gate", os.O_WRONLY | os.O_NONBLOCK)))
attempt("gate_read", lambda: os.close(os.open("/run/chv-gate", os.O_RDONLY | os.O_NONBLOCK)))
s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=3)
out["gateway_tcp"] = s.recv(16).decode()
out["env"] = {k: os.environ.get(k) for k in ("CHV_CELL", "CHV_SLOT")}
out["cwd"] = os.getcwd()
print(json.dumps(out))
'''


def listener(addr):
    """TCP listener on the slot's gateway address, bound before it exists (IP_FREEBIND)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
    srv.bind((addr, 0))
    srv.listen(4)
    srv.settimeout(20)

    def serve():
        try:
            c, dummy = srv.accept()
            c.sendall(b"hello")
            c.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return srv


def probe(env, policy):
    srv = listener("10.231.20.1")
    try:
        r = run(policy, "--slot", "slot0", "--", "python3", "-I", "-c", PROBE, env["secret"], "10.231.20.1",
                str(srv.getsockname()[1]))
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_isolation_each_beside_its_control(env):
    p = probe(env, env["policy"])
    s0 = env["pol"]["slots"][0]
    # cell root is not host root: uid 0 inside, mapped to the slot's range
    assert p["uid"] == 0 and p["uid_map"] == ["0", str(s0["uid_base"]), "65536"]
    ws_file = os.path.join(env["pol"]["workspace_root"], "slot0", "probe.txt")
    assert os.stat(ws_file).st_uid == s0["uid_base"]
    # secret hidden, ordinary /etc file readable
    assert p["read_secret"] == "EACCES" and p["read_ordinary"] == "ok"
    # /usr read-only, workspace writable
    assert p["write_usr"] in ("EROFS", "EACCES") and p["write_workspace"] == "ok"
    # io_uring denied, ordinary syscall fine
    assert p["io_uring_setup"] == "EPERM" and p["getpid"] == "ok"
    # dropped capabilities absent from CapEff and CapBnd, CAP_CHOWN (kept) present
    eff, bnd = int(p["CapEff"], 16), int(p["CapBnd"], 16)
    for cap in DROPPED:
        assert not eff & (1 << CAP_BITS[cap]) and not bnd & (1 << CAP_BITS[cap]), cap
    assert eff & 1 and bnd & 1
    assert p["NoNewPrivs"] == "1"
    # the start gate can be read (it released this payload) but never opened for writing
    assert p["gate_write"] == "EACCES" and p["gate_read"] == "ok"
    # the cell reaches its gateway (TCP to a listener on the host side)
    assert p["gateway_tcp"] == "hello"
    assert p["env"] == {"CHV_CELL": "1", "CHV_SLOT": "slot0"} and p["cwd"] == "/workspace"


def test_counter_proof_without_inaccessible_the_secret_is_readable(env):
    p = probe(env, env["counter"])
    assert p["read_secret"] == "ok" and p["read_ordinary"] == "ok"


def test_two_cells_at_once_get_distinct_identities(env):
    script = "sleep 0.7; echo $CHV_SLOT $(ip -4 -o addr show eth0 | awk '{print $4}') $(awk '{print $2}' /proc/self/uid_map)"
    procs = [subprocess.Popen(cmd(env["policy"], "--timeout", "5", "--", "sh", "-c", script), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for dummy in range(2)]
    outs = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ids = sorted(o[0].split() for o in outs)
    assert ids == [["slot0", "10.231.20.2/24", "3000000"], ["slot1", "10.231.21.2/24", "3065536"]]


def wait_record(env, name, proc, timeout=10):
    rec = os.path.join(env["pol"]["state_dir"], "cells", name + ".json")
    end = time.monotonic() + timeout
    while not os.path.exists(rec):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end
        time.sleep(0.02)
    with open(rec) as fh:
        return json.load(fh)


def test_all_slots_busy_waits_then_fails_cleanly(env):
    holders = [subprocess.Popen(cmd(env["policy"], "--slot", n, "--", "sleep", "30"), stderr=subprocess.PIPE)
               for n in ("slot0", "slot1")]
    try:
        recs = [wait_record(env, n, h) for n, h in zip(("slot0", "slot1"), holders)]
        # the live record names the cell's leader, in the slot's uid range
        for rec, s in zip(recs, env["pol"]["slots"]):
            assert rec["slot"] == s["name"] and rec["uid_base"] == s["uid_base"]
            assert open("/proc/%d/uid_map" % rec["pid"]).read().split()[:2] == ["0", str(s["uid_base"])]
        t = time.monotonic()
        r = run(env["policy"], "--timeout", "0.6", "--", "true")
        waited = time.monotonic() - t
        assert r.returncode == 75
        assert "all 2 slot(s) busy (slot0, slot1)" in r.stderr
        assert waited >= 0.6
        # one more that waits long enough gets the slot once it is freed
        waiter = subprocess.Popen(cmd(env["policy"], "--timeout", "20", "--", "echo", "got-it"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)
        assert waiter.poll() is None
        holders[1].send_signal(signal.SIGTERM)
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 0 and out == "got-it\n", err
    finally:
        for h in holders:
            h.send_signal(signal.SIGTERM)
            h.communicate(timeout=30)
    assert holders[0].returncode == 128 + signal.SIGTERM


def test_sigkill_of_the_launcher_leaves_a_claimable_slot(env):
    h = subprocess.Popen(cmd(env["policy"], "--slot", "slot0", "--", "sleep", "30"), stderr=subprocess.PIPE)
    rec = wait_record(env, "slot0", h)
    h.kill()
    h.communicate(timeout=10)
    r = run(env["policy"], "--slot", "slot0", "--timeout", "10", "--", "sh", "-c", "ip -4 -o addr show eth0")
    assert r.returncode == 0, r.stderr
    assert "10.231.20.2/24" in r.stdout
    assert not os.path.exists("/proc/%d" % rec["pid"])  # the old cell is gone


def test_sigterm_stops_the_payload_gracefully(env):
    ws = os.path.join(env["pol"]["workspace_root"], "slot1")
    marker = os.path.join(ws, "got-term")
    ready = os.path.join(ws, "trap-set")
    for f in (marker, ready):
        if os.path.exists(f):
            os.unlink(f)
    h = subprocess.Popen(cmd(env["policy"], "--slot", "slot1", "--", "sh", "-c",
                             "trap 'touch /workspace/got-term; exit 0' TERM; touch /workspace/trap-set; "
                             "sleep 30 & wait"),
                         stderr=subprocess.PIPE, text=True)
    wait_record(env, "slot1", h)
    end = time.monotonic() + 20  # the payload has set its trap (no guessing under load)
    while not os.path.exists(ready):
        assert h.poll() is None and time.monotonic() < end
        time.sleep(0.02)
    h.send_signal(signal.SIGTERM)
    dummy, err = h.communicate(timeout=20)
    assert h.returncode == 128 + signal.SIGTERM
    assert "stopping on signal 15" in err
    assert os.path.exists(marker)


def test_veth_setup_failure_is_loud_and_kills_the_cell(env):
    r = run(env["badnet"], "--", "sh", "-c", "echo payload-ran")
    assert r.returncode == 125
    assert "cannot configure the veth" in r.stderr
    assert "payload-ran" not in r.stdout


def test_shared_network_only_when_asked_and_logged(env):
    r = run(env["shared"], "--shared-network", "--", "sh", "-c", "test -e /sys/class/net/lo && echo ran")
    assert r.returncode == 0 and r.stdout == "ran\n"
    assert "--shared-network" in r.stderr and "WARNING" in r.stderr


def test_shared_network_refused_unless_the_policy_allows_it(env):
    r = run(env["policy"], "--shared-network", "--", "sh", "-c", "echo payload-ran")
    assert r.returncode == 78
    assert "payload-ran" not in r.stdout
    assert "chv_cell_allow_shared_network" in r.stderr
    # control: the same policy runs the same payload without the flag
    r = run(env["policy"], "--", "sh", "-c", "echo payload-ran")
    assert r.returncode == 0 and r.stdout == "payload-ran\n"


# ---------------------------------------------------------------- fail closed: ruleset
MIN_TABLE = """table inet chv_cell {
	set cell_ifs { type ifname; %s }
	chain forward { type filter hook forward priority filter; policy accept; }
	chain input { type filter hook input priority filter; policy accept; }
}
"""


def nft(*args, stdin=None):
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, check=False)


@pytest.fixture
def host_table():
    """Load a minimal cell_nat table into the host's namespace; delete it after."""
    if not shutil.which("nft"):
        pytest.skip("nft is needed for the ruleset tests")
    if nft("list", "table", "inet", "chv_cell").returncode == 0:
        pytest.skip("this host already has table inet chv_cell: not touching it")
    loaded = []

    def load(ifnames):
        if loaded:
            assert nft("delete", "table", "inet", "chv_cell").returncode == 0
        elems = "elements = { %s }" % ", ".join('"%s"' % i for i in ifnames) if ifnames else ""
        r = nft("-f", "-", stdin=MIN_TABLE % elems)
        assert r.returncode == 0, r.stderr
        loaded.append(ifnames)

    try:
        yield load
    finally:
        if loaded:
            nft("delete", "table", "inet", "chv_cell")
    assert nft("list", "table", "inet", "chv_cell").returncode != 0


def marker_run(env, policy, name, slot_name="slot0"):
    marker = os.path.join(env["pol"]["workspace_root"], slot_name, name)
    if os.path.exists(marker):
        os.unlink(marker)
    r = run(policy, "--slot", slot_name, "--", "sh", "-c", "touch /workspace/%s && echo payload-ran" % name)
    return r, os.path.exists(marker)


def test_ruleset_absent_refused_loaded_runs(env, host_table):
    r, ran = marker_run(env, env["ruleset"], "ruleset-marker")
    assert r.returncode == 125, r.stderr
    assert not ran and "payload-ran" not in r.stdout
    assert ("nftables table inet chv_cell is not loaded (is chv-cell-nat.service active?); "
            "refusing to start the cell (policy require_ruleset)") in r.stderr
    # control: the same run with the table loaded
    host_table(["lth20", "lth21"])
    r, ran = marker_run(env, env["ruleset"], "ruleset-marker")
    assert r.returncode == 0, r.stderr
    assert ran and r.stdout == "payload-ran\n"
    assert "WARNING" not in r.stderr


def test_ruleset_without_the_slots_interface_refused(env, host_table):
    host_table(["lth21"])
    r, ran = marker_run(env, env["ruleset"], "ruleset-marker", "slot0")
    assert r.returncode == 125 and not ran
    assert "interface lth20 in set cell_ifs of table inet chv_cell" in r.stderr
    assert "require_ruleset" in r.stderr
    # control: slot1's interface is in the set, same table, same policy
    r, ran = marker_run(env, env["ruleset"], "ruleset-marker", "slot1")
    assert r.returncode == 0 and ran, r.stderr


def test_ruleset_unchecked_only_with_a_warning(env):
    r, ran = marker_run(env, env["policy"], "ruleset-marker")
    assert r.returncode == 0 and ran
    assert "WARNING: the cell_nat ruleset is not checked (policy require_ruleset is false)" in r.stderr


# ---------------------------------------------------------------- fail closed: nested user namespaces
USERNS_PROBE = r"""
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    r = libc.unshare(0x10000000)
    os._exit(0 if r == 0 else 100 + ctypes.get_errno())
st = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
u = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True)
print("ctypes=%s unshare=%d %s" % ("ok" if st == 0 else os.strerror(st - 100), u.returncode, u.stderr.strip()))
"""


def test_nested_user_namespaces_off_by_default(env):
    # control on the host, outside any cell: both probes work here
    host = subprocess.run([sys.executable, "-I", "-c", USERNS_PROBE], capture_output=True, text=True, check=False)
    assert host.stdout.startswith("ctypes=ok unshare=0"), host.stdout + host.stderr
    # in a default cell: both fail (the cell's user.max_user_namespaces is 0)
    r = run(env["policy"], "--", "python3", "-I", "-c", USERNS_PROBE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ctypes=No space left on device unshare=1"), r.stdout
    # control: a cell whose policy allows them
    r = run(env["userns"], "--", "python3", "-I", "-c", USERNS_PROBE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ctypes=ok unshare=0"), r.stdout


# ---------------------------------------------------------------- fail closed: wall-clock limit
def status(env, policy):
    r = subprocess.run([sys.executable, "-I", ENTRY, "--policy", policy, "status"], capture_output=True, text=True,
                       check=True)
    return {ln.split()[0]: ln.split()[-1] for ln in r.stdout.splitlines()}


def test_runtime_max_stops_the_cell(env):
    t = time.monotonic()
    r = run(env["runtime"], "--slot", "slot0", "--", "sleep", "30")
    took = time.monotonic() - t
    assert r.returncode == 124, r.stderr
    assert took < 10
    assert "runtime_max of 1s reached; stopping the cell (exit 124)" in r.stderr
    assert status(env, env["runtime"])["slot0"] == "idle"
    assert not os.path.exists("/sys/class/net/lth20")
    # control: a payload under the limit returns its own code
    r = run(env["runtime"], "--slot", "slot0", "--", "sh", "-c", "exit 3")
    assert r.returncode == 3, r.stderr


def test_runtime_max_flag_only_lowers(env):
    # the policy has no limit: the flag sets one
    t = time.monotonic()
    r = run(env["policy"], "--runtime-max", "0.5", "--", "sleep", "30")
    assert r.returncode == 124 and time.monotonic() - t < 10, r.stderr
    # the policy says 1s: asking for more is refused before anything starts
    r = run(env["runtime"], "--runtime-max", "5", "--", "sh", "-c", "echo payload-ran")
    assert r.returncode == 78 and "payload-ran" not in r.stdout
    assert "exceeds the policy's runtime_max of 1s" in r.stderr
    # control: asking for less is fine
    r = run(env["runtime"], "--runtime-max", "0.9", "--", "sh", "-c", "echo payload-ran")
    assert r.returncode == 0 and r.stdout == "payload-ran\n"


# ---------------------------------------------------------------- fail closed: resource limits
def own_cgroup2_controllers():
    with open("/proc/self/cgroup") as fh:
        path = next(ln.split(":", 2)[2].strip() for ln in fh if ln.startswith("0::"))
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        f = os.path.join(base + path, "cgroup.subtree_control")
        if os.path.exists(f):
            with open(f) as fh:
                return set(fh.read().split())
    return set()


def test_limits_never_dropped_silently(env):
    if {"memory", "pids", "cpu"} <= own_cgroup2_controllers():
        pytest.skip("this host delegates memory, pids and cpu: the refusal cannot be shown here")
    r, ran = marker_run(env, env["limits"], "limits-marker")
    assert r.returncode == 125 and not ran, r.stderr
    assert "resource limits cannot be enforced" in r.stderr and "require_limits" in r.stderr
    missing = {"memory", "pids", "cpu"} - own_cgroup2_controllers()
    for prop, ctrl in (("MemoryMax", "memory"), ("TasksMax", "pids"), ("CPUQuota", "cpu")):
        if ctrl in missing:
            assert "%s (%s.max): controller %s is not available" % (prop, ctrl, ctrl) in r.stderr
    # control: the same properties without require_limits run, with one warning line
    r, ran = marker_run(env, env["limits_warn"], "limits-marker")
    assert r.returncode == 0 and ran, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "resource limits NOT enforced" in ln]
    assert len(warn) == 1 and "MemoryMax (memory.max)" in warn[0]


def test_hundred_consecutive_runs(env):
    """100 consecutive `chv-cell run -- true` all exit 0 (prints the mean latency, asserts no timing)."""
    n = 100
    t = time.monotonic()
    for dummy in range(n):
        assert run(env["policy"], "--", "true").returncode == 0
    per = (time.monotonic() - t) / n
    print("\nchv-cell run -- true: %.1f ms per run (%d runs)" % (per * 1000, n))
