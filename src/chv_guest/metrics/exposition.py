"""The metric families chv-fleet-metrics emits and the Prometheus text
exposition format (version 0.0.4) they are written in.

``METRICS`` is the one list of the collector's metrics: every sample is
checked against it (name and label names) before it is written, the
Grafana dashboard's and the alert rules' tests read it, and
docs/observability.md has a row for each. Labels are bounded by
construction: slot, reason, verdict, unit, state, case, source, and the
info metric's version and policy digest; never hosts, URLs, pids or task
ids."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, NamedTuple, Tuple

Labels = Tuple[Tuple[str, str], ...]


class Family(NamedTuple):
    """One metric family: its name, type (gauge or counter), help text and
    the exact label names of its samples."""
    name: str
    type: str
    help: str
    labels: Tuple[str, ...]


class Sample(NamedTuple):
    """One sample: the family's name, its labels (name, value) and its value."""
    name: str
    labels: Labels
    value: float


# The states systemd reports as ActiveState (one sample each per unit, 1 for the current one).
UNIT_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating")
# A case's verdict in the audit report (chv_guest/cell/audit.py), and the report's own.
CASE_VERDICTS = ("pass", "fail", "error", "skip")
REPORT_VERDICTS = ("passed", "failed", "error")
# What the collector reads, each reported by chv_metrics_source_up.
SOURCES = ("policy", "cells", "nft", "units", "audit")

METRICS: Tuple[Family, ...] = (
    Family("chv_fleet_info", "gauge",
           "Always 1: the collection version that installed the collector and the sha256 of the cell policy.",
           ("version", "policy_sha256")),
    Family("chv_cell_slots", "gauge", "Slots in the cell policy.", ()),
    Family("chv_cell_running", "gauge",
           "1 when the slot has a live cell (its record in the state directory and its leader process).", ("slot",)),
    Family("chv_cell_stale_record", "gauge",
           "1 when the slot's cell record names a process that is gone (a launcher killed before its cleanup).",
           ("slot",)),
    Family("chv_cell_start_time_seconds", "gauge", "When the slot's running cell started (Unix time).", ("slot",)),
    Family("chv_cell_cordoned", "gauge",
           "1 when the host is cordoned (chv-cell cordon): new cells are refused, running ones go on.", ()),
    Family("chv_nft_table_present", "gauge", "1 when table inet chv_cell is loaded.", ()),
    Family("chv_nft_ruleset_applied", "gauge",
           "1 when the ruleset files (cell-nat.nft and the door drop-ins) are those chv-cell-nat.service last loaded "
           "(loaded.sha256).", ()),
    Family("chv_nft_table_unchanged", "gauge",
           "1 when table inet chv_cell, listed without counters, is what chv-cell-nat.service loaded (table.sha256).",
           ()),
    Family("chv_nft_packets_total", "counter",
           "Packets counted by the named counter of a verdict and reason of table inet chv_cell.", ("verdict", "reason")),
    Family("chv_nft_bytes_total", "counter",
           "Bytes counted by the named counter of a verdict and reason of table inet chv_cell.", ("verdict", "reason")),
    Family("chv_nft_slot_packets_total", "counter",
           "Packets of a slot's cell accepted or dropped by table inet chv_cell.", ("slot", "verdict")),
    Family("chv_nft_slot_bytes_total", "counter",
           "Bytes of a slot's cell accepted or dropped by table inet chv_cell.", ("slot", "verdict")),
    Family("chv_unit_loaded", "gauge", "1 when systemd has the unit loaded (installed).", ("unit",)),
    Family("chv_unit_state", "gauge", "1 for the unit's current ActiveState, 0 for the others.", ("unit", "state")),
    Family("chv_unit_restarts_total", "counter", "Automatic restarts of the unit (systemd's NRestarts).", ("unit",)),
    Family("chv_audit_report_present", "gauge", "1 when the last audit report (audit.json) can be read.", ()),
    Family("chv_audit_timestamp_seconds", "gauge", "When the last audit ran (Unix time, the report's header).", ()),
    Family("chv_audit_verdict", "gauge", "1 for the last audit's verdict, 0 for the others.", ("verdict",)),
    Family("chv_audit_case_verdict", "gauge", "1 for each audit case's verdict in the last report, 0 for the others.",
           ("case", "verdict")),
    Family("chv_audit_policy_current", "gauge",
           "1 when the last audit ran against the cell policy in place now (its policy_sha256).", ()),
    Family("chv_metrics_source_up", "gauge", "1 when the collector could read the source.", ("source",)),
    Family("chv_metrics_collect_timestamp_seconds", "gauge", "When the collector wrote this file (Unix time).", ()),
    Family("chv_metrics_collect_duration_seconds", "gauge", "How long the collector took to read the sources.", ()),
)
FAMILIES: Dict[str, Family] = {f.name: f for f in METRICS}


def sample(name: str, value: float, **labels: str) -> Sample:
    """A sample of a family of METRICS, its labels in the family's order;
    ValueError for an unknown family or other label names than its own."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError("no metric family %s" % name)
    if set(labels) != set(family.labels):
        raise ValueError("%s takes the labels %s, not %s"
                         % (name, ", ".join(family.labels) or "none", ", ".join(sorted(labels)) or "none"))
    return Sample(name, tuple((k, labels[k]) for k in family.labels), float(value))


def escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2 ** 53:
        return "%d" % value
    return repr(value)


def render(samples: Iterable[Sample]) -> str:
    """The exposition text: each family with samples, in METRICS' order,
    its HELP and TYPE lines, then its samples sorted by labels. A family's
    sample given twice with the same labels is a ValueError."""
    by_family: Dict[str, Dict[Labels, float]] = {}
    for s in samples:
        if s.name not in FAMILIES or tuple(k for k, dummy in s.labels) != FAMILIES[s.name].labels:
            raise ValueError("%s%r is not a sample of METRICS" % (s.name, s.labels))
        seen = by_family.setdefault(s.name, {})
        if s.labels in seen:
            raise ValueError("%s%r given twice" % (s.name, s.labels))
        seen[s.labels] = s.value
    lines: List[str] = []
    for family in METRICS:
        if family.name not in by_family:
            continue
        lines.append("# HELP %s %s" % (family.name, family.help.replace("\\", "\\\\").replace("\n", "\\n")))
        lines.append("# TYPE %s %s" % (family.name, family.type))
        for labels, value in sorted(by_family[family.name].items()):
            text = ",".join('%s="%s"' % (k, escape(v)) for k, v in labels)
            lines.append("%s%s %s" % (family.name, "{%s}" % text if text else "", number(value)))
    return "\n".join(lines) + "\n" if lines else ""
