"""chv.fleet.metrics on the canary, against the guest's real journald, nft
and systemd (docs/observability.md; the fleet scenario turns the role on in
molecule/fleet/group_vars/chv_fleet/metrics.yml, textfile-only).

A scripted workload - two cells that ran (one payload exiting 3), one run
refused on a cordoned guest, a connection the ruleset drops as denied, a
broker ping, a browser open and a sync status from a cell - moves exactly
those series of the textfile, read after a run of chv-fleet-metrics.service
(started by the test, not waited for from its timer); the text passes
`promtool check metrics`; `journalctl CHV_SLOT=<slot>` shows the launcher's
and chv-broker's entries with the fields journald sets; and with table inet
chv_cell deleted the next collection reports it missing, the reloaded
table present again.

Fleet only: nothing here depends on the distribution. 16 to 34 s on a lab
guest."""

import json
import os
import shlex
import subprocess
import time

import pytest
import yaml

from conftest import CLIENT, OutsideHTTP, html, in_cell, lab_guest, only_in
from prom_text import alert_annotations, family, input_series, key, parse
from testpaths import ROOT

pytestmark = only_in("fleet")

RULES = os.path.join(ROOT, "roles", "metrics", "files", "chv-fleet.rules.yml")
PORT = 18710  # the lab's listener ports (lab.json listener_ports); test_browser.py has 18700
# the fleet's cell_nat_egress_deny (docs/examples/inventory/group_vars/chv_fleet/main.yml): drop_denied
DENIED = "192.168.254.254"
# the families the workload moves (their every series is compared)
EVENT_FAMILIES = ("chv_cell_runs_total", "chv_cell_payload_exits_total", "chv_cell_start_seconds_count",
                  "chv_broker_requests_total", "chv_browser_requests_total", "chv_browser_request_seconds_count",
                  "chv_sync_requests_total")


def promtool():
    """Debian's promtool, unpacked by the Makefile ($(PROMTOOL)); a missing one is an error, not a skip."""
    path = os.environ.get("CHV_PROMTOOL") or os.path.join(ROOT, "build", "promtool", "usr", "bin", "promtool")
    assert os.access(path, os.X_OK), "no promtool at %s (make build/promtool/usr/bin/promtool)" % path
    return path


def delta(before, after, names):
    """The series of `names` that changed, by how much."""
    out = {}
    for series in set(before) | set(after):
        if series[0] in names and after.get(series, 0) != before.get(series, 0):
            out[series] = after.get(series, 0) - before.get(series, 0)
    return out


@pytest.fixture(scope="module")
def textfile(host):
    """The file the unit writes: its --textfile-dir (the scenario's chv_metrics_textfile_dir)."""
    argv = host.check_output("systemctl show -p ExecStart --value chv-fleet-metrics.service")
    return host.file(argv.split("--textfile-dir ")[1].split()[0] + "/chv_fleet.prom")


@pytest.fixture(scope="module")
def collect(host, textfile):
    """One run of the collector's unit (as its timer starts it), then the file it wrote."""
    def run():
        with host.sudo():
            host.run_expect([0], "systemctl start chv-fleet-metrics.service")
            text = textfile.content_string
        return text, parse(text)
    return run


