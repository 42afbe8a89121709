# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet audit report (playbooks/audit.yml): every host's ``chv-cell
audit`` report joined into one case-by-host matrix, with each host's verdict
judged here, on the controller, by one rule: every case passed beside its
control, or (a skip) its ID is in the operator's reviewed list of allowed
skips with a reason. A host without a report (unreachable, or the audit did
not run) fails. Pure functions; the filter chv.fleet.fleet_report calls
``build`` and the renderers."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import json
import os
import re
import xml.etree.ElementTree as ET

# what the header of a host's report carries that the fleet report shows per host
HEADER_KEYS = ("collection_version", "commit", "os", "kernel", "systemd", "policy_sha256", "launcher_sha256", "time")
CASE_ID = re.compile(r"^[A-Z]+-[0-9]{2}(/[0-9]{2})?$")


HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$")
URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
TARGETS = ("chv_fleet_audit_allow", "chv_fleet_audit_deny", "chv_fleet_audit_special")


def check_settings(settings):
    """Errors of the audit's settings ({variable: value}), each naming the
    variable and the bad value; [] when all are good."""
    errors = []
    for name in TARGETS:
        value = settings.get(name, [])
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            errors.append("%s must be a list of HOST:PORT or [IPv6]:PORT strings, got %s" % (name, json.dumps(value)))
            continue
        for item in value:
            if not isinstance(item, str) or not HOST_PORT.match(item) or not 0 < int(item.rsplit(":", 1)[1]) < 65536:
                errors.append("%s: %s is not HOST:PORT or [IPv6]:PORT (port 1-65535)" % (name, json.dumps(item)))
    url = settings.get("chv_fleet_audit_allow_url", "")
    if not isinstance(url, str) or (url and not URL.match(url)):
        errors.append("chv_fleet_audit_allow_url must be an http:// or https:// URL or empty, got %s" % json.dumps(url))
    runs = settings.get("chv_fleet_audit_runs", 1)
    if isinstance(runs, str) and runs.isdigit():
        runs = int(runs)  # -e key=value gives strings
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        errors.append("chv_fleet_audit_runs must be a whole number >= 1, got %s" % json.dumps(runs))
    trusted = settings.get("chv_fleet_audit_trusted", [])
    if isinstance(trusted, (str, bytes)) or not isinstance(trusted, (list, tuple)) or \
            not all(isinstance(t, str) and t.startswith("/") for t in trusted):
        errors.append("chv_fleet_audit_trusted must be a list of absolute paths, got %s" % json.dumps(trusted))
    return errors + check_allowed_skips(settings.get("chv_fleet_audit_allowed_skips", {}))


def read_reports(hosts, report_dir):
    """{host: its fetched audit.json, or None when there is none or it is not a report}."""
    out = {}
    for host in hosts:
        try:
            with open(os.path.join(report_dir, "hosts", host, "audit.json")) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = None
        out[host] = data if isinstance(data, dict) else None
    return out


def check_allowed_skips(allowed):
    """Errors of the allowed-skips setting: {case ID: reason}, each reason non-empty."""
    if not isinstance(allowed, dict):
        return ["chv_fleet_audit_allowed_skips must be a dict of case ID to reason, got %s" % json.dumps(allowed)]
    errors = []
    for cid, reason in sorted(allowed.items(), key=lambda kv: str(kv[0])):
        if not isinstance(cid, str) or not CASE_ID.match(cid):
            errors.append("chv_fleet_audit_allowed_skips: %s is not a case ID (for example LIM-02)" % json.dumps(cid))
        if not isinstance(reason, str) or not reason.strip():
            errors.append("chv_fleet_audit_allowed_skips: %s needs a reason (why the case cannot run on these hosts), "
                          "got %s" % (cid, json.dumps(reason)))
    return errors


def judge(report, allowed):
    """(verdict, [bad cases]) of one host's report: "passed", or "failed" with
    each case that neither passed nor is an allowed skip."""
    if not isinstance(report, dict) or not isinstance(report.get("cases"), list) or not report["cases"]:
        return "failed", [{"id": "-", "verdict": "error",
                           "why": "no report: the host was unreachable, is not Linux, or the audit did not run or wrote nothing"}]
    bad = []
    for case in report["cases"]:
        verdict = case.get("verdict")
        if verdict == "pass" or (verdict == "skip" and case.get("id") in allowed):
            continue
        why = case.get("control") if verdict == "error" else case.get("probe")
        if verdict == "skip":
            why = "skipped, and not in chv_fleet_audit_allowed_skips: %s" % (case.get("probe") or "")
        bad.append({"id": case.get("id"), "verdict": verdict, "why": one_line(why or "")})
    return ("failed" if bad else "passed"), bad


