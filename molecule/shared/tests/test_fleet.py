"""The fleet scenario: site.yml over three guests of docs/examples/inventory
(guest-a and guest-b bookworm, guest-c trixie) and one guest outside
chv_fleet (build-1). Every other test of this directory verifies the
canary, guest-a; these reach each guest themselves.

Molecule's converge rolled the collection out in two batches (the canary,
then the rest: molecule/fleet/molecule.yml); these tests read what that
rollout left on each guest, inject a health-gate failure into the second of
the default batches (one host each here) of a new rollout, and roll a
broker change out over a busy fleet, which changes nothing else on guest-a
and guest-c (the scenario's idempotence check: it has no idempotence step,
a second converge of every guest that would cost about 3 minutes of
make test; the trixie guest's no-change run is test_faults.py's)."""

import ipaddress
import json
import os
import re
import subprocess

import pytest

from conftest import CONVERGE, SUMMARY_CALLBACKS, fleet_guest, inventory_argv, only_in, run_converge
from playbook_output import batches, changed_tasks
from testpaths import ROOT

pytestmark = only_in("fleet")

SNAPSHOT = os.path.join(ROOT, "tests", "helpers", "host_snapshot.py")
BEFORE = "/root/chv-fleet-before.json"
# docs/examples/inventory: the fleet's denies, the region's and the odd host's additions
FLEET_DENY = ["172.16.0.0/12", "192.168.0.0/16"]
EXPECTED = {
    "guest-a": {"slots": 2, "pool": "10.192.0.0/16", "uplink": "host0", "deny": FLEET_DENY, "memory": "4G"},
    "guest-b": {"slots": 2, "pool": "10.193.0.0/16", "uplink": "host0", "deny": FLEET_DENY, "memory": "4G"},
    "guest-c": {"slots": 3, "pool": "10.194.0.0/16", "uplink": "ens5", "memory": "6G",
                "deny": FLEET_DENY + ["100.64.0.0/10", "198.51.100.128/25"]},
}
DISTRO = {"guest-a": "bookworm", "guest-b": "bookworm", "guest-c": "trixie", "build-1": "bookworm"}


guest = fleet_guest


def snapshot(host):
    with open(SNAPSHOT) as fh:
        script = fh.read()
    with host.sudo():
        return json.loads(host.check_output("python3 - <<'EOF'\n%s\nEOF" % script))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_guest_runs_its_layers_of_the_example_inventory(name):
    want, g = EXPECTED[name], guest(name)
    with g.sudo():
        assert DISTRO[name] in g.check_output("cat /etc/os-release")
        policy = json.loads(g.file("/etc/chv-fleet/cell-policy.json").content_string)
        ledger = json.loads(g.file("/var/lib/chv-fleet/identities.json").content_string)
        ruleset = g.check_output("nft -j list table inet chv_cell")
        rendered = g.file("/etc/chv-fleet/nft/cell-nat.nft").content_string
        cell = g.run("chv-cell run -- ip -4 -o addr show scope global")
    # slots from the host's layer (guest-c) or the fleet's; subnets from chv.fleet.host_pool by the host's index
    assert len(policy["slots"]) == want["slots"], policy["slots"]
    pool = ipaddress.ip_network(want["pool"])
    assert all(ipaddress.ip_network(s["subnet"]).subnet_of(pool) for s in policy["slots"]), policy["slots"]
    assert ledger["pool"] == want["pool"], ledger
    assert sorted(s["subnet"] for s in policy["slots"]) == sorted(s["subnet"] for s in ledger["slots"].values())
    # unit properties layered key by key: the fleet's CPUQuota on every guest, memory from the region and host
    props = policy["properties"]
    assert (props["CPUQuota"], props["MemoryMax"], str(props["TasksMax"])) == ("150%", want["memory"], "1024"), props
    # the ruleset: every deny of the fleet, the region and the host, and NAT out of the host's uplink
    # (the operator's deny set only: the special-purpose ranges, 100.64.0.0/10 among them, are in a set of
    # their own on every guest, denied by default)
    deny_set = json.dumps([e["set"].get("elem", []) for e in json.loads(ruleset)["nftables"]
                           if "set" in e and e["set"]["name"] == "deny_nets"])
    for cidr in EXPECTED["guest-c"]["deny"]:
        net = ipaddress.ip_network(cidr)
        assert (cidr in want["deny"]) == (str(net.network_address) in deny_set), (name, cidr, deny_set)
        rendered_deny = rendered.split("set deny_nets {", 1)[1].split("}", 1)[0]
        assert (cidr in want["deny"]) == (cidr in rendered_deny), (name, cidr, rendered_deny)
    uplinks = [e["set"]["elem"] for e in json.loads(ruleset)["nftables"]
               if "set" in e and e["set"]["name"] == "uplink_ifs"]
    assert uplinks == [[want["uplink"]]] and "# Uplink: %s " % want["uplink"] in rendered, (uplinks, rendered[:300])
    # a real cell of this guest runs, with an address of the guest's pool
    assert cell.rc == 0, cell
    address = re.search(r"inet (\S+)/", cell.stdout).group(1)
    assert ipaddress.ip_address(address) in pool, cell.stdout


