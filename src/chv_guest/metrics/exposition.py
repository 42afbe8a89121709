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
    """One metric family: its name, type (gauge, counter or histogram),
    help text and the exact label names of its samples (a histogram's
    buckets take le besides)."""
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
SOURCES = ("policy", "cells", "nft", "units", "audit", "journal")

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
    # counted from the journal's entries (chv_guest/metrics/events.py)
    Family("chv_cell_runs_total", "counter",
           "chv-cell runs by slot (none: refused before a claim) and verdict (the --status-fd verdicts).",
           ("slot", "verdict")),
    Family("chv_cell_payload_exits_total", "counter",
           "Payloads that ran to their end, by slot and exit code class (0, 1-125, 126-127, 128-255).",
           ("slot", "code")),
    Family("chv_cell_start_seconds", "histogram",
           "From a run's start to its payload's release (the cold start, or a warm cell's hand-over).", ()),
    Family("chv_broker_requests_total", "counter",
           "chv-broker's connections by operation (none: refused before a request was read) and verdict "
           "(ok, denied, busy, rejected: the peer check, bad-request, error).", ("op", "verdict")),
    Family("chv_browser_requests_total", "counter",
           "The browser operation's requests through chv-broker by action and verdict.", ("action", "verdict")),
    Family("chv_browser_request_seconds", "histogram",
           "How long the browser operation's requests took, by action.", ("action",)),
    Family("chv_sync_requests_total", "counter",
           "The sync operation's requests through chv-broker by action and verdict.", ("action", "verdict")),
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


HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_of(name: str) -> Tuple[Family, Tuple[str, ...]]:
    """The family of a sample name (a histogram's by its _bucket, _sum or
    _count), and the label names its samples take (a bucket's: le too)."""
    family = FAMILIES.get(name)
    if family is not None and family.type != "histogram":
        return family, family.labels
    for suffix in HISTOGRAM_SUFFIXES:
        base = FAMILIES.get(name[:-len(suffix)]) if name.endswith(suffix) else None
        if base is not None and base.type == "histogram":
            return base, base.labels + (("le",) if suffix == "_bucket" else ())
    raise ValueError("no metric family %s" % name)


def sample(name: str, value: float, **labels: str) -> Sample:
    """A sample of a family of METRICS, its labels in the family's order;
    ValueError for an unknown family or other label names than its own.
    A histogram's samples are named with _bucket (label le), _sum, _count."""
    family, names = family_of(name)
    if set(labels) != set(names):
        raise ValueError("%s takes the labels %s, not %s"
                         % (name, ", ".join(names) or "none", ", ".join(sorted(labels)) or "none"))
    return Sample(name, tuple((k, labels[k]) for k in names), float(value))


def _order(s: Sample) -> Tuple[Labels, int, float]:
    """A family's samples in the text's order: by labels, then a histogram's
    buckets by le (numerically), then _sum and _count."""
    other = tuple((k, v) for k, v in s.labels if k != "le")
    le = dict(s.labels).get("le")
    rank = next((i for i, suffix in enumerate(HISTOGRAM_SUFFIXES) if s.name.endswith(suffix)), 0)
    return other, rank, (math.inf if le == "+Inf" else float(le)) if le is not None else 0.0


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
    by_family: Dict[str, Dict[Tuple[str, Labels], Sample]] = {}
    for s in samples:
        try:
            family, names = family_of(s.name)
        except ValueError:
            family, names = None, ()
        if family is None or tuple(k for k, dummy in s.labels) != names:
            raise ValueError("%s%r is not a sample of METRICS" % (s.name, s.labels))
        seen = by_family.setdefault(family.name, {})
        if (s.name, s.labels) in seen:
            raise ValueError("%s%r given twice" % (s.name, s.labels))
        seen[(s.name, s.labels)] = s
    lines: List[str] = []
    for family in METRICS:
        if family.name not in by_family:
            continue
        lines.append("# HELP %s %s" % (family.name, family.help.replace("\\", "\\\\").replace("\n", "\\n")))
        lines.append("# TYPE %s %s" % (family.name, family.type))
        for s in sorted(by_family[family.name].values(), key=_order):
            text = ",".join('%s="%s"' % (k, escape(v)) for k, v in s.labels)
            lines.append("%s%s %s" % (s.name, "{%s}" % text if text else "", number(s.value)))
    return "\n".join(lines) + "\n" if lines else ""
