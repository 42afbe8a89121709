"""chv.fleet.cell_runtime on a converged guest: the launcher, its paths and
every slot at once. The isolation of a cell, each probe beside its control,
is the catalog's (test_catalog.py, docs/isolation-cases.md).
"""

import json

import pytest

POLICY = "/etc/chv-fleet/cell-policy.json"


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
    # each the slot's own: its cell root's uid and gid, 0700, no group shared with the agent user or another
    # slot (the executor reads results with chv-cell read: test_executor.py)
    with host.sudo():
        for s in policy["slots"]:
            for root in (policy["workspace_root"], policy["agent_state_root"]):
                f = host.file("%s/%s" % (root, s["name"]))
                assert f.is_directory and f.uid == s["uid_base"] and f.gid == s["uid_base"] and f.mode == 0o700, f.path


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


def test_nothing_left_behind(host, policy):
    with host.sudo():
        for s in policy["slots"]:
            assert not host.file("/sys/class/net/" + s["host_ifname"]).exists
            assert not host.file("/run/chv-fleet/cells/%s.json" % s["name"]).exists
            assert not host.file("/run/chv-fleet/locks/%s.lock" % s["name"]).exists


def test_each_slots_disk_is_mounted_under_its_workspace_and_home(host, policy):
    """chv_cell_disk_max (molecule/shared/group_vars: 64M; the policy's
    disk_max, read back on the guest): each slot's image is preallocated and mounted (a loop device), and the slot's workspace and
    agent state are binds of it, nodev and nosuid. Its quota from inside a
    cell is the catalog's TEN-05 (test_catalog.py)."""
    size_max = int(host.check_output("python3 -IS -c 'import sys; sys.path.insert(0, \"/usr/lib/chv-fleet\"); "
                                     "from chv_guest.cell import disk; print(disk.parse_size(sys.argv[1]))' %s",
                                     policy["disk_max"]))
    assert size_max >= 1 << 20, policy["disk_max"]
    with host.sudo():
        mounts = host.check_output("findmnt -rn -o TARGET,SOURCE,FSTYPE,OPTIONS")
        table = {ln.split()[0]: ln.split()[1:] for ln in mounts.splitlines()}
        for s in policy["slots"]:
            image = table["/var/lib/chv-fleet/disks/" + s["name"]]
            assert image[0].startswith("/dev/loop") and image[1] == "ext4", image
            for root in (policy["workspace_root"], policy["agent_state_root"]):
                got = table["%s/%s" % (root, s["name"])]
                assert got[0].startswith(image[0]) and got[1] == "ext4", (root, got, image)  # the image's own device
                assert {"nodev", "nosuid"} <= set(got[2].split(",")), got
            size, blocks = host.check_output("stat -c '%%s %%b' /var/lib/chv-fleet/disks/%s.img", s["name"]).split()
            assert int(size) == size_max and int(blocks) * 512 >= size_max, (size, blocks)  # preallocated
