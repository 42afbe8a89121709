"""The isolation case catalog (docs/isolation-cases.md) on the converged
guest: `chv-cell audit` runs every case in real cells (each probe beside
its control); on the fleet's canary (bookworm) with --counter-proof, which
then loosens each boundary that can be loosened here, shows exactly its
case failing, and runs the cells again. The trixie guest runs the catalog
alone (the counter-proofs do not depend on the distribution; make test's
time budget). A launcher that cannot start a cell makes every case an
error.

The reports (JSON, JUnit, Markdown) are kept under build/reports/ for the
auditor: one directory per scenario and guest."""

import contextlib
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import fleet_guest, inventory_argv, lab_guest, lab_record, only_in
from listeners import HelloServer
from testpaths import ROOT

POLICY = "/etc/chv-fleet/cell-policy.json"
REPORTS = "/var/lib/chv-fleet/audit"
SCENARIO = os.environ.get("MOLECULE_SCENARIO_NAME", "")
# In the example fleet's cell_nat_egress_deny (192.168.0.0/16): the lab host
# answers on it (on its loopback, for the run), so the guest reaches it and
# its cells must not (NET-05). The trixie scenario denies nothing.
DENIED = "192.168.254.254" if SCENARIO == "fleet" else None
# TEN-06's stand-in: an address of 198.18.0.0/15 (benchmarking, RFC 2544), a
# special-purpose range that neither scenario denies or carves out (the lab
# host is their only carve-out, molecule/shared/group_vars), so only the
# default deny of the special-purpose ranges keeps cells and doors from it.
# On the lab host's loopback for the run, one address per scenario (the
# scenarios may run at once on the one lab host).
SPECIAL = "198.18.254.254" if SCENARIO == "fleet" else "198.18.254.253"
# what these guests lack: lab guests get no cgroup controllers (docs/lab.md)
SKIPS = {"LIM-02"} | (set() if DENIED else {"NET-05"})
# /etc/chv is 0700 and each workspace 2750 with its slot's owner: their
# permissions keep every cell out as well, so no single loosening opens them
NOT_APPLICABLE = {"FS-01", "FS-03"}
PROVEN = {"FS-02", "FS-04", "FS-05", "ID-03/04", "ID-07", "NET-02", "NET-03", "NET-04", "NET-05", "IPC-02",
          "IPC-04", "BRW-01", "BRW-02", "BRW-03", "BRW-04", "TEN-04", "TEN-06"}
COUNTER_PROOF = SCENARIO == "fleet"
# fixed ports inside the lab host's listener range (lab.json listener_ports,
# docs/lab.md): the lab host refuses guests anything else
ALLOW_PORT, DENY_PORT, SPECIAL_PORT = 18770, 18771, 18772


@contextlib.contextmanager
def stand_ins(lab_addresses):
    """The audit's destinations on the lab host for the run: one allowed
    listener on each guest's gateway address (NET-01, the BRW page), the
    denied one (NET-05) and TEN-06's special-range stand-in, each on the lab
    host's loopback when it is no lab address; yields {"allow": {address:
    port}, "deny": port, "special": port}."""
    # replace, not add: a run killed before its cleanup left the
    # address behind, and the next run's add failed on it (EEXIST)
    for stand_in in [SPECIAL] + ([DENIED] if DENIED else []):
        subprocess.run(["ip", "addr", "replace", stand_in + "/32", "dev", "lo"], check=True)
    try:
        with contextlib.ExitStack() as stack:
            allow = dict((a, stack.enter_context(HelloServer(a, ALLOW_PORT)).port) for a in lab_addresses)
            deny = stack.enter_context(HelloServer(DENIED or lab_addresses[0], DENY_PORT))
            special = stack.enter_context(HelloServer(SPECIAL, SPECIAL_PORT))
            yield {"allow": allow, "deny": deny.port, "special": special.port}
    finally:
        for stand_in in [SPECIAL] + ([DENIED] if DENIED else []):
            subprocess.run(["ip", "addr", "del", stand_in + "/32", "dev", "lo"], check=False)


