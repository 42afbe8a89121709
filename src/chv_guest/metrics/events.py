"""Event counters from the journal: the launcher's run entries
(``chv-cell.run``, cell/launcher.py) and chv-broker's audit entries
(``chv-broker.audit``), both with CHV_* fields (chv_guest/journal.py).

The collector reads the entries written since its last run (journalctl
--after-cursor) and adds them to the counts it keeps in a state file
beside its output; ``add`` and ``samples`` are pure. Every label value is
one of a fixed set (a slot of the policy, a verdict, an operation or
action of the wire protocol; anything else is ``other``), so the series
stay bounded whatever a cell sends."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from ..cell.status import VERDICTS as RUN_VERDICTS
from ..wire.protocol import BROWSER_ACTIONS, OPS, SYNC_ACTIONS
from .exposition import Sample, sample

RUN_EVENT = "chv-cell.run"  # as cell/launcher.py RUN_EVENT (the collector does not import the launcher)
BROKER_EVENT = "chv-broker.audit"  # as broker/server.py AUDIT_EVENT
BROKER_VERDICTS = ("ok", "denied", "busy", "rejected", "bad-request", "error")
OTHER, NONE = "other", "none"
START_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
BROWSER_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
EXIT_CLASSES = ((0, 0, "0"), (1, 125, "1-125"), (126, 127, "126-127"), (128, 255, "128-255"))

Counts = Dict[str, Any]


def empty() -> Counts:
    """Counts before any entry: the journal cursor and one table per metric (JSON-serialisable)."""
    return {"cursor": None, "runs": {}, "exits": {}, "start": _histogram(START_BUCKETS), "broker": {},
            "browser": {}, "browser_seconds": {}, "sync": {}}


def _histogram(bounds: Sequence[float]) -> Dict[str, Any]:
    return {"buckets": [0] * len(bounds), "sum": 0.0, "count": 0}


def _observe(h: Dict[str, Any], bounds: Sequence[float], value: float) -> None:
    for i, bound in enumerate(bounds):
        if value <= bound:
            h["buckets"][i] += 1
    h["sum"] += value
    h["count"] += 1


def _one_of(value: Optional[str], allowed: Iterable[str], none: str = NONE) -> str:
    if not value:
        return none
    return value if value in allowed else OTHER


def _bump(table: Dict[str, int], *labels: str) -> None:
    key = "\x1f".join(labels)
    table[key] = table.get(key, 0) + 1


def _number(value: Optional[str]) -> Optional[float]:
    try:
        n = float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
    return n if n is not None and math.isfinite(n) and n >= 0 else None


def exit_class(code: int) -> str:
    """The class of a payload's exit code (pure): 0, 1-125, 126-127 or 128-255."""
    return next((name for low, high, name in EXIT_CLASSES if low <= code <= high), OTHER)


def add(counts: Counts, entry: Mapping[str, Any], slots: Iterable[str]) -> None:
    """Count one journal entry (journalctl -o json's object) into ``counts``;
    ``slots``: the policy's slot names (other slot values count as other)."""
    event = entry.get("CHV_EVENT")
    writer = TRUSTED.get(event) if isinstance(event, str) else None
    if writer is None or entry.get(writer[0]) != writer[1]:
        return  # not one of ours, or from another writer than its own (journalctl's matches say the same)
    if event == RUN_EVENT:
        slot = _one_of(entry.get("CHV_SLOT"), slots)
        _bump(counts["runs"], slot, _one_of(entry.get("CHV_VERDICT"), RUN_VERDICTS, OTHER))
        code = _number(entry.get("CHV_PAYLOAD_EXIT"))
        if code is not None and code == int(code):
            _bump(counts["exits"], slot, exit_class(int(code)))
        started = _number(entry.get("CHV_START_MS"))
        if started is not None:
            _observe(counts["start"], START_BUCKETS, started / 1000.0)
    elif event == BROKER_EVENT:
        op, verdict = entry.get("CHV_OP"), entry.get("CHV_VERDICT")
        if verdict in ("started", "thawed", "reaped"):  # the daemon's own events, no request
            return
        verdict_label = _one_of(verdict, BROKER_VERDICTS, OTHER)
        _bump(counts["broker"], _one_of(op, OPS), verdict_label)
        if op == "browser":
            action = _one_of(entry.get("CHV_ACTION"), BROWSER_ACTIONS)
            _bump(counts["browser"], action, verdict_label)
            took = _number(entry.get("CHV_DURATION_MS"))
            if took is not None:
                h = counts["browser_seconds"].setdefault(action, _histogram(BROWSER_BUCKETS))
                _observe(h, BROWSER_BUCKETS, took / 1000.0)
        elif op == "sync":
            _bump(counts["sync"], _one_of(entry.get("CHV_ACTION"), SYNC_ACTIONS), verdict_label)


