"""TEN: one tenant's slot against another's, through the doors, the
launcher and the slot's own resources (issue 29)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

from .. import exits
from .case import Case, Result, error, missing, pair, skip
from .facts import (DISK_FULL, NO_BROWSER, NO_BROWSER_OP, QUOTA_EXTRA, Facts, answer, cookie_sent, dropped, marker,
                    reply_text, result_of, short, snapshot_text, workspace_written)
from .loosen import Loosening, unless


def _secrets(facts: Facts) -> List[str]:
    """The texts of slot B's files that no reply to cell A may carry."""
    return [marker("bws", facts["nonce"]), marker("bstate", facts["nonce"])]


def _ten01(case: Case, facts: Facts) -> Result:
    sync = facts["a"].get("sync")
    lacking = missing(facts, "sync_skip", sync, "the cell ran no sync request (no broker client in it)")
    if lacking:
        return lacking
    replies, g = sync["replies"], facts["guest"]
    clean = answer(replies.get("clean", {})) or {}
    if "unknown or disabled op" in str(clean.get("error", "")):
        return skip("the sync door (this guest's broker has no sync op)")
    hostile = ["packed_refs", "alternates"]
    answers = dict((k, answer(replies.get(k, {})) or {}) for k in hostile)
    leaked = [k for k in hostile if any(m in reply_text(replies.get(k, {})) for m in _secrets(facts))]
    setup_ok = all(sync["setup"].get(k) == "ok" for k in ["clean"] + hostile)
    return pair(all(answers[k].get("ok") is False for k in hostile) and not leaked,
                "; ".join("%s: %s" % (k, ("refused: %s" % str(answers[k].get("error"))[:90])
                                      if answers[k].get("ok") is False else short(replies.get(k, {})))
                          for k in hostile) + "; slot B's text in a reply: %s" % (leaked or "none"),
                clean.get("ok") is True and result_of(replies.get("clean", {})).get("returncode") == 0 and setup_ok
                and g.get("b_files_readable") is True,
                "clean repository: %s; set up: %s; the guest reads slot B's files: %s"
                % ("returncode %s" % result_of(replies.get("clean", {})).get("returncode") if clean.get("ok") else
                   short(replies.get("clean", {})), ", ".join("%s %s" % kv for kv in sorted(sync["setup"].items())),
                   g.get("b_files_readable")))


def _ten02(case: Case, facts: Facts) -> Result:
    quota, g = facts["a"].get("quota"), facts["guest"]
    lacking = missing(facts, "quota_skip", quota, "the cell did not hold the door (no broker client in it)")
    if lacking:
        return lacking
    limit = int(g["quota"]["max_connections_per_slot"])
    name = facts["slot_a"]["name"]
    replies = quota.get("replies", [])
    past = replies[limit:]
    refused = len(past) == QUOTA_EXTRA and all(
        "busy: slot %s " % name in r and "max_connections_per_slot" in r for r in past)
    b_ping = g.get("quota_b_ping") or {}
    after = answer(quota.get("ping_after") or {}) or {}
    admitted = replies[:limit] == ["idle"] * limit
    held = admitted and quota.get("still_held") == limit and quota.get("go") is True
    return pair(refused and (answer(b_ping) or {}).get("ok") is True,
                "past the quota of %d: %s; slot B's ping while A held it: %s"
                % (limit, " | ".join(r[:110] for r in past) or "none",
                   short(b_ping) if b_ping else g.get("quota_relay_error", "not sent")),
                held and after.get("ok") is True,
                "A's first %d connections admitted: %s, still held when B pinged: %s of %d; A's ping after letting "
                "go: %s (attempt %s)" % (limit, admitted, quota.get("still_held"), limit,
                                         short(quota.get("ping_after") or {}), quota.get("ping_attempts")))