def keep_reports(name, files):
    """The reports under build/reports/<name>/, for the auditor."""
    keep = os.path.join(ROOT, "build", "reports", name)
    os.makedirs(keep, exist_ok=True)
    for fname, text in files.items():
        with open(os.path.join(keep, fname), "w") as fh:
            fh.write(text)


def run_audit(host, counter_proof, runs=5):
    """chv-cell audit on ``host`` as the catalog tests run it: (exit code,
    report, counter-proof report or None, the report files)."""
    lab = lab_guest(host)["host_address"]
    with stand_ins([lab]) as ports:
        # --exclusive: the lab guests are idle, LIFE-03 fills every slot
        argv = ["chv-cell audit --json --exclusive --runs %d --metadata-stand-in" % runs, "--allow %s:%d" % (lab, ports["allow"][lab]),
                "--allow-url http://%s:%d/" % (lab, ports["allow"][lab]), "--special %s:%d" % (SPECIAL, ports["special"]),
                "--trusted /etc/chv-fleet/nft/cell-nat.nft",
                "--report-dir %s --label scenario=%s" % (REPORTS, SCENARIO)]
        if DENIED:
            argv.append("--deny %s:%d" % (DENIED, ports["deny"]))
        if counter_proof:
            argv.append("--counter-proof")
        names = ["audit.json", "audit.xml", "audit.md"] + (
            ["counter-proof.json", "counter-proof.md"] if counter_proof else [])
        with host.sudo():
            host.run("rm -rf %s", REPORTS)
            r = host.run(" ".join(argv))
            files = dict((name, host.file(os.path.join(REPORTS, name)).content_string) for name in names)
    keep_reports("audit-%s-%s" % (SCENARIO, host.backend.get_hostname()), files)
    assert r.stdout.strip(), r.stderr
    rep = json.loads(r.stdout)
    return r.rc, (rep["before_report"] if counter_proof else rep), (rep if counter_proof else None), files


@pytest.fixture(scope="module")
def catalog(host):
    return run_audit(host, COUNTER_PROOF)


def assert_every_case_passed_or_skipped(before):
    """Each case passed beside its control, or was skipped by name (SKIPS)."""
    cases = before["cases"]
    assert len(cases) >= 40 and len(set(c["id"] for c in cases)) == len(cases)
    verdicts = dict((c["id"], c["verdict"]) for c in cases)
    assert set(v for cid, v in verdicts.items() if cid not in SKIPS) == {"pass"}, \
        [(c["id"], c["verdict"], c["probe"], c["control"]) for c in cases if c["verdict"] != "pass"]
    for c in cases:
        if c["id"] in SKIPS:
            assert c["verdict"] == "skip" and c["probe"].startswith("needs "), c
        else:
            assert c["probe"] and c["control"], c  # evidence for both halves
    assert before["verdict"] == "passed" and before["exit"] == 0


def test_every_case_passes_beside_its_control_or_is_skipped_by_name(catalog):
    rc, before, counter, files = catalog
    cases = before["cases"]
    assert_every_case_passed_or_skipped(before)
    assert counter is not None or rc == 0
    h = before["header"]
    assert len(h["policy_sha256"]) == 64 and len(h["launcher_sha256"]) == 64
    assert h["kernel"] and h["systemd"].startswith("systemd") and h["scenario"] == SCENARIO
    # the reports: every case in the JUnit file and the Markdown page
    assert files["audit.xml"].count("<testcase ") == len(cases)
    assert json.loads(files["audit.json"]) == before
    for c in cases:
        assert "| %s | %s | %s |" % (c["id"], c["title"], c["verdict"].upper()) in files["audit.md"]


@only_in("fleet")
def test_each_loosened_boundary_fails_exactly_its_case_and_passes_again_after(catalog):
    rc, before, rep, files = catalog
    got = dict((r["name"], r) for r in rep["loosenings"])
    assert set(got) == PROVEN, rep["not_applicable"]
    for name, r in got.items():
        assert r["verdict"] == "proven" and r["failed"] == sorted(r["expected"]), r
    # and the loosenings of proxy mode's cases, which a cidr-mode guest does not judge
    assert set(r["name"] for r in rep["not_applicable"]
               if not r["reason"].startswith("not judged on this guest")) == NOT_APPLICABLE
    assert rep["after"]["verdict"] == "passed"
    assert (rc, rep["verdict"]) == (0, "proven")
    assert rep["stale_rules_removed"] == rep["stale_builds_removed"] == rep["stale_copies_removed"] == 0


