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

import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET

from . import argv as argvmod
from . import audit_probe as probe
from . import health as healthmod
from . import policy as policymod
from . import runner

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


# ------------------------------------------------------------- the catalog

class Case(object):
    """One boundary: what is probed and what the control is (how each is
    loosened, its counter-proof, is counterproof.py's)."""

    def __init__(self, cid, title, probe_text, control):
        self.id, self.title, self.probe, self.control = cid, title, probe_text, control

    @property
    def area(self):
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
LIFECYCLE_CASES = ("LIFE-02", "LIFE-03", "LIFE-04", "LIM-01", "LIM-02")


# ------------------------------------------------------------- verdicts

def _result(verdict, probe_ev, control_ev):
    return {"verdict": verdict, "probe": probe_ev, "control": control_ev}


def pair(probe_ok, probe_ev, control_ok, control_ev):
    """pass when the probe was stopped; error, whatever the probe did,
    when the control did not succeed."""
    if not control_ok:
        return _result("error", probe_ev, "CONTROL FAILED: %s" % control_ev)
    return _result("pass" if probe_ok else "fail", probe_ev, control_ev)


def skip(requirement):
    return _result("skip", "needs %s" % requirement, "")


def _caps(hexmask):
    try:
        value = int(hexmask, 16)
    except (TypeError, ValueError):
        return None
    return set(name for bit, name in enumerate(policymod.CAP_NAMES) if value >> bit & 1)


def _denied(result):
    return result not in ("ok",)


def _dropped(result):
    return result in DROPPED


def judge(facts):
    """Every case's verdict from the facts of one run (the cells' reports
    and the guest's observations). Returns {case id: result}."""
    out = {}
    a, g = facts.get("a"), facts["guest"]
    if a is None:
        # nothing was proven: every case is an error, the lifecycle ones too (not run)
        why = "cell A did not run: %s" % facts.get("a_error", "no report")
        return dict((c.id, _result("error", "", "CONTROL FAILED: %s" % why)) for c in CASES)
    out.update(_judge_cell(facts, a, g))
    out.update(_judge_life(facts, g))
    return out


def _judge_cell(facts, a, g):
    out, rd, wr, k = {}, a["read"], a["write"], a["kernel"]
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
        ranges = []
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
    return out


def _judge_net(facts, a, g):
    out, tcp = {}, a["tcp"]
    neigh_ok = "lladdr" in a.get("neigh_out", "")
    moved = g.get("counters_moved") or {}

    def dropped_here(cid, results):
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


def _answer(reply):
    """The broker's JSON reply of a client run, or None."""
    try:
        return json.loads(reply.get("out") or "null")
    except ValueError:
        return None


def _judge_ipc(facts, a, g):
    if "broker" not in a:
        return dict((cid, skip("chv-broker's client (--broker-client)"))
                    for cid in ("IPC-01", "IPC-02", "IPC-03", "IPC-04"))
    br = a["broker"]
    ping = _answer(br["ping"]) or {}
    pinged = ping.get("ok") is True
    ping_ev = "cell ping: %s" % (br["ping"]["out"] or br["ping"]["err"])
    out = {"IPC-01": pair(pinged, ping_ev, os.path.exists(facts["broker_client"]), "client %s" % facts["broker_client"])}
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


def _judge_brw(facts, a, g):
    br = a.get("browser")
    if br is None or br.get("allowed") is None:
        why = "--allow-url URL, a page cells may open through chv-browser (and chv-broker's client)"
        return dict((cid, skip(why)) for cid in BRW_CASES)
    ctl = _answer(br["allowed"]) or {}
    if "unknown or disabled op" in str(ctl.get("error", "")):
        return dict((cid, skip("chv-browser (this guest's broker has no browser op)")) for cid in BRW_CASES)
    result = ctl.get("result") if isinstance(ctl.get("result"), dict) else {}
    snapshot = str(result.get("aria_snapshot", ""))
    ctl_ok = ctl.get("ok") is True and bool(snapshot)
    ctl_ev = "allowed page: %s" % (("title %r, %d characters of snapshot" % (result.get("title"), len(snapshot)))
                                   if ctl_ok else (br["allowed"]["out"] or br["allowed"]["err"])[-200:])
    moved = g.get("counters_moved") or {}
    cell_a = facts["slot_a"]["address"]
    doors = [s for s in g.get("listener_seen", []) if s["peer"] != cell_a]  # a cell's own arrival is NET's

    def refused(keys):
        replies = dict((key, _answer(br["denied"][key]) or {}) for key in keys)
        ok = bool(keys) and all(r.get("ok") is False for r in replies.values())
        return ok, ", ".join("%s: %s" % (key.split(":", 1)[-1], "refused: %s" % str(r.get("error", ""))[:60]
                                         if r.get("ok") is False else "OPENED" if r.get("ok") else "no reply")
                             for key, r in sorted(replies.items()))
    out = {}
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


