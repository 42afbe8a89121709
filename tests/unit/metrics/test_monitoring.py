"""What ships beside the collector for Prometheus and Grafana
(roles/metrics/files): the alert rules pass promtool check rules and their
tests (promtool test rules, chv-fleet.rules.test.yml); with table inet
chv_cell deleted, series recorded from the collector's own output fire
ChvCellTableMissing within the rule's "for" and not before; the rules, the
dashboard and docs/observability.md name only metrics the collector emits
(exposition.METRICS, the one list), with those metrics' own labels, and
the docs have a row for every one of them."""

import json
import os
import re
import shutil
import subprocess

import pytest
from promtool_path import promtool
import yaml

from chv_guest.metrics import exposition, state
from prom_text import alert_annotations, input_series
from test_collector import fixture_state

from testpaths import ROOT

FILES = os.path.join(ROOT, "roles", "metrics", "files")
RULES = os.path.join(FILES, "chv-fleet.rules.yml")
RULES_TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chv-fleet.rules.test.yml")
DASHBOARD = os.path.join(FILES, "chv-fleet.dashboard.json")
DOC = os.path.join(ROOT, "docs", "observability.md")
# a metric name in PromQL, and a selector's label matchers
METRIC = re.compile(r"\bchv_[a-z0-9_]+")
SELECTOR = re.compile(r"\b(chv_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
# what Prometheus adds to every scraped series
TARGET_LABELS = {"instance", "job"}
# names in the prose of annotations that are no metric: the table's
NOT_METRICS = {"chv_cell"}



def run_promtool(*args, cwd=None):
    proc = subprocess.run([promtool()] + list(args), capture_output=True, text=True, cwd=cwd, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def rules():
    with open(RULES, encoding="utf-8") as fh:
        return [r for g in yaml.safe_load(fh)["groups"] for r in g["rules"]]


def dashboard_exprs():
    with open(DASHBOARD, encoding="utf-8") as fh:
        dash = json.load(fh)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v.get("query"), dict) else v["query"]
              for v in dash["templating"]["list"] if v["type"] == "query"]
    return dash, exprs


def family(name):
    """The family name of a sample name (a histogram's _bucket, _sum and _count its own), or None."""
    try:
        return exposition.family_of(name)[0].name
    except ValueError:
        return None


def check_names(exprs):
    """The metrics and selector labels the expressions use that the collector does not emit."""
    bad = []
    for expr in exprs:
        bad += ["%s (no such metric)" % m for m in METRIC.findall(expr)
                if family(m) is None and m not in NOT_METRICS]
        for name, matchers in SELECTOR.findall(expr):
            if family(name) is not None:
                allowed = set(exposition.family_of(name)[1]) | TARGET_LABELS
                bad += ["%s{%s} (no such label)" % (name, lab) for lab in MATCHER.findall(matchers) if lab not in allowed]
    return bad


# ------------------------------------------------------------- the rules

def test_the_rules_pass_promtool_check_rules():
    rc, out = run_promtool("check", "rules", RULES)
    assert rc == 0 and "SUCCESS" in out, out


def test_the_rules_pass_their_promtool_tests():
    rc, out = run_promtool("test", "rules", os.path.basename(RULES_TEST), cwd=os.path.dirname(RULES_TEST))
    assert rc == 0 and "SUCCESS" in out, out


def test_every_rule_has_a_test_that_fires_it_and_one_that_does_not():
    with open(RULES_TEST, encoding="utf-8") as fh:
        tests = yaml.safe_load(fh)["tests"]
    checks = [c for t in tests for c in t["alert_rule_test"]]
    for rule in rules():
        mine = [c for c in checks if c["alertname"] == rule["alert"]]
        assert [c for c in mine if c["exp_alerts"]], "%s never fires in the tests" % rule["alert"]
        assert [c for c in mine if not c["exp_alerts"]] or rule["alert"] == "ChvAuditStale", \
            "%s is never shown quiet" % rule["alert"]


def test_the_rules_name_only_metrics_the_collector_emits():
    exprs = [r["expr"] for r in rules()] + [a for r in rules() for a in r.get("annotations", {}).values()]
    assert check_names(exprs) == []
    assert check_names(['chv_nft_table_gone == 0', 'chv_unit_state{host="x"}']) == [
        "chv_nft_table_gone (no such metric)", "chv_unit_state{host} (no such label)"]  # the check's own control