def test_no_loosening_is_left_on_the_guest(host):
    """No rule and no set element of a counter-proof (TEN-06's carve_nets
    element carries the comment too), no policy copy, no stand-in address,
    nothing of the doors' test builds (their directories, scopes, processes)."""
    with host.sudo():
        assert host.check_output("ls /run | grep -c '^chv-audit-build' || true") == "0"
        assert "chv-audit-build" not in host.check_output("systemctl list-units --all --no-legend 'chv-audit-build-*'")
        assert host.check_output("pgrep -fc '[t]estbuild import main' || true") == "0"
        assert "chv-audit" not in host.check_output("nft list table inet chv_cell")
        assert SPECIAL not in host.check_output("nft list set inet chv_cell carve_nets")
        assert host.check_output("ls /run/chv-fleet | grep -c audit-policy || true") == "0"
        assert host.check_output("ip -4 addr show dev lo").count("169.254.169.254") == 0


def test_a_cell_that_cannot_start_makes_every_case_an_error(host):
    """The launcher pointed at a missing systemd-nspawn: nothing ran, so
    nothing is proven (exit 2, every case an error), never a pass."""
    with host.sudo():
        broken = dict(json.loads(host.file(POLICY).content_string), nspawn="/nonexistent/systemd-nspawn")
        host.check_output("printf '%%s' %s > /run/chv-fleet/broken-policy.json", json.dumps(broken))
        try:
            r = host.run("chv-cell --policy /run/chv-fleet/broken-policy.json audit --runs 1 --json")
        finally:
            host.run("rm -f /run/chv-fleet/broken-policy.json")
    rep = json.loads(r.stdout)
    assert r.rc == 2 and rep["verdict"] == "error", r.stderr
    assert set(c["verdict"] for c in rep["cases"]) == {"error"} and len(rep["cases"]) >= 40
    assert "nonexistent" in rep["cases"][0]["control"] or "exited" in rep["cases"][0]["control"]


FLEET = ["guest-a", "guest-b", "guest-c"]
# lab guests get no pids controller (docs/lab.md): the one case they cannot run
LAB_SKIPS = {"LIM-02": "lab guests get no pids controller delegated (docs/lab.md)"}


def fleet_audit(report_dir, limit=None, runs=5, busy=()):
    """ansible-playbook chv.fleet.audit over the fleet's guests (all three
    in one batch), with the stand-ins of this lab host as each guest's
    destinations, set in an inventory of its own beside the scenario's, as
    an operator's would be. Returns (process, fleet-report.json or None)."""
    guests = dict((g["name"], g) for g in lab_record()["guests"])
    with stand_ins([guests[n]["host_address"] for n in FLEET]) as ports:
        hosts = {}
        for name in FLEET:
            lab = guests[name]["host_address"]
            hosts[name] = {
                "chv_fleet_audit_allow": ["%s:%d" % (lab, ports["allow"][lab])],
                "chv_fleet_audit_allow_url": "http://%s:%d/" % (lab, ports["allow"][lab]),
                "chv_fleet_audit_deny": ["%s:%d" % (DENIED, ports["deny"])],
                "chv_fleet_audit_special": ["%s:%d" % (SPECIAL, ports["special"])],
                "chv_fleet_audit_runs": runs,
                "chv_fleet_audit_allowed_skips": LAB_SKIPS,
                # a guest running a cell of its own: no --exclusive (LIFE-03 an allowed skip)
                "chv_fleet_audit_exclusive": name not in busy}
        overlay = os.path.join(report_dir, "audit-inventory.yml")
        os.makedirs(report_dir, exist_ok=True)
        with open(overlay, "w") as fh:
            json.dump({"all": {"children": {"chv_fleet": {"hosts": hosts}}}}, fh)
        argv = ["ansible-playbook"] + inventory_argv(whole=True) + ["-i", overlay, "chv.fleet.audit",
                                                                    "-e", "chv_fleet_audit_report_dir=" + report_dir,
                                                                    "-e", json.dumps({"chv_fleet_batches": ["100%"]})]
        if limit:
            argv += ["--limit", limit]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
    path = os.path.join(report_dir, "fleet-report.json")
    return proc, (json.load(open(path)) if os.path.exists(path) else None)


