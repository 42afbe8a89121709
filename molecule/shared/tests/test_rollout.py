"""site.yml as ops run it over a converged guest: check mode that does not
cry wolf, a tag that selects one role, and the drain that holds a code
change of the broker back until running cells end (docs/operations.md)."""

import json
import subprocess

from conftest import OutsideHTTP, lab_guest, only_in, roles_argv, run_converge, run_roles

GATE_PORT = 18751


@only_in("trixie")
def test_check_mode_on_the_converged_guest_reports_no_change(host):
    # every role's tasks in check mode (the fast path would skip them on this guest: test_faults.py covers it)
    proc, recap, changed = run_converge(["--check", "--diff", "-e", "chv_fleet_full_converge=true"])
    name = host.backend.get_hostname()
    assert recap[name]["failed"] == 0 and recap[name]["changed"] == 0, (changed, proc.stdout[-3000:])


@only_in("trixie")  # distribution-independent; trixie's lane ends before the fleet's (make test's budget)
def test_tags_cell_nat_and_configure_change_the_ruleset_only_and_host_denies_extend_the_fleet(host):
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
        # control: a --tags configure run (every role's configure phase) takes the deny entry out again,
        # changing the ruleset only; the gate then fails the host, because the destination it was told
        # to see refused answers
        proc, recap, changed = run_converge(["--tags", "configure", "-e",
                                             json.dumps({"chv_fleet_health_deny": [target]})], expect_ok=False)
        server.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and recap[name]["failed"] == 1, out[-3000:]
    assert "%s failed the health gate, so the rollout stops before the next batch" % name in out, out[-3000:]
    assert "refused %s: connected" % target in out, out[-3000:]
    assert changed and all(t.startswith("chv.fleet.cell_nat : ") for t in changed), changed
    assert "chv.fleet.cell_nat : Render the cell NAT rulesets and the forwarding settings" in changed, changed
    # the configure phase of the other roles ran too, and found nothing to change
    ran = set(line.split("[", 1)[1].rsplit("]", 1)[0] for line in proc.stdout.splitlines() if line.startswith("TASK ["))
    assert {"chv.fleet.cell_runtime : Allocate the slot identities",
            "chv.fleet._common : Render the configuration of chv-broker",
            "chv.fleet._common : Render the configuration of chv-browser"} <= ran, sorted(ran)
    assert not [t for t in ran if "Install the packages" in t or "Install Playwright" in t], sorted(ran)
    with host.sudo():
        assert "198.51.100.7" not in host.file(ruleset).content_string


