"""`chv-cell audit`: the isolation case catalog, run on this guest
(docs/isolation-cases.md).

Each case names one boundary of a cell, the probe the boundary must stop,
and a control that must succeed in the same run. A case whose control did
not succeed is an error, never a pass: a cell that did not start, a
missing tool or a broken probe proves nothing. A case that needs what this
guest or this run lacks (a second slot, a delegated cgroup controller, a
destination to test) is skipped with the requirement named;
``--strict-skips`` makes a skip fail the run.

The probes run in real cells through ``chv-cell run``: cell A runs
audit_probe.py (every probe and its control, in one cell), cell B, in a
second slot, a listener A must not reach. This side prepares what the
probes look for (a root-only file in /etc/chv, a credentials file in the
slot's home, a listener on every guest address, a marked guest process),
checks afterwards what a cell must not have changed, runs the lifecycle
cases, removes what it made, and writes the report: JSON, JUnit XML and
Markdown. Exit 0: every case passed (or was skipped); 1: a case failed;
2: no case failed but a control did not succeed."""

from __future__ import annotations

import hashlib
import html
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, TypedDict

from . import argv as argvmod
from . import audit_probe as probe
from . import disk as diskmod
from . import exits
from . import families as familiesmod
from . import health as healthmod
from . import policy as policymod
from . import records

EXIT_FAILED = 1
EXIT_ERROR = 2
DROPPED = ("TimeoutError", "ETIMEDOUT")  # a connect the ruleset drops gets no answer
# the ruleset's counter that each NET case's drops must move (roles/cell_nat); the
# metadata stand-in is an address of the guest, so its drop is the input path's
DROP_COUNTERS = {"NET-02": "drop_cell_to_cell", "NET-03": "drop_cell_to_guest", "NET-04": "drop_cell_to_guest",
                 "NET-05": "drop_denied"}
METADATA = "169.254.169.254"
SHOTS_DIR = "/run/chv-shots"  # chv-browser's screenshots, a directory per slot (FS-04)
RAW_MARKER = "chv-audit-raw-html"
PAGE = ("<!doctype html><html><head><title>chv-audit</title></head><body><h1>chv-audit</h1>"
        "<!-- %s --><script>var raw = '%s';</script></body></html>" % (RAW_MARKER, RAW_MARKER))
# what chv-browser's open returns to a cell (roles/browser: chv_browser/server.py, Engine.op_open and
# _describe; tests/unit/cell_runtime/test_audit.py compares the two), and nothing else
SNAPSHOT_KEYS = frozenset(["title", "url", "aria_snapshot", "truncated", "status"])
# TEN-03: the Listener's page that sets a cookie (its value from the query's v) and shows the Cookie
# header chromium sent
COOKIE_PATH = "/chv-audit-cookie"
COOKIE_NAME = "chv_audit"
# TEN-02: chv-broker's configuration and the defaults of what the case reads from it
# (src/chv_guest/broker/server.py DEFAULTS; a unit test compares the two)
BROKER_CONFIG = "/etc/chv-fleet/broker.json"
BROKER_DEFAULTS = {"max_connections_per_slot": 4, "read_timeout": 10.0}
QUOTA_EXTRA = 2  # connections past the quota that must be refused
CELL_BROKER_SOCKET = "/run/chv/broker.sock"  # where the cells have chv-broker (the client's default)
# TEN-04: families a cell of the default policy must not get, and how each is tried
# (socket type, protocol); families not named here are tried as datagram sockets
FAMILY_PROBES = ("AF_VSOCK", "AF_PACKET", "AF_XDP")
FAMILY_TYPES = {"AF_UNIX": (1, 0), "AF_INET": (1, 0), "AF_INET6": (1, 0), "AF_NETLINK": (3, 0), "AF_VSOCK": (1, 0),
                "AF_PACKET": (3, 0), "AF_XDP": (3, 0)}
DISK_FULL = ("ENOSPC", "EDQUOT")
# TEN-07: what the payload writes to stderr, a busy launcher's words (runner.Launcher)
FORGED_BUSY = "chv-cell: all 1 slot(s) busy (slot0) for 1s; giving up"

# The facts of one run (the cells' reports, the guest's observations, the
# options) and the reports: JSON objects. Their keys are the probes' and the
# judges' contract, one key per fact, read where each case is judged.
Facts = Dict[str, Any]


class Result(TypedDict):
    """One case's verdict (pass, fail, error, skip) and its evidence."""
    verdict: str
    probe: str
    control: str


def loop_backing_file(dev: int) -> Optional[str]:
    """The file a loop device ``dev`` (st_dev) reads from, or None (not a loop device)."""
    try:
        with open("/sys/dev/block/%d:%d/loop/backing_file" % (os.major(dev), os.minor(dev))) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _allocated(path: Optional[str]) -> int:
    """Bytes of the guest's disk allocated to ``path`` (0 for None)."""
    return os.stat(path).st_blocks * 512 if path else 0


def _family_spec(name: str) -> List[int]:
    """[family number, socket type, protocol] of TEN-04's try of family ``name``."""
    return [familiesmod.FAMILIES[name]] + list(FAMILY_TYPES.get(name, (2, 0)))


def marker(kind: str, nonce: str) -> str:
    """The text of a file of slot B (or /etc/shadow's stand-in words) that no reply may carry."""
    return "chv-audit-%s-%s" % (kind, nonce)


# ------------------------------------------------------------- the catalog

class Case(object):
    """One boundary: what is probed and what the control is (how each is
    loosened, its counter-proof, is counterproof.py's)."""

    def __init__(self, cid: str, title: str, probe_text: str, control: str) -> None:
        self.id, self.title, self.probe, self.control = cid, title, probe_text, control

    @property
    def area(self) -> str:
        return self.id.split("-")[0]


CASES = [
    Case("FS-01", "Guest secrets in /etc/chv cannot be read",
         "read a file readable by every guest user that the audit puts in /etc/chv",
         "the cell reads /etc/os-release; the guest reads the file"),
    Case("FS-02", "The agent's credentials file is hidden",
         "read $HOME/.git-credentials (0644 in the slot's home)",
         "read another 0644 file of the same directory"),
    Case("FS-03", "Another slot's workspace is out of reach",
         "read a file of slot B's workspace by its guest path",
         "read the audit's file in the cell's own /workspace"),
    Case("FS-04", "Another slot's screenshots are out of reach",
         "read a file of slot B's screenshot directory",
         "read the audit's file in the cell's own /run/chv/shots"),
    Case("FS-05", "chv-browser's and Playwright's files are out of reach",
         "read or list each path of chv_cell_inaccessible that exists on the guest",
         "the guest has each path; the cell reads /usr/bin/env"),
    Case("FS-06", "The launcher's state (/run/chv-fleet) is not visible",
         "list the launcher's state directory",
         "list /run/chv, the cells' bind"),
    Case("FS-07", "/usr is read-only",
         "create a file in /usr",
         "create a file in /workspace, which the guest then sees"),
    Case("FS-08", "A write to /etc never reaches the guest",
         "create a file in /etc; the guest looks for it",
         "the workspace write reached the guest"),
    Case("FS-09", "What the launcher, broker and ruleset trust is not writable",
         "open the policy, the launcher, the broker and the ruleset for writing; the guest compares their hashes",
         "the workspace write reached the guest"),
    Case("ID-01", "Cell root is the slot's own unprivileged guest uid",
         "the cell's uid_map maps 0 to the slot's uid_base, not to guest root",
         "the payload runs as uid 0 of the cell"),
    Case("ID-02", "Slots get disjoint uid ranges", "cells A and B map to disjoint guest uid ranges", "both cells ran"),
    Case("ID-03", "Dropped capabilities are absent from the effective set",
         "no capability of drop_capabilities in CapEff",
         "CAP_CHOWN is in CapEff"),
    Case("ID-04", "Dropped capabilities are absent from the bounding set",
         "no capability of drop_capabilities in CapBnd",
         "CAP_CHOWN is in CapBnd"),
    Case("ID-05", "NoNewPrivs is set", "NoNewPrivs of /proc/self/status is 1", "the field is there"),
    Case("ID-06", "io_uring is refused (EPERM)", "io_uring_setup", "getpid through syscall()"),
    Case("ID-07", "No new user namespace", "unshare(CLONE_NEWUSER)", "unshare(0)"),
    Case("ID-08", "No mount", "mount a tmpfs", "mkdir the mount point"),
    Case("ID-09", "No device nodes", "mknod a character device (1,3)", "mkfifo"),
    Case("ID-10", "No raw sockets", "socket(AF_INET, SOCK_RAW)", "socket(AF_INET, SOCK_DGRAM)"),
    Case("ID-11", "ptrace cannot reach a guest process",
         "PTRACE_ATTACH to the audit's guest process; kill(pid, 0)",
         "the probe signals its own child (kill(pid, 0))"),
    Case("ID-12", "nsenter cannot enter the guest's namespaces",
         "nsenter -t <guest pid> and -t 1; setns() into the cell's own network namespace",
         "nsenter --version runs; /proc/self/ns/net opens"),
    Case("ID-13", "Guest processes are invisible",
         "look for the audit's marked guest process in the cell's /proc; kill(pid, 0)",
         "the cell lists its own pid; the guest sees the marked process"),
    Case("ID-14", "No address change in the cell",
         "ip addr add on the cell's interface",
         "ip addr show of the interface"),
    Case("ID-15", "No route change in the cell", "ip route add", "ip route show"),
    Case("NET-01", "Egress through the NAT works",
         "connect to each --allow destination from the cell",
         "the guest connects to it"),
    Case("NET-02", "Another cell is unreachable",
         "connect from cell A to cell B's listener: no answer, and drop_cell_to_cell moves",
         "cell B reaches its own listener"),
    Case("NET-03", "Guest services are unreachable on every guest address",
         "connect from the cell to a guest listener on each guest IPv4 address and each slot gateway: no answer, "
         "and drop_cell_to_guest moves",
         "the guest reaches the listener on each (cell A's own gateway, which exists only while A runs: it answers "
         "A's ARP)"),
    Case("NET-04", "The metadata stand-in is unreachable",
         "connect to 169.254.169.254 (added to the guest's loopback for the run): no answer, and "
         "drop_cell_to_guest moves",
         "the guest connects to it"),
    Case("NET-05", "Denied destinations are dropped",
         "connect to each --deny destination from the cell: no answer, and drop_denied moves",
         "the guest connects to it"),
    Case("NET-06", "IPv6 is unreachable",
         "connect over IPv6 to the guest's global addresses and to 2001:db8::1 (no route leaves the cell)",
         "the cell's IPv4 gateway answers ARP"),
    Case("NET-07", "The cell's resolvers are real ones, not the guest's 127.0.0.53 stub",
         "no 127.0.0.53 in the cell's /etc/resolv.conf",
         "the file names at least one resolver"),
    Case("IPC-01", "The broker answers a cell",
         "ping through the broker socket from the cell",
         "the broker's client is installed"),
    Case("IPC-02", "The broker refuses a guest process",
         "ping as guest root outside any cell",
         "the cell's ping (IPC-01) was answered"),
    Case("IPC-03", "The broker refuses a guest process that has a cell's uid",
         "ping as the slot's uid_base outside any cell",
         "the cell's ping (IPC-01) was answered"),
    Case("IPC-04", "Unknown operations are refused and the broker survives",
         "an unknown op from the cell",
         "a ping after it is answered"),
    Case("BRW-01", "chv-browser opens no guest service for a cell",
         "open, for cell A, the guest's listener on 127.0.0.1, each guest IPv4 address and each slot gateway: each "
         "refused, nothing reaches the listener, and drop_door_to_guest moves",
         "the same open of the --allow-url page returns its snapshot"),
    Case("BRW-02", "chv-browser does not reach the metadata stand-in for a cell",
         "open 169.254.169.254 (the stand-in on the guest's loopback): refused, nothing reaches the listener",
         "the allowed page's snapshot"),
    Case("BRW-03", "chv-browser does not reach another cell for a cell",
         "open cell B's listener: refused, nothing reaches it, and drop_door_to_cell moves",
         "the allowed page's snapshot; cell B reaches its own listener"),
    Case("BRW-04", "chv-browser returns snapshots only",
         "the reply to the allowed page carries no key but %s and none of the page's raw HTML (a comment and a "
         "script)" % ", ".join(sorted(SNAPSHOT_KEYS)),
         "the snapshot names the page's heading"),
    Case("TEN-01", "The sync door reads nothing outside the slot",
         "cell A's repositories whose .git/packed-refs is a link to a file of slot B's workspace and whose "
         ".git/objects/info/alternates names slot B's agent state: sync status through the broker is refused "
         "and no reply carries the files' text",
         "sync status of a clean repository in the same cell succeeds; the guest reads slot B's files"),
    Case("TEN-02", "A slot at its door quota is refused for itself alone",
         "cell A holds max_connections_per_slot idle connections to chv-broker and opens %d more: those are "
         "refused as busy naming slot A and the quota; meanwhile cell B's ping is answered" % QUOTA_EXTRA,
         "A's first connections were admitted and still held while B pinged; after A lets go, A's own ping "
         "is answered"),
    Case("TEN-03", "The browser keeps nothing of a run for the slot's next run",
         "run 1 of slot A opens the audit's cookie page through chv-browser; run 2 of slot A: snapshot finds "
         "no page, and the cookie page shows no cookie",
         "in run 1 a second open shows the cookie; run 2's open works"),
    Case("TEN-04", "A cell gets only the policy's socket families",
         "socket() of AF_VSOCK (and its bind), AF_PACKET and AF_XDP, and AF_VSOCK with bit 32 set through "
         "syscall(): each EAFNOSUPPORT",
         "each family of socket_families works in the same cell; the guest binds an AF_VSOCK socket"),
    Case("TEN-05", "A slot's disk quota holds",
         "the workspace's file system is no larger than disk_max; fallocate of its free space + 1 MiB fails "
         "with ENOSPC; the image the slot's file system lives in takes no more of the guest's disk than before",
         "a small write in the workspace succeeds; the workspace is on a file system of its own (not /'s)"),
    Case("TEN-06", "Private and special-purpose ranges are denied by default",
         "connect from cell A to the --special stand-in (a special-purpose address no deny entry or "
         "carve-out covers): no answer, and drop_special_range moves; chv-browser's open of it for A is refused",
         "the guest connects to it"),
    Case("TEN-07", "The launcher's verdict cannot be forged by the payload",
         "a payload prints a busy launcher's words, writes to the --status-fd number and exits 75: the "
         "status record says it ran, exit 75, and the payload's write failed",
         "a real busy run (every slot held, LIFE-03) with --status-fd records verdict busy"),
    Case("TEN-08", "A reader of a slot's files never follows what the cell planted",
         "chv-cell read --slot A of cell A's links to slot B's file and to /etc/shadow and of its FIFO: each "
         "refused (exit 65) at once, none of their text on stdout",
         "a regular file cell A wrote reads back"),
    Case("TEN-09", "Each slot's workspace and home are the slot's own",
         "cell A's and B's workspace and home are owned by the slot's uid_base (user and group), mode 0700",
         "the directories are there and cell A wrote its workspace"),
    Case("LIFE-01", "Nothing is left after the cells exit",
         "no cell record, host interface or machine of the audit's slots after the runs",
         "while cell B ran, its record and interface existed"),
    Case("LIFE-02", "Consecutive runs all start",
         "--runs cells one after the other in one slot, each exit 0",
         "the first of them ran"),
    Case("LIFE-03", "All slots at once, then one more is refused as busy",
         "with a cell in every slot, one more run with --timeout 1 exits 75",
         "every slot's cell ran at the same time"),
    Case("LIFE-04", "A SIGKILLed launcher leaves its slot claimable",
         "after SIGKILL of a launcher, a new run in its slot exits 0",
         "the killed launcher's cell had started"),
    Case("LIM-01", "The wall-clock limit stops a cell (exit 124)",
         "--runtime-max 1 -- sleep 30 exits 124",
         "--runtime-max 30 -- true exits 0"),
    Case("LIM-02", "The task limit (TasksMax) is enforced", "start TasksMax + 16 threads in a cell", "start 4 threads"),
]
BY_ID = dict((c.id, c) for c in CASES)
# the cases of _lifecycle (not run by a counter-proof run, which probes the cells only)
LIFECYCLE_CASES = ("LIFE-02", "LIFE-03", "LIFE-04", "LIM-01", "LIM-02", "TEN-07")