@only_in("fleet")
def test_the_fleet_audit_reports_every_guest_with_its_evidence_and_in_warm_cells_too():
    """`ansible-playbook chv.fleet.audit` over the three guests writes one
    fleet report on this controller: every case of every guest passed beside
    its control (LIM-02 skipped where the inventory allows it, with its
    reason: no lab guest has a pids controller), each guest's version, commit
    and digests. guest-c keeps every slot warm (chv_cell_warm_slots: 3 in the
    example's host_vars; docs/cells.md "Warm cells"): its audit's runs are
    handed to cells started before them, and pass as in cold cells. Control
    for the warm half: the three warm cells were ready before the audit; the
    warm units' journal shows the hand-overs (at least one per LIFE-02 run).
    guest-c is busy too: an agent's cell runs in one of its slots from
    before the audit to after it, untouched; its audit takes the free slots
    and skips LIFE-03 (every slot at once) with its reason, an allowed skip
    without --exclusive, while guest-a and guest-b, idle, run it."""
    c = fleet_guest("guest-c")
    running_pid = "chv-cell status | sed -n 's/.*running pid=\\([0-9]*\\).*/\\1/p'"
    with c.sudo():
        c.run_expect([0], "for i in $(seq 100); do [ $(chv-cell status | grep -c 'idle (warm cell ready') = 3 ] && exit 0; "
                     "sleep 0.2; done; chv-cell status; exit 1")
        since = c.check_output("date +%s")
        c.run_expect([0], "systemd-run --unit=chv-molecule-audit-busy --collect chv-cell run -- sleep 900")
        c.run_expect([0], "for i in $(seq 100); do chv-cell status | grep -q 'running pid=' && exit 0; "
                          "sleep 0.1; done; exit 1")
        busy_pid = c.check_output(running_pid)
    report_dir = os.path.join(ROOT, "build", "reports", "fleet-audit")
    shutil.rmtree(report_dir, ignore_errors=True)
    runs = 5
    try:
        proc, fleet = fleet_audit(report_dir, runs=runs, busy=("guest-c",))
        with c.sudo():
            # the agent's cell ran through the whole audit: the same pid, still running
            assert busy_pid and c.check_output(running_pid) == busy_pid
    finally:
        with c.sudo():
            c.run("systemctl stop chv-molecule-audit-busy")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "All 3 hosts passed every case of the catalog" in out, out[-3000:]
    assert fleet["verdict"] == "passed" and fleet["failed_hosts"] == []
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert [h["host"] for h in fleet["hosts"]] == FLEET
    for h in fleet["hosts"]:
        assert h["verdict"] == "passed" and h["bad"] == [], h
        skipped = set(LAB_SKIPS) | ({"LIFE-03"} if h["host"] == "guest-c" else set())
        assert set(v for cid, v in h["verdicts"].items() if cid not in skipped) == {"pass"}, h["verdicts"]
        assert len(h["verdicts"]) >= 45, h["verdicts"]
        if h["host"] == "guest-c":  # busy: LIFE-03 skipped with the launcher's reason, allowed
            assert [s["id"] for s in h["skips"]] == ["LIFE-03", "LIM-02"] and all(s["allowed"] for s in h["skips"]), \
                h["skips"]
            assert "needs every slot free" in h["skips"][0]["reason"], h["skips"]
        else:  # control: the idle guests ran LIFE-03 (--exclusive)
            assert [s["id"] for s in h["skips"]] == ["LIM-02"] and h["skips"][0]["allowed"], h["skips"]
            assert h["verdicts"]["LIFE-03"] == "pass", h["verdicts"]
        assert len(h["header"]["policy_sha256"]) == 64 and len(h["header"]["launcher_sha256"]) == 64, h
        assert h["header"]["kernel"] and h["header"]["systemd"].startswith("systemd"), h
        assert h["header"]["commit"] == commit and h["header"]["collection_version"], h
    md = open(os.path.join(report_dir, "fleet-report.md")).read()
    assert "# chv.fleet audit: PASSED" in md and "| NET-01 | pass | pass | pass |" in md, md[:3000]
    assert "- guest-b LIM-02 skip (allowed): " in md, md
    assert open(os.path.join(report_dir, "fleet-report.xml")).read().count("<testsuite ") == 3
    for name in FLEET:
        assert json.load(open(os.path.join(report_dir, "hosts", name, "audit.json")))["verdict"] == "passed"
    # the hosts kept nothing of the audit (its temporary report directories)
    for name in FLEET:
        with fleet_guest(name).sudo():
            assert fleet_guest(name).check_output("ls -d /tmp/chv-fleet-audit.* 2>/dev/null | wc -l") == "0"
    with c.sudo():
        took = int(c.check_output("journalctl -q -u 'chv-cell-warm@*' --since @%s | grep -c 'warm cell took a payload' "
                                  "|| true", since))
        failed = c.check_output("systemctl list-units --failed --plain --no-legend 'chv-cell-warm@*'")
    assert took >= runs, took
    assert failed == "", failed


