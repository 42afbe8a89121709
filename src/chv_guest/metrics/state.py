"""From what was read on the guest to samples: pure functions, no I/O
(``collector`` reads; the tests hand fixtures in).

The sources (docs/observability.md):

- the cell policy (/etc/chv-fleet/cell-policy.json): its slots, and its
  sha256 for the info metric;
- the live cell records (/run/chv-fleet/cells/<slot>.json, written by
  chv-cell once a cell's leader exists, removed on exit) and whether each
  record's process is alive;
- table inet chv_cell: ``nft -s list table`` (present, and its digest
  against /run/chv-cell-nat/table.sha256, what chv-cell-nat.service
  loaded) and ``nft -j list counters table`` (the named counters);
- /run/chv-cell-nat/loaded.sha256 against the ruleset files now;
- ``systemctl show`` of the units the cells depend on;
- the last audit report (audit.json, chv_guest/cell/audit.py report()).
"""

from __future__ import annotations

import calendar
import hashlib
import json
import re
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import events, exposition
from .exposition import Sample, sample

# The ruleset's counter names (roles/cell_nat/templates/cell-nat.nft.j2,
# plugins/module_utils/cell_nat.py VERDICT_COUNTERS and build_ruleset):
# one per verdict and reason ("drop_cell_to_guest", "accept_dns",
# "nat_masquerade"), and two per slot ("slot0_accepted", "slot0_dropped";
# a slot name has no underscore).
REASON_COUNTER = re.compile(r"(accept|drop|nat)_([a-z0-9_]+)\Z")
SLOT_COUNTER = re.compile(r"([a-z](?:[a-z0-9-]*[a-z0-9])?)_(accepted|dropped)\Z")
SLOT_VERDICT = {"accepted": "accept", "dropped": "drop"}
AUDIT_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class State(NamedTuple):
    """Everything the collector read, as it read it (None: not there or
    not readable)."""
    now: float
    version: str
    # the policy file's bytes
    policy: Optional[bytes]
    # slot name -> the text of its live cell record
    records: Mapping[str, str]
    # slot name -> whether the record's process exists
    alive: Mapping[str, bool]
    # nft ran (False: no nft, or it could not run at all)
    nft_ran: bool
    # stdout of `nft -s list table inet chv_cell` when it exited 0, else None
    table_listing: Optional[bytes]
    # stdout of `nft -j list counters table inet chv_cell` when it exited 0, else None
    counters_json: Optional[str]
    # /run/chv-cell-nat/loaded.sha256 and table.sha256
    loaded_sha256: Optional[str]
    table_sha256: Optional[str]
    # path -> sha256 of each ruleset file nft loads now (cell-nat.nft, door.d/*.nft); None: unreadable
    ruleset_digests: Mapping[str, Optional[str]]
    # the units asked, in order, and stdout of `systemctl show -p ... -- UNITS` (None: it failed)
    units: Sequence[str]
    systemctl_show: Optional[str]
    # audit.json's text and its modification time
    audit: Optional[str]
    audit_mtime: Optional[float]
    # how long the reading took
    duration: float
    # the host's cordon marker (<state_dir>/cordon, chv-cell cordon) is there; None: not read
    cordoned: Optional[bool] = None
    # the event counts (events.py) after this run's journal entries; None: the journal could not be read
    events: Optional[Dict[str, Any]] = None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------- policy and cells

def policy_slots(policy: Optional[bytes]) -> Optional[List[str]]:
    """The slot names of the policy, or None when it cannot be read as one."""
    if policy is None:
        return None
    try:
        doc = json.loads(policy.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("slots"), list):
        return None
    return [s["name"] for s in doc["slots"] if isinstance(s, dict) and isinstance(s.get("name"), str)]


def policy_samples(state: State) -> List[Sample]:
    slots = policy_slots(state.policy)
    out = [sample("chv_metrics_source_up", 1 if slots is not None else 0, source="policy"),
           sample("chv_fleet_info", 1, version=state.version,
                  policy_sha256=sha256(state.policy) if state.policy is not None else "")]
    if slots is not None:
        out.append(sample("chv_cell_slots", len(slots)))
    return out