# ------------------------------------------------------------- verdicts

def _result(verdict: str, probe_ev: str, control_ev: str) -> Result:
    return {"verdict": verdict, "probe": probe_ev, "control": control_ev}


def pair(probe_ok: object, probe_ev: str, control_ok: object, control_ev: str) -> Result:
    """pass when the probe was stopped; error, whatever the probe did,
    when the control did not succeed."""
    if not control_ok:
        return _result("error", probe_ev, "CONTROL FAILED: %s" % control_ev)
    return _result("pass" if probe_ok else "fail", probe_ev, control_ev)


def skip(requirement: str) -> Result:
    return _result("skip", "needs %s" % requirement, "")


def _caps(hexmask: Any) -> Optional[Set[str]]:
    try:
        value = int(hexmask, 16)
    except (TypeError, ValueError):
        return None
    return set(name for bit, name in enumerate(policymod.CAP_NAMES) if value >> bit & 1)


def _denied(result: str) -> bool:
    return result not in ("ok",)


def _dropped(result: str) -> bool:
    return result in DROPPED


def judge(facts: Facts) -> Dict[str, Result]:
    """Every case's verdict from the facts of one run (the cells' reports
    and the guest's observations). Returns {case id: result}."""
    out: Dict[str, Result] = {}
    a, g = facts.get("a"), facts["guest"]
    if a is None:
        # nothing was proven: every case is an error, the lifecycle ones too (not run)
        why = "cell A did not run: %s" % facts.get("a_error", "no report")
        return dict((c.id, _result("error", "", "CONTROL FAILED: %s" % why)) for c in CASES)
    out.update(_judge_cell(facts, a, g))
    out.update(_judge_life(facts, g))
    return out


def _judge_cell(facts: Facts, a: Facts, g: Facts) -> Dict[str, Result]:
    out: Dict[str, Result] = {}
    rd, wr, k = a["read"], a["write"], a["kernel"]
    ws_ok = wr.get("workspace") == "ok" and g.get("workspace_write_seen") is True
    ws_ev = "cell: %s, guest sees it: %s" % (wr.get("workspace"), g.get("workspace_write_seen"))
    if "etc_chv" in rd:
        out["FS-01"] = pair(_denied(rd["etc_chv"]), "read: %s" % rd["etc_chv"],
                            rd.get("os_release") == "ok" and g.get("etc_chv_readable"),
                            "os-release: %s, guest reads it: %s" % (rd.get("os_release"), g.get("etc_chv_readable")))
    else:
        out["FS-01"] = skip("/etc/chv on the guest")
    out["FS-02"] = pair(_denied(rd["credentials"]), "read: %s" % rd["credentials"], rd["ordinary"] == "ok",
                        "the other file: %s" % rd["ordinary"])
    if "other_workspace" in rd:
        out["FS-03"] = pair(_denied(rd["other_workspace"]), "read: %s" % rd["other_workspace"],
                            rd["own_workspace"] == "ok", "own /workspace file: %s" % rd["own_workspace"])
    else:
        out["FS-03"] = skip("a second slot")
    if "other_shots" in rd:
        out["FS-04"] = pair(_denied(rd["other_shots"]), "read: %s" % rd["other_shots"], rd["own_shots"] == "ok",
                            "own /run/chv/shots file: %s" % rd["own_shots"])
    else:
        out["FS-04"] = skip(facts.get("shots_skip", "chv-browser's screenshots directory"))
    hidden = dict((key[len("hidden:"):], v) for key, v in rd.items() if key.startswith("hidden:"))
    if hidden:
        out["FS-05"] = pair(all(_denied(v) for v in hidden.values()),
                            ", ".join("%s: %s" % kv for kv in sorted(hidden.items())),
                            rd.get("env") == "ok", "/usr/bin/env: %s (the guest has each path)" % rd.get("env"))
    else:
        out["FS-05"] = skip("a path of chv_cell_inaccessible that exists on the guest")
    out["FS-06"] = pair(_denied(rd["state_dir"]), "list: %s" % rd["state_dir"], rd["run_chv"] == "ok",
                        "list /run/chv: %s" % rd["run_chv"])
    out["FS-07"] = pair(_denied(wr["usr"]), "create: %s" % wr["usr"], ws_ok, ws_ev)
    out["FS-08"] = pair(g.get("etc_write_seen") is False, "cell: %s, on the guest: %s"
                        % (wr["etc"], "present" if g.get("etc_write_seen") else "absent"), ws_ok, ws_ev)
    trusted = dict((key[len("trusted:"):], v) for key, v in wr.items() if key.startswith("trusted:"))
    changed = g.get("trusted_changed", [])
    out["FS-09"] = pair(all(_denied(v) for v in trusted.values()) and not changed,
                        ", ".join("%s: %s" % kv for kv in sorted(trusted.items()))
                        + "; changed on the guest: %s" % (", ".join(changed) or "none"), ws_ok, ws_ev)

    slot_a = facts["slot_a"]
    umap = a["uid_map"]
    out["ID-01"] = pair(umap[:1] == ["0"] and umap[1:2] == [str(slot_a["uid_base"])] and slot_a["uid_base"] > 0,
                        "uid_map %s, slot uid_base %d" % (" ".join(umap), slot_a["uid_base"]),
                        a["uid"] == 0, "uid in the cell: %s" % a["uid"])
    b = facts.get("b")
    if facts.get("slot_b") is None:
        out["ID-02"] = skip("a second slot")
    else:
        bmap = (b or {}).get("uid_map", [])
        ranges: List[Tuple[int, int]] = []
        for m in (umap, bmap):
            if len(m) >= 3:
                ranges.append((int(m[1]), int(m[1]) + int(m[2])))
        disjoint = len(ranges) == 2 and (ranges[0][1] <= ranges[1][0] or ranges[1][1] <= ranges[0][0])
        out["ID-02"] = pair(disjoint, "A %s, B %s" % (" ".join(umap), " ".join(bmap)), b is not None,
                            "cell B ran: %s" % (b is not None))
    dropped = set(facts["policy"]["drop_capabilities"])
    for cid, field in (("ID-03", "CapEff"), ("ID-04", "CapBnd")):
        have = _caps(a.get(field))
        kept = sorted(dropped & have) if have is not None else ["unreadable"]
        out[cid] = pair(not kept, "%s %s; dropped ones present: %s" % (field, a.get(field), ", ".join(kept) or "none"),
                        have is not None and "CAP_CHOWN" in have and "CAP_CHOWN" not in dropped,
                        "CAP_CHOWN in %s: %s" % (field, have is not None and "CAP_CHOWN" in have))
    out["ID-05"] = pair(a["NoNewPrivs"] == "1", "NoNewPrivs %s" % a["NoNewPrivs"], a["NoNewPrivs"] in ("0", "1"),
                        "field present")
    out["ID-06"] = pair(k["io_uring_setup"] == "EPERM", "io_uring_setup: %s" % k["io_uring_setup"],
                        k["syscall_getpid"] == "ok", "getpid: %s" % k["syscall_getpid"])
    for cid, probe_key, control_key in (("ID-07", "unshare_user", "unshare_none"), ("ID-08", "mount_tmpfs", "mkdir"),
                                        ("ID-09", "mknod_chr", "mkfifo"), ("ID-10", "raw_socket", "dgram_socket"),
                                        ("ID-11", "ptrace_guest", "kill0_own_child")):
        out[cid] = pair(_denied(k[probe_key]), "%s: %s" % (probe_key, k[probe_key]), k[control_key] == "ok",
                        "%s: %s" % (control_key, k[control_key]))
    ns_probe = [k["nsenter_guest"]["rc"] not in (0, None), k["nsenter_init"]["rc"] not in (0, None),
                _denied(k["setns_own"]), _denied(k["open_guest_ns"])]
    out["ID-12"] = pair(all(ns_probe), "nsenter guest: rc %s %s; nsenter 1: rc %s %s; setns: %s; open guest ns: %s"
                        % (k["nsenter_guest"]["rc"], k["nsenter_guest"]["err"][:80], k["nsenter_init"]["rc"],
                           k["nsenter_init"]["err"][:80], k["setns_own"], k["open_guest_ns"]),
                        k["nsenter_version"]["rc"] == 0 and k["open_own_ns"] == "ok",
                        "nsenter --version: rc %s; own ns: %s" % (k["nsenter_version"]["rc"], k["open_own_ns"]))
    out["ID-13"] = pair(k["marker_seen"] == [] and _denied(k["kill0_guest"]),
                        "marked process seen: %s; kill(pid, 0): %s" % (k["marker_seen"] or "no", k["kill0_guest"]),
                        k["own_pid_listed"] and g.get("marker_alive") is True,
                        "own pid listed: %s; guest sees the marked process: %s"
                        % (k["own_pid_listed"], g.get("marker_alive")))
    for cid, probe_key, control_key in (("ID-14", "ip_addr_add", "ip_addr_show"),
                                        ("ID-15", "ip_route_add", "ip_route_show")):
        tried = k[probe_key]
        out[cid] = pair(tried["rc"] not in (0, None), "%s: rc %s %s" % (probe_key, tried["rc"], tried["err"][:80]),
                        k[control_key]["rc"] == 0, "%s: rc %s" % (control_key, k[control_key]["rc"]))
    out.update(_judge_net(facts, a, g))
    out.update(_judge_ipc(facts, a, g))
    out.update(_judge_brw(facts, a, g))
    out.update(_judge_ten(facts, a, g))
    return out