@pytest.fixture(scope="module")
def workload(host, slots, collect):
    """The metrics before and after the workload, the workload's start time and the slots it used."""
    mine, other = slots[:2]
    server = OutsideHTTP(lab_guest(host)["host_address"], PORT, {"/": (200, {}, html("metrics", "<h1>m</h1>"), 0)})
    try:
        _text, before = collect()
        since = host.check_output("date +%s")
        reqs = [{"op": "ping"}, {"op": "browser", "action": "open", "url": server.url + "/"},
                {"op": "sync", "action": "status", "repo": "repo"}]
        connect = ("import socket; s = socket.socket(); s.settimeout(0.5)\n"
                   "try:\n    s.connect((%r, 443)); print('connected')\n"
                   "except socket.timeout:\n    print('timed out')\n" % DENIED)
        script = ("cd /workspace && rm -rf repo && git init -q -b main repo && "
                  + "".join("python3 %s %s; echo; " % (CLIENT, shlex.quote(json.dumps(r))) for r in reqs)
                  + "python3 -c %s" % shlex.quote(connect))
        ran = in_cell(host, mine, ["sh", "-c", script])
        lines = [line for line in ran.stdout.splitlines() if line.strip()]
        assert ran.rc == 0 and len(lines) == 4, (ran.rc, ran.stdout, ran.stderr[-2000:])
        replies = [json.loads(line) for line in lines[:3]]
        assert all(r["ok"] for r in replies), replies
        assert lines[3] == "timed out", lines  # dropped, not refused
        assert in_cell(host, other, ["sh", "-c", "exit 3"]).rc == 3
        with host.sudo():
            host.run_expect([0], "chv-cell cordon")
            try:
                refused = host.run("chv-cell run -- true")
            finally:
                host.run_expect([0], "chv-cell uncordon")
        assert refused.rc == 69, (refused.rc, refused.stderr)  # chv_guest/cell/exits.py EXIT_CORDONED
        # journald takes the entries from its socket in its own time: a run may start before the
        # last one is stored (the next run counts it); collect until the three runs and the three
        # requests are in (or 20 s), then compare every series exactly
        deadline = time.monotonic() + 20
        while True:
            text, after = collect()
            runs = sum(family(after, "chv_cell_runs_total").values()) - sum(family(before, "chv_cell_runs_total").values())
            brokered = (sum(family(after, "chv_broker_requests_total").values())
                        - sum(family(before, "chv_broker_requests_total").values()))
            if (runs >= 3 and brokered >= 3) or time.monotonic() > deadline:
                break
        yield {"before": before, "after": after, "text": text, "since": since, "slots": (mine, other)}
    finally:
        server.close()


def test_the_workload_moves_exactly_its_series(workload):
    mine, other = workload["slots"]
    assert delta(workload["before"], workload["after"], EVENT_FAMILIES) == {
        key("chv_cell_runs_total", slot=mine, verdict="ran"): 1,
        key("chv_cell_runs_total", slot=other, verdict="ran"): 1,
        key("chv_cell_runs_total", slot="none", verdict="cordoned"): 1,
        key("chv_cell_payload_exits_total", slot=mine, code="0"): 1,
        key("chv_cell_payload_exits_total", slot=other, code="1-125"): 1,
        key("chv_cell_start_seconds_count"): 2,
        key("chv_broker_requests_total", op="ping", verdict="ok"): 1,
        key("chv_broker_requests_total", op="browser", verdict="ok"): 1,
        key("chv_broker_requests_total", op="sync", verdict="ok"): 1,
        key("chv_browser_requests_total", action="open", verdict="ok"): 1,
        key("chv_browser_request_seconds_count", action="open"): 1,
        key("chv_sync_requests_total", action="status", verdict="ok"): 1,
    }
    # the one connection the ruleset dropped: as denied, and in the slot that sent it
    drops = delta(workload["before"], workload["after"], ("chv_nft_packets_total", "chv_nft_slot_packets_total"))
    assert drops.get(key("chv_nft_packets_total", verdict="drop", reason="denied")) == 1, drops
    assert drops.get(key("chv_nft_slot_packets_total", slot=mine, verdict="drop")) == 1, drops
    assert key("chv_nft_slot_packets_total", slot=other, verdict="drop") not in drops, drops
    # every source was read: the journal too, through the unit's sandbox
    assert {dict(k)["source"]: v for k, v in family(workload["after"], "chv_metrics_source_up").items()} == dict.fromkeys(
        ("policy", "cells", "nft", "units", "audit", "journal"), 1.0)