def _judge_life(facts, g):
    out = {}
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
    if busy is None:
        out["LIFE-03"] = skip(g.get("busy_skip", "every slot idle"))
    else:
        out["LIFE-03"] = pair(busy["extra_rc"] == runner.EXIT_BUSY, "one more run: exit %s" % busy["extra_rc"],
                              busy["all_ran"], "cells running at once: %d of %d" % (busy["running"], busy["slots"]))
    kill = g.get("sigkill", {})
    out["LIFE-04"] = pair(kill.get("after_rc") == 0, "run after SIGKILL: exit %s" % kill.get("after_rc"),
                          kill.get("started") is True, "the killed launcher's cell had started: %s" % kill.get("started"))
    lim = g.get("runtime", {})
    out["LIM-01"] = pair(lim.get("limited_rc") == runner.EXIT_RUNTIME, "exit %s" % lim.get("limited_rc"),
                         lim.get("control_rc") == 0, "exit %s" % lim.get("control_rc"))
    tasks = g.get("tasks")
    if tasks is None:
        out["LIM-02"] = skip(g.get("tasks_skip", "TasksMax in the policy"))
    else:
        out["LIM-02"] = pair(tasks["started"] < tasks["limit"], "threads started: %s of %s asked, TasksMax %s"
                             % (tasks["started"], tasks["limit"] + 16, tasks["limit"]), tasks["control"] == 4,
                             "4 threads: %s started" % tasks["control"])
    return out


def verdict_of(results, strict_skips=False):
    counts = dict((v, 0) for v in ("pass", "fail", "error", "skip"))
    for r in results.values():
        counts[r["verdict"]] += 1
    if counts["fail"] or (strict_skips and counts["skip"]):
        return "failed", EXIT_FAILED, counts
    if counts["error"]:
        return "error", EXIT_ERROR, counts
    return "passed", 0, counts


# ------------------------------------------------------------- reports

def report(results, header, strict_skips=False):
    verdict, code, counts = verdict_of(results, strict_skips)
    cases = []
    for c in CASES:
        r = results.get(c.id) or _result("error", "", "CONTROL FAILED: the audit did not reach this case")
        cases.append(dict(r, id=c.id, area=c.area, title=c.title))
    return {"verdict": verdict, "exit": code, "counts": counts, "header": header, "cases": cases}


def to_markdown(rep):
    h = rep["header"]
    lines = ["# chv-cell audit: %s on %s" % (rep["verdict"].upper(), h.get("guest")), "",
             "%(pass)d passed, %(fail)d failed, %(error)d errors, %(skip)d skipped" % rep["counts"], ""]
    lines += ["- %s: %s" % (k, h[k]) for k in sorted(h)]
    lines += ["", "| id | boundary | verdict | probe | control |", "|---|---|---|---|---|"]
    for c in rep["cases"]:
        lines.append("| %s | %s | %s | %s | %s |" % (c["id"], c["title"], c["verdict"].upper(),
                                                     cell_text(c["probe"]), cell_text(c["control"])))
    return "\n".join(lines) + "\n"


def cell_text(text):
    """Evidence as one Markdown table cell: no row break, no column break."""
    return " / ".join(line.strip() for line in text.splitlines() if line.strip()).replace("|", "/")


def to_junit(rep):
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


