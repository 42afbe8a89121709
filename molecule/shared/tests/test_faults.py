"""Faults a converged guest must survive (issue 15; docs/reliability.md).

Each fault is followed by the proof that the boundary held: `chv-cell
health` starts a real cell that pings the broker (its control: the cell ran
and its door answers) and must have its connections to the guest's sshd and
to its gateway dropped by the ruleset (the drop counters move). Where the
launcher refuses to start the cell instead, that refusal is the proof, and
its message must be the launcher's fail-closed check.

- /run full while a cell takes screenshots: chv-browser replies an error
  naming the lack of space, the same cell's next snapshot works, the
  collection's units stay active and cells run isolated afterwards;
- the distribution's nftables.service restarted (its /etc/nftables.conf
  starts with `flush ruleset`): while the table is gone the launcher refuses
  every cell; chv-cell-nat.service (PartOf=nftables.service) puts it back
  (and its check runs however often it is started);
- the guest rebooted: the ledger is as it was, the ruleset and the
  forwarding sysctl are in force before sshd accepts a login (before any
  executor can start a cell), broker and browser answer, cells run, all
  without Ansible;
- converges SIGKILLed early (while the ledger module runs), in the middle of
  cell_nat (after the ruleset file was written, before its reload; a
  `--tags cell_nat` run) and during the handlers (chv-broker's restart; a
  `--tags broker` run): in between, no cell starts
  unisolated; the next converge completes, loads the ruleset the file holds
  and restarts chv-broker if the killed run did not; the one after takes the
  fast path (at most 20 module runs, changed=0; chv.fleet.metrics on, its
  collector run in between), and after a file of the
  roles is removed and a unit stopped the next run takes the full path and
  repairs exactly those two; the ledger is byte for byte the same
  throughout. Those last three converges also switch the guest to proxy
  mode (egress by name, issue 33; the variables of
  tests/helpers/proxy_guests.py): the repairing one is thus a full converge
  in proxy mode that changes nothing else, and test_proxy_mode.py audits
  the guest in that mode afterwards.

They run after every other test but those that end the guest further
(ends_the_guest, order 0): the reboot empties /run and the converges leave a
deny entry and a broker setting of their own.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

import proxy_guests
from conftest import CLIENT, CONVERGE, LAB_ROOT, OutsideHTTP, html, inventory_argv, lab_guest, lab_record, \
    only_in, run_converge, unit_value

# before the other tests that end the guest (test_doors.py releases a slot; these need both slots
# and the ledger as converged)
pytestmark = [only_in("trixie"), pytest.mark.ends_the_guest(order=0)]

LEDGER = "/var/lib/chv-fleet/identities.json"
RULESET = "/etc/chv-fleet/nft/cell-nat.nft"
LOADED = "/run/chv-cell-nat/loaded.sha256"  # what chv-cell-nat.service loaded (sha256sum lines)
PORT = 18760
FILLER = "/run/chv-faults-filler"
MARKER = "/run/chv-fleet/chv-broker.restart-pending"  # a restart of chv-broker owed (roles/broker/vars/main.yml)
# what a converge changes after the sudoers drop-in was removed and the tasks' timer stopped
REPAIRED = {"chv.fleet.cell_runtime : Let the agent group run cells through sudo (exactly chv-cell-agent), render the "
            "cell policy, install the warm cells' units",
            "chv.fleet.cell_runtime : Enable and start the timer that tears down expired tasks"}


def health(host):
    """chv-cell health from a real cell. Returns (ran, checks by name, the report)."""
    address = lab_guest(host)["address"]
    with host.sudo():
        r = host.run("chv-cell health --json --timeout 60 --unit chv-cell-nat.service --broker-client %s "
                     "--deny %s:22", CLIENT, address)
    try:
        body = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(r)
    checks = {c["check"]: c for c in body["checks"]}
    return checks["cell runs"]["ok"], checks, body


def assert_isolated_or_refused(host, when):
    """The cell either ran with every refusal in force (and its broker ping as
    the control), or the launcher refused to start it (fail closed)."""
    ran, checks, body = health(host)
    if not ran:
        assert "refusing to start the cell" in checks["cell runs"]["detail"], (when, body)
        return "refused"
    refused = [c for name, c in checks.items() if name.startswith("refused")]
    assert checks["broker ping"]["ok"], (when, body)
    assert len(refused) >= 3 and all(c["ok"] for c in refused), (when, body)
    return "isolated"


def sha256(host, path):
    with host.sudo():
        return host.check_output("sha256sum %s", path).split()[0]


@pytest.fixture(scope="module")
def page(host):
    server = OutsideHTTP(lab_guest(host)["host_address"], PORT,
                         {"/": (200, {}, html("Faults page", "<h1>faults</h1>"), 0)})
    yield server.url + "/"
    server.close()


def test_run_full_screenshot_fails_with_an_error_and_the_guest_keeps_working(host, slots, page):
    slot = slots[0]
    go = "/var/lib/chv-fleet/workspaces/%s/.faults-go" % slot
    out = "/root/chv-faults-shots.out"

    def req(body):
        return "python3 %s '%s'; echo" % (CLIENT, json.dumps(body))

    # one cell: open the page and take a screenshot (the control), wait until the guest has filled
    # /run, then a screenshot (must fail) and a snapshot of the same page (must work)
    script = "; ".join([
        req({"op": "browser", "action": "open", "url": page}),
        req({"op": "browser", "action": "screenshot", "name": "before"}),
        "until test -e /workspace/.faults-go; do sleep 0.1; done",
        req({"op": "browser", "action": "screenshot", "name": "full"}),
        req({"op": "browser", "action": "snapshot"}),
        # what the cell's screenshot directory holds at the end of its run (the run's end removes it)
        "for f in $(ls -A /run/chv/shots); do echo shot: $f; done"])
    with host.sudo():
        size = host.check_output("findmnt -no SIZE -b /run")
        host.run("systemctl stop chv-faults-shots")  # none, unless an earlier run of this test was cut short
        host.run_expect([0], "rm -f %s %s", go, out)
        host.run_expect([0], "systemd-run --unit=chv-faults-shots --collect sh -c %s",
                             "chv-cell run --slot %s -- sh -c '%s' > %s 2>&1" % (slot, script.replace("'", "'\\''"), out))
        host.run_expect([0], "for i in $(seq 300); do test $(grep -c '^{' %s 2>/dev/null || echo 0) -ge 2 && exit 0; "
                             "sleep 0.1; done; exit 1", out)
        try:
            # /run shrunk to what it holds and 256 KiB, then filled to the last block
            used = int(host.check_output("df --output=used -B1 /run | tail -1"))
            host.run_expect([0], "mount -o remount,size=%s /run", str(used + 256 * 1024))
            # filled until one more block does not fit: a file of the guest's own removed from /run
            # meanwhile frees blocks the first fill could not take
            host.run_expect([0], "for i in $(seq 20); do dd if=/dev/zero of=%s bs=4k oflag=append conv=notrunc "
                                 "2>/dev/null; dd if=/dev/zero of=%s.more bs=4k count=1 2>/dev/null || exit 0; "
                                 "rm -f %s.more; sleep 0.2; done; exit 1", FILLER, FILLER, FILLER)
            host.run_expect([0], "touch %s", go)
            host.run_expect([0], "for i in $(seq 300); do systemctl is-active -q chv-faults-shots || exit 0; "
                                 "sleep 0.1; done; exit 1")
            # the guest keeps working: every unit of the collection is still active (other units of the
            # guest may fail while /run is full: listed, not asserted; their failures are reset below)
            failed = host.check_output("systemctl list-units --failed --no-legend --plain | awk '{print $1}'")
            for unit in ("chv-cell-nat.service", "chv-broker.socket", "chv-browser.socket", "chv-browser.service"):
                assert host.service(unit).is_running, (unit, failed)
            print("units failed while /run was full: %s" % (failed.split() or "none"))
        finally:
            host.run("rm -f %s %s.more %s", FILLER, FILLER, go)
            host.run_expect([0], "mount -o remount,size=%s /run", size)
            host.run("systemctl reset-failed")
        lines = host.check_output("cat %s", out).splitlines()
        replies = [json.loads(line) for line in lines if line.startswith("{")]
        shots = [line.split(" ", 1)[1] for line in lines if line.startswith("shot: ")]
        left = host.check_output("ls -A /run/chv-shots/%s", slot).split()
    assert len(replies) == 4, replies
    opened, before, full, snapshot = replies
    assert opened["ok"] and before["ok"] and before["result"]["bytes"] > 0, replies
    assert not full["ok"] and "no space" in full["error"].lower(), full
    assert snapshot["ok"] and snapshot["result"]["title"] == "Faults page", snapshot
    assert "before.png" in shots and not [s for s in shots if s.startswith(".") or s.startswith("full")], shots
    assert left == [], left  # the run's end removed the slot's screenshots
    assert assert_isolated_or_refused(host, "after /run was full") == "isolated"


def test_nftables_restart_with_the_distribution_config_refuses_cells_until_the_table_is_back(host):
    with host.sudo():
        # the distribution's own configuration, as shipped: it flushes the whole ruleset
        assert host.check_output("grep -c '^flush ruleset' /etc/nftables.conf") == "1"
        assert host.run("dpkg --verify nftables").stdout.strip() == ""
        loaded = host.check_output("nft -s list table inet chv_cell")
        # chv-cell-nat-check.service: passes on the table as loaded, fails on a changed or missing one
        host.run_expect([0], "systemctl start chv-cell-nat-check.service")
        host.run_expect([0], "nft insert rule inet chv_cell forward accept")
        host.run_expect([1], "systemctl start chv-cell-nat-check.service")
        host.run_expect([0], "systemctl reload chv-cell-nat.service")
        host.run_expect([0], "systemctl start chv-cell-nat-check.service")
        host.run_expect([0], "nft flush ruleset")  # what the restart does first
        host.run_expect([1], "systemctl start chv-cell-nat-check.service")
        assert host.check_output("systemctl is-failed chv-cell-nat-check.service || true") == "failed"
        assert "table inet chv_cell is missing or differs" in host.check_output(
            "journalctl -u chv-cell-nat-check.service -n 5 --no-pager -o cat")
        refused = assert_isolated_or_refused(host, "the table flushed")
        host.run_expect([0], "systemctl restart nftables.service")
        host.run_expect([0], "for i in $(seq 100); do nft list table inet chv_cell >/dev/null 2>&1 && "
                             "systemctl is-active -q chv-cell-nat.service && exit 0; sleep 0.1; done; exit 1")
        assert host.check_output("nft -s list table inet chv_cell") == loaded
        assert host.check_output("nft list tables").split("\n") == ["table inet filter", "table inet chv_cell"]
        host.run_expect([0], "systemctl start chv-cell-nat-check.service")
        # the check runs however often it is started: six times more within 10 s (systemd's default
        # start limit, 5 in 10 s, refused the check on a fast guest: no look at the table, a false alarm)
        host.run_expect([0], "for i in $(seq 6); do systemctl start chv-cell-nat-check.service || exit 1; done")
    assert refused == "refused"
    assert assert_isolated_or_refused(host, "after nftables.service restarted") == "isolated"


def test_a_reboot_keeps_the_ledger_and_restores_the_boundary_before_sshd_without_ansible(host):
    guest = lab_guest(host)
    record = lab_record()
    ledger = sha256(host, LEDGER)
    args = {"name": guest["name"], "lab": record["lab"], "lab_dir": str(LAB_ROOT / record["lab"]),
            "state": "rebooted", "address": guest["address"], "host_address": guest["host_address"],
            "ifname": guest["ifname"], "prefixlen": guest["prefixlen"]}
    proc = subprocess.run(["ansible", "localhost", "-m", "chv.fleet_lab.lab_guest", "-a", json.dumps(args)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "CHANGED" in proc.stdout, proc.stdout + proc.stderr
    with host.sudo():
        host.run_expect([0], "for i in $(seq 300); do s=$(systemctl is-system-running); "
                             "test \"$s\" = running -o \"$s\" = degraded && exit 0; sleep 0.1; done; exit 1")
        assert host.check_output("systemctl is-system-running") == "running"
        assert host.check_output("cat /proc/sys/net/ipv4/ip_forward") == "1"
        units = ("chv-cell-nat.service", "systemd-sysctl.service", "ssh.service")
        started = dict(zip(units, (int(host.check_output("systemctl show -P ActiveEnterTimestampMonotonic %s", u))
                                   for u in units)))
        assert host.run("sha256sum --quiet -c %s", LOADED).rc == 0 and RULESET in host.file(LOADED).content_string
        for unit in ("chv-broker.socket", "chv-browser.socket"):
            assert host.service(unit).is_running, unit
    assert sha256(host, LEDGER) == ledger
    # the ruleset and the forwarding setting were in force before sshd took a login
    assert 0 < started["chv-cell-nat.service"] < started["ssh.service"], started
    assert 0 < started["systemd-sysctl.service"] < started["ssh.service"], started
    assert assert_isolated_or_refused(host, "after the reboot") == "isolated"


def killed_converge(extra, trigger, tags=()):
    """The scenario's converge (with --tags `tags`, if any), SIGKILLed (ansible-playbook and its
    workers) as soon as a line starting with `trigger` is printed. Returns the output up to then."""
    argv = ["ansible-playbook"] + inventory_argv() + [str(CONVERGE), "-e", json.dumps(extra)]
    proc = subprocess.Popen(argv + (["--tags", ",".join(tags)] if tags else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(trigger):
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    out = "".join(lines)
    assert lines and lines[-1].startswith(trigger), out[-3000:]
    time.sleep(1)  # what the killed run had started on the guest ends (its module process, a reload)
    return out


def test_converges_killed_at_three_points_leave_no_cell_unisolated_and_the_next_completes(host):
    clock = [time.monotonic()]
    phases = []

    def lap(what):
        phases.append("%s %.0f s" % (what, time.monotonic() - clock[0]))
        clock[0] = time.monotonic()

    name = host.backend.get_hostname()
    # each changes the ruleset and chv-broker's configuration (a restart of it)
    first = {"cell_nat_egress_deny_host": [{"cidr": "198.51.100.91/32", "comment": "faults run 1"}],
             "chv_broker_read_timeout": 12}
    second = {"cell_nat_egress_deny_host": [{"cidr": "198.51.100.92/32", "comment": "faults run 2"}],
              "chv_broker_read_timeout": 11}
    ledger = sha256(host, LEDGER)
    outcomes = []

    # early: while the ledger module runs
    killed_converge(first, "TASK [chv.fleet.cell_runtime : Allocate the slot identities]")
    lap("kill 1")
    outcomes.append(assert_isolated_or_refused(host, "killed early"))
    lap("check 1")
    assert sha256(host, LEDGER) == ledger

    # in the middle of cell_nat: the ruleset file written, its reload (a handler) never run (the role's tag:
    # the roles before it, which the first kill ran, are not run again to get there)
    out = killed_converge(first, "TASK [chv.fleet.cell_nat : Install the chv-cell-nat unit and the check of its table]",
                          tags=["cell_nat"])
    lap("kill 2")
    assert re.search(r"TASK \[chv\.fleet\.cell_nat : Render the cell NAT rulesets and the forwarding settings\] \**"
                     r"\nchanged: \[%s\]" % name, out), out[-3000:]
    with host.sudo():
        assert "198.51.100.91" in host.file(RULESET).content_string
        assert "198.51.100.91" not in host.check_output("nft list table inet chv_cell")  # the lost reload
    outcomes.append(assert_isolated_or_refused(host, "killed after the ruleset was written"))
    lap("check 2")
    assert sha256(host, LEDGER) == ledger

    # during the handlers, in chv-broker's restart: the broker's new configuration written, its restart
    # owed (the marker) unless the killed run got to it (the role's tag: the ruleset's change of `second`
    # is left to the converge that completes)
    invocation = unit_value(host, "chv-broker.service", "InvocationID")
    killed_converge(second, "RUNNING HANDLER [chv.fleet.broker : Restart chv-broker]", tags=["broker"])
    lap("kill 3")
    with host.sudo():
        assert '"read_timeout": 11.0' in host.file("/etc/chv-fleet/broker.json").content_string
        owed = host.file(MARKER).exists
    assert owed or unit_value(host, "chv-broker.service", "InvocationID") != invocation
    outcomes.append(assert_isolated_or_refused(host, "killed in chv-broker's restart handler"))
    lap("check 3")
    assert sha256(host, LEDGER) == ledger

    # the next converge completes and loads what the file holds; the one after changes nothing. These
    # three turn chv.fleet.metrics on as well (textfile-only, as the fleet scenario has it): its collector
    # rewrites its file and counters every run, which must not cost the fast path; and proxy mode (the
    # squid install and the doors' switch in the first, a full no-change run of that mode in the last)
    last = dict(second, chv_fleet_metrics_enabled=True, chv_metrics_create_textfile_dir=True,
                chv_metrics_textfile_dir="/var/lib/chv-fleet-textfile", **proxy_guests.site_vars())
    proc, recap, changed = run_converge(["-e", json.dumps(last)])
    lap("converge")
    with host.sudo():
        assert host.run("sha256sum --quiet -c %s", LOADED).rc == 0 and RULESET in host.file(LOADED).content_string
        table = host.check_output("nft list table inet chv_cell")
    assert "198.51.100.92" in table and "198.51.100.91" not in table, table
    assert '"drop_proxy_mode"' in table, table  # the switch to proxy mode took
    with host.sudo():
        assert not host.file(MARKER).exists  # chv-broker has started since its configuration changed
    # (it ended with site.yml's health gate: chv-cell health from a real cell, healthy)
    assert "%s: healthy (" % name in proc.stdout, proc.stdout[-3000:]
    # The fast path (docs/operations.md "A run that changes nothing"): that converge's gate passed, so it
    # recorded what it left; the next run with the same inputs finds the host so and runs neither the roles
    # nor the gate's cell (its module runs are counted by make bench, bench/bench_rollout.py).
    with host.sudo():  # the collector runs between the converges, as its timer has it
        host.run_expect([0], "systemctl start chv-fleet-metrics.service")
    proc, recap, changed = run_converge(["-e", json.dumps(last)], summary=True)
    lap("fast no-change converge")
    assert recap[name]["changed"] == 0 and recap[name]["failed"] == 0, (changed, proc.stdout[-3000:])
    # (the summary line names the path; no task of a role's converge.yml ran)
    assert re.search(r"^%s: ok, changed=0, batch: 1 of 1, path: fast \(as the last converge left it\)"
                     % re.escape(name), proc.stdout, re.M), proc.stdout[-3000:]
    assert "TASK [chv.fleet.cell_runtime : Allocate" not in proc.stdout, proc.stdout[-3000:]
    # ... and it does not hide a change: a file of the roles removed and a unit stopped on the guest take
    # the next run the full way, which repairs exactly those (the full path's no-change check: nothing
    # else changes), with its gate
    with host.sudo():
        sudoers = host.check_output("sha256sum /etc/sudoers.d/chv-cell")
        host.run_expect([0], "rm /etc/sudoers.d/chv-cell && systemctl stop chv-cell-task-reap.timer")
    proc, recap, changed = run_converge(["-e", json.dumps(last)], summary=True)
    lap("repairing converge")
    assert re.search(r"^%s: ok, changed=2, batch: 1 of 1, path: full \(/etc/sudoers.d/chv-cell: gone\)"
                     % re.escape(name), proc.stdout, re.M) and recap[name]["changed"] == 2, proc.stdout[-3000:]
    assert set(changed) == REPAIRED, changed
    assert "%s: healthy (" % name in proc.stdout, proc.stdout[-3000:]
    with host.sudo():
        assert host.check_output("sha256sum /etc/sudoers.d/chv-cell") == sudoers
        assert host.check_output("systemctl is-active chv-cell-task-reap.timer") == "active"
    assert sha256(host, LEDGER) == ledger
    print("between the kills: %s; %s" % (outcomes, ", ".join(phases)))