def one_line(text, limit=2000):
    text = " / ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def build(hosts, reports, allowed, labels=None):
    """The fleet report: ``hosts`` every host the audit targeted (play order),
    ``reports`` {host: its audit.json or None}, ``allowed`` {host: {case ID:
    reason}} (each host's own, from its inventory), ``labels`` what the
    controller adds (collection version, commit)."""
    labels = dict(labels or {})
    case_ids = []
    for host in hosts:
        for case in (reports.get(host) or {}).get("cases") or []:
            if case.get("id") not in case_ids:
                case_ids.append(case.get("id"))
    out_hosts = []
    for host in hosts:
        rep = reports.get(host)
        host_allowed = allowed.get(host) or {}
        verdict, bad = judge(rep, host_allowed)
        header = (rep or {}).get("header") or {}
        verdicts = dict((c.get("id"), c.get("verdict")) for c in (rep or {}).get("cases") or [])
        out_hosts.append({
            "host": host, "verdict": verdict, "bad": bad,
            "header": dict((k, header.get(k, "")) for k in HEADER_KEYS),
            "counts": (rep or {}).get("counts") or {},
            "verdicts": verdicts,
            "allowed_skips": dict(host_allowed),
            "skips": [{"id": c.get("id"), "reason": one_line(c.get("probe") or ""),
                       "allowed": c.get("id") in host_allowed}
                      for c in (rep or {}).get("cases") or [] if c.get("verdict") == "skip"],
        })
    failed = [h["host"] for h in out_hosts if h["verdict"] != "passed"]
    return {"verdict": "failed" if failed else "passed", "failed_hosts": failed, "labels": labels,
            "cases": case_ids, "hosts": out_hosts}


def failure_message(fleet):
    """One line per failing host, naming its failing cases."""
    parts = []
    for h in fleet["hosts"]:
        if h["verdict"] == "passed":
            continue
        if not h["verdicts"]:
            parts.append("%s: no report (unreachable, not Linux, or the audit did not run)" % h["host"])
        else:
            parts.append("%s: %s" % (h["host"], ", ".join("%s %s" % (b["id"], b["verdict"].upper()) for b in h["bad"])))
    return "; ".join(parts)


_MARK = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "skip": "skip", None: "-"}


def to_markdown(fleet):
    lines = ["# chv.fleet audit: %s" % fleet["verdict"].upper(), ""]
    lines.append("%d hosts, %d passed, %d failed%s" % (
        len(fleet["hosts"]), len(fleet["hosts"]) - len(fleet["failed_hosts"]), len(fleet["failed_hosts"]),
        (": " + ", ".join(fleet["failed_hosts"])) if fleet["failed_hosts"] else ""))
    lines += [""] + ["- %s: %s" % (k, v) for k, v in sorted(fleet["labels"].items())]
    allowed = [(h["host"], k, v) for h in fleet["hosts"] for k, v in sorted(h["allowed_skips"].items())]
    if allowed:
        lines += ["", "Skips allowed by the inventory (chv_fleet_audit_allowed_skips):", ""]
        lines += ["- %s %s: %s" % item for item in allowed]
    lines += ["", "## Hosts", "", "| host | verdict | passed | failed | errors | skipped | %s |" % " | ".join(HEADER_KEYS),
              "|---|---|---:|---:|---:|---:|%s" % ("---|" * len(HEADER_KEYS))]
    for h in fleet["hosts"]:
        c = h["counts"]
        lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            h["host"], h["verdict"].upper(), c.get("pass", "-"), c.get("fail", "-"), c.get("error", "-"),
            c.get("skip", "-"), " | ".join(cell(h["header"].get(k, "")) for k in HEADER_KEYS)))
    lines += ["", "## Cases by host", "", "| case | %s |" % " | ".join(h["host"] for h in fleet["hosts"]),
              "|---|%s" % ("---|" * len(fleet["hosts"]))]
    for cid in fleet["cases"]:
        lines.append("| %s | %s |" % (cid, " | ".join(_MARK.get(h["verdicts"].get(cid)) for h in fleet["hosts"])))
    lines += ["", "## Failures, errors and skips", ""]
    any_line = False
    for h in fleet["hosts"]:
        for b in h["bad"]:
            lines.append("- %s %s %s: %s" % (h["host"], b["id"], b["verdict"].upper(), cell(b["why"])))
            any_line = True
        for s in h["skips"]:
            if s["allowed"]:
                lines.append("- %s %s skip (allowed): %s" % (h["host"], s["id"], cell(s["reason"])))
                any_line = True
    if not any_line:
        lines.append("none")
    return "\n".join(lines) + "\n"


def cell(text):
    return str(text).replace("|", "/").replace("\n", " ")


def to_junit(fleet):
    suites = ET.Element("testsuites", name="chv.fleet audit")
    for h in fleet["hosts"]:
        bad = dict((b["id"], b) for b in h["bad"])
        ids = list(h["verdicts"]) or ["-"]
        suite = ET.SubElement(suites, "testsuite", name=h["host"], tests=str(len(ids)),
                              failures=str(sum(1 for b in h["bad"] if b["verdict"] in ("fail", "skip"))),
                              errors=str(sum(1 for b in h["bad"] if b["verdict"] == "error")),
                              skipped=str(sum(1 for s in h["skips"] if s["allowed"])))
        props = ET.SubElement(suite, "properties")
        for k in HEADER_KEYS:
            ET.SubElement(props, "property", name=k, value=str(h["header"].get(k, "")))
        for cid in ids:
            case = ET.SubElement(suite, "testcase", classname=h["host"], name=cid)
            if cid in bad:
                tag = "error" if bad[cid]["verdict"] == "error" else "failure"
                ET.SubElement(case, tag, message=bad[cid]["why"][:200]).text = bad[cid]["why"]
            elif h["verdicts"].get(cid) == "skip":
                ET.SubElement(case, "skipped", message=h["allowed_skips"].get(cid, ""))
    return ET.tostring(suites, encoding="unicode") + "\n"


def to_json(fleet):
    return json.dumps(fleet, indent=2, sort_keys=True) + "\n"