def _judge_net(facts: Facts, a: Facts, g: Facts) -> Dict[str, Result]:
    out: Dict[str, Result] = {}
    tcp = a["tcp"]
    neigh_ok = "lladdr" in a.get("neigh_out", "")
    moved = g.get("counters_moved") or {}

    def dropped_here(cid: str, results: List[str]) -> Tuple[bool, str]:
        """Every connect timed out and the case's own drop counter moved."""
        name = DROP_COUNTERS[cid]
        ok = bool(results) and all(_dropped(r) for r in results) and moved.get(name, 0) > 0
        return ok, "; %s +%d" % (name, moved.get(name, 0))
    allow = [key for key in tcp if key.startswith("allow:")]
    if allow:
        out["NET-01"] = pair(all(tcp[key].startswith("connected") for key in allow),
                             ", ".join("%s: %s" % (key[6:], tcp[key]) for key in allow),
                             all(g["reach"].get(key[6:], "").startswith("connected") for key in allow),
                             "guest: %s" % ", ".join("%s: %s" % (key[6:], g["reach"].get(key[6:])) for key in allow))
    else:
        out["NET-01"] = skip("--allow HOST:PORT, a destination cells may reach")
    b = facts.get("b")
    if facts.get("slot_b") is None:
        out["NET-02"] = skip("a second slot")
    else:
        result = tcp.get("cell_b", "not probed")
        ok, ev = dropped_here("NET-02", [result])
        out["NET-02"] = pair(ok, "to cell B: %s%s" % (result, ev),
                             b is not None and b.get("self", "").startswith("connected"),
                             "cell B to itself: %s" % (b or {}).get("self", "cell B did not run"))
    guest = [key for key in tcp if key.startswith("guest:")]
    # cell A's own gateway exists only while A runs: its control is the
    # gateway's ARP answer to A (the listener is bound to every address)
    own_gw = "guest:" + facts["slot_a"]["gateway"]
    reached = [key for key in guest if key != own_gw]
    ok, ev = dropped_here("NET-03", [tcp[key] for key in guest])
    out["NET-03"] = pair(ok, ", ".join("%s: %s" % (key[6:], tcp[key]) for key in guest) + ev,
                         neigh_ok and all(g["reach"].get(key[6:], "").startswith("connected") for key in reached),
                         "cell A's gateway answers ARP: %s; the guest reaches the listener on %s"
                         % (a.get("neigh_out") or "no", ", ".join("%s: %s" % (key[6:], g["reach"].get(key[6:]))
                                                                  for key in reached) or "no other address"))
    if "metadata" in tcp:
        ok, ev = dropped_here("NET-04", [tcp["metadata"]])
        out["NET-04"] = pair(ok, "%s: %s%s" % (METADATA, tcp["metadata"], ev),
                             g["reach"].get("metadata", "").startswith("connected"),
                             "guest: %s" % g["reach"].get("metadata"))
    else:
        out["NET-04"] = skip("--metadata-stand-in (the audit adds %s to the guest's loopback for the run)" % METADATA)
    deny = [key for key in tcp if key.startswith("deny:")]
    if deny:
        ok, ev = dropped_here("NET-05", [tcp[key] for key in deny])
        out["NET-05"] = pair(ok, ", ".join("%s: %s" % (key[5:], tcp[key]) for key in deny) + ev,
                             all(g["reach"].get(key[5:], "").startswith("connected") for key in deny),
                             "guest: %s" % ", ".join("%s: %s" % (key[5:], g["reach"].get(key[5:])) for key in deny))
    else:
        out["NET-05"] = skip("--deny HOST:PORT, a destination the egress policy denies that the guest reaches")
    v6 = a["tcp6"]
    out["NET-06"] = pair(bool(v6) and not any(r.startswith("connected") for r in v6.values()),
                         ", ".join("[%s]: %s" % kv for kv in sorted(v6.items())), neigh_ok,
                         "IPv4 gateway ARP: %s" % (a.get("neigh_out") or "none"))
    resolv = a.get("resolv", "")
    servers = [line.split()[1] for line in resolv.splitlines() if line.startswith("nameserver") and len(line.split()) > 1]
    out["NET-07"] = pair("127.0.0.53" not in servers, "nameservers: %s" % (", ".join(servers) or "none"),
                         bool(servers), "resolv.conf lists %d resolver(s)" % len(servers))
    return out


def _answer(reply: Facts) -> Any:
    """The broker's JSON reply of a client run, or None."""
    try:
        return json.loads(reply.get("out") or "null")
    except ValueError:
        return None


def _judge_ipc(facts: Facts, a: Facts, g: Facts) -> Dict[str, Result]:
    if "broker" not in a:
        return dict((cid, skip("chv-broker's client (--broker-client)"))
                    for cid in ("IPC-01", "IPC-02", "IPC-03", "IPC-04"))
    br = a["broker"]
    ping = _answer(br["ping"]) or {}
    pinged = ping.get("ok") is True
    ping_ev = "cell ping: %s" % (br["ping"]["out"] or br["ping"]["err"])
    out: Dict[str, Result] = {"IPC-01": pair(pinged, ping_ev, os.path.exists(facts["broker_client"]), "client %s" % facts["broker_client"])}
    for cid, key in (("IPC-02", "broker_root"), ("IPC-03", "broker_cell_uid")):
        reply = g.get(key, {})
        answer = _answer(reply) or {}
        out[cid] = pair(answer.get("ok") is False, "reply: %s" % (reply.get("out") or reply.get("err")), pinged,
                        ping_ev)
    unknown = _answer(br["unknown"]) or {}
    after = _answer(br["ping_after"]) or {}
    out["IPC-04"] = pair(unknown.get("ok") is False, "reply: %s" % br["unknown"]["out"], after.get("ok") is True,
                         "ping after: %s" % br["ping_after"]["out"])
    return out


BRW_CASES = ("BRW-01", "BRW-02", "BRW-03", "BRW-04")


