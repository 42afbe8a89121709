"""chv-fleet-metrics: read the guest's state, write it as one ``.prom``
file into node_exporter's textfile directory, atomically (a temporary file
in the same directory, renamed over the old one: node_exporter never reads
half a file). The reading is all here; what it means is ``state``'s.

Run by chv-fleet-metrics.timer (roles/metrics) as root: nft needs
CAP_NET_ADMIN, and the cell records and /run/chv-cell-nat are root's."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import events as eventsmod
from . import state as statemod

DEFAULT_UNITS = ("chv-cell-nat.service", "chv-broker.socket", "chv-broker.service",
                 "chv-browser.socket", "chv-browser.service")
FILE_NAME = "chv_fleet.prom"
# The longest any one command may take (a hung systemd or nft must not stack up runs).
COMMAND_TIMEOUT = 20.0


def read_bytes(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def read_text(path: str) -> Optional[str]:
    data = read_bytes(path)
    return None if data is None else data.decode("utf-8", errors="replace")


def file_sha256(path: str) -> Optional[str]:
    data = read_bytes(path)
    return None if data is None else hashlib.sha256(data).hexdigest()


def run(argv: Sequence[str]) -> Tuple[Optional[int], bytes]:
    """(exit code, stdout); (None, b"") when the program cannot run."""
    try:
        proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=COMMAND_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None, b""
    return proc.returncode, proc.stdout


def cell_records(state_dir: str) -> Tuple[Dict[str, str], Dict[str, bool]]:
    """{slot: record text} of the live cell records, and {slot: its process exists}."""
    records: Dict[str, str] = {}
    alive: Dict[str, bool] = {}
    for path in sorted(glob.glob(os.path.join(state_dir, "cells", "*.json"))):
        slot = os.path.basename(path)[:-len(".json")]
        text = read_text(path)
        if text is None:
            continue
        records[slot] = text
        try:
            pid = json.loads(text).get("pid")
        except (ValueError, AttributeError):
            pid = None
        alive[slot] = isinstance(pid, int) and pid > 0 and os.path.exists("/proc/%d" % pid)
    return records, alive


def read_events(opts: argparse.Namespace, slots: Optional[List[str]]) -> Optional[eventsmod.Counts]:
    """The event counts kept in opts.events_state with the journal's entries
    since its cursor added, written back; None when journalctl failed (the
    counts stay as they were). A cursor journalctl refuses while it reads
    the journal without one ("Failed to seek to cursor": a state file
    damaged, or written by another journal's reader) restarts the counters,
    as a lost state file does: kept, it would stop them for good."""
    counts = eventsmod.loads(read_text(opts.events_state))
    rc, out = run(eventsmod.journalctl_argv(opts.journalctl, counts["cursor"]))
    if rc not in (0, None) and counts["cursor"] is not None:
        rc, out = run(eventsmod.journalctl_argv(opts.journalctl, None))
        counts = eventsmod.empty()
    if rc != 0:
        return None
    if eventsmod.add_output(counts, out.decode("utf-8", errors="replace"), slots or []) or counts["cursor"] is None:
        try:
            os.makedirs(os.path.dirname(opts.events_state), mode=0o700, exist_ok=True)
            write_atomic(os.path.dirname(opts.events_state), os.path.basename(opts.events_state),
                         eventsmod.dumps(counts))
        except OSError as exc:
            sys.stderr.write("chv-fleet-metrics: cannot keep the event counts in %s: %s\n" % (opts.events_state, exc))
    return counts


def read_state(opts: argparse.Namespace) -> statemod.State:
    start = time.monotonic()
    policy = read_bytes(opts.policy)
    records, alive = cell_records(opts.state_dir)
    rc, listing = run([opts.nft, "-s", "list", "table", "inet", "chv_cell"])
    counters: Optional[str] = None
    if rc == 0:
        crc, out = run([opts.nft, "-j", "list", "counters", "table", "inet", "chv_cell"])
        counters = out.decode("utf-8", errors="replace") if crc == 0 else None
    paths = [opts.ruleset_file] + (sorted(glob.glob(os.path.join(opts.door_dir, "*.nft"))) if opts.door_dir else [])
    units: List[str] = list(opts.unit or DEFAULT_UNITS)
    src, show = run([opts.systemctl, "show", "-p", "LoadState,ActiveState,SubState,NRestarts", "--"] + units)
    audit_mtime: Optional[float]
    try:
        audit_mtime = os.stat(opts.audit_report).st_mtime
    except OSError:
        audit_mtime = None
    return statemod.State(
        now=time.time(), version=opts.collection_version, policy=policy, records=records, alive=alive,
        nft_ran=rc is not None, table_listing=listing if rc == 0 else None, counters_json=counters,
        loaded_sha256=read_text(os.path.join(opts.nat_run_dir, "loaded.sha256")),
        table_sha256=read_text(os.path.join(opts.nat_run_dir, "table.sha256")),
        ruleset_digests=dict((p, file_sha256(p)) for p in paths),
        units=units, systemctl_show=show.decode("utf-8", errors="replace") if src == 0 else None,
        audit=read_text(opts.audit_report), audit_mtime=audit_mtime,
        cordoned=os.path.isfile(os.path.join(opts.state_dir, "cordon")),
        events=read_events(opts, statemod.policy_slots(policy)),
        duration=time.monotonic() - start)


def write_atomic(directory: str, name: str, text: str) -> str:
    """``text`` as ``directory/name`` (0644), replaced in one rename; the
    temporary file's name does not end in .prom (node_exporter skips it)."""
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, ".%s.%d.tmp" % (name, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chv-fleet-metrics", description="Write the guest's chv.fleet state as Prometheus metrics "
                                "into node_exporter's textfile directory (docs/observability.md).")
    p.add_argument("--textfile-dir", default="/var/lib/prometheus/node-exporter",
                   help="node_exporter's --collector.textfile.directory")
    p.add_argument("--file-name", default=FILE_NAME)
    p.add_argument("--collection-version", default="unknown")
    p.add_argument("--policy", default="/etc/chv-fleet/cell-policy.json")
    p.add_argument("--state-dir", default="/run/chv-fleet", help="the policy's state_dir (cells/<slot>.json)")
    p.add_argument("--nat-run-dir", default="/run/chv-cell-nat", help="loaded.sha256 and table.sha256")
    p.add_argument("--ruleset-file", default="/etc/chv-fleet/nft/cell-nat.nft")
    p.add_argument("--door-dir", default="/etc/chv-fleet/nft/door.d")
    p.add_argument("--audit-report", default="/var/lib/chv-fleet/audit/audit.json")
    p.add_argument("--unit", action="append", help="a unit to report (repeat; default: %s)" % " ".join(DEFAULT_UNITS))
    p.add_argument("--events-state", default="/var/lib/chv-fleet-metrics/events.json",
                   help="where the event counters and the journal cursor are kept between runs")
    p.add_argument("--journalctl", default="journalctl")
    p.add_argument("--nft", default="/usr/sbin/nft")
    p.add_argument("--systemctl", default="systemctl")
    p.add_argument("--stdout", action="store_true", help="print the text instead of writing the file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parser().parse_args(argv)
    text = statemod.exposition_text(read_state(opts))
    if opts.stdout:
        sys.stdout.write(text)
        return 0
    try:
        write_atomic(opts.textfile_dir, opts.file_name, text)
    except OSError as exc:
        sys.stderr.write("chv-fleet-metrics: cannot write %s: %s\n"
                         % (os.path.join(opts.textfile_dir, opts.file_name), exc))
        return 1
    return 0