def cell_samples(state: State) -> List[Sample]:
    """Per slot of the policy (and per slot with a record the policy no
    longer names): running, a stale record, and the running cell's start."""
    slots = policy_slots(state.policy) or []
    out: List[Sample] = [sample("chv_metrics_source_up", 1, source="cells")]
    if state.cordoned is not None:
        out.append(sample("chv_cell_cordoned", 1 if state.cordoned else 0))
    for slot in sorted(set(slots) | set(state.records)):
        text = state.records.get(slot)
        record: Any = None
        if text is not None:
            try:
                record = json.loads(text)
            except ValueError:
                record = None
        has_record = isinstance(record, dict)
        alive = has_record and bool(state.alive.get(slot))
        out.append(sample("chv_cell_running", 1 if alive else 0, slot=slot))
        out.append(sample("chv_cell_stale_record", 1 if has_record and not alive else 0, slot=slot))
        if alive and isinstance(record.get("started"), (int, float)):
            out.append(sample("chv_cell_start_time_seconds", float(record["started"]), slot=slot))
    return out


# ------------------------------------------------------------- nftables

def parse_counters(text: str) -> List[Tuple[str, int, int]]:
    """(name, packets, bytes) of each named counter of an ``nft -j list
    counters`` listing; ValueError when it is not one."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise ValueError("no 'nftables' list")
    out = []
    for item in doc["nftables"]:
        counter = item.get("counter") if isinstance(item, dict) else None
        if isinstance(counter, dict) and isinstance(counter.get("name"), str):
            out.append((counter["name"], int(counter.get("packets", 0)), int(counter.get("bytes", 0))))
    return out


def counter_samples(name: str, packets: int, nbytes: int) -> List[Sample]:
    """A named counter as its two samples; none for a name of no known form."""
    m = SLOT_COUNTER.match(name)
    if m:
        verdict = SLOT_VERDICT[m.group(2)]
        return [sample("chv_nft_slot_packets_total", packets, slot=m.group(1), verdict=verdict),
                sample("chv_nft_slot_bytes_total", nbytes, slot=m.group(1), verdict=verdict)]
    m = REASON_COUNTER.match(name)
    if m:
        return [sample("chv_nft_packets_total", packets, verdict=m.group(1), reason=m.group(2)),
                sample("chv_nft_bytes_total", nbytes, verdict=m.group(1), reason=m.group(2))]
    return []


def digest_lines(text: Optional[str]) -> Optional[Dict[str, str]]:
    """sha256sum's lines ("DIGEST  PATH") as {path: digest}."""
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        digest, sep, path = line.partition("  ")
        if sep:
            out[path] = digest
    return out


def ruleset_applied(loaded_sha256: Optional[str], digests: Mapping[str, Optional[str]]) -> bool:
    """The files nft loads now are those chv-cell-nat.service recorded when
    it last loaded them (as cell_nat_info's ruleset_applied decides): the
    same paths, the same digests. No record (the service never loaded, or
    stopped: its runtime directory is gone) is not applied."""
    loaded = digest_lines(loaded_sha256)
    if not loaded or any(d is None for d in digests.values()):
        return False
    return loaded == dict(digests)


def table_unchanged(listing: Optional[bytes], table_sha256: Optional[str]) -> bool:
    """The table's stateless listing hashes to what the service recorded
    (``nft -s list table ... | sha256sum``, as chv-cell-nat-check.service
    compares them). A missing table is changed."""
    if listing is None or not table_sha256:
        return False
    return table_sha256.split()[0] == sha256(listing)


def nft_samples(state: State) -> List[Sample]:
    """The table's presence, its digest, the files' digests and the
    counters. Without nft (not installed, or it cannot run) the table is
    reported missing and the source down."""
    present = state.nft_ran and state.table_listing is not None
    out = [sample("chv_nft_ruleset_applied", 1 if ruleset_applied(state.loaded_sha256, state.ruleset_digests) else 0),
           sample("chv_nft_table_present", 1 if present else 0),
           sample("chv_nft_table_unchanged", 1 if present and table_unchanged(state.table_listing, state.table_sha256)
                  else 0)]
    if not state.nft_ran:
        return out + [sample("chv_metrics_source_up", 0, source="nft")]
    counters: List[Tuple[str, int, int]] = []
    ok = True
    if present and state.counters_json is not None:
        try:
            counters = parse_counters(state.counters_json)
        except (ValueError, TypeError):
            ok = False
    elif present:
        ok = False
    # one sample per name: the ruleset uses some names in several rules (one counter object each name)
    seen = set()
    for name, packets, nbytes in counters:
        if name not in seen:
            seen.add(name)
            out += counter_samples(name, packets, nbytes)
    return out + [sample("chv_metrics_source_up", 1 if ok else 0, source="nft")]


