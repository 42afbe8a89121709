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

import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import hostlock
import pytest

from cellrt import ENTRY, NEEDS_REAL_CELLS, NOISE
from listeners import hello_listener
from testpaths import PROBES

pytestmark = [pytest.mark.cells] + NEEDS_REAL_CELLS

TAG = "lt%d" % os.getpid()
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
        # a warm cell in slot0 (chv-cell warm, started by the warm fixture)
        "warm": {"warm_slots": ["slot0"]},
        "warm_other": {"warm_slots": ["slot0"], "stop_grace": 2},
        "warm_ruleset": {"warm_slots": ["slot0"], "require_ruleset": True},
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


with open(os.path.join(PROBES, "cell_probe.py")) as _fh:
    PROBE = _fh.read()


def probe(env, policy):
    srv = hello_listener("10.231.20.1", freebind=True)
    try:
        checks = {"read": {"read_secret": env["secret"], "read_ordinary": "/etc/os-release"},
                  "write": {"write_usr": "/usr/chv-celltest", "write_workspace": "/workspace/probe.txt"},
                  "gate": "/run/chv-gate", "tcp": {"gateway_tcp": ["10.231.20.1", srv.getsockname()[1]]}}
        r = run(policy, "--slot", "slot0", "--", "python3", "-I", "-c", PROBE, json.dumps(checks))
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_isolation_each_beside_its_control(env):
    assert_isolated(env, probe(env, env["policy"]))


def assert_isolated(env, p):
    """Every boundary the probe checks, each beside its control."""
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
        # the live record names the cell's leader, in the slot's uid range (the
        # record is written as soon as the leader exists; nspawn writes its
        # uid_map a moment later)
        for rec, s in zip(recs, env["pol"]["slots"]):
            assert rec["slot"] == s["name"] and rec["uid_base"] == s["uid_base"]
            end = time.monotonic() + 10
            while not open("/proc/%d/uid_map" % rec["pid"]).read() and time.monotonic() < end:
                time.sleep(0.02)
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


def test_consecutive_runs(env):
    """30 consecutive `chv-cell run -- true` in one slot all exit 0, and
    leave nothing behind (clean_after; prints the mean latency, asserts no
    timing: make bench measures it). 100 runs before: 49 s of make test
    here, and nothing that 30 runs and the check after them do not show
    (every other test of this module checks what a run leaves, too)."""
    n = 30
    t = time.monotonic()
    for dummy in range(n):
        assert run(env["policy"], "--", "true").returncode == 0
    per = (time.monotonic() - t) / n
    print("\nchv-cell run -- true: %.1f ms per run (%d runs)" % (per * 1000, n))


# ---------------------------------------------------------------- the executor's path: a non-root user through sudo
# The tests install a copy of the launcher (chv-cell, chv-cell-agent, chv_guest/cell/)
# in a root-owned directory under /run whose only change is the agent's fixed
# policy path (policy.DEFAULT_POLICY_PATH, patched in the copy to this test's
# policy), plus a sudoers drop-in of the role's shape for that copy, a
# throwaway group and two throwaway users (one in the group, one not).  All
# of it is removed at teardown.
AGENT_KEYS = {"agent_state_mount": "/home/chv", "workspace_aliases": ["/home/chv/workspace"]}


def _sh(*args):
    r = subprocess.run(list(args), capture_output=True, text=True, check=False)
    assert r.returncode == 0, (args, r.stdout, r.stderr)