def write_files(directory, files):
    """{name: text} into `directory`, each file replaced whole."""
    os.makedirs(directory, exist_ok=True)
    for name, text in sorted(files.items()):
        tmp = os.path.join(directory, "." + name)
        with open(tmp, "w") as fh:
            fh.write(text)
        os.rename(tmp, os.path.join(directory, name))


def report_files(rep):
    return {"audit.json": json.dumps(rep, indent=2, sort_keys=True) + "\n", "audit.xml": to_junit(rep) + "\n",
            "audit.md": to_markdown(rep)}


def write_reports(rep, directory):
    write_files(directory, report_files(rep))


# ------------------------------------------------------------- the guest side

def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def _launcher_hash():
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(here) if n.endswith(".py")):
        h.update(name.encode() + b"\0" + _sha256(os.path.join(here, name)).encode())
    return h.hexdigest()


def _first_line(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
        return (p.stdout.splitlines() or [""])[0]
    except OSError:
        return ""


def _os_release():
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def header(policy_path, labels):
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

    def __init__(self, address="0.0.0.0", port=0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.3)
        self.address, self.port = address, self.sock.getsockname()[1]
        self.seen = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            self.seen.append({"local": conn.getsockname()[0], "peer": peer[0]})
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn):
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
            body = PAGE.encode()
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n" % len(body) + body)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join(2)
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _guest_addresses(ip):
    """The guest's IPv4 and global IPv6 addresses (no loopback, no link-local)."""
    v4, v6 = [], []
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


def _chv_cell(policy_path, *args):
    lib = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-I", os.path.join(lib, "chv-cell"), "--policy", policy_path] + list(args)


def _run_cell(policy_path, slot, payload, timeout, extra=()):
    argv = _chv_cell(policy_path, "run", "--slot", slot, "--timeout", str(timeout), *extra) + ["--"] + payload
    p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout + 300)
    return p.returncode, p.stdout, p.stderr


def _record_exists(pol, slot):
    return os.path.exists(argvmod.cell_paths(pol, slot)["record"])


