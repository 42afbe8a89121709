"""One lab of two guests for the lab playbooks and for site.yml's input checks.

The lab: a second lab_up changes nothing, both guests run systemd, and
lab_down (the last test) leaves no process, veth, cgroup, mount, propagate
entry or directory behind.

site.yml on the first guest, fresh: a bad value of any role's variable fails
before the first role changes the host, and the failure names the variable.
The guest is checked afterwards for every trace of a converge (directories,
units, users, nft tables). The control is a `--check --diff` run of the
whole site.yml with good values on the same fresh guest (in proxy mode, so
that the egress proxy's install is reported too): it gets past every
check, runs every role without a failure and reports changes, so the roles
would change this guest (docs/operations.md: check mode on a fresh host).
The guests boot from the minimal image, which has none of the roles'
packages and has never fetched its package lists: the hardest fresh host
for check mode (the package installs are reported, not failed).
The second guest is never converged: it is there for the lab's shared
network and table, and for test_lab_firewall.py (the lab: conftest.py)."""

import json
import os
import re
import subprocess

import pytest
import yaml

from conftest import BIN, GUESTS, INVENTORY, LAB, lab, run
from labtraces import lab_traces
from playbook_output import recap
from testpaths import ROOT

TRACES = ("/etc/chv-fleet /var/lib/chv-fleet /usr/lib/chv-fleet /opt/chv-browser /etc/chv /run/chv-shots "
          "/etc/systemd/system/chv-broker.socket /etc/systemd/system/chv-browser.service "
          "/etc/systemd/system/chv-cell-nat.service /etc/tmpfiles.d/chv-browser.conf")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/systemd-nspawn"),
                                reason="the lab needs root and systemd-nspawn")


@pytest.fixture(scope="module")
def guest(site_lab):
    return site_lab


def test_lab_up_again_changes_nothing_and_every_guest_runs_systemd(guest):
    rc, counts, out = lab("lab_up.yml")
    assert rc == 0 and counts["changed"] == 0, out[-3000:]
    assert len([t for t in lab_traces(LAB) if t.startswith("process")]) == GUESTS
    ping = run([os.path.join(BIN, "ansible"), "-i", INVENTORY, "all", "-m", "command",
                 "-a", "systemctl is-system-running"])
    assert ping.stdout.count("running") >= GUESTS, ping.stdout + ping.stderr


def site(*args, limit=LAB + "1"):
    """site.yml on the lab's inventory with `args`, `--limit limit`: (process, {host: recap counts})."""
    proc = run([os.path.join(BIN, "ansible-playbook"), "-i", INVENTORY, os.path.join(ROOT, "site.yml"),
                "--limit", limit] + list(args))
    return proc, recap(proc.stdout)