def _ten03(case: Case, facts: Facts) -> Result:
    br, cookie = facts["a"].get("browser"), facts["a"].get("cookie")
    if br is None or br.get("allowed") is None or cookie is None:
        return skip(NO_BROWSER)
    if "unknown or disabled op" in str((answer(br["allowed"]) or {}).get("error", "")):
        return skip(NO_BROWSER_OP)
    sent = cookie_sent(facts["nonce"])
    shown = sent in reply_text(cookie[1]) and (answer(cookie[1]) or {}).get("ok") is True
    run2 = facts.get("run2")
    if run2 is None:
        return error("run 2 of slot A: %s; run 1 showed the cookie: %s" % (facts.get("run2_error", "did not run"),
                                                                           shown))
    snap = answer(run2["snapshot"]) or {}
    opened = answer(run2["open"]) or {}
    kept = [k for k in ("snapshot", "open") if sent in reply_text(run2[k])]
    return pair(snap.get("ok") is False and not kept,
                "run 2 snapshot: %s; run 1's cookie in run 2's replies: %s"
                % ("refused: %s" % str(snap.get("error"))[:80] if snap.get("ok") is False
                   else "A PAGE: %s" % short(run2["snapshot"]), kept or "no"),
                shown and opened.get("ok") is True and "chv-audit-cookie" in reply_text(run2["open"]),
                "run 1's second open shows %s: %s; run 2's open: %s"
                % (sent, shown if shown else "no: %s" % snapshot_text(cookie[1]),
                   "ok" if opened.get("ok") else short(run2["open"])))


def _ten04(case: Case, facts: Facts) -> Result:
    fam, g = facts["a"]["kernel"].get("families"), facts["guest"]
    lacking = missing(facts, "families_skip", fam, "the cell did not report its socket families")
    if lacking:
        return lacking
    if g.get("vsock_guest") not in (None, "ok"):
        return skip("AF_VSOCK on the guest's kernel (socket and bind on the guest: %s)" % g["vsock_guest"])
    tried = dict(fam["denied"])
    if g.get("vsock_guest") == "ok":
        tried.update(vsock_bind=fam["vsock_bind"].split(": ")[-1], high_bits=fam["high_bits"])
    return pair(bool(tried) and all(v == "EAFNOSUPPORT" for v in tried.values()),
                ", ".join("%s: %s" % kv for kv in sorted(tried.items())),
                all(v == "ok" for v in fam["allowed"].values()) and bool(fam["allowed"]),
                "%s; the guest binds AF_VSOCK: %s" % (", ".join("%s: %s" % kv for kv in sorted(fam["allowed"].items())),
                                                      g.get("vsock_guest") or "not tried (allowed)"))


def _ten05(case: Case, facts: Facts) -> Result:
    disk, gd = facts["a"].get("disk"), facts["guest"].get("disk")
    if gd is None:
        return skip("a disk quota in the policy (disk_max, role variable chv_cell_disk_max)")
    if disk is None:
        return error("the cell did not report its workspace's file system")
    grew = gd.get("image_grew", 0)
    return pair(disk["size"] <= gd["limit"] and disk["big"] in DISK_FULL and grew == 0,
                "file system %d bytes (disk_max %s: %d); fallocate of %d bytes: %s in %ss; the image %s grew by %d "
                "bytes" % (disk["size"], gd["disk_max"], gd["limit"], disk["asked"], disk["big"],
                           disk.get("big_seconds"), gd.get("image") or "(none: not a loop device)", grew),
                disk["small"] == "ok" and gd["own_device"] is True,
                "small write: %s; the workspace on a file system of its own: %s" % (disk["small"], gd["own_device"]))


def _ten06(case: Case, facts: Facts) -> Result:
    tcp, g = facts["a"]["tcp"], facts["guest"]
    if "special" not in tcp:
        return skip("--special HOST:PORT, a stand-in in a private or special-purpose range that no deny entry or "
                    "carve-out covers, which the guest reaches")
    counter = case.drop_counter or ""
    moved = (g.get("counters_moved") or {}).get(counter, 0)
    door = (facts["a"].get("browser") or {}).get("denied", {}).get("special")
    door_answer: Any = answer(door) if door else None
    door_ok = door is None or (door_answer or {}).get("ok") is False
    return pair(dropped(tcp["special"]) and moved > 0 and door_ok,
                "cell A: %s; %s +%d; chv-browser for A: %s"
                % (tcp["special"], counter, moved, "not asked (no --allow-url)" if door is None else
                   "refused: %s" % str(door_answer.get("error"))[:60]
                   if (door_answer or {}).get("ok") is False else "OPENED" if door_answer else "no reply"),
                g["reach"].get("special", "").startswith("connected"), "guest: %s" % g["reach"].get("special"))