@contextlib.contextmanager
def agent_install(pol, packages=("chv_guest", os.path.join("chv_guest", "cell"))):
    """chv-cell and its agent installed as the role installs them (the
    ``packages`` of src/ copied into a lib directory, the entry points beside
    them), the installed policy ``pol``, an agent group with a member and an
    account outside it, and a sudo rule for the group: the executor's path.
    Yields the paths and names."""
    import grp
    import pwd
    import tempfile

    from testpaths import SRC

    if not all(shutil.which(t) for t in ("sudo", "visudo", "useradd", "groupadd")):
        pytest.skip("sudo, visudo, useradd and groupadd are needed for the executor's path")
    n = os.getpid()
    group, member, other = "chvtg%d" % n, "chvt%d" % n, "chvn%d" % n
    for name, db in ((group, grp.getgrnam), (member, pwd.getpwnam), (other, pwd.getpwnam)):
        with pytest.raises(KeyError):
            db(name)  # never reuse an existing account
    d = tempfile.mkdtemp(prefix="chv-agenttest-", dir="/run")
    sudoers = "/etc/sudoers.d/chv-celltest-%d" % n
    with hostlock.changing():  # the macOS walk's snapshots wait while these accounts exist
        made = []
        try:
            os.chmod(d, 0o755)
            lib = os.path.join(d, "lib")
            for package in packages:
                os.makedirs(os.path.join(lib, package), 0o755)
            for name in ("chv-cell", "chv-cell-agent"):
                shutil.copy(os.path.join(SRC, name), os.path.join(lib, name))
                os.chmod(os.path.join(lib, name), 0o755)
            for package in packages:  # the role's part (chv.fleet.guest_tree)
                for name in os.listdir(os.path.join(SRC, package)):
                    if name.endswith(".py"):
                        shutil.copy(os.path.join(SRC, package, name), os.path.join(lib, package, name))
                        os.chmod(os.path.join(lib, package, name), 0o644)
            policy_path = os.path.join(d, "cell-policy.json")
            with open(policy_path, "w") as fh:
                json.dump(pol, fh)
            os.chmod(policy_path, 0o644)
            src = os.path.join(lib, "chv_guest", "cell", "policy.py")
            with open(src) as fh:
                text = fh.read()
            old = 'DEFAULT_POLICY_PATH = "/etc/chv-fleet/cell-policy.json"\n'
            assert text.count(old) == 1
            with open(src, "w") as fh:
                fh.write(text.replace(old, "DEFAULT_POLICY_PATH = %r\n" % policy_path))
            agent = os.path.join(lib, "chv-cell-agent")
            _sh("groupadd", group)
            made.append(("groupdel", group))
            for user, extra in ((member, ["-G", group]), (other, [])):
                _sh("useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", "-U", *extra, user)
                made.append(("userdel", user))
            # the role's template less closefrom_override (test_slot_files.py adds the role's own drop-in)
            rule = "Defaults!%s env_reset\n%%%s ALL=(root) NOPASSWD: %s\n" % (agent, group, agent)
            tmp = os.path.join(d, "sudoers")
            with open(tmp, "w") as fh:
                fh.write(rule)
            _sh("visudo", "-cf", tmp)
            os.chmod(tmp, 0o440)
            shutil.move(tmp, sudoers)
            yield {"dir": d, "chv_cell": os.path.join(lib, "chv-cell"), "agent": agent, "policy": policy_path,
                   "pol": pol, "member": member, "other": other, "group": group, "lib": lib}
        finally:
            if os.path.exists(sudoers):
                os.unlink(sudoers)
            for what, name in reversed(made):
                subprocess.run([what, name], capture_output=True, check=False)
                if what == "userdel":
                    subprocess.run(["groupdel", name], capture_output=True, check=False)  # the user's own group
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def sudo_env(env):
    pol = copy.deepcopy(env["pol"])
    pol.update(AGENT_KEYS)
    with agent_install(pol) as s:
        yield s


def as_user(user, argv, **kw):
    """Popen of argv as ``user`` (its uid, primary group and groups), with a
    minimal environment, as an SSH session would start it."""
    import pwd

    pw = pwd.getpwnam(user)
    groups = os.getgrouplist(user, pw.pw_gid)
    return subprocess.Popen(argv, user=pw.pw_uid, group=pw.pw_gid, extra_groups=groups, cwd="/",
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}, **kw)


