"""chv-fleet-metrics (src/chv_guest/metrics): the state read on a guest,
as fixtures, to the exposition text; promtool check metrics on it; the
metrics moving when the state does (the table deleted or changed, the
ruleset files newer than what was loaded, a cell gone, a unit failed, an
audit failing); and the collector's own I/O on a fake guest tree."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from promtool_path import promtool

from chv_guest.metrics import collector, events, exposition, state

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
RULESET = "/etc/chv-fleet/nft/cell-nat.nft"
UNITS = collector.DEFAULT_UNITS
NOW = 1796284800.0  # 2026-12-03T08:00:00Z, two hours after the fixture audit


def _read(name, mode="r"):
    with open(os.path.join(FIXTURES, name), mode) as fh:
        return fh.read()


def fixture_events():
    """The event counts of the fixture journal (journal.json: journalctl -o json's lines)."""
    counts = events.empty()
    events.add_output(counts, _read("journal.json"), ["slot0", "slot1", "slot2"])
    return counts


def fixture_state(**changes):
    """The fixture guest: three slots, slot0 running, slot1's record stale,
    the table loaded as recorded, chv-browser.service failed, the last
    audit failed one case; the journal's run and broker entries counted."""
    base = state.State(
        now=NOW, version="0.2.0", policy=_read("cell-policy.json", "rb"),
        records={"slot0": _read("cells/slot0.json"), "slot1": _read("cells/slot1.json")},
        alive={"slot0": True, "slot1": False},
        nft_ran=True, table_listing=_read("table.txt", "rb"), counters_json=_read("counters.json"),
        loaded_sha256=_read("loaded.sha256"), table_sha256=_read("table.sha256"),
        ruleset_digests={RULESET: hashlib.sha256(_read("cell-nat.nft", "rb")).hexdigest()},
        units=UNITS, systemctl_show=_read("systemctl-show.txt"),
        audit=_read("audit.json"), audit_mtime=NOW - 7200, duration=0.0125, cordoned=False,
        events=fixture_events())
    return base._replace(**changes)


def values(st):
    """{(name, labels...): value} of the state's samples."""
    return {(s.name,) + tuple(v for _, v in s.labels): s.value for s in state.samples(st)}



# ------------------------------------------------------------- the whole text

def test_the_fixture_state_passes_promtool_check_metrics():
    text = state.exposition_text(fixture_state())
    proc = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_the_fixture_state_emits_every_metric_family():
    """So every family the docs, rules and dashboard name is one a guest can show."""
    emitted = {exposition.family_of(s.name)[0].name for s in state.samples(fixture_state())}
    assert emitted == set(exposition.FAMILIES)


def test_the_fixture_state_has_the_expected_values():
    v = values(fixture_state())
    policy_sha = hashlib.sha256(_read("cell-policy.json", "rb")).hexdigest()
    assert v[("chv_fleet_info", "0.2.0", policy_sha)] == 1
    assert v[("chv_cell_slots",)] == 3
    assert (v[("chv_cell_running", "slot0")], v[("chv_cell_running", "slot1")], v[("chv_cell_running", "slot2")]) == (1, 0, 0)
    assert (v[("chv_cell_stale_record", "slot0")], v[("chv_cell_stale_record", "slot1")]) == (0, 1)
    assert v[("chv_cell_start_time_seconds", "slot0")] == 1796280000.5
    assert ("chv_cell_start_time_seconds", "slot1") not in v  # no live cell, no start time
    assert v[("chv_nft_table_present",)] == 1 and v[("chv_nft_table_unchanged",)] == 1
    assert v[("chv_nft_ruleset_applied",)] == 1
    assert v[("chv_nft_packets_total", "drop", "cell_to_guest")] == 7
    assert v[("chv_nft_bytes_total", "drop", "cell_to_guest")] == 420
    assert v[("chv_nft_packets_total", "nat", "masquerade")] == 3
    assert v[("chv_nft_slot_packets_total", "slot0", "drop")] == 7
    assert v[("chv_nft_slot_bytes_total", "slot0", "accept")] == 9256
    assert v[("chv_unit_state", "chv-cell-nat.service", "active")] == 1
    assert v[("chv_unit_state", "chv-browser.service", "failed")] == 1
    assert v[("chv_unit_state", "chv-browser.service", "active")] == 0
    assert v[("chv_unit_restarts_total", "chv-browser.service")] == 2
    assert ("chv_unit_restarts_total", "chv-broker.socket") not in v  # a socket has no NRestarts
    assert v[("chv_audit_report_present",)] == 1
    assert v[("chv_audit_timestamp_seconds",)] == NOW - 7200
    assert v[("chv_audit_verdict", "failed")] == 1 and v[("chv_audit_verdict", "passed")] == 0
    assert v[("chv_audit_case_verdict", "NET-02", "fail")] == 1
    assert v[("chv_audit_case_verdict", "LIM-03", "skip")] == 1
    assert v[("chv_audit_policy_current",)] == 1
    assert all(v[("chv_metrics_source_up", s)] == 1 for s in exposition.SOURCES)
    assert v[("chv_metrics_collect_timestamp_seconds",)] == NOW


def test_labels_are_bounded_no_host_pid_or_path_reaches_the_text():
    text = state.exposition_text(fixture_state())
    for needle in ("guest-1", "4242", "/etc/", "/run/", "10.200."):
        assert needle not in text
    allowed = {"slot", "reason", "verdict", "unit", "state", "case", "source", "version", "policy_sha256", "op",
               "action", "code"}
    assert {label for f in exposition.METRICS for label in f.labels} <= allowed


# ------------------------------------------------------------- the table and the ruleset

def test_the_table_deleted_shows_as_missing_and_changed_with_no_counters():
    v = values(fixture_state(table_listing=None, counters_json=None))
    assert v[("chv_nft_table_present",)] == 0 and v[("chv_nft_table_unchanged",)] == 0
    assert not [k for k in v if k[0].startswith("chv_nft_") and k[0].endswith("_total")]
    assert v[("chv_metrics_source_up", "nft")] == 1  # nft answered: the table is gone, not the source


def test_a_rule_added_to_the_loaded_table_shows_as_changed():
    listing = _read("table.txt", "rb").replace(b"chain input {", b"chain input {\n\t\taccept")
    v = values(fixture_state(table_listing=listing))
    assert v[("chv_nft_table_present",)] == 1 and v[("chv_nft_table_unchanged",)] == 0


def test_without_nft_the_table_is_missing_and_the_source_down():
    v = values(fixture_state(nft_ran=False, table_listing=None, counters_json=None))
    assert v[("chv_nft_table_present",)] == 0 and v[("chv_metrics_source_up", "nft")] == 0


@pytest.mark.parametrize("change", ["file_changed", "door_added", "no_record", "file_unreadable"])
def test_ruleset_files_not_as_loaded_show_as_not_applied(change):
    digests = {RULESET: hashlib.sha256(_read("cell-nat.nft", "rb")).hexdigest()}
    loaded = _read("loaded.sha256")
    if change == "file_changed":
        digests[RULESET] = hashlib.sha256(b"other").hexdigest()
    elif change == "door_added":
        digests["/etc/chv-fleet/nft/door.d/browser.nft"] = hashlib.sha256(b"x").hexdigest()
    elif change == "no_record":
        loaded = None
    else:
        digests[RULESET] = None
    assert values(fixture_state())[("chv_nft_ruleset_applied",)] == 1  # the positive control
    assert values(fixture_state(ruleset_digests=digests, loaded_sha256=loaded))[("chv_nft_ruleset_applied",)] == 0


@pytest.mark.parametrize("name,metric,labels", [
    ("drop_cell_to_guest", "chv_nft_packets_total", ("drop", "cell_to_guest")),
    ("accept_guest_established", "chv_nft_packets_total", ("accept", "guest_established")),
    ("nat_masquerade", "chv_nft_packets_total", ("nat", "masquerade")),
    ("slot0_accepted", "chv_nft_slot_packets_total", ("slot0", "accept")),
    ("build-7_dropped", "chv_nft_slot_packets_total", ("build-7", "drop")),
])
def test_counter_names_map_to_verdict_reason_or_slot(name, metric, labels):
    out = state.counter_samples(name, 5, 300)
    assert [(s.name, tuple(v for _, v in s.labels), s.value) for s in out][0] == (metric, labels, 5)


def test_a_counter_of_no_known_form_is_left_out():
    assert state.counter_samples("something_else", 1, 1) == []


def test_every_counter_the_ruleset_declares_maps_to_a_sample():
    names = [i["counter"]["name"] for i in json.loads(_read("counters.json"))["nftables"] if "counter" in i]
    assert names and all(state.counter_samples(n, 0, 0) for n in names)


# ------------------------------------------------------------- cells, units, audit

def test_a_record_of_unreadable_json_counts_as_no_cell():
    v = values(fixture_state(records={"slot0": "{not json"}, alive={"slot0": True}))
    assert v[("chv_cell_running", "slot0")] == 0 and v[("chv_cell_stale_record", "slot0")] == 0


def test_a_unit_not_installed_reads_not_loaded_and_inactive():
    show = "LoadState=not-found\nActiveState=inactive\nSubState=dead\n"
    v = values(fixture_state(units=("chv-browser.socket",), systemctl_show=show))
    assert v[("chv_unit_loaded", "chv-browser.socket")] == 0
    assert v[("chv_unit_state", "chv-browser.socket", "inactive")] == 1


@pytest.mark.parametrize("show", [None, "LoadState=loaded\n"])
def test_systemctl_failing_or_short_marks_the_units_source_down(show):
    v = values(fixture_state(systemctl_show=show))
    assert v[("chv_metrics_source_up", "units")] == 0
    assert not [k for k in v if k[0].startswith("chv_unit_")]


def test_no_audit_yet_is_reported_absent_not_as_a_broken_source():
    v = values(fixture_state(audit=None, audit_mtime=None))
    assert v[("chv_audit_report_present",)] == 0 and v[("chv_metrics_source_up", "audit")] == 1
    v = values(fixture_state(audit="{truncated"))
    assert v[("chv_audit_report_present",)] == 0 and v[("chv_metrics_source_up", "audit")] == 0


def test_the_audit_time_falls_back_to_the_file_time_and_the_policy_digest_is_compared():
    rep = json.loads(_read("audit.json"))
    del rep["header"]["time"]
    rep["header"]["policy_sha256"] = "0" * 64
    v = values(fixture_state(audit=json.dumps(rep), audit_mtime=123.0))
    assert v[("chv_audit_timestamp_seconds",)] == 123.0
    assert v[("chv_audit_policy_current",)] == 0


# ------------------------------------------------------------- the format

def test_render_refuses_unknown_families_and_other_label_names():
    with pytest.raises(ValueError, match="no metric family"):
        exposition.sample("chv_nope", 1)
    with pytest.raises(ValueError, match="takes the labels slot"):
        exposition.sample("chv_cell_running", 1, host="guest-1")
    with pytest.raises(ValueError, match="not a sample of METRICS"):
        exposition.render([exposition.Sample("chv_cell_running", (("pid", "1"),), 1.0)])
    with pytest.raises(ValueError, match="given twice"):
        exposition.render([exposition.sample("chv_cell_slots", 1), exposition.sample("chv_cell_slots", 2)])


def test_label_values_are_escaped():
    text = exposition.render([exposition.sample("chv_unit_loaded", 1, unit='a"b\\c\nd')])
    assert 'chv_unit_loaded{unit="a\\"b\\\\c\\nd"} 1' in text


# ------------------------------------------------------------- the I/O

FAKE_NFT = """#!/bin/sh
# a guest's nft: the fixture table, or none when $FIXTURES/no-table exists
[ -e "%(dir)s/no-table" ] && { echo "Error: No such file or directory" >&2; exit 1; }
case "$1" in
  -s) cat "%(fixtures)s/table.txt" ;;
  -j) cat "%(fixtures)s/counters.json" ;;
  *) exit 2 ;;
esac
"""
FAKE_SYSTEMCTL = """#!/bin/sh
cat "%(fixtures)s/systemctl-show.txt"
"""


def _guest(tmp_path):
    """A fake guest tree under tmp_path, with fake nft and systemctl; the argv of the collector for it."""
    for name, text in (("nft", FAKE_NFT), ("systemctl", FAKE_SYSTEMCTL)):
        p = tmp_path / name
        p.write_text(text % {"dir": tmp_path, "fixtures": FIXTURES})
        p.chmod(0o755)
    (tmp_path / "etc").mkdir()
    shutil.copy(os.path.join(FIXTURES, "cell-policy.json"), str(tmp_path / "etc" / "cell-policy.json"))
    shutil.copy(os.path.join(FIXTURES, "cell-nat.nft"), str(tmp_path / "etc" / "cell-nat.nft"))
    (tmp_path / "etc" / "door.d").mkdir()
    (tmp_path / "run" / "cells").mkdir(parents=True)
    # slot0: this test's own pid (alive); slot1: a pid that cannot exist
    (tmp_path / "run" / "cells" / "slot0.json").write_text(json.dumps({"slot": "slot0", "pid": os.getpid(), "started": 5.0}))
    (tmp_path / "run" / "cells" / "slot1.json").write_text(json.dumps({"slot": "slot1", "pid": 2 ** 22 + 1, "started": 6.0}))
    (tmp_path / "nat").mkdir()
    shutil.copy(os.path.join(FIXTURES, "table.sha256"), str(tmp_path / "nat" / "table.sha256"))
    digest = hashlib.sha256(_read("cell-nat.nft", "rb")).hexdigest()
    (tmp_path / "nat" / "loaded.sha256").write_text("%s  %s\n" % (digest, tmp_path / "etc" / "cell-nat.nft"))
    (tmp_path / "textfile").mkdir()
    return ["--textfile-dir", str(tmp_path / "textfile"), "--collection-version", "0.2.0",
            "--policy", str(tmp_path / "etc" / "cell-policy.json"), "--state-dir", str(tmp_path / "run"),
            "--nat-run-dir", str(tmp_path / "nat"), "--ruleset-file", str(tmp_path / "etc" / "cell-nat.nft"),
            "--door-dir", str(tmp_path / "etc" / "door.d"), "--audit-report", os.path.join(FIXTURES, "audit.json"),
            "--nft", str(tmp_path / "nft"), "--systemctl", str(tmp_path / "systemctl")]


def _metric_lines(path):
    with open(path) as fh:
        return [line for line in fh.read().splitlines() if not line.startswith("#")]


def test_the_collector_writes_the_file_atomically_and_it_follows_the_table(tmp_path):
    argv = _guest(tmp_path)
    assert collector.main(argv) == 0
    out = tmp_path / "textfile" / collector.FILE_NAME
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert os.listdir(str(tmp_path / "textfile")) == [collector.FILE_NAME]  # no temporary file left
    lines = _metric_lines(str(out))
    assert "chv_nft_table_present 1" in lines and "chv_nft_table_unchanged 1" in lines
    assert "chv_nft_ruleset_applied 1" in lines
    assert 'chv_cell_running{slot="slot0"} 1' in lines and 'chv_cell_stale_record{slot="slot1"} 1' in lines
    assert 'chv_nft_packets_total{verdict="drop",reason="cell_to_guest"} 7' in lines
    # the table deleted: the next run shows it
    (tmp_path / "no-table").write_text("")
    assert collector.main(argv) == 0
    lines = _metric_lines(str(out))
    assert "chv_nft_table_present 0" in lines and "chv_nft_table_unchanged 0" in lines
    # a door drop-in written and not loaded: the ruleset is stale
    (tmp_path / "etc" / "door.d" / "browser.nft").write_text("add element inet chv_cell door_uids { 999 }\n")
    assert collector.main(argv) == 0
    assert "chv_nft_ruleset_applied 0" in _metric_lines(str(out))


def test_the_collector_fails_naming_the_directory_it_cannot_write(tmp_path, capsys):
    argv = _guest(tmp_path)
    argv[1] = str(tmp_path / "missing")
    assert collector.main(argv) == 1
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_the_module_runs_as_python_m_on_the_guest_python(tmp_path):
    """python3 -m chv_guest.metrics, as the unit runs it (the interpreter of this test)."""
    argv = _guest(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(FIXTURES), "..", "..", "..", "src"))
    proc = subprocess.run([sys.executable, "-m", "chv_guest.metrics", "--stdout"] + argv, capture_output=True,
                          text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "chv_nft_table_present 1" in proc.stdout.splitlines()


def test_a_cordoned_host_shows_in_the_metrics():
    assert values(fixture_state(cordoned=True))[("chv_cell_cordoned",)] == 1
    assert values(fixture_state(cordoned=False))[("chv_cell_cordoned",)] == 0
    assert ("chv_cell_cordoned",) not in values(fixture_state(cordoned=None))  # not read: no sample


# ------------------------------------------------------------- events from the journal

def test_the_journals_entries_count_in_bounded_series_and_only_from_their_writers():
    v = values(fixture_state())
    assert v[("chv_cell_runs_total", "slot0", "ran")] == 1  # the entry of uid 1000 (c5) is not counted
    assert v[("chv_cell_runs_total", "slot1", "ran")] == 1
    assert v[("chv_cell_runs_total", "none", "busy")] == 1 and v[("chv_cell_runs_total", "none", "cordoned")] == 1
    assert v[("chv_cell_payload_exits_total", "slot0", "0")] == 1
    assert v[("chv_cell_payload_exits_total", "slot1", "1-125")] == 1
    assert v[("chv_cell_start_seconds_bucket", "0.5")] == 0 and v[("chv_cell_start_seconds_bucket", "1")] == 1
    assert v[("chv_cell_start_seconds_bucket", "4")] == 2 and v[("chv_cell_start_seconds_bucket", "+Inf")] == 2
    assert v[("chv_cell_start_seconds_count",)] == 2 and v[("chv_cell_start_seconds_sum",)] == 3.9125
    # chv-broker's requests: ping ok (evil.service's entry c13 not counted), a peer refusal, the browser and sync
    assert v[("chv_broker_requests_total", "ping", "ok")] == 1
    assert v[("chv_broker_requests_total", "none", "rejected")] == 1
    assert v[("chv_broker_requests_total", "other", "denied")] == 1  # an op no protocol has: other
    assert v[("chv_browser_requests_total", "open", "ok")] == 1 and v[("chv_browser_requests_total", "open", "denied")] == 1
    assert v[("chv_browser_request_seconds_bucket", "open", "2")] == 2
    assert v[("chv_browser_request_seconds_bucket", "open", "1")] == 1
    assert v[("chv_sync_requests_total", "push", "denied")] == 1
    assert ("chv_broker_requests_total", "none", "started") not in v  # the daemon's own start: no request
    assert fixture_events()["cursor"] == "c13"


def test_the_counts_survive_a_restart_and_go_on_from_the_cursor(tmp_path):
    counts = fixture_events()
    again = events.loads(events.dumps(counts))
    assert again == counts
    events.add_output(again, _read("journal.json").splitlines()[0] + "\n", ["slot0"])
    assert again["runs"]["slot0\x1fran"] == 2
    assert events.loads("not json") == events.empty() and events.loads(None) == events.empty()
    argv = events.journalctl_argv("journalctl", "c13")
    assert argv[argv.index("--after-cursor") + 1] == "c13"
    assert argv[-5:] == ["CHV_EVENT=chv-broker.audit", "_SYSTEMD_UNIT=chv-broker.service", "+",
                         "CHV_EVENT=chv-cell.run", "_UID=0"]
    assert "--after-cursor" not in events.journalctl_argv("journalctl", None)


FAKE_JOURNALCTL = """#!/bin/sh
# journalctl as on a guest (systemd 252): a cursor it cannot parse fails the run
for a in "$@"; do [ "$a" = garbage ] && { echo "Failed to seek to cursor: Invalid argument" >&2; exit 1; }; done
case " $* " in *" --after-cursor "*) exit 0;; esac  # nothing new after a good cursor
cat %(fixtures)s/journal.json
"""


def test_a_cursor_journalctl_refuses_restarts_the_counters_instead_of_stopping_them(tmp_path):
    argv = _guest(tmp_path)
    fake = tmp_path / "journalctl"
    fake.write_text(FAKE_JOURNALCTL % {"fixtures": FIXTURES})
    fake.chmod(0o755)
    kept = tmp_path / "events.json"
    argv += ["--journalctl", str(fake), "--events-state", str(kept), "--stdout"]
    counts = fixture_events()
    assert counts["cursor"] is not None and counts["runs"]
    # control: a good cursor and nothing new, the kept counts go on (doubled here, to tell them apart)
    counts["runs"] = dict((k, 2 * n) for k, n in counts["runs"].items())
    kept.write_text(events.dumps(counts))
    state_ok = collector.read_state(collector.parser().parse_args(argv))
    assert state_ok.events is not None and state_ok.events["runs"] == counts["runs"]
    # the cursor refused (as journalctl refuses "garbage"): the counters restart from the journal
    counts["cursor"] = "garbage"
    kept.write_text(events.dumps(counts))
    restarted = collector.read_state(collector.parser().parse_args(argv))
    assert restarted.events is not None and restarted.events["runs"] == fixture_events()["runs"]
    assert json.loads(kept.read_text())["cursor"] == fixture_events()["cursor"]  # and the new cursor is kept
    assert values(restarted)[("chv_metrics_source_up", "journal")] == 1


def test_an_unreadable_journal_reports_its_source_down_and_no_event_series():
    v = values(fixture_state(events=None))
    assert v[("chv_metrics_source_up", "journal")] == 0
    assert not [k for k in v if k[0].startswith(("chv_cell_runs", "chv_broker_requests"))]