def _judge_brw(facts: Facts, a: Facts, g: Facts) -> Dict[str, Result]:
    br = a.get("browser")
    if br is None or br.get("allowed") is None:
        why = "--allow-url URL, a page cells may open through chv-browser (and chv-broker's client)"
        return dict((cid, skip(why)) for cid in BRW_CASES)
    ctl = _answer(br["allowed"]) or {}
    if "unknown or disabled op" in str(ctl.get("error", "")):
        return dict((cid, skip("chv-browser (this guest's broker has no browser op)")) for cid in BRW_CASES)
    result: Any = ctl.get("result") if isinstance(ctl.get("result"), dict) else {}
    snapshot = str(result.get("aria_snapshot", ""))
    ctl_ok = ctl.get("ok") is True and bool(snapshot)
    ctl_ev = "allowed page: %s" % (("title %r, %d characters of snapshot" % (result.get("title"), len(snapshot)))
                                   if ctl_ok else (br["allowed"]["out"] or br["allowed"]["err"])[-200:])
    moved = g.get("counters_moved") or {}
    cell_a = facts["slot_a"]["address"]
    doors = [s for s in g.get("listener_seen", []) if s["peer"] != cell_a]  # a cell's own arrival is NET's

    def refused(keys: List[str]) -> Tuple[bool, str]:
        replies = dict((key, _answer(br["denied"][key]) or {}) for key in keys)
        ok = bool(keys) and all(r.get("ok") is False for r in replies.values())
        return ok, ", ".join("%s: %s" % (key.split(":", 1)[-1], "refused: %s" % str(r.get("error", ""))[:60]
                                         if r.get("ok") is False else "OPENED" if r.get("ok") else "no reply")
                             for key, r in sorted(replies.items()))
    out: Dict[str, Result] = {}
    guest = [key for key in br["denied"] if key.startswith("guest:")]
    ok, ev = refused(guest)
    arrived = [s["local"] for s in doors if s["local"] != METADATA]
    out["BRW-01"] = pair(ok and not arrived and moved.get("drop_door_to_guest", 0) > 0,
                         "%s; reached the listener: %s; drop_door_to_guest +%d"
                         % (ev, ", ".join(arrived) or "nothing", moved.get("drop_door_to_guest", 0)), ctl_ok, ctl_ev)
    if "metadata" in br["denied"]:
        ok, ev = refused(["metadata"])
        arrived = [s["local"] for s in doors if s["local"] == METADATA]
        out["BRW-02"] = pair(ok and not arrived, "%s; reached the stand-in: %s" % (ev, len(arrived)), ctl_ok, ctl_ev)
    else:
        out["BRW-02"] = skip("--metadata-stand-in")
    if "cell_b" in br["denied"]:
        ok, ev = refused(["cell_b"])
        reached = g.get("b_listener_seen")
        if reached is not None:
            reached = [peer for peer in reached if peer != cell_a]  # cell A's own arrival is NET-02's
        b_ok = (facts.get("b") or {}).get("self", "").startswith("connected")
        out["BRW-03"] = pair(ok and reached == [] and moved.get("drop_door_to_cell", 0) > 0,
                             "%s; reached cell B: %s; drop_door_to_cell +%d"
                             % (ev, "unknown" if reached is None else len(reached), moved.get("drop_door_to_cell", 0)),
                             ctl_ok and b_ok, "%s; cell B to itself: %s" % (ctl_ev, b_ok))
    else:
        out["BRW-03"] = skip("a second slot")
    extra = sorted(set(result) - SNAPSHOT_KEYS)
    raw = RAW_MARKER in json.dumps(result)
    out["BRW-04"] = pair(not extra and not raw, "keys: %s; raw HTML in the reply: %s"
                         % (", ".join(sorted(result)) or "none", "yes" if raw else "no"),
                         ctl_ok and "chv-audit" in snapshot,
                         "%s; heading chv-audit in the snapshot: %s" % (ctl_ev, "chv-audit" in snapshot))
    return out


TEN_CELL_CASES = ("TEN-01", "TEN-02", "TEN-03", "TEN-04", "TEN-05", "TEN-06", "TEN-08", "TEN-09")


def _reply_text(reply: Facts) -> str:
    return "%s %s" % (reply.get("out", ""), reply.get("err", ""))


def _short(reply: Facts, n: int = 120) -> str:
    return (reply.get("out") or reply.get("err") or "no reply")[:n]


def _snapshot_text(reply: Facts) -> str:
    """What an open's reply showed: the snapshot's text, or the reply itself."""
    answer = _answer(reply) or {}
    result: Any = answer.get("result") if isinstance(answer.get("result"), dict) else {}
    return (str(result.get("aria_snapshot", "")) or _short(reply, 200))[:200]


def _judge_ten(facts: Facts, a: Facts, g: Facts) -> Dict[str, Result]:
    out: Dict[str, Result] = {}
    nonce = facts["nonce"]
    secrets = [marker("bws", nonce), marker("bstate", nonce)]
    # TEN-01: the sync door
    sync = a.get("sync")
    if facts.get("sync_skip"):
        out["TEN-01"] = skip(facts["sync_skip"])
    elif sync is None:
        out["TEN-01"] = _result("error", "", "CONTROL FAILED: the cell ran no sync request (no broker client in it)")
    else:
        replies = sync["replies"]
        clean = _answer(replies.get("clean", {})) or {}
        if "unknown or disabled op" in str(clean.get("error", "")):
            out["TEN-01"] = skip("the sync door (this guest's broker has no sync op)")
        else:
            hostile = ["packed_refs", "alternates"]
            answers = dict((k, _answer(replies.get(k, {})) or {}) for k in hostile)
            leaked = [k for k in hostile if any(m in _reply_text(replies.get(k, {})) for m in secrets)]
            result: Any = clean.get("result") if isinstance(clean.get("result"), dict) else {}
            setup_ok = all(sync["setup"].get(k) == "ok" for k in ["clean"] + hostile)
            out["TEN-01"] = pair(all(answers[k].get("ok") is False for k in hostile) and not leaked,
                                 "; ".join("%s: %s" % (k, ("refused: %s" % str(answers[k].get("error"))[:90])
                                                       if answers[k].get("ok") is False else _short(replies.get(k, {})))
                                           for k in hostile) + "; slot B's text in a reply: %s" % (leaked or "none"),
                                 clean.get("ok") is True and result.get("returncode") == 0 and setup_ok and
                                 g.get("b_files_readable") is True,
                                 "clean repository: %s; set up: %s; the guest reads slot B's files: %s"
                                 % ("returncode %s" % result.get("returncode") if clean.get("ok") else
                                    _short(replies.get("clean", {})),
                                    ", ".join("%s %s" % kv for kv in sorted(sync["setup"].items())),
                                    g.get("b_files_readable")))
    # TEN-02: the door quota
    quota = a.get("quota")
    if facts.get("quota_skip"):
        out["TEN-02"] = skip(facts["quota_skip"])
    elif quota is None:
        out["TEN-02"] = _result("error", "", "CONTROL FAILED: the cell did not hold the door (no broker client in it)")
    else:
        limit = int(g["quota"]["max_connections_per_slot"])
        name = facts["slot_a"]["name"]
        replies = quota.get("replies", [])
        past = replies[limit:]
        refused = len(past) == QUOTA_EXTRA and all(
            "busy: slot %s " % name in r and "max_connections_per_slot" in r for r in past)
        b_ping = g.get("quota_b_ping") or {}
        b_answer = _answer(b_ping) or {}
        after = _answer(quota.get("ping_after") or {}) or {}
        held = replies[:limit] == ["idle"] * limit and quota.get("still_held") == limit and quota.get("go") is True
        out["TEN-02"] = pair(refused and b_answer.get("ok") is True,
                             "past the quota of %d: %s; slot B's ping while A held it: %s"
                             % (limit, " | ".join(r[:110] for r in past) or "none", _short(b_ping) if b_ping else
                                g.get("quota_relay_error", "not sent")),
                             held and after.get("ok") is True,
                             "A's first %d connections admitted: %s, still held when B pinged: %s of %d; A's ping "
                             "after letting go: %s (attempt %s)" % (limit, replies[:limit] == ["idle"] * limit,
                                                                    quota.get("still_held"), limit,
                                                                    _short(quota.get("ping_after") or {}),
                                                                    quota.get("ping_attempts")))
    # TEN-03: the browser between two runs of a slot
    br = a.get("browser")
    cookie = a.get("cookie")
    if br is None or br.get("allowed") is None or cookie is None:
        out["TEN-03"] = skip("--allow-url URL, a page cells may open through chv-browser (and chv-broker's client)")
    elif "unknown or disabled op" in str((_answer(br["allowed"]) or {}).get("error", "")):
        out["TEN-03"] = skip("chv-browser (this guest's broker has no browser op)")
    else:
        sent = cookie_sent(nonce)
        second = _answer(cookie[1]) or {}
        run2 = facts.get("run2")
        shown = sent in _reply_text(cookie[1]) and second.get("ok") is True
        if run2 is None:
            out["TEN-03"] = _result("error", "", "CONTROL FAILED: run 2 of slot A: %s; run 1 showed the cookie: %s"
                                    % (facts.get("run2_error", "did not run"), shown))
        else:
            snap = _answer(run2["snapshot"]) or {}
            opened = _answer(run2["open"]) or {}
            kept = [k for k in ("snapshot", "open") if sent in _reply_text(run2[k])]
            out["TEN-03"] = pair(snap.get("ok") is False and not kept,
                                 "run 2 snapshot: %s; run 1's cookie in run 2's replies: %s"
                                 % ("refused: %s" % str(snap.get("error"))[:80] if snap.get("ok") is False
                                    else "A PAGE: %s" % _short(run2["snapshot"]), kept or "no"),
                                 shown and opened.get("ok") is True and "chv-audit-cookie" in _reply_text(run2["open"]),
                                 "run 1's second open shows %s: %s; run 2's open: %s"
                                 % (sent, shown if shown else "no: %s" % _snapshot_text(cookie[1]),
                                    "ok" if opened.get("ok") else _short(run2["open"])))
    # TEN-04: socket families
    fam = a["kernel"].get("families")
    if facts.get("families_skip"):
        out["TEN-04"] = skip(facts["families_skip"])
    elif fam is None:
        out["TEN-04"] = _result("error", "", "CONTROL FAILED: the cell did not report its socket families")
    elif g.get("vsock_guest") not in (None, "ok"):
        out["TEN-04"] = skip("AF_VSOCK on the guest's kernel (socket and bind on the guest: %s)" % g["vsock_guest"])
    else:
        vsock = g.get("vsock_guest") == "ok"
        tried = dict(fam["denied"])
        if vsock:
            tried.update(vsock_bind=fam["vsock_bind"].split(": ")[-1], high_bits=fam["high_bits"])
        out["TEN-04"] = pair(bool(tried) and all(v == "EAFNOSUPPORT" for v in tried.values()),
                             ", ".join("%s: %s" % kv for kv in sorted(tried.items())),
                             all(v == "ok" for v in fam["allowed"].values()) and bool(fam["allowed"]),
                             "%s; the guest binds AF_VSOCK: %s" % (", ".join("%s: %s" % kv
                                                                             for kv in sorted(fam["allowed"].items())),
                                                                   g.get("vsock_guest") or "not tried (allowed)"))
    # TEN-05: the disk quota
    disk, gd = a.get("disk"), g.get("disk")
    if gd is None:
        out["TEN-05"] = skip("a disk quota in the policy (disk_max, role variable chv_cell_disk_max)")
    elif disk is None:
        out["TEN-05"] = _result("error", "", "CONTROL FAILED: the cell did not report its workspace's file system")
    else:
        grew = gd.get("image_grew", 0)
        out["TEN-05"] = pair(disk["size"] <= gd["limit"] and disk["big"] in DISK_FULL and grew == 0,
                             "file system %d bytes (disk_max %s: %d); fallocate of %d bytes: %s in %ss; the image %s "
                             "grew by %d bytes" % (disk["size"], gd["disk_max"], gd["limit"], disk["asked"], disk["big"],
                                                   disk.get("big_seconds"), gd.get("image") or "(none: not a loop "
                                                   "device)", grew),
                             disk["small"] == "ok" and gd["own_device"] is True,
                             "small write: %s; the workspace on a file system of its own: %s"
                             % (disk["small"], gd["own_device"]))
    # TEN-06: special-purpose ranges
    tcp = a["tcp"]
    if "special" not in tcp:
        out["TEN-06"] = skip("--special HOST:PORT, a stand-in in a private or special-purpose range that no deny "
                             "entry or carve-out covers, which the guest reaches")
    else:
        moved = (g.get("counters_moved") or {}).get("drop_special_range", 0)
        door = (br or {}).get("denied", {}).get("special")
        door_answer: Any = _answer(door) if door else None
        door_ok = door is None or (door_answer or {}).get("ok") is False
        out["TEN-06"] = pair(_dropped(tcp["special"]) and moved > 0 and door_ok,
                             "cell A: %s; drop_special_range +%d; chv-browser for A: %s"
                             % (tcp["special"], moved, "not asked (no --allow-url)" if door is None else
                                "refused: %s" % str(door_answer.get("error"))[:60]
                                if (door_answer or {}).get("ok") is False else "OPENED" if door_answer else "no reply"),
                             g["reach"].get("special", "").startswith("connected"),
                             "guest: %s" % g["reach"].get("special"))
    # TEN-08: chv-cell read of what the cell planted
    reads, planted = g.get("read") or {}, a.get("plant") or {}
    words = secrets + list(g.get("shadow_words") or [])
    hostile = sorted(k for k in reads if k != "file")
    bad = [k for k in hostile if reads[k]["rc"] != 65 or (reads[k]["seconds"] or 99) > 10 or
           any(w in reads[k]["out"] for w in words if w)]
    ctl = reads.get("file") or {}
    out["TEN-08"] = pair(bool(hostile) and not bad,
                         "; ".join("%s: exit %s in %ss, %d bytes out"
                                   % (k, reads[k]["rc"], reads[k]["seconds"], len(reads[k]["out"])) for k in hostile)
                         or "nothing read",
                         bool(reads) and all(v == "ok" for v in planted.values()) and ctl.get("rc") == 0 and
                         ctl.get("out") == marker("read", nonce),
                         "planted: %s; the regular file: exit %s, %s"
                         % (", ".join("%s %s" % kv for kv in sorted(planted.items())) or "nothing", ctl.get("rc"),
                            "its text" if ctl.get("out") == marker("read", nonce) else repr(ctl.get("out", ""))[:60]))
    # TEN-09: the slot directories
    dirs = g.get("slot_dirs") or []
    ok = [d for d in dirs if "error" not in d and d["dir"]]
    own = [d for d in ok if d["uid"] == d["uid_base"] and d["gid"] == d["uid_base"] and d["mode"] == "0700"]
    ws_ok = a["write"].get("workspace") == "ok" and g.get("workspace_write_seen") is True
    out["TEN-09"] = pair(bool(ok) and len(own) == len(ok),
                         ", ".join("%s %s:%s %s" % (d["path"], d["uid"], d["gid"], d["mode"]) for d in ok),
                         bool(dirs) and len(ok) == len(dirs) and ws_ok,
                         "directories: %s; cell A wrote its workspace: %s"
                         % (", ".join("%s %s" % (d["path"], d.get("error", "ok" if d.get("dir") else "not a directory"))
                                      for d in dirs) or "none", ws_ok))
    return out