def _recorded(states, instance="g1"):
    """promtool input_series from the collector's samples of each state, one per interval (prom_text.input_series)."""
    return input_series([{(s.name, tuple(sorted((k, exposition.escape(v)) for k, v in s.labels))): s.value
                          for s in state.samples(st)} for st in states], instance)


def _annotations(alert, instance):
    with open(RULES, encoding="utf-8") as fh:
        return alert_annotations(yaml.safe_load(fh), alert, instance)


def test_the_table_deleted_fires_the_alert_on_series_recorded_from_the_collector(tmp_path):
    """Three minutes of a healthy guest, then table inet chv_cell deleted (nft lists no table, no
    counters): the collector's own samples, one every 30 s, as the series Prometheus would scrape."""
    healthy = [fixture_state(now=30.0 * i) for i in range(6)]
    deleted = [fixture_state(now=30.0 * i, table_listing=None, counters_json=None) for i in range(6, 14)]
    assert [s for s in _recorded(healthy + deleted) if s["series"].startswith("chv_nft_table_present")] == [
        {"series": 'chv_nft_table_present{instance="g1",job="node"}', "values": "1 1 1 1 1 1 0 0 0 0 0 0 0 0"}]
    missing = {"alertname": "ChvCellTableMissing", "exp_alerts": [
        {"exp_labels": {"severity": "critical", "instance": "g1", "job": "node"},
         "exp_annotations": _annotations("ChvCellTableMissing", "g1")}]}
    doc = {"rule_files": [RULES], "evaluation_interval": "30s", "tests": [{
        "interval": "30s", "input_series": _recorded(healthy + deleted),
        "alert_rule_test": [
            # the positive control: the healthy guest fires nothing of the table's
            {"eval_time": "2m30s", "alertname": "ChvCellTableMissing", "exp_alerts": []},
            {"eval_time": "2m30s", "alertname": "ChvCellTableChanged", "exp_alerts": []},
            {"eval_time": "2m30s", "alertname": "ChvCellRulesetStale", "exp_alerts": []},
            # deleted at 3 min: pending, then firing once "for: 1m" has passed
            {"eval_time": "3m30s", "alertname": "ChvCellTableMissing", "exp_alerts": []},
            dict(missing, eval_time="4m"),
            dict(missing, eval_time="6m30s"),
            # missing is not also reported as changed
            {"eval_time": "6m30s", "alertname": "ChvCellTableChanged", "exp_alerts": []},
        ]}]}
    path = tmp_path / "recorded.test.yml"
    path.write_text(json.dumps(doc, indent=1))
    rc, out = run_promtool("test", "rules", str(path))
    assert rc == 0 and "SUCCESS" in out, out
    # and the test is evidence: with the table never deleted, the firing expectation fails
    doc["tests"][0]["input_series"] = _recorded(healthy + [fixture_state(now=30.0 * i) for i in range(6, 14)])
    path.write_text(json.dumps(doc, indent=1))
    rc, out = run_promtool("test", "rules", str(path))
    assert rc != 0 and "ChvCellTableMissing" in out, out


# ------------------------------------------------------------- the dashboard

def test_the_dashboard_queries_name_only_metrics_the_collector_emits():
    dash, exprs = dashboard_exprs()
    assert len(exprs) >= 10
    assert check_names(exprs) == []
    used = {family(m) for e in exprs for m in METRIC.findall(e)}
    # every family has a panel, but the info metric's policy label needs none of its own
    assert set(exposition.FAMILIES) - used == set(), sorted(set(exposition.FAMILIES) - used)


def test_the_dashboard_is_importable_grafana_json():
    dash, _exprs = dashboard_exprs()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "chv-fleet"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    assert all(t["refId"] for p in dash["panels"] for t in p["targets"])


# ------------------------------------------------------------- the docs

def test_the_docs_have_a_row_for_every_metric_and_none_for_others():
    with open(DOC, encoding="utf-8") as fh:
        rows = re.findall(r"^\| `(chv_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", fh.read(), re.M)
    assert sorted(name for name, _ in rows) == sorted(exposition.FAMILIES)
    assert all(exposition.FAMILIES[name].type == kind for name, kind in rows)
