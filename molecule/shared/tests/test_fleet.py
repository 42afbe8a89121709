"""The fleet scenario: site.yml over three guests of docs/examples/inventory
(guest-a and guest-b bookworm, guest-c trixie) and one guest outside
chv_fleet (build-1). Every other test of this directory verifies the
canary, guest-a; these reach each guest themselves.

Molecule's converge rolled the collection out in two batches (the canary,
then the rest: molecule/fleet/molecule.yml) and its idempotence step re-ran
it over the whole fleet with changed=0 on every guest; these tests read what
that rollout left on each guest, then inject a health-gate failure into the
second of the default batches (one host each here) of a new rollout."""

import ipaddress
import json
import os
import re

import pytest

from conftest import fleet_guest, only_in, run_converge
from playbook_output import batches
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
    guest-c; build-1 is not part of it. (Molecule's converge and idempotence
    ran the same gates over all three batches with the broker up.)"""
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


def test_a_host_outside_chv_fleet_is_left_as_it_was():
    """build-1 is in the inventory, outside chv_fleet: after the converge, the
    idempotence run and the rollouts above it is as before the first converge."""
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