def _judge_life(facts: Facts, g: Facts) -> Dict[str, Result]:
    out: Dict[str, Result] = {}
    if g.get("lifecycle") is False:
        out.update((cid, skip("a run with the lifecycle cases (this run probes the cells only)"))
                   for cid in LIFECYCLE_CASES)
    left = g.get("left_behind")
    out["LIFE-01"] = pair(left == [], "left: %s" % (", ".join(left) if left else "nothing" if left == [] else "unchecked"),
                          g.get("b_seen_running") is True,
                          "cell B's record and interface while it ran: %s" % g.get("b_seen_running"))
    if g.get("lifecycle") is False:
        return out
    runs = g.get("runs", [])
    failed = [(i, rc) for i, rc in enumerate(runs) if rc != 0]
    out["LIFE-02"] = pair(bool(runs) and not failed, "%d runs, failed: %s" % (len(runs), failed[:5] or "none"),
                          bool(runs) and runs[0] == 0, "first run: exit %s" % (runs[0] if runs else "not run"))
    busy = g.get("busy")
    forged = g.get("forged") or {}
    record = forged.get("record") or {}
    if busy is None:
        out["TEN-07"] = skip(g.get("busy_skip", "every slot idle") + " (the control is LIFE-03's busy run)")
    else:
        real = busy.get("extra_record") or {}
        # a warm cell's launcher cannot tell whether exit is the payload's (verdict unknown): not busy either
        ran = ("ran", "unknown") if forged.get("warm") else ("ran",)
        out["TEN-07"] = pair(bool(forged) and record.get("verdict") in ran and record.get("exit") == exits.EXIT_BUSY and
                             forged.get("write") != "ok",
                             "status record: %s; the payload's write to the fd: %s"
                             % (json.dumps(record, sort_keys=True) if record else "none", forged.get("write")),
                             real.get("verdict") == "busy" and real.get("exit") == exits.EXIT_BUSY,
                             "LIFE-03's busy run: %s" % (json.dumps(real, sort_keys=True) if real else "no record"))
    if busy is None:
        out["LIFE-03"] = skip(g.get("busy_skip", "every slot idle"))
    else:
        out["LIFE-03"] = pair(busy["extra_rc"] == exits.EXIT_BUSY, "one more run: exit %s" % busy["extra_rc"],
                              busy["all_ran"], "cells running at once: %d of %d" % (busy["running"], busy["slots"]))
    kill = g.get("sigkill", {})
    out["LIFE-04"] = pair(kill.get("after_rc") == 0, "run after SIGKILL: exit %s" % kill.get("after_rc"),
                          kill.get("started") is True, "the killed launcher's cell had started: %s" % kill.get("started"))
    lim = g.get("runtime", {})
    out["LIM-01"] = pair(lim.get("limited_rc") == exits.EXIT_RUNTIME, "exit %s" % lim.get("limited_rc"),
                         lim.get("control_rc") == 0, "exit %s" % lim.get("control_rc"))
    tasks = g.get("tasks")
    if tasks is None:
        out["LIM-02"] = skip(g.get("tasks_skip", "TasksMax in the policy"))
    else:
        out["LIM-02"] = pair(tasks["started"] < tasks["limit"], "threads started: %s of %s asked, TasksMax %s"
                             % (tasks["started"], tasks["limit"] + 16, tasks["limit"]), tasks["control"] == 4,
                             "4 threads: %s started" % tasks["control"])
    return out


def verdict_of(results: Mapping[str, Result], strict_skips: bool = False) -> Tuple[str, int, Dict[str, int]]:
    counts = dict((v, 0) for v in ("pass", "fail", "error", "skip"))
    for r in results.values():
        counts[r["verdict"]] += 1
    if counts["fail"] or (strict_skips and counts["skip"]):
        return "failed", EXIT_FAILED, counts
    if counts["error"]:
        return "error", EXIT_ERROR, counts
    return "passed", 0, counts


# ------------------------------------------------------------- reports

def report(results: Mapping[str, Result], header: Dict[str, str], strict_skips: bool = False,
           only: Optional[Sequence[str]] = None) -> Facts:
    """The report of every case (or of the cases ``only`` names), in the catalog's order."""
    verdict, code, counts = verdict_of(results, strict_skips)
    cases: List[Facts] = []
    for c in CASES:
        if only is not None and c.id not in only:
            continue
        r = results.get(c.id) or _result("error", "", "CONTROL FAILED: the audit did not reach this case")
        cases.append(dict(r, id=c.id, area=c.area, title=c.title))
    return {"verdict": verdict, "exit": code, "counts": counts, "header": header, "cases": cases}


def to_markdown(rep: Facts) -> str:
    h = rep["header"]
    lines = ["# chv-cell audit: %s on %s" % (rep["verdict"].upper(), h.get("guest")), "",
             "%(pass)d passed, %(fail)d failed, %(error)d errors, %(skip)d skipped" % rep["counts"], ""]
    lines += ["- %s: %s" % (k, h[k]) for k in sorted(h)]
    lines += ["", "| id | boundary | verdict | probe | control |", "|---|---|---|---|---|"]
    for c in rep["cases"]:
        lines.append("| %s | %s | %s | %s | %s |" % (c["id"], c["title"], c["verdict"].upper(),
                                                     cell_text(c["probe"]), cell_text(c["control"])))
    return "\n".join(lines) + "\n"


def cell_text(text: str) -> str:
    """Evidence as one Markdown table cell: no row break, no column break."""
    return " / ".join(line.strip() for line in text.splitlines() if line.strip()).replace("|", "/")


def to_junit(rep: Facts) -> str:
    suite = ET.Element("testsuite", name="chv-cell audit %s" % rep["header"].get("guest"), tests=str(len(rep["cases"])),
                       failures=str(rep["counts"]["fail"]), errors=str(rep["counts"]["error"]),
                       skipped=str(rep["counts"]["skip"]))
    props = ET.SubElement(suite, "properties")
    for k in sorted(rep["header"]):
        ET.SubElement(props, "property", name=k, value=str(rep["header"][k]))
    for c in rep["cases"]:
        case = ET.SubElement(suite, "testcase", classname=c["area"], name="%s %s" % (c["id"], c["title"]))
        text = "probe: %s\ncontrol: %s" % (c["probe"], c["control"])
        if c["verdict"] in ("fail", "error", "skip"):
            tag = {"fail": "failure", "error": "error", "skip": "skipped"}[c["verdict"]]
            ET.SubElement(case, tag, message=(c["probe"] if c["verdict"] != "error" else c["control"])[:200]).text = text
        else:
            ET.SubElement(case, "system-out").text = text
    return ET.tostring(suite, encoding="unicode")


def write_files(directory: str, files: Mapping[str, str]) -> None:
    """{name: text} into `directory`, each file replaced whole."""
    os.makedirs(directory, exist_ok=True)
    for name, text in sorted(files.items()):
        tmp = os.path.join(directory, "." + name)
        with open(tmp, "w") as fh:
            fh.write(text)
        os.rename(tmp, os.path.join(directory, name))


def report_files(rep: Facts) -> Dict[str, str]:
    return {"audit.json": json.dumps(rep, indent=2, sort_keys=True) + "\n", "audit.xml": to_junit(rep) + "\n",
            "audit.md": to_markdown(rep)}


def write_reports(rep: Facts, directory: str) -> None:
    write_files(directory, report_files(rep))


# ------------------------------------------------------------- the guest side

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def _launcher_hash() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(here) if n.endswith(".py")):
        h.update(name.encode() + b"\0" + _sha256(os.path.join(here, name)).encode())
    return h.hexdigest()


