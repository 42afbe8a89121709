"""chv.fleet.preflight's identities check (site.yml, before any change): the
slots allocated as chv.fleet.cell_identity would, in check mode, on a fake
host tree; each refusal names the cell_runtime role's variable and its bad
value, beside its control. Also the allocator's own refusals behind it: a
shared UID range holding existing accounts, a pool the host's routes leave
too small (naming the routes)."""

import json
import os

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci
from ansible_collections.chv.fleet.plugins.module_utils import preflight as pf
from fake_tree import write

RELEASE = "6.1.0-test-amd64"
PASSWD = ("root:x:0:0::/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n"
          "systemd-network:x:998:998::/:/usr/sbin/nologin\nchv:x:1000:1000::/home/chv:/bin/bash\n"
          "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n")
GROUP = "root:x:0:\ndaemon:x:1:\nsystemd-network:x:998:\nchv:x:1000:\nnogroup:x:65534:\n"
# the guest's link, as a lab guest has it
ADDRS = [{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
         {"ifname": "host0", "addr_info": [{"family": "inet", "local": "10.99.32.2", "prefixlen": 30}]}]
ROUTES = [{"dst": "default", "gateway": "10.99.32.1", "dev": "host0"},
          {"dst": "10.99.32.0/30", "dev": "host0", "prefsrc": "10.99.32.2"}]


@pytest.fixture
def root(tmp_path):
    write(tmp_path, "/etc/passwd", PASSWD)
    write(tmp_path, "/etc/group", GROUP)
    os.makedirs(os.path.join(str(tmp_path), "sys/class/net/host0"))
    os.makedirs(os.path.join(str(tmp_path), "proc"))
    return tmp_path


def run(argv):
    return json.dumps(ADDRS if argv[2] == "addr" else ROUTES)


def identity(**changes):
    out = dict(slots=2, pool="10.200.0.0/16", prefix=24, uid_mode="per_slot", shared_uid=None, agent_user="chv",
               agent_uid=1000, ifname_prefix="chvh", cell_ifname="eth0", machine_prefix="chv-",
               ledger="/var/lib/chv-fleet/identities.json", reassign=False, force=False, state_dir="/run/chv-fleet")
    out.update(changes)
    return out


def check(root, **changes):
    return pf.check_identities(str(root), run, identity(**changes))


def test_the_role_defaults_fit_and_nothing_is_written(root):
    before = sorted(os.walk(str(root)))
    ok, detail = check(root)
    assert ok and detail == "2 slots: 2 new, 0 kept (chvh0 ... chvh1, 10.200.0.0/24 ... 10.200.1.0/24)", detail
    assert sorted(os.walk(str(root))) == before  # no ledger, no lock file, no directory


@pytest.mark.parametrize("changes,control,message", [
    # the whole pool is the host's own link
    ({"pool": "10.99.32.0/30", "prefix": 30, "slots": 1}, {"pool": "10.99.36.0/30", "prefix": 30, "slots": 1},
     "chv_cell_pool 10.99.32.0/30 is too small: of its 1 /30 subnets, 0 are held by other slots and the rest "
     "overlap addresses or routes on this host (10.99.32.0/30 on host0), so slot 'slot0' cannot be placed"),
    # 500-66035 holds systemd-network and chv (nobody, 65534, is the kernel's overflow ID)
    ({"uid_mode": "shared", "shared_uid": 500}, {"uid_mode": "shared", "shared_uid": None},
     "chv_cell_shared_uid 500: with uid_mode shared the cells' UIDs are the host UIDs 500-66035, which hold "
     "existing accounts (UID/GID 998, 1000 in passwd/group)"),
    ({"slots": 3, "pool": "10.200.0.0/23"}, {"slots": 2, "pool": "10.200.0.0/23"},
     "chv_cell_slots 3 is more than chv_cell_pool 10.200.0.0/23 holds: 2 /24 subnets (chv_cell_prefix 24)"),
    ({"slots": ["a", "b", "c"], "pool": "10.200.0.0/23"}, {"slots": ["a", "b"], "pool": "10.200.0.0/23"},
     "chv_cell_slots ['a', 'b', 'c'] (3 slots) is more than chv_cell_pool 10.200.0.0/23 holds"),
    ({"pool": "10.200.0.0/33"}, {"pool": "10.200.0.0/16"}, "chv_cell_pool '10.200.0.0/33' is not an IPv4 network"),
    ({"ifname_prefix": "averyveryverylongprefix"}, {"ifname_prefix": "averyverylon"},
     "chv_cell_ifname_prefix 'averyveryverylongprefix' must match"),
    ({"uid_mode": "shared", "shared_uid": 0}, {"uid_mode": "per_slot", "shared_uid": 0},
     "chv_cell_shared_uid 0 with uid_mode shared would map every cell's root to host root"),
])
def test_a_refusal_names_the_role_variable_and_its_value(root, changes, control, message):
    ok, detail = check(root, **changes)
    assert not ok and detail.startswith(message), detail
    ok, detail = check(root, **control)
    assert ok, detail


def test_the_shared_uid_defaults_to_the_agent_users_uid(root):
    write(root, "/etc/passwd", PASSWD.replace("chv:x:1000:1000", "chv:x:1500:1000"))
    ok, detail = check(root, uid_mode="shared")  # 1500-67035 holds no account but chv and nobody
    assert ok, detail
    ok, detail = check(root, uid_mode="shared", agent_user="nosuchuser")  # agent_uid 1000: chv's 1500 is inside
    assert not ok and detail.startswith("chv_cell_shared_uid 1000: ") and "UID/GID 1500 in" in detail, detail


def test_a_subuid_range_in_the_shared_range_is_refused(root):
    write(root, "/etc/subuid", "chv:100000:65536\n")
    assert check(root, uid_mode="shared", shared_uid=40000)[0] is False
    assert check(root, uid_mode="shared", shared_uid=None)[0] is True  # 1000-66535 ends below 100000


def test_a_change_of_a_slot_with_a_running_cell_is_refused_naming_the_force_variable(root, hold_lock):
    ledger = write(root, "/var/lib/chv-fleet/identities.json")
    host = ci.HostFacts(ifnames=["host0"])
    with open(ledger, "w") as f:
        f.write(ci.dump_ledger(ci.allocate(None, 2, ci.Settings(), host).ledger))
    text = open(ledger).read()
    holder = hold_lock(os.path.join(str(root), "run/chv-fleet/locks/slot1.lock"))
    ok, detail = check(root, slots=1)
    assert not ok and "slot slot1 has a running cell" in detail and "chv_cell_identity_force" in detail, detail
    assert open(ledger).read() == text
    assert check(root, slots=1, force=True)[0] is True  # the control: force lets it through (and writes nothing)
    assert open(ledger).read() == text
    holder.stop()
    assert check(root, slots=1)[0] is True


def test_a_corrupt_ledger_names_the_ledger_variable(root):
    write(root, "/var/lib/chv-fleet/identities.json", '{"version": 1, "po')
    ok, detail = check(root)
    assert not ok and detail.startswith("chv_cell_ledger /var/lib/chv-fleet/identities.json: "), detail


def test_run_checks_adds_the_identities_check_only_when_asked(root):
    for path, text in (("/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n"),
                       ("/proc/sys/user/max_user_namespaces", "63424\n"),
                       ("/proc/meminfo", "MemTotal:       16384000 kB\n")):
        write(root, path, text)
    os.chmod(write(root, "/usr/sbin/ip"), 0o755)
    names = [c[0] for c in pf.run_checks(str(root), RELEASE, ["a", "b", "c"], "4G", proven=("veth", "nf_tables"))]
    assert names == ["cgroup2", "user namespaces", "kernel modules", "iproute2", "memory"]
    checks = pf.run_checks(str(root), RELEASE, ["a", "b", "c"], "4G", ("veth", "nf_tables"), identity(), run)
    assert [c[0] for c in checks][-1] == "identities" and all(c[1] for c in checks), checks
    assert checks[4][2].startswith("3 slots x MemoryMax 4G")  # a list of names counts as its length
    no_ip = pf.run_checks(str(root), RELEASE, 2, "4G", ("veth", "nf_tables"), identity(), None)
    assert no_ip[-1] == ("identities", False, "not checked: no ip command to read the host's addresses and routes")
    with pytest.raises(ValueError, match=r"^chv_cell_slots count -1 is not between 0 and 65536$"):
        pf.run_checks(str(root), RELEASE, -1, "4G")


def test_the_labels_follow_the_role_variables():
    assert pf.identity_label("pool", "pool 10.0.0.0/8 is too small") == "chv_cell_pool 10.0.0.0/8 is too small"
    assert pf.identity_label("force", "slot x has a running cell") == "chv_cell_identity_force: slot x has a running cell"
    assert pf.identity_label("reassign", "the requested settings") == "chv_cell_reassign: the requested settings"


# ------------------------------------------------------------- the allocator's own refusals

def test_the_shared_range_may_hold_its_own_uid_and_the_overflow_id_only():
    host = ci.HostFacts(ids=[0, 1, 1000, 65534])
    ci.allocate(None, 2, ci.Settings(uid_mode="shared", shared_uid=1000), host)
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(None, 2, ci.Settings(uid_mode="shared", shared_uid=1), host)
    assert err.value.param == "shared_uid"
    assert str(err.value).startswith("shared_uid 1: with uid_mode shared the cells' UIDs are the host UIDs 1-65536, "
                                     "which hold existing accounts (UID/GID 1000 in passwd/group)")


def test_an_account_made_after_the_shared_slots_does_not_move_them():
    ledger = ci.allocate(None, 2, ci.Settings(uid_mode="shared", shared_uid=1000), ci.HostFacts()).ledger
    later = ci.HostFacts(ids=[1000, 1001])
    assert ci.allocate(ledger, 2, ci.Settings(uid_mode="shared", shared_uid=1000), later).ledger == ledger
    with pytest.raises(ci.AllocationError, match="UID/GID 1001"):  # a new slot needs the range afresh
        ci.allocate(ledger, 3, ci.Settings(uid_mode="shared", shared_uid=1000), later)


def test_a_pool_left_too_small_by_routes_names_them_once():
    host = ci.HostFacts(networks=[("10.200.0.0/26", "eth0"), ("10.200.0.0/26", "eth0"), ("10.200.0.5/32", "eth0"),
                                  ("10.200.0.64/26", None), ("10.200.0.128/26", "eth1"), ("10.200.0.192/27", "eth2")])
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(None, 1, ci.Settings(pool="10.200.0.0/24", prefix=26), host)
    assert ("(10.200.0.0/26 on eth0, 10.200.0.64/26 on a device-less route, 10.200.0.128/26 on eth1, 1 more), "
            "so slot 'slot0' cannot be placed") in str(err.value)