# ------------------------------------------------------------- units

def parse_show(text: str, units: Sequence[str]) -> Dict[str, Dict[str, str]]:
    """``systemctl show -p ... -- UNIT...``: one block of KEY=VALUE lines per
    unit, in the order asked, separated by empty lines."""
    blocks: List[Dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append({})
            continue
        key, sep, value = line.partition("=")
        if sep:
            blocks[-1][key] = value
    blocks = [b for b in blocks if b]
    if len(blocks) != len(units):
        raise ValueError("systemctl show gave %d blocks for %d units" % (len(blocks), len(units)))
    return dict(zip(units, blocks))


def unit_samples(state: State) -> List[Sample]:
    try:
        props = parse_show(state.systemctl_show, state.units) if state.systemctl_show is not None else None
    except ValueError:
        props = None
    if props is None:
        return [sample("chv_metrics_source_up", 0, source="units")]
    out = [sample("chv_metrics_source_up", 1, source="units")]
    for unit in state.units:
        p = props[unit]
        out.append(sample("chv_unit_loaded", 1 if p.get("LoadState") == "loaded" else 0, unit=unit))
        active = p.get("ActiveState", "")
        out += [sample("chv_unit_state", 1 if active == s else 0, unit=unit, state=s) for s in exposition.UNIT_STATES]
        restarts = p.get("NRestarts", "")
        if restarts.isdigit():
            out.append(sample("chv_unit_restarts_total", int(restarts), unit=unit))
    return out


# ------------------------------------------------------------- the audit

def audit_time(report: Mapping[str, Any], mtime: Optional[float]) -> Optional[float]:
    """When the audit ran: its header's time, else the file's mtime."""
    header = report.get("header")
    stamp = header.get("time") if isinstance(header, dict) else None
    if isinstance(stamp, str):
        try:
            return float(calendar.timegm(time.strptime(stamp, AUDIT_TIME_FORMAT)))
        except ValueError:
            pass
    return mtime


def audit_samples(state: State) -> List[Sample]:
    report: Any = None
    if state.audit is not None:
        try:
            report = json.loads(state.audit)
        except ValueError:
            report = None
    if not isinstance(report, dict) or not isinstance(report.get("cases"), list):
        # no audit yet is no failure of the collector: the source is up, the report absent
        return [sample("chv_audit_report_present", 0),
                sample("chv_metrics_source_up", 1 if state.audit is None else 0, source="audit")]
    out = [sample("chv_audit_report_present", 1), sample("chv_metrics_source_up", 1, source="audit")]
    when = audit_time(report, state.audit_mtime)
    if when is not None:
        out.append(sample("chv_audit_timestamp_seconds", when))
    out += [sample("chv_audit_verdict", 1 if report.get("verdict") == v else 0, verdict=v)
            for v in exposition.REPORT_VERDICTS]
    seen = set()
    for case in report["cases"]:
        cid = case.get("id") if isinstance(case, dict) else None
        if not isinstance(cid, str) or cid in seen:
            continue
        seen.add(cid)
        out += [sample("chv_audit_case_verdict", 1 if case.get("verdict") == v else 0, case=cid, verdict=v)
                for v in exposition.CASE_VERDICTS]
    header = report.get("header")
    audited = header.get("policy_sha256") if isinstance(header, dict) else None
    current = sha256(state.policy) if state.policy is not None else None
    out.append(sample("chv_audit_policy_current", 1 if audited is not None and audited == current else 0))
    return out


# ------------------------------------------------------------- all of it

def samples(state: State) -> List[Sample]:
    """Every sample of the state."""
    return (policy_samples(state) + cell_samples(state) + nft_samples(state) + unit_samples(state)
            + audit_samples(state)
            + (events.samples(state.events) if state.events is not None else [])
            + [sample("chv_metrics_source_up", 1 if state.events is not None else 0, source="journal"),
               sample("chv_metrics_collect_timestamp_seconds", round(state.now, 3)),
               sample("chv_metrics_collect_duration_seconds", round(state.duration, 6))])


def exposition_text(state: State) -> str:
    """The state as the text node_exporter's textfile collector reads."""
    return exposition.render(samples(state))