@only_in("trixie")  # distribution-independent; the fleet's lane is make test's longest (its budget)
def test_a_broker_code_change_waits_for_running_cells_and_a_short_bound_changes_nothing(host):
    """While a cell runs: a broker configuration change with a bound shorter than the cell
    fails the host as not drained, the configuration as it was. Then the guest's copy of a
    broker module is made to differ from the role's (a code change to roll out): with the
    short bound, the host fails as not drained and the code and the service are as they
    were; with a long bound, the run waits and changes the code only after the cell has
    ended (its last act is to write the time)."""
    module = "/usr/lib/chv-fleet/chv_guest/broker/server.py"
    ended = "/run/chv-molecule-drain-ended"
    # the cell's payload waits for a trigger file the guest drops into its workspace
    cell = ("systemd-run --unit=chv-molecule-drain --collect sh -c "
            "'chv-cell run --slot %s -- sh -c \"until test -e /workspace/.drain-go; do sleep 0.2; done\"; "
            "date +%%s.%%N > %s'")
    with host.sudo():
        slot = host.check_output("chv-cell status | awk 'NR==1 {print $1}'")
        workspace = "/var/lib/chv-fleet/workspaces/%s" % slot

        def start_cell():
            host.run("rm -f %s/.drain-go %s", workspace, ended)
            host.run_expect([0], cell % (slot, ended))
            host.run_expect([0], "for i in $(seq 100); do chv-cell status | grep -q '^%s .*running pid=' && exit 0; "
                                 "sleep 0.1; done; exit 1", slot)

        config = host.check_output("sha256sum /etc/chv-fleet/broker.json")
        invocation = host.check_output("systemctl show -P InvocationID chv-broker.socket chv-broker.service")
        # the converge's sync allow-list (molecule/shared/converge.yml sets it for the doors tests)
        as_converged = {"chv_broker_sync_hosts": json.loads(host.file("/etc/chv-fleet/broker.json").content_string)
                        ["sync"]["hosts"], "chv_fleet_drain_timeout": 2}
        start_cell()
        try:
            # control: with nothing to change, a run does not wait for the running cell (short bound, success)
            run_roles(["chv.fleet.broker"], as_converged)
            # a configuration change alone (the code as the role's) is held back
            short = run_roles(["chv.fleet.broker"], dict(as_converged, chv_broker_read_timeout=29), expect_ok=False)
            out = short.stdout + short.stderr
            assert short.returncode != 0 and "did not drain within chv_fleet_drain_timeout=2 s" in out, out[-3000:]
            assert host.check_output("sha256sum /etc/chv-fleet/broker.json") == config
            host.run_expect([0], "echo '# a code change to roll out' >> %s", module)
            drifted = host.check_output("sha256sum %s", module)
            short = run_roles(["chv.fleet.broker"], {"chv_fleet_drain_timeout": 2}, expect_ok=False)
            out = short.stdout + short.stderr
            assert short.returncode != 0, out[-3000:]
            assert "did not drain within chv_fleet_drain_timeout=2 s: waiting for 1 cell(s): %s (pid " % slot in out, \
                out[-3000:]
            # the drain cordoned the host, and uncordoned it again when it did not drain
            assert "(the host is uncordoned again)" in out, out[-3000:]
            assert not host.file("/run/chv-fleet/cordon").exists
            assert "restarting chv-broker (its code, configuration or units change) held back, nothing of it done" \
                in out, out[-3000:]
            # left as it was: the code and configuration, and the broker's socket and service not restarted
            assert host.check_output("sha256sum %s", module) == drifted
            assert host.check_output("sha256sum /etc/chv-fleet/broker.json") == config
            assert host.check_output("systemctl show -P InvocationID chv-broker.socket chv-broker.service") == \
                invocation
            # a long bound: the run waits (polling) while the cell runs, and the cell ends only when told
            waiting = subprocess.Popen(roles_argv(["chv.fleet.broker"], {"chv_fleet_drain_timeout": 300}),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            for line in waiting.stdout:
                lines.append(line)
                # the drain's progress line per look names the running slot
                if "(item=waiting for 1 cell(s): %s (pid " % slot in line:
                    break
            assert host.check_output("sha256sum %s", module) == drifted, "changed before the cell ended"
            host.run_expect([0], "touch %s/.drain-go", workspace)
            lines += waiting.stdout.readlines()
            assert waiting.wait(timeout=600) == 0, "".join(lines)[-3000:]
            # the roles alone (no site.yml gate play, which uncordons after its gate): still cordoned,
            # as a run killed before its gate leaves the host
            assert host.file("/run/chv-fleet/cordon").exists
            assert json.loads(host.file("/run/chv-fleet/cordon").content_string)["rollout"] is True
            # the next rollout's passed gate lifts a rollout's cordon (with nothing to drain for)
            gate = run_converge(["--tags", "health_gate"])[0]
            assert not host.file("/run/chv-fleet/cordon").exists, (gate.stdout + gate.stderr)[-3000:]
        finally:
            host.run("touch %s/.drain-go; sleep 1; systemctl stop chv-molecule-drain; rm -f %s/.drain-go; "
                     "chv-cell uncordon", workspace, workspace)
        cell_ended = float(host.check_output("cat %s", ended))
        changed_at = float(host.check_output("stat -c %%.9Y %s", module))
        assert host.check_output("sha256sum %s", module) != drifted
        assert changed_at > cell_ended, (changed_at, cell_ended)
