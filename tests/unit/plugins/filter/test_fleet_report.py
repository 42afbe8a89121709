"""chv.fleet.fleet_report and chv.fleet.audit_settings_errors (the fleet
audit, playbooks/audit.yml): each host judged by one rule, the matrix and
the failing cases named, the settings checked before any host is audited."""

import json
import xml.etree.ElementTree as ET

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.fleet_report import audit_settings_errors, fleet_report

HEADER = {"guest": "g", "kernel": "6.1.0", "systemd": "systemd 252 (252.38-1)", "os": "Debian 12",
          "policy_sha256": "p" * 64, "launcher_sha256": "l" * 64, "time": "2026-12-02T12:00:00Z",
          "collection_version": "0.3.0", "commit": "abc"}


def _case(cid, verdict, probe="probe evidence", control="control evidence"):
    return {"id": cid, "area": cid.split("-")[0].lower(), "title": "t " + cid, "verdict": verdict,
            "probe": probe, "control": control}


def _report(*cases):
    counts = dict((v, sum(1 for c in cases if c["verdict"] == v)) for v in ("pass", "fail", "error", "skip"))
    return {"verdict": "x", "exit": 0, "counts": counts, "header": HEADER, "cases": list(cases)}


def _write(tmp_path, reports):
    for host, rep in reports.items():
        d = tmp_path / "hosts" / host
        d.mkdir(parents=True)
        (d / "audit.json").write_text(rep if isinstance(rep, str) else json.dumps(rep))
    return str(tmp_path)


def test_all_passed_on_every_host(tmp_path):
    good = _report(_case("FS-01", "pass"), _case("NET-01", "pass"))
    out = fleet_report(["a", "b"], _write(tmp_path, {"a": good, "b": good}), {}, {"commit": "abc"})
    assert out["verdict"] == "passed" and out["failed_hosts"] == [] and out["message"] == ""
    assert "# chv.fleet audit: PASSED" in out["markdown"] and "2 hosts, 2 passed, 0 failed" in out["markdown"]
    assert "| FS-01 | pass | pass |" in out["markdown"]
    assert "6.1.0" in out["markdown"] and "p" * 64 in out["markdown"]
    fleet = json.loads(out["json"])
    assert [h["verdict"] for h in fleet["hosts"]] == ["passed", "passed"]
    assert fleet["labels"] == {"commit": "abc"}


def test_a_failing_host_is_named_with_its_failing_cases_and_the_others_still_pass(tmp_path):
    good = _report(_case("NET-01", "pass"), _case("NET-02", "pass"), _case("LIM-02", "pass"))
    bad = _report(_case("NET-01", "fail", probe="reached 192.0.2.1:80"), _case("NET-02", "error", control="no table"),
                  _case("LIM-02", "pass"))
    out = fleet_report(["a", "b", "c"], _write(tmp_path, {"a": good, "b": bad, "c": good}), {}, {})
    assert out["verdict"] == "failed" and out["failed_hosts"] == ["b"]
    assert out["message"] == "b: NET-01 FAIL, NET-02 ERROR"
    assert "| NET-01 | pass | **FAIL** | pass |" in out["markdown"]
    assert "- b NET-01 FAIL: reached 192.0.2.1:80" in out["markdown"]
    assert "- b NET-02 ERROR: no table" in out["markdown"]
    suites = ET.fromstring(out["junit"])
    b = next(s for s in suites if s.get("name") == "b")
    assert (b.get("failures"), b.get("errors")) == ("1", "1")
    assert [s.get("failures") for s in suites if s.get("name") != "b"] == ["0", "0"]


def test_a_skip_fails_unless_the_host_allows_that_case_with_a_reason(tmp_path):
    rep = _report(_case("FS-01", "pass"), _case("LIM-02", "skip", probe="needs the pids controller"))
    d = _write(tmp_path, {"a": rep, "b": rep})
    out = fleet_report(["a", "b"], d, {"a": {"LIM-02": "no pids controller in the lab"}}, {})
    assert out["failed_hosts"] == ["b"]
    assert out["message"] == "b: LIM-02 SKIP"
    assert "skipped, and not in chv_fleet_audit_allowed_skips: needs the pids controller" in out["markdown"]
    assert "- a LIM-02 skip (allowed): needs the pids controller" in out["markdown"]
    assert "- a LIM-02: no pids controller in the lab" in out["markdown"]
    with pytest.raises(AnsibleFilterError, match="a: chv_fleet_audit_allowed_skips: LIM-02 needs a reason"):
        fleet_report(["a"], d, {"a": {"LIM-02": ""}}, {})