def user_run(user, argv, stdin=None, timeout=60):
    p = as_user(user, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(stdin, timeout=timeout)
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith(NOISE))
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_agent_user_runs_a_cell_through_sudo(env, sudo_env):
    s = sudo_env
    payload = ["sh", "-c", "echo $HOME $USER $LOGNAME $(id -u) $PWD; cat; echo err >&2; exit 7"]
    r = user_run(s["member"], [s["chv_cell"], "-v", "run", "--", *payload], stdin="piped-in\n")
    assert r.returncode == 7, r.stderr
    assert r.stdout == "/home/chv chv chv 0 /workspace\npiped-in\n"
    assert "err\n" in r.stderr and "err" not in r.stdout
    uid = __import__("pwd").getpwnam(s["member"]).pw_uid
    assert "run requested by %s (uid %d) through sudo" % (s["member"], uid) in r.stderr
    # the same command from a user outside the agent group: refused, nothing runs
    r = user_run(s["other"], [s["chv_cell"], "run", "--", *payload], stdin="piped-in\n")
    assert r.returncode == 78 and r.stdout == ""
    assert "user %s" % s["other"] in r.stderr and "is not allowed to run cells" in r.stderr
    assert "chv_cell_agent_group" in r.stderr
    # status answers through sudo too
    r = user_run(s["member"], [s["chv_cell"], "status"])
    assert r.returncode == 0 and [ln.split()[-1] for ln in r.stdout.splitlines()] == ["idle", "idle"]


SMUGGLE_MARKER = "smuggled-marker"


def test_agent_refuses_everything_but_run_and_status(env, sudo_env):
    s = sudo_env
    marker = os.path.join(env["pol"]["workspace_root"], "slot0", SMUGGLE_MARKER)
    payload = ["--", "sh", "-c", "touch /workspace/%s; echo payload-ran" % SMUGGLE_MARKER]
    attempts = {
        # through the public chv-cell (refused before sudo)
        "wrapper": [
            ["--policy", env["shared"], "run", "--slot", "slot0", *payload],
            ["run", "--policy=" + env["shared"], "--slot", "slot0", *payload],
            ["run", "--shared-network", "--slot", "slot0", *payload],
            ["run", "--slot", "slot0", "--"],
            ["status", "--policy", env["shared"]],
            ["run", "--pol", env["shared"], "--slot", "slot0", *payload],
        ],
        # straight at the agent through sudo (the wrapper's checks skipped)
        "agent": [
            ["--policy", env["shared"], "run", "--slot", "slot0", *payload],
            ["run", "--policy", env["shared"], "--slot", "slot0", *payload],
            ["run", "--policy=" + env["shared"], "--slot", "slot0", *payload],
            ["run", "--shared-network", "--slot", "slot0", *payload],
            ["run", "--slot", "slot0", "--"],
            ["run", "--slot", "slot0", "sh", "-c", "touch /workspace/%s" % SMUGGLE_MARKER],
            ["status", "--policy", env["shared"]],
            ["argv", "--slot", "slot0", *payload],
            ["validate-policy", "/etc/shadow"],
            [],
        ],
    }
    for how, lists in attempts.items():
        for args in lists:
            if os.path.exists(marker):
                os.unlink(marker)
            argv = [s["chv_cell"], *args] if how == "wrapper" else ["sudo", "-n", s["agent"], *args]
            r = user_run(s["member"], argv)
            assert r.returncode == 78, (how, args, r.stderr)
            assert "payload-ran" not in r.stdout and not os.path.exists(marker), (how, args)
            assert r.stderr.startswith("chv-cell: "), (how, args, r.stderr)
            assert "/etc/shadow" not in r.stdout and "root:" not in r.stdout
    # control: the same payload in the allowed shape, both ways
    for argv in ([s["chv_cell"], "run", "--slot", "slot0", *payload],
                 ["sudo", "-n", s["agent"], "run", "--slot", "slot0", *payload]):
        os.path.exists(marker) and os.unlink(marker)
        r = user_run(s["member"], argv)
        assert r.returncode == 0 and r.stdout == "payload-ran\n" and os.path.exists(marker), r.stderr