def _ten07(case: Case, facts: Facts) -> Result:
    g = facts["guest"]
    # the control: LIFE-03's busy run, or (without --exclusive) one in cell A's slot while the audit held its lock
    busy, forged = g.get("busy") or g.get("busy_control"), g.get("forged") or {}
    if busy is None:
        return skip(g.get("busy_skip", "every slot idle") + " (the control is LIFE-03's busy run)")
    record, real = forged.get("record") or {}, busy.get("extra_record") or {}
    # a warm cell's launcher cannot tell whether exit is the payload's (verdict unknown): not busy either
    ran = ("ran", "unknown") if forged.get("warm") else ("ran",)
    return pair(bool(forged) and record.get("verdict") in ran and record.get("exit") == exits.EXIT_BUSY and
                forged.get("write") != "ok",
                "status record: %s; the payload's write to the fd: %s"
                % (json.dumps(record, sort_keys=True) if record else "none", forged.get("write")),
                real.get("verdict") == "busy" and real.get("exit") == exits.EXIT_BUSY,
                "%s: %s" % ("LIFE-03's busy run" if g.get("busy") else "a run in cell A's held slot",
                            json.dumps(real, sort_keys=True) if real else "no record"))


def _ten08(case: Case, facts: Facts) -> Result:
    g, nonce = facts["guest"], facts["nonce"]
    reads, planted = g.get("read") or {}, facts["a"].get("plant") or {}
    words = _secrets(facts) + list(g.get("shadow_words") or [])
    hostile = sorted(k for k in reads if k != "file")
    bad = [k for k in hostile if reads[k]["rc"] != 65 or (reads[k]["seconds"] or 99) > 10 or
           any(w in reads[k]["out"] for w in words if w)]
    ctl: Dict[str, Any] = reads.get("file") or {}
    return pair(bool(hostile) and not bad,
                "; ".join("%s: exit %s in %ss, %d bytes out"
                          % (k, reads[k]["rc"], reads[k]["seconds"], len(reads[k]["out"])) for k in hostile)
                or "nothing read",
                bool(reads) and all(v == "ok" for v in planted.values()) and ctl.get("rc") == 0 and
                ctl.get("out") == marker("read", nonce),
                "planted: %s; the regular file: exit %s, %s"
                % (", ".join("%s %s" % kv for kv in sorted(planted.items())) or "nothing", ctl.get("rc"),
                   "its text" if ctl.get("out") == marker("read", nonce) else repr(ctl.get("out", ""))[:60]))


def _ten09(case: Case, facts: Facts) -> Result:
    g = facts["guest"]
    dirs = g.get("slot_dirs") or []
    ok = [d for d in dirs if "error" not in d and d["dir"]]
    own = [d for d in ok if d["uid"] == d["uid_base"] and d["gid"] == d["uid_base"] and d["mode"] == "0700"]
    ws_ok = workspace_written(facts)
    return pair(bool(ok) and len(own) == len(ok),
                ", ".join("%s %s:%s %s" % (d["path"], d["uid"], d["gid"], d["mode"]) for d in ok),
                bool(dirs) and len(ok) == len(dirs) and ws_ok,
                "directories: %s; cell A wrote its workspace: %s"
                % (", ".join("%s %s" % (d["path"], d.get("error", "ok" if d.get("dir") else "not a directory"))
                             for d in dirs) or "none", ws_ok))