def _wait(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


class Fixtures(object):
    """What the guest side puts on the guest for one run, removed again."""

    def __init__(self):
        self.files, self.dirs, self.procs, self.undo = [], [], [], []

    def file(self, path, text, mode, uid=0, gid=0):
        with open(path, "w") as fh:
            fh.write(text)
        os.chown(path, uid, gid)
        os.chmod(path, mode)
        self.files.append(path)

    def directory(self, path, mode, uid=0, gid=0):
        os.mkdir(path, mode)
        os.chown(path, uid, gid)
        self.dirs.append(path)

    def cleanup(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
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
        for fn in self.undo:
            fn()


def hidden_paths(pol):
    """The inaccessible paths of FS-05: all but those of FS-01, FS-02 and FS-04."""
    return [p for p in pol["inaccessible"] if p not in ("/etc/chv", SHOTS_DIR) and not p.endswith("/.git-credentials")]


def _broker_as(client, uid=None):
    kwargs = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        p = subprocess.run([sys.executable, "-I", client, json.dumps({"op": "ping"})], capture_output=True,
                           text=True, timeout=30, check=False, **kwargs)
        return {"rc": p.returncode, "out": p.stdout.strip()[-300:], "err": p.stderr.strip()[-300:]}
    except OSError as exc:
        return {"rc": None, "out": "", "err": str(exc)}


def _cell_probes(pol, policy_path, slot_a, slot_b, opts, fix, facts):
    """Cells A and B with their fixtures; fills facts["a"], ["b"] and the
    guest's observations."""
    g, nonce = facts["guest"], facts["nonce"]
    launch = opts.get("cell_policy") or policy_path  # a counter-proof's loosened copy
    paths_a = argvmod.cell_paths(pol, slot_a)
    uid_a = slot_a["uid_base"]
    home = pol["agent_state_mount"]
    mark = ".chv-audit-%s" % nonce
    read, write = {}, {}
    # FS-01: a root-only file in /etc/chv
    if os.path.isdir("/etc/chv"):
        # readable by every guest user: only the cell's boundary keeps it out
        fix.file("/etc/chv/%s" % mark, "secret\n", 0o644)
        read["etc_chv"] = "/etc/chv/%s" % mark
        g["etc_chv_readable"] = os.access("/etc/chv/%s" % mark, os.R_OK)
    read["os_release"] = "/etc/os-release"
    # FS-02: the credentials file (an existing one is used as it is, never changed)
    cred = os.path.join(paths_a["agent_state"], ".git-credentials")
    if not os.path.exists(cred):
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
    tcp, g["reach"] = {}, {}
    for addr in sorted(set(v4 + gateways) - {METADATA}):
        tcp["guest:" + addr] = [addr, listener.port]
    if opts["metadata_stand_in"]:
        tcp["metadata"] = [METADATA, listener.port]
    for key, target in [("allow:" + t, t) for t in opts["allow"]] + [("deny:" + t, t) for t in opts["deny"]]:
        tcp[key] = list(healthmod.parse_target(target))
    if slot_b is not None:
        tcp["cell_b"] = [slot_b["address"], probe.LISTENER_PORT]
    tcp6 = dict((a, [a, listener.port]) for a in v6)
    tcp6["2001:db8::1"] = ["2001:db8::1", 80]
    # the marked guest process (ID-11, ID-12, ID-13)
    marker = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(600)", probe.MARKER])
    fix.procs.append(marker)
    request = {"nonce": nonce, "read": read, "write": write, "tcp": tcp, "tcp6": tcp6, "guest_pid": marker.pid,
               "ip": ip, "cell_ifname": slot_a["cell_ifname"], "gateway": slot_a["gateway"],
               "broker_client": opts["broker_client"] if os.path.exists(opts["broker_client"] or "") else None}
    # the doors (BRW): chv-browser opens, for cell A, the allowed page and every target the cell may not reach
    if request["broker_client"] and opts.get("allow_url"):
        denied = dict((key, "http://%s:%s/chv-audit-door" % (host, port)) for key, (host, port) in tcp.items()
                      if key.startswith("guest:") or key in ("metadata", "cell_b"))
        denied["guest:127.0.0.1"] = "http://127.0.0.1:%d/chv-audit-door" % listener.port
        request["browser"] = {"allowed": opts["allow_url"], "denied": denied}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "audit_probe.py")
    # cell B first: its listener, its uid_map and its control
    b_proc = None
    if slot_b is not None:
        paths_b = argvmod.cell_paths(pol, slot_b)
        ready, done, seen = (os.path.join(paths_b["workspace"], mark + s) for s in (".ready", ".done", ".seen"))
        breq = dict((k, os.path.join(pol["workspace_mount"], mark + "." + k)) for k in ("ready", "done", "seen"))
        breq["address"] = slot_b["address"]
        fix.files += [ready, done, seen]
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
            facts["b_error"] = "cell B did not start: %s" % (b_proc.stderr.read()[-400:] if b_proc.poll() is not None
                                                             else "no ready file")
    for key, (host, port) in tcp.items():
        if key.startswith(("guest:", "allow:", "deny:", "metadata")) and key != "guest:" + slot_a["gateway"]:
            g["reach"][key.split(":", 1)[1] if ":" in key else key] = probe.connect(host, int(port))
    g["marker_alive"] = marker.poll() is None
    counters_before = healthmod.read_counters()
    seen_before = len(listener.seen)
    rc, out, err = _run_cell(launch, slot_a["name"], ["python3", "-I", script, "in-cell", json.dumps(request)],
                             opts["timeout"])
    counters_after = healthmod.read_counters()
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
    g["workspace_write_seen"] = os.path.exists(os.path.join(paths_a["workspace"], mark + ".w"))
    if g["workspace_write_seen"]:
        fix.files.append(os.path.join(paths_a["workspace"], mark + ".w"))
    g["etc_write_seen"] = os.path.exists("/etc/%s" % mark)
    g["trusted_changed"] = [p for p in trusted if _sha256(p) != before[p]]
    if request["broker_client"]:
        g["broker_root"] = _broker_as(request["broker_client"])
        g["broker_cell_uid"] = _broker_as(request["broker_client"], uid_a)


def _lifecycle(pol, policy_path, slot_a, opts, facts):
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
        counts = []
        for want in (4, int(limit) + 16):
            out = _run_cell(policy_path, name, ["python3", "-I", "-c", code, str(want)], opts["timeout"])[1]
            counts.append(int(out.split()[-1]) if out.split() and out.split()[-1].isdigit() else -1)
        g["tasks"] = {"limit": int(limit), "control": counts[0], "started": counts[1]}
    # LIFE-03: every slot at once, then one more
    # warm cells being replaced after the runs above: wait until they wait
    _wait(lambda: not any(runner.payload_running(pol, s) for s in pol["slots"]), 10)
    busy = [s for s in pol["slots"] if runner.payload_running(pol, s)]
    if busy:
        g["busy_skip"] = "every slot idle (busy: %s)" % ", ".join(s["name"] for s in busy)
    else:
        go = ".chv-audit-go-%s" % nonce
        gate = "until test -e %s/%s; do sleep 0.1; done" % (pol["workspace_mount"], go)
        procs = [subprocess.Popen(_chv_cell(policy_path, "run", "--slot", s["name"], "--timeout", str(opts["timeout"]),
                                            "--", "sh", "-c", gate), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for s in pol["slots"]]
        try:
            _wait(lambda: all(runner.payload_running(pol, s) for s in pol["slots"]) or
                  any(p.poll() is not None for p in procs), opts["timeout"] + 30)
            running = sum(1 for s in pol["slots"] if runner.payload_running(pol, s))
            extra = _run_cell(policy_path, name, ["true"], 1)[0] if running == len(pol["slots"]) else None
            g["busy"] = {"slots": len(pol["slots"]), "running": running, "all_ran": running == len(pol["slots"]),
                         "extra_rc": extra}
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
    # LIFE-04: SIGKILL a launcher whose cell runs; the slot is claimable again
    proc = subprocess.Popen(_chv_cell(policy_path, "run", "--slot", name, "--timeout", str(opts["timeout"]), "--",
                                      "sleep", "300"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = _wait(lambda: runner.payload_running(pol, slot_a) or proc.poll() is not None, opts["timeout"] + 30) and \
        proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    g["sigkill"] = {"started": started, "after_rc": _run_cell(policy_path, name, ["true"], 30)[0]}


def _left_behind(pol, slots):
    """What of the slots' cells is still there.  A slot whose warm cell waits
    for a payload holds that fresh cell's record, veth and machine, not a
    leftover (a warm cell listens only before its one payload)."""
    left = []
    for s in slots:
        if runner.warm_waiting(pol, s):
            continue
        if _record_exists(pol, s):
            left.append("record of %s" % s["name"])
        if os.path.exists("/sys/class/net/%s" % s["host_ifname"]):
            left.append("interface %s" % s["host_ifname"])
        if os.path.exists("/run/systemd/machines/%s" % s["machine"]):
            left.append("machine %s" % s["machine"])
    return left


def run(policy_path, opts):
    """The whole catalog on this guest; returns the report."""
    pol = policymod.load(policy_path)
    slots = pol["slots"]
    slot_a = policymod.slot_by_name(pol, opts["slot"]) if opts.get("slot") else slots[0]
    others = [s for s in slots if s["name"] != slot_a["name"]]
    slot_b = others[0] if others else None
    facts = {"nonce": os.urandom(4).hex(), "guest": {}, "policy": pol, "slot_a": slot_a, "slot_b": slot_b,
             "broker_client": opts["broker_client"] or ""}
    fix = Fixtures()
    try:
        _cell_probes(pol, policy_path, slot_a, slot_b, opts, fix, facts)
    finally:
        fix.cleanup()
    if facts.get("a") is not None and opts.get("lifecycle", True):
        _lifecycle(pol, policy_path, slot_a, opts, facts)
    facts["guest"]["lifecycle"] = bool(opts.get("lifecycle", True))
    audited = [slot_a] + ([slot_b] if slot_b else [])
    _wait(lambda: not _left_behind(pol, audited), 10)
    facts["guest"]["left_behind"] = _left_behind(pol, audited)
    results = judge(facts)
    return report(results, header(policy_path, opts.get("labels", {})), opts.get("strict_skips", False))