def test_the_scraped_text_passes_promtool_check_metrics(workload):
    proc = subprocess.run([promtool(), "check", "metrics"], input=workload["text"], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # control: the same check fails on a text that breaks the format (a counter without _total)
    bad = workload["text"].replace("chv_cell_runs_total", "chv_cell_runs")
    proc = subprocess.run([promtool(), "check", "metrics"], input=bad, capture_output=True, text=True, check=False,
                          timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_journalctl_by_slot_shows_the_launchers_and_the_brokers_entries(host, workload):
    mine, _other = workload["slots"]
    with host.sudo():
        out = host.check_output("journalctl -q -o json --since=@%s CHV_SLOT=%s", workload["since"], mine)
    entries = [json.loads(line) for line in out.splitlines()]
    runs = [e for e in entries if e.get("CHV_EVENT") == "chv-cell.run"]
    assert len(runs) == 1, runs
    assert (runs[0]["_UID"], runs[0]["CHV_VERDICT"], runs[0]["CHV_PAYLOAD_EXIT"]) == ("0", "ran", "0"), runs[0]
    assert float(runs[0]["CHV_START_MS"]) > 0 and runs[0]["SYSLOG_IDENTIFIER"] == "chv-cell", runs[0]
    # the cell's requests (not the broker's own "reaped", the browser context closed once the cell is gone)
    broker = [e for e in entries if e.get("CHV_EVENT") == "chv-broker.audit" and e["CHV_VERDICT"] != "reaped"]
    assert sorted((e["CHV_OP"], e.get("CHV_ACTION", ""), e["CHV_VERDICT"], e["_SYSTEMD_UNIT"]) for e in broker) == [
        ("browser", "open", "ok", "chv-broker.service"), ("ping", "", "ok", "chv-broker.service"),
        ("sync", "status", "ok", "chv-broker.service")], broker


def test_the_deleted_table_shows_in_the_next_collection_and_fires_the_shipped_alert(host, workload, collect, tmp_path):
    assert family(workload["after"], "chv_nft_table_present") == {(): 1.0}  # control: there, as loaded
    assert family(workload["after"], "chv_nft_table_unchanged") == {(): 1.0}
    with host.sudo():
        assert host.service("chv-fleet-metrics.timer").is_running
        try:
            host.run_expect([0], "nft delete table inet chv_cell")
            _text, deleted = collect()
        finally:
            host.run_expect([0], "systemctl reload chv-cell-nat.service")
    assert family(deleted, "chv_nft_table_present") == {(): 0.0}
    assert family(deleted, "chv_nft_table_unchanged") == {(): 0.0}
    assert family(deleted, "chv_nft_packets_total") == {}  # the counters went with the table
    _text, reloaded = collect()
    # the unit runs however often it is started: six more starts within 10 s (systemd's default
    # start limit, 5 in 10 s, would fail a collection that did nothing wrong)
    with host.sudo():
        host.run_expect([0], "for i in $(seq 6); do systemctl start chv-fleet-metrics.service || exit 1; done")
    assert family(reloaded, "chv_nft_table_present") == {(): 1.0}
    assert family(reloaded, "chv_nft_table_unchanged") == {(): 1.0}
    # the shipped rules on these two scrapes as series (3 min healthy, then deleted, every 30 s):
    # ChvCellTableMissing is quiet, then fires once its "for: 1m" has passed; healthy throughout, it does not
    with open(RULES, encoding="utf-8") as fh:
        annotations = alert_annotations(yaml.safe_load(fh), "ChvCellTableMissing", "guest-a")
    firing = [{"exp_labels": {"severity": "critical", "instance": "guest-a", "job": "node"},
               "exp_annotations": annotations}]
    for steps, expected in (([workload["after"]] * 6 + [deleted] * 8, firing), ([workload["after"]] * 14, [])):
        doc = {"rule_files": [RULES], "evaluation_interval": "30s", "tests": [{
            "interval": "30s", "input_series": input_series(steps, "guest-a"),
            "alert_rule_test": [{"eval_time": "2m30s", "alertname": "ChvCellTableMissing", "exp_alerts": []},
                                {"eval_time": "4m", "alertname": "ChvCellTableMissing", "exp_alerts": expected}]}]}
        path = tmp_path / "recorded.test.yml"
        path.write_text(json.dumps(doc))
        proc = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True,
                              check=False, timeout=60)
        assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