def _histogram_samples(name: str, h: Mapping[str, Any], bounds: Sequence[float], **labels: str) -> List[Sample]:
    out = [sample(name + "_bucket", n, le="%g" % bound, **labels) for bound, n in zip(bounds, h["buckets"])]
    out.append(sample(name + "_bucket", h["count"], le="+Inf", **labels))
    return out + [sample(name + "_sum", h["sum"], **labels), sample(name + "_count", h["count"], **labels)]


def samples(counts: Counts) -> List[Sample]:
    """The event families' samples (pure)."""
    def table(name: str, key: str, labels: Sequence[str]) -> List[Sample]:
        return [sample(name, n, **dict(zip(labels, k.split("\x1f")))) for k, n in sorted(counts[key].items())]

    out = table("chv_cell_runs_total", "runs", ("slot", "verdict"))
    out += table("chv_cell_payload_exits_total", "exits", ("slot", "code"))
    out += _histogram_samples("chv_cell_start_seconds", counts["start"], START_BUCKETS)
    out += table("chv_broker_requests_total", "broker", ("op", "verdict"))
    out += table("chv_browser_requests_total", "browser", ("action", "verdict"))
    for action, h in sorted(counts["browser_seconds"].items()):
        out += _histogram_samples("chv_browser_request_seconds", h, BROWSER_BUCKETS, action=action)
    out += table("chv_sync_requests_total", "sync", ("action", "verdict"))
    return out


def loads(text: Optional[str]) -> Counts:
    """The counts kept in the state file; empty ones for a missing or unreadable file (the counters restart)."""
    counts = empty()
    try:
        kept = json.loads(text) if text else None
    except ValueError:
        kept = None
    if isinstance(kept, dict) and set(kept) == set(counts):
        counts.update(kept)
    return counts


def dumps(counts: Counts) -> str:
    return json.dumps(counts, sort_keys=True)


# Who may write each event: any local user can send a journal entry with
# any CHV_* field, but not the fields journald sets itself (_UID,
# _SYSTEMD_UNIT): only entries from the launcher (root, through sudo) and
# from chv-broker's unit are counted.
TRUSTED = {RUN_EVENT: ("_UID", "0"), BROKER_EVENT: ("_SYSTEMD_UNIT", "chv-broker.service")}


def journalctl_argv(journalctl: str, cursor: Optional[str]) -> List[str]:
    """The command reading the entries since ``cursor`` (all when None),
    oldest first, as JSON lines: each event only from its writer (TRUSTED)."""
    matches: List[str] = []
    for event, (field, value) in sorted(TRUSTED.items()):
        matches += (["+"] if matches else []) + ["CHV_EVENT=%s" % event, "%s=%s" % (field, value)]
    return [journalctl, "--no-pager", "-q", "-o", "json"] + (["--after-cursor", cursor] if cursor else []) + matches


def add_output(counts: Counts, output: str, slots: Iterable[str]) -> int:
    """Count journalctl's JSON lines into ``counts`` and move its cursor to the last; how many were read."""
    names = list(slots)
    read = 0
    for line in output.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        add(counts, entry, names)
        if isinstance(entry.get("__CURSOR"), str):
            counts["cursor"] = entry["__CURSOR"]
        read += 1
    return read
