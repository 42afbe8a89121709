"""chv.fleet.cell_runtime on a converged guest: real cells through `chv-cell run`.

Each negative check sits beside its positive control in the same cell.
The cell's gateway is proven reachable twice: at L2 (the gateway's neighbour
entry resolves inside the cell) and through it (TCP to a listener on the lab
host, the guest's own default gateway, via the cell_nat masquerade).
"""

import json
import os

import pytest

from listeners import hello_listener
from testpaths import PROBES

POLICY = "/etc/chv-fleet/cell-policy.json"
CAPS = {"CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17,
        "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_MKNOD": 27}

# The in-cell probe shared with tests/integration/cells (run with python3 -I -c, never imported).
with open(os.path.join(PROBES, "cell_probe.py")) as _fh:
    PROBE = _fh.read()


@pytest.fixture(scope="module")
def policy(host):
    with host.sudo():
        return json.loads(host.file(POLICY).content_string)


def test_policy_valid_and_launcher_on_path(host):
    with host.sudo():
        r = host.run("chv-cell validate-policy")
    assert r.rc == 0, r.stderr
    assert host.file("/usr/local/bin/chv-cell").is_symlink


@pytest.mark.parametrize("path,mode", [("/etc/chv", 0o700), ("/run/chv-fleet", 0o700), ("/run/chv", 0o755),
                                       ("/etc/chv-fleet/cell-policy.json", 0o644)])
def test_paths(host, path, mode):
    with host.sudo():
        f = host.file(path)
        assert f.exists and f.user == "root" and f.mode == mode


def test_workspaces_belong_to_cell_root(host, policy):
    # cell root's, setgid to the agent group (the executor reads results, never writes)
    gid = int(host.check_output("getent group %s", policy["agent_user"]).split(":")[2])
    with host.sudo():
        for s in policy["slots"]:
            for root in (policy["workspace_root"], policy["agent_state_root"]):
                f = host.file("%s/%s" % (root, s["name"]))
                assert f.is_directory and f.uid == s["uid_base"] and f.gid == gid and f.mode == 0o2750, f.path


def _lab_host_address(host):
    return host.run("ip -4 route show default").stdout.split()[2]


def test_isolation_each_beside_its_control(host, policy):
    s0 = policy["slots"][0]
    state = "%s/%s" % (policy["agent_state_root"], s0["name"])
    lab = _lab_host_address(host)
    srv = hello_listener(lab, timeout=30)  # the controller is the lab host: beyond the gateway + NAT
    with host.sudo():
        host.run("install -m 0600 /dev/null /etc/chv/molecule-secret && echo s > /etc/chv/molecule-secret")
        host.run("echo cred > %s/.git-credentials && chmod 0644 %s/.git-credentials" % (state, state))
        host.run("echo plain > %s/ordinary.txt && chmod 0644 %s/ordinary.txt" % (state, state))
        home = policy["agent_state_mount"]
        checks = {"read": {"read_etc_chv": "/etc/chv/molecule-secret", "read_credentials": home + "/.git-credentials",
                           "read_ordinary": home + "/ordinary.txt", "read_etc": "/etc/os-release"},
                  "write": {"write_usr": "/usr/chv-molecule", "write_workspace": "/workspace/probe.txt"},
                  "tcp": {"via_gateway": [lab, srv.getsockname()[1]]}, "neigh": s0["gateway"]}
        r = host.run("chv-cell run --slot %s -- python3 -I -c %s %s", s0["name"], PROBE, json.dumps(checks))
    srv.close()
    assert r.rc == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["uid"] == 0 and p["uid_map"][:2] == ["0", str(s0["uid_base"])] and s0["uid_base"] > 0
    assert p["home"] == policy["agent_state_mount"] == policy["agent_home"]  # the slot's state is the agent's HOME
    assert p["read_etc_chv"] == "EACCES" and p["read_credentials"] == "EACCES"
    assert p["read_ordinary"] == "ok" and p["read_etc"] == "ok"
    assert p["write_usr"] in ("EROFS", "EACCES") and p["write_workspace"] == "ok"
    assert p["io_uring_setup"] == "EPERM" and p["getpid"] == "ok"
    eff, bnd = int(p["CapEff"], 16), int(p["CapBnd"], 16)
    for cap, bit in CAPS.items():
        assert not eff & (1 << bit) and not bnd & (1 << bit), cap
    assert eff & 1  # CAP_CHOWN, not dropped: the control
    assert p["NoNewPrivs"] == "1"
    assert "lladdr" in p["neigh"], p["neigh"]
    assert p["via_gateway"] == "hello"


def test_consecutive_runs_leave_nothing_behind(host, policy):
    """Thirty cells one after the other: each starts, and afterwards no cell
    record, host-side interface or registered machine is left."""
    prefix = policy["slots"][0]["host_ifname"].rstrip("0123456789")
    with host.sudo():
        r = host.run("for i in $(seq 30); do chv-cell run -- true || exit $?; done")
        assert r.rc == 0, r.stderr
        assert host.check_output("ls /run/chv-fleet/cells/ | grep -c . || true") == "0"
        links = host.check_output("ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1")
        assert [ln for ln in links.split() if ln.startswith(prefix)] == [], links
        if policy.get("register"):
            assert host.check_output("machinectl list --no-legend | grep -c . || true") == "0"


def test_all_slots_at_once_then_one_more(host, policy):
    n = len(policy["slots"])
    with host.sudo():
        r = host.run(
            "for i in $(seq %d); do chv-cell run --timeout 10 -- sh -c 'sleep 2; "
            "set -- $(ip -4 -o addr show dev %s); a=$4; set -- $(cat /proc/self/uid_map); "
            "echo $CHV_SLOT $a $2' > /tmp/cell.$i & done; "
            "sleep 1; chv-cell run --timeout 0.5 -- true; echo extra=$?; wait; cat /tmp/cell.*; rm -f /tmp/cell.*"
            % (n, policy["slots"][0]["cell_ifname"]))
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("extra=")]
    assert "extra=75" in r.stdout
    assert len(lines) == n and len({tuple(x) for x in lines}) == n
    for i in range(3):  # slot name, address, uid base: all distinct
        assert len({x[i] for x in lines}) == n, lines


def test_sigkill_of_launcher_leaves_a_claimable_slot(host, policy):
    s0 = policy["slots"][0]["name"]
    with host.sudo():
        r = host.run(
            "chv-cell run --slot %s -- sleep 60 & L=$!; "
            "for i in $(seq 100); do test -e /run/chv-fleet/cells/%s.json && break; sleep 0.05; done; "
            "kill -9 $L; chv-cell run --slot %s --timeout 15 -- true" % (s0, s0, s0))
    assert r.rc == 0, r.stderr


def test_nothing_left_behind(host, policy):
    with host.sudo():
        for s in policy["slots"]:
            assert not host.file("/sys/class/net/" + s["host_ifname"]).exists
            assert not host.file("/run/chv-fleet/cells/%s.json" % s["name"]).exists
            assert not host.file("/run/chv-fleet/locks/%s.lock" % s["name"]).exists
