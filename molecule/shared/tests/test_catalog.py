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

import json
import os
import subprocess

import pytest

from conftest import fleet_guest, lab_guest, lab_record, only_in
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
PROVEN = {"FS-02", "FS-04", "FS-05", "ID-03/04", "ID-07", "NET-02", "NET-03", "NET-04", "NET-05", "BRW-01",
          "BRW-02", "BRW-03", "TEN-04", "TEN-06"}
COUNTER_PROOF = SCENARIO == "fleet"
# fixed ports inside the lab host's listener range (lab.json listener_ports,
# docs/lab.md): the lab host refuses guests anything else
ALLOW_PORT, DENY_PORT, SPECIAL_PORT = 18770, 18771, 18772


def run_audit(host, counter_proof, runs=100):
    """chv-cell audit on ``host`` as the catalog tests run it: (exit code,
    report, counter-proof report or None, the report files)."""
    lab = lab_guest(host)["host_address"]
    try:
        # replace, not add: a run killed before its cleanup left the
        # address behind, and the next run's add failed on it (EEXIST)
        for stand_in in [SPECIAL] + ([DENIED] if DENIED else []):
            subprocess.run(["ip", "addr", "replace", stand_in + "/32", "dev", "lo"], check=True)
        with HelloServer(lab, ALLOW_PORT) as allow, HelloServer(DENIED or lab, DENY_PORT) as deny, \
                HelloServer(SPECIAL, SPECIAL_PORT) as special:
            argv = ["chv-cell audit --json --runs %d --metadata-stand-in" % runs, "--allow %s:%d" % (lab, allow.port),
                    "--allow-url http://%s:%d/" % (lab, allow.port), "--special %s:%d" % (SPECIAL, special.port),
                    "--trusted /etc/chv-fleet/nft/cell-nat.nft",
                    "--report-dir %s --label scenario=%s" % (REPORTS, SCENARIO)]
            if DENIED:
                argv.append("--deny %s:%d" % (DENIED, deny.port))
            if counter_proof:
                argv.append("--counter-proof")
            names = ["audit.json", "audit.xml", "audit.md"] + (
                ["counter-proof.json", "counter-proof.md"] if counter_proof else [])
            with host.sudo():
                host.run("rm -rf %s", REPORTS)
                r = host.run(" ".join(argv))
                files = dict((name, host.file(os.path.join(REPORTS, name)).content_string) for name in names)
    finally:
        for stand_in in [SPECIAL] + ([DENIED] if DENIED else []):
            subprocess.run(["ip", "addr", "del", stand_in + "/32", "dev", "lo"], check=False)
    keep = os.path.join(ROOT, "build", "reports", "audit-%s-%s" % (SCENARIO, host.backend.get_hostname()))
    os.makedirs(keep, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(keep, name), "w") as fh:
            fh.write(text)
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
    assert set(r["name"] for r in rep["not_applicable"]) == NOT_APPLICABLE
    assert rep["after"]["verdict"] == "passed"
    assert (rc, rep["verdict"]) == (0, "proven")
    assert rep["stale_rules_removed"] == 0


def test_no_loosening_is_left_on_the_guest(host):
    """No rule and no set element of a counter-proof (TEN-06's carve_nets
    element carries the comment too), no policy copy, no stand-in address."""
    with host.sudo():
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


@only_in("fleet")
def test_the_catalog_passes_in_warm_cells_too():
    """guest-c keeps every slot warm (chv_cell_warm_slots: 3 in the example's
    host_vars; docs/cells.md "Warm cells"): each `chv-cell run` of the audit
    is handed to a cell started before it (the argv and stdio over the
    cell's socketpair), and every case passes beside its control as in cold
    cells. Control: the three warm cells were ready before the audit; the
    warm units' journal shows the hand-overs (at least one per LIFE-02 run),
    so the cells were warm ones and not cold starts."""
    c = fleet_guest("guest-c")
    with c.sudo():
        c.run_expect([0], "for i in $(seq 100); do [ $(chv-cell status | grep -c 'idle (warm cell ready') = 3 ] && exit 0; "
                     "sleep 0.2; done; chv-cell status; exit 1")
        since = c.check_output("date +%s")
    runs = 5
    rc, report, dummy, files = run_audit(c, False, runs=runs)
    assert_every_case_passed_or_skipped(report)
    assert rc == 0
    with c.sudo():
        took = int(c.check_output("journalctl -q -u 'chv-cell-warm@*' --since @%s | grep -c 'warm cell took a payload' "
                                  "|| true", since))
        failed = c.check_output("systemctl list-units --failed --plain --no-legend 'chv-cell-warm@*'")
    assert took >= runs, took
    assert failed == "", failed
    # the executor's way in (ssh as the agent user, sudo, chv-cell-agent) lands in a warm cell too
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