def traces():
    # the agent user chv exists before any converge (the lab makes it, as on a real guest): not a trace
    # (the minimal image has no nft before a converge: no table then)
    cmd = ("ls -d %s 2>/dev/null; getent passwd chv-browser; getent group chv-broker; "
           "! command -v nft >/dev/null || nft list tables" % TRACES)
    with open(os.path.join(os.path.dirname(INVENTORY), "lab.json")) as f:
        record = json.load(f)
    found = []
    for g in record["guests"]:  # plain ssh: an ansible run per check would cost a second of CPU
        proc = subprocess.run(["ssh", "-i", record["key"], "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                               "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "root@" + g["address"], cmd],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        found += ["%s: %s" % (g["name"], line) for line in proc.stdout.split("\n") if line.strip()]
    return "\n".join(found)


def test_good_values_would_change_the_guest(guest):
    """The whole site.yml in check mode on the fresh guest, in proxy mode (egress by name: the proxy's tasks
    report their changes too): every role runs without a failure and
    reports the changes it would make, and the guest is left as it was."""
    proxy = {"chv_cell_egress_mode": "proxy", "cell_nat_egress_names": ["pypi.org", {"name": "*.example.net",
                                                                                     "port": 80}]}
    proc, counts = site("--check", "--diff", "-e", json.dumps(proxy))
    counts = counts.get(LAB + "1", {})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert counts["changed"] > 10 and counts["failed"] == 0, counts
    for role in ("cell_runtime", "cell_nat", "broker", "browser"):
        assert "TASK [chv.fleet.%s : " % role in proc.stdout, role
    # the minimal image lacks the packages: each role reports their install (chv.fleet.package_unresolved);
    # cell_runtime's own task, the others' through the _common role's packages entry point
    for task in ("Install the packages cells need (only those missing",
                 "Install the packages the role needs (only those missing), for chv.fleet.cell_nat",
                 "Install the packages the role needs (only those missing), for chv-broker",
                 "Install the packages the role needs (only those missing), for chv-browser"):
        assert re.search(r"TASK \[chv\.fleet\.\w+ : %s[^\n]*\nchanged: \[lsite1\]" % re.escape(task),
                         proc.stdout), task
    # squid is not there yet (nor its user, unit or configuration): the proxy's install is reported
    blocks = proc.stdout.split("\nTASK [")                                 # a task's output, its diff included
    for task in ("Mask Debian's squid.service", "Install the packages the role needs (only those missing), for "
                 "the egress proxy of chv.fleet.cell_nat", "Create the egress proxy's system user",
                 "Render the egress proxy's configuration and unit"):
        assert [b for b in blocks if re.match(r"chv\.fleet\.\w+ : %s" % re.escape(task), b)
                and "\nchanged: [lsite1]" in b], task
    assert "http_access allow chv_cells chv_name_1 chv_port_80" in proc.stdout       # the diff of squid.conf
    assert traces() == ""


# One case per class of bad input (docs/reliability.md, "Bad input refused
# before any change", lists them): each needle holds the variable's name and
# the bad value as the failure prints them (JSON-escaped). host_vars go into
# a second inventory beside the lab's (for a setting of the other guest).
BAD_INPUT = [
    pytest.param({"chv_cell_properties": ["MemoryMax=1G"]}, None,
                 'chv_cell_properties [\\"MemoryMax=1G\\"]: not a dict', id="wrong-type"),
    pytest.param({"chv_cell_pool": "10.200.0.0/33"}, None,
                 "chv_cell_pool '10.200.0.0/33' is not an IPv4 network", id="invalid-cidr"),
    # the guest's own link (lab_network 10.99.32.0/28, a /30 per guest) as the whole pool
    pytest.param({"chv_cell_pool": "10.99.32.0/30", "chv_cell_prefix": 30, "chv_cell_slots": 1}, None,
                 "chv_cell_pool 10.99.32.0/30 is too small: of its 1 /30 subnets, 0 are held by other slots and "
                 "the rest overlap addresses or routes on this host (10.99.32.0/30 on host0)",
                 id="pool-overlaps-host-routes"),
    # lsite2 (outside --limit) has a pool of its own inside lsite1's (the role default)
    pytest.param({}, {"lsite2": {"chv_cell_pool": "10.200.128.0/17"}},
                 "lsite1: chv_cell_pool 10.200.0.0/16 overlaps lsite2's chv_cell_pool 10.200.128.0/17",
                 id="pool-overlaps-other-host"),
    # the lab's agent user (uid 1000) and the system accounts lie in 500-66035
    pytest.param({"chv_cell_uid_mode": "shared", "chv_cell_shared_uid": 500}, None,
                 "chv_cell_shared_uid 500: with uid_mode shared the cells' UIDs are the host UIDs 500-66035, "
                 "which hold existing accounts (UID/GID ", id="uid-range-overlaps-accounts"),
    pytest.param({"chv_cell_ifname_prefix": "averyveryverylongprefix"}, None,
                 'chv_cell_ifname_prefix \\"averyveryverylongprefix\\" leaves no room for the slot index',
                 id="ifname-prefix-too-long"),
    pytest.param({"chv_cell_drop_capabilities": ["CAP_SYS_ADMINN"]}, None,
                 "chv_cell_drop_capabilities: unknown capability 'CAP_SYS_ADMINN'", id="unknown-capability"),
    pytest.param({"chv_cell_workspace_root": "var/lib/chv-fleet/workspaces"}, None,
                 "chv_cell_workspace_root: 'var/lib/chv-fleet/workspaces' must be an absolute normalised path",
                 id="relative-path"),
    pytest.param({"cell_nat_egress_allow": [{"cidr": "https://pypi.org/simple"}]}, None,
                 "cell_nat_egress_allow[0].cidr: 'https://pypi.org/simple' is neither an IPv4 CIDR nor an address",
                 id="egress-entry-not-cidr"),
    pytest.param({"chv_cell_slots": 3, "chv_cell_pool": "10.200.0.0/23"}, None,
                 "chv_cell_slots 3 is more than chv_cell_pool 10.200.0.0/23 holds: 2 /24 subnets",
                 id="slots-beyond-pool"),
    # /opt holds /opt/chv-browser, which chv_cell_inaccessible hides at /opt/chv-browser only
    pytest.param({"chv_cell_readonly_binds": [{"source": "/opt", "target": "/mnt/opt"}]}, None,
                 'chv_cell_readonly_binds[2]: {\\"source\\": \\"/opt\\", \\"target\\": \\"/mnt/opt\\"} '
                 "would show /opt/chv-browser, hidden by chv_cell_inaccessible, at /mnt/opt/chv-browser",
                 id="bind-exposes-hidden-path"),
    # settings two roles share: a mismatch names both
    pytest.param({"chv_browser_broker_group": "web"}, None,
                 'chv_browser_broker_group=\\"web\\" and chv_broker_group=\\"chv-broker\\"',
                 id="cross-role-conflict"),
    # egress by name (docs/network.md): a name that is an address; one role in proxy mode, the other not
    pytest.param({"cell_nat_egress_names_host": ["pypi.org", "203.0.113.7"]}, None,
                 "cell_nat_egress_names_host[1]: '203.0.113.7' is an IP address, not a name", id="egress-name-ip"),
    pytest.param({"cell_nat_egress_mode": "proxy"}, None,
                 'cell_nat_egress_mode=\\"proxy\\" and chv_cell_egress_mode=\\"cidr\\" must be equal',
                 id="egress-mode-mismatch"),
    # more refusals, not classes of the table's own: a count, a bound, a forbidden argument, a browser
    # path cells could see, every slot's cell at its MemoryMax more than the host's memory (preflight)
    pytest.param({"chv_cell_slots": 0}, None, "chv_cell_slots 0 must be a count >= 1", id="slots-zero"),
    pytest.param({"chv_broker_max_request_bytes": 10}, None, "chv_broker_max_request_bytes must be at least 1024, not 10",
                 id="broker-request-bytes"),
    pytest.param({"chv_browser_pages_per_slot": 0}, None, "chv_browser_pages_per_slot must be at least 1, not 0",
                 id="browser-pages-per-slot"),
    pytest.param({"chv_browser_chromium_args": ["--no-sandbox"]}, None,
                 'chv_browser_chromium_args(_default, _group, _host) (has [\\"--no-sandbox\\"]',
                 id="browser-no-sandbox"),
    pytest.param({"chv_browser_state_dir": "/srv/browser-state"}, None,
                 'must hide chv-browser\'s paths from cells, and lacks [\\"/srv/browser-state\\"]',
                 id="browser-path-visible"),
    pytest.param({"chv_cell_properties": {"MemoryMax": "1T"}}, None,
                 "memory: 2 slots x MemoryMax 1T = 2097152 MiB, more than", id="memory-over-host"),
]


def alone(extra, host_vars):
    """A case that sets a cell pool (or another host's variables) runs on its own: the validation
    reads every targeted host's pool in one run_once task, so one host's bad or overlapping pool
    is every host's failure there. The others share one run (bad_hosts)."""
    return bool(host_vars) or "chv_cell_pool" in extra


def alias(case_id):
    return "bad-" + case_id


@pytest.fixture(scope="module")
def bad_hosts(guest, tmp_path_factory):
    """One site.yml run for every case that runs with others: each case is a host of its own, an
    alias of lsite1 (its address and the lab's variables for it) with the case's bad values as its
    host variables, and the run's failure threshold at 100 % so that every host goes on to its own
    check (with the default 0 the first failing task ends the run for all: tests/integration/
    playbooks, test_site_validation.py). Each host's output is its failure lines and its recap;
    the guest is checked for traces once, after the run. Hosts of one run instead of 16 runs: the
    20 cases cost 64 CPU-seconds on this controller instead of 85 (measured with the lab up)."""
    with open(INVENTORY) as fh:
        lab_hosts = yaml.safe_load(fh)["all"]["children"]["chv_lab_" + LAB]["hosts"]
    hosts = dict((alias(p.id), dict(lab_hosts[LAB + "1"], **p.values[0])) for p in BAD_INPUT if not alone(*p.values[:2]))
    inventory = tmp_path_factory.mktemp("bad-input") / "aliases.yml"
    inventory.write_text(json.dumps({"all": {"children": {"chv_lab_" + LAB: {"hosts": hosts}}}}))
    proc, counts = site("-i", str(inventory), "-e", json.dumps({"chv_fleet_max_fail_percentage": 100}),
                        limit=",".join(hosts))
    return proc, counts, traces()


@pytest.mark.parametrize("extra,host_vars,needle", BAD_INPUT)
def test_bad_value_fails_before_any_change(guest, bad_hosts, tmp_path, extra, host_vars, needle, request):
    if alone(extra, host_vars):
        args = ["-e", json.dumps(extra)]
        if host_vars:
            inventory = tmp_path / "host_vars.yml"
            inventory.write_text(json.dumps({"all": {"hosts": host_vars}}))
            args = ["-i", str(inventory)] + args
        proc, counts = site(*args)
        _refused_before_any_change(proc, counts.get(LAB + "1", {}), needle)
        return
    proc, counts, found = bad_hosts
    name = alias(request.node.callspec.id)
    _refused_before_any_change(proc, counts[name], needle, host=name, found=found)
    assert counts[name]["failed"] == 1, counts


def test_a_tagged_run_checks_every_role_first(guest):
    # --tags cell_nat runs one role, yet a bad value of another role's variable still stops it first
    proc, counts = site("--tags", "cell_nat", "-e", json.dumps({"chv_broker_sync_isolation": "chroot"}))
    _refused_before_any_change(proc, counts.get(LAB + "1", {}), 'chv_broker_sync_isolation \\"chroot\\"')


def _refused_before_any_change(proc, counts, needle, host=None, found=None):
    """The run failed, `host`'s failure lines (every host's by default) name the needle, its
    recap `counts` say changed=0, and the guests have no trace (`found`: read after the run)."""
    assert proc.returncode != 0
    # a failed task, or a failed item of a looped one
    starts = ("fatal: [%s]" % host, "failed: [%s]" % host) if host else ("fatal: ", "failed: ")
    fatal = [m for m in proc.stdout.splitlines() if m.startswith(starts)]
    assert fatal and needle in "\n".join(fatal), proc.stdout[-3000:]
    assert counts.get("changed") == 0, counts
    assert (traces() if found is None else found) == ""


def test_lab_down_leaves_nothing(guest):
    rc, dummy_counts, out = lab("lab_down.yml")
    assert rc == 0, out[-3000:]
    assert lab_traces(LAB) == []