@only_in("fleet")
def test_the_fleet_audit_fails_naming_a_guest_whose_table_is_gone():
    """guest-b's ruleset table deleted (root on the guest can; docs/security.md):
    the fleet audit of guest-b fails, naming guest-b and its failing cases,
    and the report says so. Control: the audit of the same guest with its
    table back (the test above, all passed) and, after this one, the table
    loaded again by its unit."""
    b = fleet_guest("guest-b")
    report_dir = os.path.join(ROOT, "build", "reports", "fleet-audit-broken")
    shutil.rmtree(report_dir, ignore_errors=True)
    with b.sudo():
        b.run_expect([0], "nft delete table inet chv_cell")
    try:
        proc, fleet = fleet_audit(report_dir, limit="guest-b", runs=1)
    finally:
        with b.sudo():
            b.run_expect([0], "systemctl restart chv-cell-nat.service && nft list table inet chv_cell >/dev/null")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    failure = re.search(r"The audit failed on 1 of 1 hosts: guest-b: ([A-Z]+-\d\d.*?) \(the report", out)
    assert failure, out[-4000:]
    assert fleet["verdict"] == "failed" and fleet["failed_hosts"] == ["guest-b"]
    bad = fleet["hosts"][0]["bad"]
    assert bad and all(b_["verdict"] in ("fail", "error") for b_ in bad), bad
    assert failure.group(1) == ", ".join("%s %s" % (b_["id"], b_["verdict"].upper()) for b_ in bad)
    md = open(os.path.join(report_dir, "fleet-report.md")).read()
    assert "# chv.fleet audit: FAILED" in md and "1 hosts, 0 passed, 1 failed: guest-b" in md, md[:2000]
    assert "- guest-b %s %s: " % (bad[0]["id"], bad[0]["verdict"].upper()) in md, md


@only_in("fleet")
def test_the_executors_way_in_lands_in_a_warm_cell():
    """ssh as the agent user, sudo, chv-cell-agent: the payload runs in one
    of guest-c's warm cells (its unit's journal names the slot and the agent
    user), its exit code comes back."""
    c = fleet_guest("guest-c")
    with c.sudo():
        c.run_expect([0], "for i in $(seq 100); do chv-cell status | grep -q 'idle (warm cell ready' && exit 0; "
                     "sleep 0.2; done; exit 1")
        since = c.check_output("date +%s")
    ssh = ["ssh", "-i", lab_record()["key"], "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
           "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "chv@%s" % lab_guest(c)["address"],
           "chv-cell run -- sh -c 'echo $CHV_SLOT $USER; exit 3'"]
    r = subprocess.run(ssh, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 3 and len(r.stdout.split()) == 2 and r.stdout.split()[1] == "chv", r
    with c.sudo():
        log = c.check_output("journalctl -q -u 'chv-cell-warm@*' --since @%s", since)
    assert "slot %s: warm cell took a payload of chv (uid " % r.stdout.split()[0] in log, log[-2000:]