def test_a_health_gate_failure_in_the_second_batch_stops_the_rollout_before_the_third():
    """guest-b's broker stopped (its unit files are the role's, in /etc, which
    systemctl mask cannot cover; no role runs to start it again): a rollout with the default batches
    (--tags health_gate: the checks and the gate, no role) passes the canary,
    fails guest-b in the second batch, naming the check, and never reaches
    guest-c; build-1 is not part of it. (Molecule's converge ran the same
    gates over both of its batches with the broker up.)"""
    b = guest("guest-b")
    with b.sudo():
        b.run_expect([0], "systemctl stop chv-broker.socket chv-broker.service")
        try:
            proc = run_converge(["--tags", "health_gate"], expect_ok=False, whole=True)[0]
        finally:
            b.run_expect([0], "systemctl start chv-broker.socket")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert batches(out) == [["guest-a"], ["guest-b"]], out[-4000:]
    assert "guest-a: healthy (" in out, out[-4000:]
    failure = re.search(r"guest-b failed the health gate, so the rollout stops before the next batch: (.*)", out)
    assert failure and "unit chv-broker.socket" in failure.group(1) and "broker ping" in failure.group(1), out[-4000:]
    deployed = out.split("PLAY [Deploy chv.fleet cells]", 1)[1]
    assert "[guest-c]" not in deployed and "[build-1]" not in deployed, deployed[-4000:]
    # control: with guest-b's broker back, the gate's own command on guest-b (as site.yml runs it) passes
    with b.sudo():
        gate = b.run("chv-cell health --broker-client /usr/lib/chv-fleet/chv_guest/broker/client.py "
                     "--unit chv-cell-nat.service --unit chv-broker.socket --unit chv-browser.service")
    assert gate.rc == 0 and "broker ping" in gate.stdout, gate


BUSY_UNIT = "chv-molecule-busy"
BUSY_RC = "/run/chv-molecule-busy.rc"


def overlay(tmp_path, hosts):
    """An inventory source given after the scenario's: per host variables
    that outrank its own (Ansible's last source wins)."""
    path = tmp_path / "overlay.yml"
    path.write_text(json.dumps({"all": {"hosts": hosts}}))
    return ["-i", str(path)]


# what a change of one chv-broker setting changes on a converged guest, and nothing else
BROKER_CHANGE = {
    "chv.fleet._common : Cordon the host (new cells refused, running ones untouched) before restarting chv-broker "
    "(its code, configuration or units change)",
    "chv.fleet._common : Record that the service must restart (kept until it has), for chv-broker",
    "chv.fleet._common : Render the configuration of chv-broker",
    "chv.fleet.broker : Restart chv-broker",
    "Uncordon the host a rollout cordoned",
}