def _first_line(argv: List[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
        return (p.stdout.splitlines() or [""])[0]
    except OSError:
        return ""


def _os_release() -> str:
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def header(policy_path: str, labels: Mapping[str, str]) -> Dict[str, str]:
    h = {"guest": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "policy": policy_path, "policy_sha256": _sha256(policy_path), "launcher_sha256": _launcher_hash(),
         "kernel": platform.release(), "systemd": _first_line(["systemctl", "--version"]), "os": _os_release()}
    h.update(labels)
    return h


class Listener(object):
    """A TCP listener (by default on every guest address, a free port) that
    answers every connection with PAGE over HTTP/1.0 (after the request, or
    half a second of silence) until closed, and records each connection's
    local and peer address in `seen`; a context manager. The page, opened
    through chv-browser, is BRW-04's: the heading must reach the cell's
    snapshot, the comment and script (RAW_MARKER) must not."""

    def __init__(self, address: str = "0.0.0.0", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.3)
        self.address, self.port = address, self.sock.getsockname()[1]
        self.seen: List[Dict[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            self.seen.append({"local": conn.getsockname()[0], "peer": peer[0]})
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.5)
            request = b""
            try:
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
            except OSError:
                pass
            body, extra = Listener.page(request)
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n%s"
                             b"Connection: close\r\n\r\n" % (len(body), extra) + body)
            except OSError:
                pass

    @staticmethod
    def page(request: bytes) -> Tuple[bytes, bytes]:
        """(body, extra header lines) for the raw request: PAGE, or for
        COOKIE_PATH?v=VALUE a page that sets the cookie COOKIE_NAME=VALUE-kept
        and shows, as a heading, the Cookie header it received (TEN-03)."""
        line = request.split(b"\r\n", 1)[0].decode("latin-1", "replace").split()
        target = line[1] if len(line) > 1 else "/"
        path, dummy, query = target.partition("?")
        if path != COOKIE_PATH:
            return PAGE.encode(), b""
        value = "".join(c for c in query.partition("v=")[2].split("&")[0] if c.isalnum())[:32]
        sent = ""
        for header in request.decode("latin-1", "replace").split("\r\n")[1:]:
            name, dummy, rest = header.partition(":")
            if name.strip().lower() == "cookie":
                sent = rest.strip()
        body = ("<!doctype html><html><head><title>chv-audit-cookie</title></head><body><h1>chv-audit-cookie</h1>"
                "<h2>sent:[%s]</h2></body></html>" % html.escape(sent)).encode()
        extra = ("Set-Cookie: %s=%s-kept; Path=/; Max-Age=3600\r\n" % (COOKIE_NAME, value)).encode() if value else b""
        return body, extra

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _guest_addresses(ip: str) -> Tuple[List[str], List[str]]:
    """The guest's IPv4 and global IPv6 addresses (no loopback, no link-local)."""
    v4: List[str] = []
    v6: List[str] = []
    for family, out in (("-4", v4), ("-6", v6)):
        proc = subprocess.run([ip, "-j", family, "addr", "show"], capture_output=True, text=True, check=False)
        try:
            links = json.loads(proc.stdout or "[]")
        except ValueError:
            links = []
        for link in links:
            for info in link.get("addr_info", []):
                local = info.get("local", "")
                if family == "-4" and local and not local.startswith("127."):
                    out.append(local)
                if family == "-6" and info.get("scope") == "global" and local:
                    out.append(local)
    return sorted(set(v4)), sorted(set(v6))


def _chv_cell(policy_path: str, *args: str) -> List[str]:
    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-I", os.path.join(lib, "chv-cell"), "--policy", policy_path] + list(args)


def _run_cell(policy_path: str, slot: str, payload: List[str], timeout: float,
              extra: Sequence[str] = ()) -> Tuple[int, str, str]:
    argv = _chv_cell(policy_path, "run", "--slot", slot, "--timeout", str(timeout), *extra) + ["--"] + payload
    p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout + 300)
    return p.returncode, p.stdout, p.stderr


def _record_exists(pol: policymod.Policy, slot: policymod.Slot) -> bool:
    return os.path.exists(argvmod.cell_paths(pol, slot)["record"])


def _wait(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


class Fixtures(object):
    """What the guest side puts on the guest for one run, removed again."""

    def __init__(self) -> None:
        self.files: List[str] = []
        self.dirs: List[str] = []
        self.procs: List[subprocess.Popen[Any]] = []
        self.undo: List[Callable[[], object]] = []
        self.trees: List[str] = []

    def file(self, path: str, text: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        """A new file (never an existing one, never through a link: the audit runs as root in
        directories a cell writes, where an earlier task may have planted a link at the name)."""
        parent, name = os.path.split(path)
        dfd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        finally:
            os.close(dfd)
        self.files.append(path)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)

    def directory(self, path: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        os.mkdir(path, mode)
        os.chown(path, uid, gid)
        self.dirs.append(path)

    def cleanup(self, keep_files: bool = False) -> List[str]:
        """End the processes and undo the guest changes; remove the files,
        directories and trees unless ``keep_files`` (returns those kept)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if keep_files:
            for fn in self.undo:
                fn()
            return [p for p in self.files + self.dirs + self.trees if os.path.lexists(p)]
        for path in self.files:
            try:
                os.unlink(path)
            except OSError:
                pass
        for path in reversed(self.dirs):
            try:
                os.rmdir(path)
            except OSError:
                pass
        for path in self.trees:
            shutil.rmtree(path, ignore_errors=True)
        for fn in self.undo:
            fn()
        return []


def hidden_paths(pol: policymod.Policy) -> List[str]:
    """The inaccessible paths of FS-05: all but those of FS-01, FS-02 and FS-04."""
    return [p for p in pol["inaccessible"] if p not in ("/etc/chv", SHOTS_DIR) and not p.endswith("/.git-credentials")]


def _broker_as(client: str, uid: Optional[int] = None) -> Facts:
    kwargs: Dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        p = subprocess.run([sys.executable, "-I", client, json.dumps({"op": "ping"})], capture_output=True,
                           text=True, timeout=30, check=False, **kwargs)
        return {"rc": p.returncode, "out": p.stdout.strip()[-300:], "err": p.stderr.strip()[-300:]}
    except OSError as exc:
        return {"rc": None, "out": "", "err": str(exc)}


def _cell_probes(pol: policymod.Policy, policy_path: str, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], opts: Facts, fix: Fixtures,
                 facts: Facts) -> None:
    """Cells A and B with their fixtures; fills facts["a"], ["b"] and the
    guest's observations."""
    g, nonce = facts["guest"], facts["nonce"]
    launch = opts.get("cell_policy") or policy_path  # a counter-proof's loosened copy
    paths_a = argvmod.cell_paths(pol, slot_a)
    uid_a = slot_a["uid_base"]
    home = pol["agent_state_mount"]
    mark = ".chv-audit-%s" % nonce
    read: Dict[str, str] = {}
    write: Dict[str, str] = {}
    # FS-01: a root-only file in /etc/chv
    if os.path.isdir("/etc/chv"):
        # readable by every guest user: only the cell's boundary keeps it out
        fix.file("/etc/chv/%s" % mark, "secret\n", 0o644)
        read["etc_chv"] = "/etc/chv/%s" % mark
        g["etc_chv_readable"] = os.access("/etc/chv/%s" % mark, os.R_OK)
    read["os_release"] = "/etc/os-release"
    # FS-02: the credentials file (an existing one is used as it is, never changed)
    cred = os.path.join(paths_a["agent_state"], ".git-credentials")
    if not os.path.lexists(cred):  # a link there (a cell's) is left as it is, never followed
        fix.file(cred, "https://audit:audit@example.invalid\n", 0o644, uid_a, uid_a)
    fix.file(os.path.join(paths_a["agent_state"], mark), "ordinary\n", 0o644, uid_a, uid_a)
    read["credentials"] = os.path.join(home, ".git-credentials")
    read["ordinary"] = os.path.join(home, mark)
    # FS-03: slot B's workspace by its guest path; the control in A's own
    fix.file(os.path.join(paths_a["workspace"], mark), "own\n", 0o644, uid_a, uid_a)
    read["own_workspace"] = os.path.join(pol["workspace_mount"], mark)
    if slot_b is not None:
        paths_b = argvmod.cell_paths(pol, slot_b)
        fix.file(os.path.join(paths_b["workspace"], mark), "other\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
        read["other_workspace"] = os.path.join(paths_b["workspace"], mark)
    # FS-04: screenshots, when chv-browser's directory is there
    shots = SHOTS_DIR
    if os.path.isdir(shots) and slot_b is not None:
        for s in (slot_a, slot_b):
            d = os.path.join(shots, s["name"])
            if not os.path.isdir(d):
                fix.directory(d, 0o755)
            fix.file(os.path.join(d, mark), "shot\n", 0o644)
        read["own_shots"] = "/run/chv/shots/%s" % mark
        read["other_shots"] = os.path.join(shots, slot_b["name"], mark)
    else:
        facts["shots_skip"] = "chv-browser's screenshots directory (%s) and a second slot" % shots
    # FS-05: every inaccessible path the guest has (FS-01, FS-02 and FS-04 have theirs)
    for path in hidden_paths(pol):
        if os.path.exists(path):
            read["hidden:" + path] = path
    read["env"] = "/usr/bin/env"
    read["state_dir"] = pol["state_dir"]
    read["run_chv"] = "/run/chv"
    write["workspace"] = os.path.join(pol["workspace_mount"], mark + ".w")
    write["usr"] = "/usr/%s" % mark
    write["etc"] = "/etc/%s" % mark
    here = os.path.dirname(os.path.abspath(__file__))
    trusted = [policy_path, os.path.join(here, "runner.py"), os.path.join(here, "policy.py")]
    if opts["broker_client"]:
        trusted.append(os.path.join(os.path.dirname(opts["broker_client"]), "peer.py"))
    trusted = [p for p in trusted + list(opts["trusted"]) if os.path.isfile(p)]
    for path in trusted:
        write["trusted:" + path] = probe.APPEND + path
    before = dict((p, _sha256(p)) for p in trusted)
    # the guest's listener, every guest address, the metadata stand-in
    listener = Listener(port=probe.GUEST_PORT)
    fix.undo.append(listener.close)
    ip = pol["ip"]
    v4, v6 = _guest_addresses(ip)
    if opts["metadata_stand_in"] and METADATA not in v4:
        subprocess.run([ip, "addr", "add", METADATA + "/32", "dev", "lo"], check=True)
        fix.undo.append(lambda: subprocess.run([ip, "addr", "del", METADATA + "/32", "dev", "lo"], check=False))
    gateways = [slot_a["gateway"]] + ([slot_b["gateway"]] if slot_b else [])
    tcp: Dict[str, List[Any]]
    tcp, g["reach"] = {}, {}
    for addr in sorted(set(v4 + gateways) - {METADATA}):
        tcp["guest:" + addr] = [addr, listener.port]
    if opts["metadata_stand_in"]:
        tcp["metadata"] = [METADATA, listener.port]
    if opts.get("special"):
        tcp["special"] = list(healthmod.parse_target(opts["special"]))
    for key, target in [("allow:" + t, t) for t in opts["allow"]] + [("deny:" + t, t) for t in opts["deny"]]:
        tcp[key] = list(healthmod.parse_target(target))
    if slot_b is not None:
        tcp["cell_b"] = [slot_b["address"], probe.LISTENER_PORT]
    tcp6 = dict((a, [a, listener.port]) for a in v6)
    tcp6["2001:db8::1"] = ["2001:db8::1", 80]
    # the marked guest process (ID-11, ID-12, ID-13)
    marker = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(600)", probe.MARKER])
    fix.procs.append(marker)
    request: Facts
    request = {"nonce": nonce, "read": read, "write": write, "tcp": tcp, "tcp6": tcp6, "guest_pid": marker.pid,
               "ip": ip, "cell_ifname": slot_a["cell_ifname"], "gateway": slot_a["gateway"],
               "broker_client": opts["broker_client"] if os.path.exists(opts["broker_client"] or "") else None}
    # the doors (BRW): chv-browser opens, for cell A, the allowed page and every target the cell may not reach
    if request["broker_client"] and opts.get("allow_url"):
        denied = dict((key, "http://%s:%s/chv-audit-door" % (host, port)) for key, (host, port) in tcp.items()
                      if key.startswith("guest:") or key in ("metadata", "cell_b"))
        denied["guest:127.0.0.1"] = "http://127.0.0.1:%d/chv-audit-door" % listener.port
        if "special" in tcp:
            denied["special"] = "http://%s:%s/chv-audit-door" % tuple(tcp["special"])
        request["browser"] = {"allowed": opts["allow_url"], "denied": denied}
        request["cookie"] = cookie_url(opts["allow_url"], nonce)
    _tenant_fixtures(pol, slot_a, slot_b, request, fix, facts, mark)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "audit_probe.py")
    # cell B first: its listener, its uid_map and its control
    b_proc = None
    if slot_b is not None:
        paths_b = argvmod.cell_paths(pol, slot_b)
        ready, done, seen = (os.path.join(paths_b["workspace"], mark + s) for s in (".ready", ".done", ".seen"))
        breq = dict((k, os.path.join(pol["workspace_mount"], mark + "." + k)) for k in ("ready", "done", "seen"))
        breq["address"] = slot_b["address"]
        fix.files += [ready, done, seen]
        if request.get("quota"):
            # TEN-02: B pings when the guest drops the ping file (A holds the door then)
            breq.update((k, os.path.join(pol["workspace_mount"], mark + "." + k)) for k in ("ping", "pinged"))
            breq["broker_client"] = request["broker_client"]
            fix.files += [os.path.join(paths_b["workspace"], mark + "." + k) for k in ("ping", "pinged")]
        b_proc = subprocess.Popen(_chv_cell(launch, "run", "--slot", slot_b["name"], "--timeout",
                                            str(opts["timeout"]), "--", "python3", "-I", script, "in-cell-listener",
                                            json.dumps(breq)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        fix.procs.append(b_proc)
        if _wait(lambda: os.path.exists(ready) or b_proc.poll() is not None, opts["timeout"] + 30) and \
                os.path.exists(ready):
            with open(ready) as fh:
                facts["b"] = json.load(fh)
            g["b_seen_running"] = _record_exists(pol, slot_b) and os.path.exists("/sys/class/net/%s"
                                                                                 % slot_b["host_ifname"])
        else:
            # stderr=PIPE: never None
            facts["b_error"] = "cell B did not start: %s" % (b_proc.stderr.read()[-400:]  # type: ignore[union-attr]
                                                             if b_proc.poll() is not None
                                                             else "no ready file")
    for key, (host, port) in tcp.items():
        if key.startswith(("guest:", "allow:", "deny:", "metadata", "special")) and \
                key != "guest:" + slot_a["gateway"]:
            g["reach"][key.split(":", 1)[1] if ":" in key else key] = probe.connect(host, int(port))
    g["marker_alive"] = marker.poll() is None
    relay = None
    if request.get("quota") and b_proc is not None and "b" in facts:
        relay = threading.Thread(target=_quota_relay, args=(pol, slot_a, slot_b, mark, g), daemon=True)
        relay.start()
    counters_before = healthmod.read_counters()
    seen_before = len(listener.seen)
    image_before = _allocated(g["disk"].get("image")) if "disk" in g else 0
    rc, out, err = _run_cell(launch, slot_a["name"], ["python3", "-I", script, "in-cell", json.dumps(request)],
                             opts["timeout"])
    if "disk" in g:
        # what the guest's disk gives the slot's image (allocated, not free space: other work on the
        # guest moves that meanwhile)
        g["disk"]["image_grew"] = _allocated(g["disk"].get("image")) - image_before
    counters_after = healthmod.read_counters()
    if relay is not None:
        relay.join(60)
    g["listener_seen"] = listener.seen[seen_before:]  # what reached the guest's listener while cell A ran
    if counters_before is not None and counters_after is not None:
        g["counters_moved"] = dict((name, n - counters_before.get(name, 0)) for name, n in counters_after.items()
                                   if n != counters_before.get(name, 0))
    try:
        facts["a"] = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
    except (ValueError, IndexError):
        facts["a"] = None
    if facts["a"] is None:
        facts["a_error"] = "chv-cell run exited %s: %s" % (rc, (err or out).strip()[-600:])
    if b_proc is not None:
        with open(done, "w"):
            pass
        try:
            b_proc.wait(30)
        except subprocess.TimeoutExpired:
            b_proc.kill()
        try:
            with open(seen) as fh:
                g["b_listener_seen"] = json.load(fh)  # what reached cell B's listener after its control
        except (OSError, ValueError):
            pass
    if facts["a"] is not None:
        _after_cell_a(pol, policy_path, launch, slot_a, slot_b, request, script, opts, facts)
    g["workspace_write_seen"] = os.path.exists(os.path.join(paths_a["workspace"], mark + ".w"))
    if g["workspace_write_seen"]:
        fix.files.append(os.path.join(paths_a["workspace"], mark + ".w"))
    g["etc_write_seen"] = os.path.exists("/etc/%s" % mark)
    g["trusted_changed"] = [p for p in trusted if _sha256(p) != before[p]]
    if request["broker_client"]:
        g["broker_root"] = _broker_as(request["broker_client"])
        g["broker_cell_uid"] = _broker_as(request["broker_client"], uid_a)


def cookie_url(allow_url: str, nonce: str) -> str:
    """The Listener's cookie page (TEN-03) on the --allow-url's host."""
    scheme, dummy, rest = allow_url.partition("://")
    return "%s://%s%s?v=%s" % (scheme, rest.split("/", 1)[0], COOKIE_PATH, nonce)


def cookie_sent(nonce: str) -> str:
    return "%s=%s-kept" % (COOKIE_NAME, nonce)


def broker_limits(path: str = BROKER_CONFIG) -> Facts:
    """max_connections_per_slot and read_timeout of chv-broker's configuration
    (its defaults where the file does not set them), and the file read."""
    cfg: Facts = {}
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        pass
    out = dict((k, cfg.get(k, v)) for k, v in BROKER_DEFAULTS.items())
    out["config"] = path if cfg else "%s (not readable: the defaults)" % path
    return out


def _tenant_fixtures(pol: policymod.Policy, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], request: Facts, fix: Fixtures, facts: Facts,
                     mark: str) -> None:
    """What the TEN cases need in cell A's request and on the guest."""
    g, nonce = facts["guest"], facts["nonce"]
    paths_a = argvmod.cell_paths(pol, slot_a)
    ws = pol["workspace_mount"]
    paths_b = argvmod.cell_paths(pol, slot_b) if slot_b else None
    b_ws = os.path.join(paths_b["workspace"], mark + ".b-file") if paths_b else None
    b_state = os.path.join(paths_b["agent_state"], mark + ".b-state") if paths_b else None
    if slot_b:
        assert b_ws is not None and b_state is not None  # both set with slot_b
        fix.file(b_ws, marker("bws", nonce) + "\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
        fix.file(b_state, marker("bstate", nonce) + "\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
    # TEN-04: the policy's families (the controls) and those it leaves out
    fam = pol.get("socket_families", list(familiesmod.DEFAULT_FAMILIES))
    if fam == familiesmod.ANY:
        facts["families_skip"] = "a socket_families list in the policy (it has %r: no filter)" % fam
    else:
        request["families"] = {"allowed": dict((n, _family_spec(n)) for n in fam),
                               "denied": dict((n, _family_spec(n)) for n in FAMILY_PROBES if n not in fam)}
        g["vsock_guest"] = probe.vsock_bind() if "AF_VSOCK" not in fam else None
    # TEN-05: the slot's own file system
    if pol.get("disk_max"):
        request["disk"] = ws
        g["disk"] = {"limit": diskmod.parse_size(pol["disk_max"]), "disk_max": pol["disk_max"],
                     "own_device": os.stat(paths_a["workspace"]).st_dev != os.stat("/").st_dev,
                     "image": loop_backing_file(os.stat(paths_a["workspace"]).st_dev)}
    # TEN-08: what cell A plants for chv-cell read
    plant: Dict[str, List[Any]]
    plant = {"file": ["file", os.path.join(ws, mark + ".read-file"), marker("read", nonce)],
             "shadow": ["symlink", os.path.join(ws, mark + ".read-shadow"), "/etc/shadow"],
             "fifo": ["fifo", os.path.join(ws, mark + ".read-fifo"), None]}
    if slot_b:
        plant["other_slot"] = ["symlink", os.path.join(ws, mark + ".read-b"), b_ws]
    request["plant"] = plant
    fix.files += [os.path.join(paths_a["workspace"], os.path.basename(p)) for dummy, p, dummy2 in plant.values()]
    # TEN-09: the audited slots' directories
    g["slot_dirs"] = []
    for s in [slot_a] + ([slot_b] if slot_b else []):
        paths = argvmod.cell_paths(pol, s)
        for kind in ("workspace", "agent_state"):
            try:
                st = os.lstat(paths[kind])
                g["slot_dirs"].append({"path": paths[kind], "uid_base": s["uid_base"], "uid": st.st_uid,
                                       "gid": st.st_gid, "mode": "%04o" % (st.st_mode & 0o7777),
                                       "dir": os.path.isdir(paths[kind]) and not os.path.islink(paths[kind])})
            except OSError as exc:
                g["slot_dirs"].append({"path": paths[kind], "error": exc.strerror})
    client = request["broker_client"]
    # TEN-01: the sync door
    if not client:
        facts["sync_skip"] = "chv-broker's client (--broker-client)"
    elif not shutil.which("git"):
        facts["sync_skip"] = "git on the guest (the sync door's worker and the cell's git init)"
    elif not slot_b:
        facts["sync_skip"] = "a second slot"
    else:
        repos: Dict[str, Facts] = {}
        for name, extra in (("clean", {}), ("packed_refs", {"packed_refs_link": b_ws}),
                            ("alternates", {"alternates": b_state})):
            repo = "%s-sync-%s" % (mark, name)
            repos[name] = dict(extra, repo=repo, path=os.path.join(ws, repo))
            fix.trees.append(os.path.join(paths_a["workspace"], repo))
        request["sync"] = {"repos": repos}
        assert b_ws is not None and b_state is not None  # both set with slot_b
        g["b_files_readable"] = all(os.access(p, os.R_OK) for p in (b_ws, b_state))
    # TEN-02: the door quota
    if not client:
        facts["quota_skip"] = "chv-broker's client (--broker-client)"
    elif not slot_b:
        facts["quota_skip"] = "a second slot"
    else:
        limits = broker_limits()
        g["quota"] = limits
        request["quota"] = {"limit": int(limits["max_connections_per_slot"]), "extra": QUOTA_EXTRA,
                            "socket": CELL_BROKER_SOCKET, "wait": 30,
                            "ready": os.path.join(ws, mark + ".quota-ready"), "go": os.path.join(ws, mark + ".quota-go")}
        fix.files += [os.path.join(paths_a["workspace"], mark + k) for k in (".quota-ready", ".quota-go")]


def _quota_relay(pol: policymod.Policy, slot_a: policymod.Slot, slot_b: policymod.Slot, mark: str, g: Facts) -> None:
    """TEN-02 on the guest: once cell A holds the door (its ready file), cell
    B pings (its ping file) and its reply is kept; then A may let go."""
    ws_a, ws_b = (argvmod.cell_paths(pol, s)["workspace"] for s in (slot_a, slot_b))
    ready, go = os.path.join(ws_a, mark + ".quota-ready"), os.path.join(ws_a, mark + ".quota-go")
    ping, pinged = os.path.join(ws_b, mark + ".ping"), os.path.join(ws_b, mark + ".pinged")
    try:
        if not _wait(lambda: os.path.exists(ready), 120):
            return
        t0 = time.monotonic()
        with open(ping, "w"):
            pass
        if _wait(lambda: os.path.exists(pinged), 15):
            with open(pinged) as fh:
                g["quota_b_ping"] = json.load(fh)
            g["quota_b_ping_seconds"] = round(time.monotonic() - t0, 3)
    except (OSError, ValueError) as exc:
        g["quota_relay_error"] = str(exc)
    finally:
        try:
            with open(go, "w"):
                pass
        except OSError:
            pass


def _read_slot(policy_path: str, slot: str, path: str) -> Facts:
    """chv-cell read --slot SLOT PATH: exit code, stdout, seconds."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(_chv_cell(policy_path, "read", "--slot", slot, "--", path), capture_output=True,
                           timeout=30, check=False)
        rc, out, err = p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", "no answer within 30 s"
    return {"rc": rc, "out": out[:2000], "err": err.strip()[-200:], "seconds": round(time.monotonic() - t0, 3)}


def _after_cell_a(pol: policymod.Policy, policy_path: str, launch: str, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], request: Facts,
                  script: str, opts: Facts, facts: Facts) -> None:
    """What follows cell A's run: the reader of its files (TEN-08) and run 2
    of slot A (TEN-03)."""
    g = facts["guest"]
    g["read"] = dict((name, _read_slot(policy_path, slot_a["name"], path))
                     for name, (dummy, path, dummy2) in sorted(request["plant"].items()))
    try:
        with open("/etc/shadow") as fh:
            g["shadow_words"] = [line.split(":", 1)[0] + ":" for line in fh if line.strip()][:3]
    except OSError:
        g["shadow_words"] = []
    if request.get("cookie"):
        run2 = {"broker_client": request["broker_client"], "cookie": request["cookie"]}
        rc, out, err = _run_cell(launch, slot_a["name"], ["python3", "-I", script, "in-cell-run2", json.dumps(run2)],
                                 opts["timeout"])
        try:
            facts["run2"] = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
        except (ValueError, IndexError):
            facts["run2"] = None
        if facts["run2"] is None:
            facts["run2_error"] = "chv-cell run exited %s: %s" % (rc, (err or out).strip()[-300:])


STATUS_FD = "{status-fd}"


def _run_status(policy_path: str, slot: str, payload: List[str], timeout: float,
                extra: Sequence[str] = ()) -> Tuple[int, str, Optional[Facts]]:
    """_run_cell with --status-fd: (exit code, stdout, the status record or
    None); STATUS_FD in ``payload`` stands for the fd's number."""
    rfd: Optional[int]
    wfd: Optional[int]
    rfd, wfd = os.pipe()
    try:
        argv = _chv_cell(policy_path, "run", "--slot", slot, "--timeout", str(timeout), "--status-fd", str(wfd),
                         *extra) + ["--"] + [str(wfd) if a == STATUS_FD else a for a in payload]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(wfd,))
        os.close(wfd)
        wfd = None
        with os.fdopen(rfd, "r") as fh:
            rfd = None
            text = fh.read()
        out, dummy = p.communicate(timeout=timeout + 300)
    finally:
        for fd in (rfd, wfd):
            if fd is not None:
                os.close(fd)
    try:
        record = json.loads(text.splitlines()[0])
    except (ValueError, IndexError):
        record = None
    return p.returncode, out, record


FORGE = ("import errno, os, sys\nsys.stderr.write(%r + '\\n')\n"
         "try:\n    os.write(int(sys.argv[1]), b'{\"exit\": 75, \"verdict\": \"busy\"}\\n')\n    print('ok')\n"
         "except OSError as exc:\n    print(errno.errorcode.get(exc.errno, exc.errno))\nsys.exit(75)\n") % FORGED_BUSY


def _lifecycle(pol: policymod.Policy, policy_path: str, slot_a: policymod.Slot, opts: Facts, facts: Facts) -> None:
    g, nonce = facts["guest"], facts["nonce"]
    name = slot_a["name"]
    g["runs"] = [_run_cell(policy_path, name, ["true"], opts["timeout"])[0] for dummy in range(opts["runs"])]
    g["runtime"] = {"control_rc": _run_cell(policy_path, name, ["true"], opts["timeout"], ["--runtime-max", "30"])[0],
                    "limited_rc": _run_cell(policy_path, name, ["sleep", "30"], opts["timeout"],
                                            ["--runtime-max", "1"])[0]}
    # LIM-02: threads up to TasksMax + 16, where the guest enforces it
    limit = str(pol["properties"].get("TasksMax", ""))
    controllers = ""
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as fh:
            controllers = fh.read()
    except OSError:
        pass
    if not limit.isdigit():
        g["tasks_skip"] = "a numeric TasksMax in the policy's properties (it has %r)" % (limit or None)
    elif "pids" not in controllers.split():
        g["tasks_skip"] = "the pids cgroup controller delegated to the cells (this guest's cgroup.controllers: %r)" \
            % controllers.strip()
    else:
        code = ("import threading, time, sys\nn = 0\nfor _ in range(int(sys.argv[1])):\n"
                "    try:\n        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
                "        n += 1\n    except RuntimeError:\n        break\nprint(n)\n")
        counts: List[int] = []
        for want in (4, int(limit) + 16):
            out = _run_cell(policy_path, name, ["python3", "-I", "-c", code, str(want)], opts["timeout"])[1]
            counts.append(int(out.split()[-1]) if out.split() and out.split()[-1].isdigit() else -1)
        g["tasks"] = {"limit": int(limit), "control": counts[0], "started": counts[1]}
    # LIFE-03: every slot at once, then one more
    # warm cells being replaced after the runs above: wait until they wait
    _wait(lambda: not any(records.payload_running(pol, s) for s in pol["slots"]), 10)
    busy = [s for s in pol["slots"] if records.payload_running(pol, s)]
    if busy:
        g["busy_skip"] = "every slot idle (busy: %s)" % ", ".join(s["name"] for s in busy)
    else:
        go = ".chv-audit-go-%s" % nonce
        gate = "until test -e %s/%s; do sleep 0.1; done" % (pol["workspace_mount"], go)
        procs = [subprocess.Popen(_chv_cell(policy_path, "run", "--slot", s["name"], "--timeout", str(opts["timeout"]),
                                            "--", "sh", "-c", gate), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for s in pol["slots"]]
        try:
            _wait(lambda: all(records.payload_running(pol, s) for s in pol["slots"]) or
                  any(p.poll() is not None for p in procs), opts["timeout"] + 30)
            running = sum(1 for s in pol["slots"] if records.payload_running(pol, s))
            extra, record = None, None
            if running == len(pol["slots"]):
                extra, dummy, record = _run_status(policy_path, name, ["true"], 1)
            g["busy"] = {"slots": len(pol["slots"]), "running": running, "all_ran": running == len(pol["slots"]),
                         "extra_rc": extra, "extra_record": record}
        finally:
            for s in pol["slots"]:
                path = os.path.join(argvmod.cell_paths(pol, s)["workspace"], go)
                with open(path, "w"):
                    pass
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for s in pol["slots"]:
                try:
                    os.unlink(os.path.join(argvmod.cell_paths(pol, s)["workspace"], go))
                except OSError:
                    pass
    # TEN-07: a payload that plays a busy launcher
    rc, out, record = _run_status(policy_path, name, ["python3", "-I", "-c", FORGE, STATUS_FD], opts["timeout"])
    g["forged"] = {"rc": rc, "write": (out.split() or ["no output"])[-1], "record": record,
                   "warm": name in pol.get("warm_slots", [])}
    # LIFE-04: SIGKILL a launcher whose cell runs; the slot is claimable again
    proc = subprocess.Popen(_chv_cell(policy_path, "run", "--slot", name, "--timeout", str(opts["timeout"]), "--",
                                      "sleep", "300"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = _wait(lambda: records.payload_running(pol, slot_a) or proc.poll() is not None, opts["timeout"] + 30) and \
        proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    g["sigkill"] = {"started": started, "after_rc": _run_cell(policy_path, name, ["true"], 30)[0]}


def _left_behind(pol: policymod.Policy, slots: Iterable[policymod.Slot]) -> List[str]:
    """What of the slots' cells is still there.  A slot whose warm cell waits
    for a payload holds that fresh cell's record, veth and machine, not a
    leftover (a warm cell listens only before its one payload)."""
    left: List[str] = []
    for s in slots:
        if records.warm_waiting(pol, s):
            continue
        if _record_exists(pol, s):
            left.append("record of %s" % s["name"])
        if os.path.exists("/sys/class/net/%s" % s["host_ifname"]):
            left.append("interface %s" % s["host_ifname"])
        if os.path.exists("/run/systemd/machines/%s" % s["machine"]):
            left.append("machine %s" % s["machine"])
    return left


def run(policy_path: str, opts: Facts) -> Facts:
    """The whole catalog on this guest; returns the report."""
    pol = policymod.load(policy_path)
    slots = pol["slots"]
    slot_a = policymod.slot_by_name(pol, opts["slot"]) if opts.get("slot") else slots[0]
    others = [s for s in slots if s["name"] != slot_a["name"]]
    slot_b = others[0] if others else None
    facts: Facts
    facts = {"nonce": os.urandom(4).hex(), "guest": {}, "policy": pol, "slot_a": slot_a, "slot_b": slot_b,
             "broker_client": opts["broker_client"] or ""}
    fix = Fixtures()
    kept: List[str] = []
    try:
        _cell_probes(pol, policy_path, slot_a, slot_b, opts, fix, facts)
    finally:
        # --keep: the fixtures the cells read and wrote stay for inspection
        # (their paths in the report's header); the audit's processes end
        kept = fix.cleanup(keep_files=bool(opts.get("keep")))
    # --case: the cells' probes run whole (one run gathers every cell case's
    # facts), the lifecycle runs only for a case of its own; the report has
    # the named cases only
    cases = list(opts.get("cases") or [])
    lifecycle = bool(opts.get("lifecycle", True)) and (not cases or bool(set(cases) & set(LIFECYCLE_CASES)))
    if facts.get("a") is not None and lifecycle:
        _lifecycle(pol, policy_path, slot_a, opts, facts)
    facts["guest"]["lifecycle"] = lifecycle
    audited = [slot_a] + ([slot_b] if slot_b else [])
    _wait(lambda: not _left_behind(pol, audited), 10)
    facts["guest"]["left_behind"] = _left_behind(pol, audited)
    results = judge(facts)
    if cases:
        results = dict((cid, r) for cid, r in results.items() if cid in cases)
    head = header(policy_path, opts.get("labels", {}))
    if opts.get("keep"):
        head["kept"] = " ".join(kept)
    return report(results, head, opts.get("strict_skips", False), cases or None)