def test_the_sudo_rule_allows_nothing_else(env, sudo_env):
    s = sudo_env
    for argv in (["sudo", "-n", "/bin/true"], ["sudo", "-n", "/usr/bin/env"], ["sudo", "-n", "-u", s["other"], "/bin/true"],
                 ["sudo", "-n", "/usr/bin/python3", "-I", s["agent"], "status"]):
        r = user_run(s["member"], argv)
        assert r.returncode != 0 and "password is required" in r.stderr, (argv, r.stderr)
    # control: the rule's one command works for the member, and sudo itself works for root
    assert user_run(s["member"], ["sudo", "-n", s["agent"], "status"]).returncode == 0
    assert subprocess.run(["sudo", "-n", "/bin/true"], check=False).returncode == 0


def test_the_agent_needs_sudo_even_for_root(env, sudo_env):
    s = sudo_env
    r = subprocess.run([s["agent"], "status"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                       check=False)
    assert r.returncode == 78 and "started only by sudo (SUDO_UID/SUDO_USER are not set)" in r.stderr
    # control: root through sudo (which sets SUDO_UID/SUDO_USER itself)
    r = subprocess.run(["sudo", "-n", s["agent"], "status"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.count("idle") == 2, r.stderr


def slot_free(env, name="slot0"):
    return (status(env, env["policy"])[name] == "idle"
            and not os.path.exists("/sys/class/net/" + next(s["host_ifname"] for s in env["pol"]["slots"]
                                                            if s["name"] == name)))


def end_session(keep, p):
    """After a test of a dropped session: close the test's end ``keep`` (None: closed) and kill ``p`` if it runs."""
    if keep is not None:
        os.close(keep)
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.parametrize("how, kind", [("sudo", "pipe"), ("sudo", "socket"), ("root", "pipe")])
def test_disconnect_without_sighup_stops_the_cell(env, sudo_env, how, kind):
    """sshd without a tty: the session's stdout/stderr lose their peer, no SIGHUP."""
    s = sudo_env
    argv = [s["chv_cell"], "run", "--slot", "slot0", "--", "sleep", "60"]
    if kind == "pipe":
        keep, give = os.pipe()
        streams = {"stdout": give, "stderr": subprocess.PIPE}
    else:
        a, b = socket.socketpair()
        keep, give = a.detach(), b.detach()
        streams = {"stdout": give, "stderr": give}
    stdin_r, stdin_w = os.pipe()
    os.close(stdin_w)  # stdin at EOF from the start: not a disconnect
    try:
        if how == "sudo":
            p = as_user(s["member"], argv, stdin=stdin_r, **streams)
        else:
            p = subprocess.Popen([sys.executable, "-I", ENTRY, "--policy", env["policy"], *argv[1:]], stdin=stdin_r,
                                 **streams)
    finally:
        os.close(give)
        os.close(stdin_r)
    try:
        wait_record(env, "slot0", p)
        time.sleep(0.5)
        assert p.poll() is None  # stdin's EOF alone did not stop it
        t = time.monotonic()
        os.close(keep)
        keep = None
        p.wait(timeout=env["pol"]["stop_grace"] + 10)
        took = time.monotonic() - t
        err = p.stderr.read().decode() if p.stderr else ""
    finally:
        end_session(keep, p)
    assert p.returncode == 129, err
    assert took < env["pol"]["stop_grace"] + 5
    if kind == "pipe":
        assert "the peer of stdout has no reader (POLLERR): the caller is gone; stopping the cell (exit 129" in err
    assert slot_free(env)


def test_live_streams_and_files_never_stop_the_cell(env, sudo_env):
    """Controls of the disconnect test: a reader that stays, /dev/null, a file."""
    s = sudo_env
    argv = [s["chv_cell"], "run", "--slot", "slot0", "--", "sh", "-c", "sleep 1.5; echo done; exit 3"]
    r = user_run(s["member"], argv)  # stdout a pipe whose reader stays
    assert r.returncode == 3 and r.stdout == "done\n", r.stderr
    with open(os.path.join(s["dir"], "out"), "w") as out, open(os.devnull, "w") as null:
        for target in (out, null):
            p = as_user(s["member"], argv, stdin=subprocess.DEVNULL, stdout=target, stderr=target)
            assert p.wait(timeout=30) == 3
    with open(os.path.join(s["dir"], "out")) as fh:
        assert "done\n" in fh.read()


def test_sighup_is_relayed_by_sudo(env, sudo_env):
    s = sudo_env
    p = as_user(s["member"], [s["chv_cell"], "run", "--slot", "slot0", "--", "sleep", "60"], stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE)
    wait_record(env, "slot0", p)
    with open("/proc/%d/cmdline" % p.pid) as fh:
        assert fh.read().split("\0")[:3] == ["/usr/bin/sudo", "-n", s["agent"]]  # chv-cell exec'd sudo
    p.send_signal(signal.SIGHUP)
    dummy, err = p.communicate(timeout=30)
    assert p.returncode == 129 and "stopping on signal 1" in err.decode()
    assert slot_free(env)


def test_tty_hangup_through_sudo_stops_the_cell(env, sudo_env):
    """ssh -t: the session has a controlling tty (and sudo its use_pty); closing it hangs up."""
    import fcntl
    import termios

    s = sudo_env
    master, slave = os.openpty()
    p = as_user(s["member"], [s["chv_cell"], "run", "--slot", "slot0", "--", "sleep", "60"], stdin=slave, stdout=slave,
                stderr=slave, start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    try:
        wait_record(env, "slot0", p)
        time.sleep(0.3)
        assert p.poll() is None
    finally:
        os.close(master)
    assert p.wait(timeout=env["pol"]["stop_grace"] + 10) == 129
    assert slot_free(env)


def test_agent_home_is_per_slot_and_the_alias_is_the_workspace(env, sudo_env):
    s = sudo_env

    def cell(slot_name, script):
        r = user_run(s["member"], [s["chv_cell"], "run", "--slot", slot_name, "--", "sh", "-c", script])
        assert r.returncode == 0, r.stderr
        return r.stdout

    cell("slot0", "mkdir -p /home/chv/.codex && echo s0 > /home/chv/.codex/host-state.json")
    # another slot has its own HOME: slot0's file is not there
    assert cell("slot1", "cat /home/chv/.codex/host-state.json 2>/dev/null || echo absent; echo $HOME") == \
        "absent\n/home/chv\n"
    # control: slot0 finds it again (its HOME persists)
    assert cell("slot0", "cat /home/chv/.codex/host-state.json") == "s0\n"
    out = cell("slot0", "echo a > /workspace/via-mount; cat /home/chv/workspace/via-mount; "
                        "echo b > /home/chv/workspace/via-alias; cat /workspace/via-alias; "
                        "test $(stat -c %d:%i /workspace) = $(stat -c %d:%i /home/chv/workspace) && echo same-dir; "
                        "ls /home/chv/via-mount 2>/dev/null || echo not-in-home")
    assert out == "a\nb\nsame-dir\nnot-in-home\n"
    ws = os.path.join(env["pol"]["workspace_root"], "slot0")
    assert sorted(f for f in os.listdir(ws) if f.startswith("via-")) == ["via-alias", "via-mount"]
    # the alias's mount point in the agent state dir belongs to the slot's cell root (not host root)
    st = os.lstat(os.path.join(env["pol"]["agent_state_root"], "slot0", "workspace"))
    assert st.st_uid == env["pol"]["slots"][0]["uid_base"]


# ---------------------------------------------------------------- warm cells
@pytest.fixture
def warm(env):
    """start(policy) runs `chv-cell warm --slot slot0` (what
    chv-cell-warm@slot0.service runs) and returns once its cell waits for a
    payload; stopped after the test."""
    procs = []
    sock = os.path.join(env["pol"]["state_dir"], "warm", "slot0.sock")

    def start(policy):
        proc = subprocess.Popen([sys.executable, "-I", ENTRY, "--policy", policy, "-v", "warm", "--slot", "slot0"],
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        end = time.monotonic() + 30
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end
            time.sleep(0.02)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=30)


def warm_log(proc, timeout=30):
    """The warm launcher's stderr once it has exited (it serves one payload)."""
    return proc.communicate(timeout=timeout)[1]


def test_a_warm_cell_runs_the_payload_isolated_as_a_cold_one(env, warm):
    """The probe in a warm cell: every boundary as in a cold cell, the
    payload on the caller's streams with its exit code, the environment nspawn
    gave the cell (nothing of the receiver's Python), and the warm launcher
    says it took the payload. Control: the same probe in a cold cell."""
    w = warm(env["warm"])
    p = probe(env, env["warm"])
    assert "slot slot0: warm cell took a payload" in warm_log(w)
    assert_isolated(env, p)
    cold = probe(env, env["policy"])
    assert p["env"] == cold["env"] and p["cwd"] == cold["cwd"] and p["uid_map"] == cold["uid_map"]
    w = warm(env["warm"])
    r = run(env["warm"], "--slot", "slot0", "--", "sh", "-c", "echo out; echo err >&2; env | sort; exit 7")
    assert r.returncode == 7 and r.stdout.startswith("out\n") and "err" in r.stderr, r
    assert "took a payload" in warm_log(w)
    c = run(env["policy"], "--slot", "slot0", "--", "sh", "-c", "echo out; echo err >&2; env | sort; exit 7")
    assert c.returncode == 7
    drop = ("container_uuid=", "LC_CTYPE=")  # a new uuid per cell; LC_CTYPE: neither may have it
    assert [x for x in r.stdout.splitlines() if not x.startswith(drop)] == \
        [x for x in c.stdout.splitlines() if not x.startswith(drop)]
    assert "LC_CTYPE=" not in r.stdout + c.stdout


def test_a_warm_cell_gives_the_payloads_verdict_on_the_status_fd(env, warm):
    """A payload a warm cell ran, that prints the launcher's busy line and exits
    75, gets the verdict "ran" with exit 75 on --status-fd (its warm launcher
    reports how the payload ended), as in a cold cell (the control)."""
    forged = "echo 'chv-cell: all 1 slot(s) busy (slot0) for 1s; giving up' >&2; exit 75"
    records = []
    for policy, warm_cell in ((env["warm"], True), (env["policy"], False)):
        w = warm(policy) if warm_cell else None
        r, wfd = os.pipe()
        p = subprocess.run([sys.executable, "-I", ENTRY, "--policy", policy, "run", "--status-fd", str(wfd),
                            "--slot", "slot0", "--", "sh", "-c", forged], capture_output=True, text=True,
                           pass_fds=(wfd,), timeout=60, check=False)
        os.close(wfd)
        with os.fdopen(r) as fh:
            records.append(json.loads(fh.read()))
        assert p.returncode == 75 and "busy" in p.stderr, p
        if w is not None:
            assert "took a payload" in warm_log(w)
    for rec in records:
        assert rec == {"verdict": "ran", "exit": 75, "slot": "slot0", "payload_started": True, "payload_exit": 75}


def test_a_warm_cell_is_not_used_with_another_policy_or_after_a_hidden_path_appeared(env, warm):
    """A caller with another policy file (a digest that differs) gets a cold
    cell; so does every caller once a path the cell's argv depends on (here
    the file to hide) appeared after the warm cell started: that cell would
    not hide it. Control: the hidden file is unreadable in the cold cell,
    and the warm cell was ready before each run."""
    w = warm(env["warm"])
    r = run(env["warm_other"], "--", "sh", "-c", "echo $CHV_SLOT")
    assert r.returncode == 0 and r.stdout == "slot1\n", r  # slot0's lock is the warm cell's: a cold cell in slot1
    assert w.poll() is None  # declined: the warm cell still waits
    late = env["secret"] + ".late"
    pol = dict(env["pol"], warm_slots=["slot0"], inaccessible=env["pol"]["inaccessible"] + [late])
    path = os.path.join(os.path.dirname(env["warm"]), "warm_late.json")
    with open(path, "w") as fh:
        json.dump(pol, fh)
    w.terminate()
    warm_log(w)
    w = warm(path)
    with open(late, "w") as fh:
        fh.write("late secret\n")
    os.chmod(late, 0o644)
    try:
        r = run(path, "--timeout", "30", "--", "sh", "-c", "cat %s; cat /etc/os-release | head -1" % late)
        log = warm_log(w)
    finally:
        os.unlink(late)
    assert "appeared or went away since it started; replacing it" in log, log
    assert "took a payload" not in log
    assert r.returncode == 0 and "late secret" not in r.stdout and "Permission denied" in r.stderr, r
    assert r.stdout.startswith(("NAME=", "PRETTY_NAME=")), r  # control: an ordinary file reads


def test_a_warm_cell_checks_the_ruleset_again_at_hand_over(env, warm, host_table):
    """Without the table no warm cell starts. The table deleted after the
    warm cell started (checked then): the hand-over refuses with the cold
    launcher's message, exit 125, no payload. Control: with the table
    loaded, the same run in a warm cell."""
    # no table at all: no warm cell is started (nothing listens), the launcher says why and exits after a pause
    sock = os.path.join(env["pol"]["state_dir"], "warm", "slot0.sock")
    idle = subprocess.Popen([sys.executable, "-I", ENTRY, "--policy", env["warm_ruleset"], "warm", "--slot", "slot0"],
                            stderr=subprocess.PIPE, text=True)
    err = idle.communicate(timeout=30)[1]
    assert idle.returncode == 125 and "is not loaded" in err and "no warm cell for 5s" in err, err
    assert not os.path.exists(sock) and leftovers(env["pol"]) == []
    host_table(["lth20", "lth21"])
    w = warm(env["warm_ruleset"])
    assert nft("delete", "table", "inet", "chv_cell").returncode == 0
    r, ran = marker_run(env, env["warm_ruleset"], "warm-ruleset-marker")
    assert r.returncode == 125 and not ran, r
    assert ("nftables table inet chv_cell is not loaded (is chv-cell-nat.service active?); "
            "refusing to start the cell (policy require_ruleset)") in r.stderr
    w.terminate()
    warm_log(w)
    assert nft("-f", "-", stdin=MIN_TABLE % 'elements = { "lth20", "lth21" }').returncode == 0
    w = warm(env["warm_ruleset"])
    r, ran = marker_run(env, env["warm_ruleset"], "warm-ruleset-marker")
    assert r.returncode == 0 and ran, r
    assert "took a payload" in warm_log(w)


def test_a_warm_cell_stops_on_the_callers_signal_and_when_the_caller_is_gone(env, warm):
    """SIGTERM to `chv-cell run` reaches the payload in the warm cell (its
    trap runs) and the run exits 143; a SIGKILLed caller stops the cell as
    on SIGHUP. Control: the payload had started each time (its file)."""
    ws = os.path.join(env["pol"]["workspace_root"], "slot0")
    for kill, rc in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        for f in ("got-term", "trap-set"):
            if os.path.exists(os.path.join(ws, f)):
                os.unlink(os.path.join(ws, f))
        w = warm(env["warm"])
        h = subprocess.Popen(cmd(env["warm"], "--slot", "slot0", "--", "sh", "-c",
                                 "trap 'touch /workspace/got-term; exit 0' TERM; touch /workspace/trap-set; "
                                 "sleep 30 & wait"), stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 20
        while not os.path.exists(os.path.join(ws, "trap-set")):
            assert h.poll() is None and time.monotonic() < end
            time.sleep(0.02)
        h.send_signal(kill)
        h.communicate(timeout=20)
        log = warm_log(w)
        assert h.returncode == rc, log
        assert os.path.exists(os.path.join(ws, "got-term")), log
        if kill == signal.SIGKILL:
            assert "the caller of the warm cell went away; stopping the cell" in log


def test_an_idle_warm_cell_is_replaced_when_its_policy_file_changes(env, warm):
    """The policy file replaced (as the role's copy does): the idle warm cell
    ends within seconds, without a payload. Control: untouched, it waits."""
    path = os.path.join(os.path.dirname(env["warm"]), "warm_copy.json")
    shutil.copy(env["warm"], path)
    w = warm(path)
    time.sleep(2.5)
    assert w.poll() is None
    shutil.copy(env["warm"], path + ".new")
    os.replace(path + ".new", path)
    log = warm_log(w, timeout=15)
    assert w.returncode == 0 and "changed since the warm cell started; replacing it" in log, log
