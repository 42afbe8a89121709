"""site.yml as ops run it over a converged guest: check mode that does not
cry wolf, and a tag that selects one role (docs/operations.md)."""

import json

import pytest

from conftest import OutsideHTTP, lab_guest, only_in, run_converge

GATE_PORT = 18751


@only_in("trixie")
def test_check_mode_on_the_converged_guest_reports_no_change(host):
    proc, recap, changed = run_converge(["--check", "--diff"])
    name = host.backend.get_hostname()
    assert recap[name]["failed"] == 0 and recap[name]["changed"] == 0, (changed, proc.stdout[-3000:])


@only_in("trixie")
def test_tags_cell_nat_changes_the_ruleset_only_and_host_denies_extend_the_fleet(host):
    """Also the health gate, on the same two runs: healthy with an allowed
    destination that answers; failing the host, named, when a destination
    it must refuse connects (site.yml's post_tasks)."""
    name = host.backend.get_hostname()
    ruleset = "/etc/chv-fleet/nft/cell-nat.nft"
    address = lab_guest(host)["host_address"]
    target = "%s:%d" % (address, GATE_PORT)
    server = OutsideHTTP(address, GATE_PORT, {})
    # a host's deny entry extends the fleet's (layered), it does not replace it
    deny = {"cell_nat_egress_deny": [{"cidr": "198.51.100.77/32", "comment": "rollout-test"}],
            "cell_nat_egress_deny_host": [{"cidr": "198.51.100.78/32", "comment": "rollout-test host"}],
            "chv_fleet_health_allow": [target]}
    try:
        proc, recap, changed = run_converge(["--tags", "cell_nat", "-e", json.dumps(deny)])
        assert recap[name]["changed"] > 0
        # every task that changed belongs to cell_nat (and the ruleset is what changed)
        assert changed and all(t.startswith("chv.fleet.cell_nat : ") for t in changed), changed
        assert "%s: healthy (" % name in proc.stdout, proc.stdout[-3000:]
        with host.sudo():
            loaded = host.check_output("nft list table inet chv_cell")
            for addr in ("198.51.100.77", "198.51.100.78"):
                assert addr in host.file(ruleset).content_string and addr in loaded, addr
    finally:
        # control: the plain converge takes the deny entry out again, changing cell_nat only; the gate
        # then fails the host, because the destination it was told to see refused answers
        proc, recap, changed = run_converge(["--tags", "cell_nat", "-e",
                                             json.dumps({"chv_fleet_health_deny": [target]})], expect_ok=False)
        server.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and recap[name]["failed"] == 1, out[-3000:]
    assert "%s failed the health gate, so the rollout stops before the next batch" % name in out, out[-3000:]
    assert "refused %s: connected" % target in out, out[-3000:]
    assert changed and all(t.startswith("chv.fleet.cell_nat : ") for t in changed), changed
    with host.sudo():
        assert "198.51.100.7" not in host.file(ruleset).content_string