CASES = [
    Case("TEN-01", ("sync",), "The sync door reads nothing outside the slot",
         "cell A's repositories whose .git/packed-refs is a link to a file of slot B's workspace and whose "
         ".git/objects/info/alternates names slot B's agent state: sync status through the broker is refused "
         "and no reply carries the files' text",
         "sync status of a clean repository in the same cell succeeds; the guest reads slot B's files", _ten01,
         "needs a build of chv-broker without its git directory checks and the worker's mount namespace; "
         "tests/integration/broker/test_sync_tenants.py shows the leak on the old code"),
    Case("TEN-02", ("quota",), "A slot at its door quota is refused for itself alone",
         "cell A holds max_connections_per_slot idle connections to chv-broker and opens %d more: those are "
         "refused as busy naming slot A and the quota; meanwhile cell B's ping is answered" % QUOTA_EXTRA,
         "A's first connections were admitted and still held while B pinged; after A lets go, A's own ping "
         "is answered", _ten02,
         "the quota is chv-broker's configuration, read when it starts: loosening it restarts every slot's "
         "door, not one slot's cells for one run; tests/integration/broker/test_door_fairness.py shows the "
         "old global cap refusing the other slot"),
    Case("TEN-03", ("browser", "cookie"), "The browser keeps nothing of a run for the slot's next run",
         "run 1 of slot A opens the audit's cookie page through chv-browser; run 2 of slot A: snapshot finds "
         "no page, and the cookie page shows no cookie",
         "in run 1 a second open shows the cookie; run 2's open works", _ten03,
         "a policy copy without the launcher's end (browser_socket empty) leaves run 1's context to run 2 only "
         "when chv-broker's reaper (every reap_interval) does not see the slot empty between the two runs: not "
         "deterministic on a guest; tests/integration/browser/test_browser_state_across_runs.py shows it with "
         "the reaper off"),
    Case("TEN-04", ("kernel",), "A cell gets only the policy's socket families",
         "socket() of AF_VSOCK (and its bind), AF_PACKET and AF_XDP, and AF_VSOCK with bit 32 set through "
         "syscall(): each EAFNOSUPPORT",
         "each family of socket_families works in the same cell; the guest binds an AF_VSOCK socket", _ten04,
         Loosening('socket_families: "any" (no socket family filter)',
                   edit=lambda raw, ctx: raw.update(socket_families="any"),
                   needs=unless("the policy's socket_families is already \"any\"",
                                lambda ctx: ctx["pol"].get("socket_families") != "any"))),
    Case("TEN-05", ("disk",), "A slot's disk quota holds",
         "the workspace's file system is no larger than disk_max; fallocate of its free space + 1 MiB fails "
         "with ENOSPC; the image the slot's file system lives in takes no more of the guest's disk than before",
         "a small write in the workspace succeeds; the workspace is on a file system of its own (not /'s)", _ten05,
         "the quota is the slot's own file system: loosening it would unmount it (or move the slot onto /) while "
         "slots may run, and the launcher refuses a slot whose directories are not on a file system of their "
         "own (disk.check_slot)"),
    Case("TEN-06", ("tcp", "browser"), "Private and special-purpose ranges are denied by default",
         "connect from cell A to the --special stand-in (a special-purpose address no deny entry or "
         "carve-out covers): no answer, and drop_special_range moves; chv-browser's open of it for A is refused",
         "the guest connects to it", _ten06,
         Loosening("the --special stand-in (a /32) as an element of the carve-out set carve_nets",
                   elements=lambda ctx: [("carve_nets", ctx["opts"]["special"].rsplit(":", 1)[0])],
                   needs=unless("run without --special HOST:PORT", lambda ctx: ctx["opts"].get("special"))),
         drop_counter="drop_special_range", mode="cidr"),
    Case("TEN-07", (), "The launcher's verdict cannot be forged by the payload",
         "a payload prints a busy launcher's words, writes to the --status-fd number and exits 75: the "
         "status record says it ran, exit 75, and the payload's write failed",
         "a real busy run with --status-fd records verdict busy (LIFE-03's, every slot held; without --exclusive one "
         "in cell A's slot while the audit holds its lock)", _ten07,
         "the launcher starts every cell with the fds above 2 closed: no policy hands the status fd to a "
         "payload", lifecycle=True),
    Case("TEN-08", ("plant",), "A reader of a slot's files never follows what the cell planted",
         "chv-cell read --slot A of cell A's links to slot B's file and to /etc/shadow and of its FIFO: each "
         "refused (exit 65) at once, none of their text on stdout",
         "a regular file cell A wrote reads back", _ten08,
         "needs a build of chv-cell read that follows links (slotfiles.read_file); "
         "tests/integration/cells/test_slot_files.py reads the same plants"),
    Case("TEN-09", ("write",), "Each slot's workspace and home are the slot's own",
         "cell A's and B's workspace and home are owned by the slot's uid_base (user and group), mode 0700",
         "the directories are there and cell A wrote its workspace", _ten09,
         "re-owning a slot's directories while its cells may run is no loosening of one run; FS-03's loosening "
         "is what a directory other users can read would give"),
]
