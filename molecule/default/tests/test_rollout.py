"""site.yml as ops run it over a converged guest: check mode that does not
cry wolf, and a tag that selects one role (docs/operations.md)."""

import json

from conftest import run_converge


def test_check_mode_on_the_converged_guest_reports_no_change(host):
    proc, recap, changed = run_converge(["--check", "--diff"])
    name = host.backend.get_hostname()
    assert recap[name]["failed"] == 0 and recap[name]["changed"] == 0, (changed, proc.stdout[-3000:])


def test_tags_cell_nat_changes_the_ruleset_only(host):
    name = host.backend.get_hostname()
    ruleset = "/etc/chv-fleet/nft/cell-nat.nft"
    deny = {"cell_nat_egress_deny": [{"cidr": "198.51.100.77/32", "comment": "rollout-test"}]}
    try:
        proc, recap, changed = run_converge(["--tags", "cell_nat", "-e", json.dumps(deny)])
        assert recap[name]["changed"] > 0
        # every task that changed belongs to cell_nat (and the ruleset is what changed)
        assert changed and all(t.startswith("chv.fleet.cell_nat : ") for t in changed), changed
        with host.sudo():
            assert "198.51.100.77" in host.file(ruleset).content_string
            assert "198.51.100.77" in host.check_output("nft list table inet chv_cell")
    finally:
        # control: the plain converge takes the deny entry out again, changing cell_nat only
        proc, recap, changed = run_converge(["--tags", "cell_nat"])
    assert all(t.startswith("chv.fleet.cell_nat : ") for t in changed), changed
    with host.sudo():
        assert "198.51.100.77" not in host.file(ruleset).content_string