def test_a_broker_change_rolls_out_over_a_busy_fleet_past_an_unreachable_guest(tmp_path):
    """A cell runs on guest-a and on guest-c (an agent that finishes when
    the test tells it to, through a file in its workspace); guest-b, the
    second of the default batches, is unreachable (its SSH port made a
    closed one). A broker change (a configuration value) rolls out with an
    allowance for one unreachable host: guest-b is reported and skipped; on
    guest-a, then guest-c, the drain cordons the guest and prints a progress
    line naming the running cell; only then is the cell told to finish, and
    it ends by itself with its own exit status 0; the broker restarts after
    it, the gate passes, the guest is uncordoned; the run succeeds and ends
    with one line per host (the fleet_summary callback). On guest-a and
    guest-c the run changes exactly what the broker's change needs (the
    scenario's idempotence check: a second converge of the fleet's canary
    and its odd host)."""
    busy = ["guest-a", "guest-c"]
    workspace, invocation = {}, {}
    for name in busy:
        g = guest(name)
        with g.sudo():
            slot = g.check_output("chv-cell status | awk 'NR==1 {print $1}'")
            workspace[name] = "/var/lib/chv-fleet/workspaces/%s" % slot
            g.run_expect([0], "rm -f %s %s/.busy-go; systemd-run --unit=%s --collect sh -c 'chv-cell run --slot %s -- "
                              "sh -c \"until test -e /workspace/.busy-go; do sleep 0.5; done\"; echo $? > %s'",
                         BUSY_RC, workspace[name], BUSY_UNIT, slot, BUSY_RC)
            g.run_expect([0], "for i in $(seq 100); do chv-cell status | grep -q '^%s .*running pid=' && exit 0; "
                              "sleep 0.1; done; exit 1", slot)
            invocation[name] = g.check_output("systemctl show -P InvocationID chv-broker.socket chv-broker.service")
    argv = (["ansible-playbook"] + inventory_argv(True) + [str(CONVERGE)]
            + overlay(tmp_path, {"guest-b": {"ansible_port": 1}})
            + ["-e", json.dumps({"chv_broker_read_timeout": 31, "chv_fleet_max_unreachable_percentage": 50})])
    try:
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, ANSIBLE_CALLBACKS_ENABLED=SUMMARY_CALLBACKS))
        lines, told = [], set()
        for line in run.stdout:
            lines.append(line)
            for name in busy:
                # the drain's progress line per look names the running cell: then the agent is told to finish
                if name not in told and re.match(r"ok: \[%s\] => \(item=waiting for 1 cell\(s\): slot\d+ \(pid \d+, "
                                                 r"running .*\); cordoned \(look \d+, every 5 s" % name, line):
                    with guest(name).sudo():
                        assert guest(name).file("/run/chv-fleet/cordon").exists
                        guest(name).run_expect([0], "touch %s/.busy-go", workspace[name])
                    told.add(name)
        out = "".join(lines)
        assert run.wait(timeout=900) == 0, out[-5000:]
        assert told == set(busy), out[-5000:]
        assert re.search(r"guest-b: unreachable \(.*\); skipped, nothing changed", out), out[-5000:]
        # the reached guests' batches: guest-b in none; a banner for each
        assert batches(out) == [["guest-a"], ["guest-c"]], out[-5000:]
        assert "(item=batch 1 of 2 (1 of 2 hosts): guest-a)" in out and \
            "(item=batch 2 of 2 (1 of 2 hosts): guest-c)" in out, out[-5000:]
        for name in busy:
            g = guest(name)
            with g.sudo():
                # the cell ended by itself, with its payload's status; the broker restarted after it
                assert g.check_output("cat %s", BUSY_RC) == "0"
                assert g.check_output("systemctl show -P InvocationID chv-broker.socket chv-broker.service") \
                    != invocation[name]
                assert json.loads(g.file("/etc/chv-fleet/broker.json").content_string)["read_timeout"] == 31
                assert not g.file("/run/chv-fleet/cordon").exists  # uncordoned after the gate
        # the rollout changed the broker's configuration and what its restart needs, nothing else: the
        # fleet's idempotence check (the scenario has no idempotence step: this run is its second converge
        # of guest-a and guest-c, each a no-change run but for the one value)
        changed = changed_tasks(out)
        for name in busy:
            assert set(changed.get(name, [])) == BROKER_CHANGE, (name, changed.get(name))
        summary = out.split("CHV.FLEET SUMMARY", 1)[1]
        assert re.search(r"^guest-b: unreachable, skipped, changed=0$", summary, re.M), summary
        for name, batch in (("guest-a", "1 of 2"), ("guest-c", "2 of 2")):
            line = re.search(r"^%s: ok, changed=\d+, batch: %s, path: full .*, drain: .*waiting for 1 cell.*gate: .*" % (name, batch),
                             summary, re.M)
            assert line and "healthy" in line.group(0), summary
    finally:
        for name in busy:
            with guest(name).sudo():
                guest(name).run("touch %s/.busy-go; sleep 1; systemctl stop %s; rm -f %s/.busy-go; chv-cell uncordon",
                                workspace[name], BUSY_UNIT, workspace[name])
        # guest-a and guest-c keep the rollout's broker setting (read_timeout 31): no later test reads it, and
        # a converge to put it back cost make test's longest lane a minute