@pytest.mark.parametrize("content", [None, "", "not json", json.dumps({"cases": []}), json.dumps([1])])
def test_a_host_without_a_report_fails(tmp_path, content):
    good = _report(_case("FS-01", "pass"))
    reports = {"a": good}
    if content is not None:
        reports["b"] = content
    out = fleet_report(["a", "b"], _write(tmp_path, reports), {}, {})
    assert out["failed_hosts"] == ["b"]
    assert out["message"] == "b: no report (unreachable, not Linux, or the audit did not run)"
    assert "no report: the host was unreachable, is not Linux, or the audit did not run" in out["markdown"]
    # what the controller knows is not what the host ran: its row carries no version or digest
    assert json.loads(out["json"])["hosts"][1]["header"]["policy_sha256"] == ""


@pytest.mark.parametrize("hosts, report_dir, allowed, labels, needle", [
    ("a", "/x", {}, {}, "list of the audited hosts"),
    (["a"], "", {}, {}, "report_dir"),
    (["a"], "/x", [], {}, "allowed_skips must be"),
    (["a"], "/x", {"a": {"not an id": "why"}}, {}, "is not a case ID"),
    (["a"], "/x", {}, "commit", "labels must be a dict"),
])
def test_bad_arguments_are_named(hosts, report_dir, allowed, labels, needle):
    with pytest.raises(AnsibleFilterError, match=needle):
        fleet_report(hosts, report_dir, allowed, labels)


def test_good_settings_pass():
    assert audit_settings_errors({
        "chv_fleet_audit_allow": ["192.0.2.10:443", "[2001:db8::1]:443", "git.example.com:22"],
        "chv_fleet_audit_deny": [], "chv_fleet_audit_special": ["198.18.254.254:18772"],
        "chv_fleet_audit_allow_url": "http://192.0.2.10:18770/", "chv_fleet_audit_runs": "5",
        "chv_fleet_audit_trusted": ["/etc/chv-fleet/nft/cell-nat.nft"],
        "chv_fleet_audit_allowed_skips": {"LIM-02": "no pids controller"}}) == []


@pytest.mark.parametrize("name, value, needle", [
    ("chv_fleet_audit_allow", "192.0.2.10:443", 'chv_fleet_audit_allow must be a list of HOST:PORT or [IPv6]:PORT '
                                                'strings, got "192.0.2.10:443"'),
    ("chv_fleet_audit_deny", ["192.0.2.10"], 'chv_fleet_audit_deny: "192.0.2.10" is not HOST:PORT'),
    ("chv_fleet_audit_special", ["198.18.0.1:70000"], 'chv_fleet_audit_special: "198.18.0.1:70000" is not'),
    ("chv_fleet_audit_allow_url", "ftp://x/", 'chv_fleet_audit_allow_url must be an http:// or https:// URL or empty, '
                                              'got "ftp://x/"'),
    ("chv_fleet_audit_runs", 0, "chv_fleet_audit_runs must be a whole number >= 1, got 0"),
    ("chv_fleet_audit_runs", "many", 'chv_fleet_audit_runs must be a whole number >= 1, got "many"'),
    ("chv_fleet_audit_trusted", "/etc/x", 'chv_fleet_audit_trusted must be a list of absolute paths, got "/etc/x"'),
    ("chv_fleet_audit_allowed_skips", ["LIM-02"], "chv_fleet_audit_allowed_skips must be a dict of case ID to reason"),
    ("chv_fleet_audit_allowed_skips", {"LIM-02": " "}, "LIM-02 needs a reason"),
])
def test_each_bad_setting_is_named_with_its_value(name, value, needle):
    errors = audit_settings_errors({name: value})
    assert len(errors) == 1 and needle in errors[0], errors