def test_a_bad_value_on_the_last_guest_stops_the_run_before_the_canary_changes(tmp_path):
    """guest-c, the last guest of the last batch, has a value of the wrong
    type: the run fails in the validation play naming it, and the canary
    guest-a is as before: a snapshot of its files, units, users, tables and
    sysctls, and the contents of the collection's configuration, the
    launcher and its ruleset; control: the snapshot tells a change from none
    (the same comparison after a file is added). Run with ANSIBLE_STRATEGY=free:
    site.yml's plays pin strategy linear (under free, ansible-core ignores the
    validation play's max_fail_percentage with a warning, and guest-a and
    guest-b were converged: measured before the pin, docs/operations.md)."""
    a = guest("guest-a")
    digest = ("find /etc/chv-fleet /usr/local/bin/chv-cell /usr/lib/chv-fleet -type f -exec sha256sum {} + | sort; "
              "nft -s list table inet chv_cell | sha256sum; systemctl show -P InvocationID chv-broker.socket")
    with a.sudo():
        contents = a.check_output(digest)
    before = snapshot(a)
    proc = run_converge(overlay(tmp_path, {"guest-c": {"chv_cell_claim_timeout": "soon"}}),
                        expect_ok=False, whole=True, env={"ANSIBLE_STRATEGY": "free"})[0]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "with the free strategy is not supported" not in out, out[-4000:]
    failed = re.findall(r"^fatal: \[([\w-]+)\]: FAILED! => (.*)$", out, re.M)
    assert [h for h, _ in failed] == ["guest-c"] and "chv_cell_claim_timeout" in failed[0][1], failed
    assert "PLAY [Deploy chv.fleet cells]" not in out and batches(out) == [], out[-4000:]
    assert snapshot(a) == before
    with a.sudo():
        assert a.check_output(digest) == contents
        a.run_expect([0], "cp -p /etc/chv-fleet/cell-policy.json /etc/chv-fleet/.snapshot-control")
        try:
            assert snapshot(a) != before  # control: the snapshot sees a new file
        finally:
            a.run_expect([0], "rm -f /etc/chv-fleet/.snapshot-control")


def test_a_host_outside_chv_fleet_is_left_as_it_was():
    """build-1 is in the inventory, outside chv_fleet: after the converge and
    the rollouts above it is as before the first converge."""
    b1 = guest("build-1")
    with b1.sudo():
        before = json.loads(b1.file(BEFORE).content_string)
        assert not b1.file("/etc/chv-fleet").exists and not b1.file("/usr/local/bin/chv-cell").exists
        assert b1.run("nft list table inet chv_cell").rc != 0
    after = snapshot(b1)
    assert sorted((set(after["files"]) ^ set(before["files"])) - {BEFORE}) == []
    for key in ("units", "users", "groups", "nft_tables", "sysctls"):
        assert after[key] == before[key], (key, before[key], after[key])
    # control: the same comparison on a fleet guest finds the collection's files, table and units
    b = guest("guest-b")
    with b.sudo():
        b_before = json.loads(b.file(BEFORE).content_string)
    b_after = snapshot(b)
    assert "/etc/chv-fleet/cell-policy.json" in set(b_after["files"]) - set(b_before["files"])
    assert b_after["nft_tables"] != b_before["nft_tables"] and b_after["units"] != b_before["units"]
