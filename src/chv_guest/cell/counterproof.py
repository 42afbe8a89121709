"""`chv-cell audit --counter-proof`: each boundary the catalog can loosen on
this guest is loosened for one run of the cells, and exactly its cases
must fail in that run; the runs before and after, without it, must pass
(docs/isolation-cases.md, "Counter-proofs").

A loosening is either a copy of the policy with one thing changed (the
cells of that run are started with the copy; the verdicts are judged
against the real policy), accept rules inserted at the top of the
cell_nat table's base chains, matching cell A's interface and the audit's
own destinations only, so that no other slot is loosened, or elements
added to one of the table's sets (TEN-06: the audit's own special-range
stand-in, a /32 in the carve-out set, for that run). Inserted rules and
elements carry COMMENT and are removed after the run, and by the next
counter-proof run or a reload of the ruleset (chv-cell-nat.service) if the
audit was killed in between.

What cannot be loosened here is listed in NOT_COUNTER_PROVABLE with the
reason; a loosening this guest cannot show (a path that its permissions
keep out of every cell anyway) is reported as not applicable, with the
reason, never as proven."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import tempfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import argv as argvmod
from . import audit
from . import audit_probe as probe
from . import policy as policymod
from . import ruleset as rulesetmod

COMMENT = "chv-audit counter-proof"
CHAINS = ("forward", "input", "output")  # the table's base chains a loosening inserts into
SETS = ("carve_nets",)  # the table's sets a loosening adds elements to
EXIT_NOT_PROVEN = audit.EXIT_FAILED
EXIT_ERROR = audit.EXIT_ERROR
# What a loosening reads: "pol" (the policy), "slot_a", "slot_b" (None with one
# slot) and "opts" (the audit's options). A plain mapping, not a TypedDict: a
# loosening's needs() is what makes sure "slot_b" is there before its rules()
# index it, which mypy cannot follow.
Context = Dict[str, Any]
# an edit(raw, ctx) of a policy copy; rules(ctx) or elements(ctx): (chain or set, text) pairs
Edit = Callable[[Dict[str, Any], Context], None]
Pairs = Callable[[Context], List[Tuple[str, str]]]
Needs = Callable[[Context], Optional[str]]
# drop_capabilities a loosening may keep: in systemd-nspawn's default
# bounding set (so keeping it really gives it to the cell), not in the floor
KEEPABLE_CAPS = ("CAP_SYS_NICE", "CAP_LINUX_IMMUTABLE", "CAP_AUDIT_CONTROL")

# case id -> why it is not counter-proven on these guests
NOT_COUNTER_PROVABLE = {
    "FS-06": "the launcher refuses a bind of its state directory (policy check: a bind would expose /run/chv-fleet)",
    "FS-07": "two layers: the read-only /usr and the user namespace (guest root's files are not the cell root's); "
             "a writable bind leaves /usr unwritable, so no single loosening opens it",
    "FS-08": "as FS-07: /etc is a read-only bind of the guest's own, and guest root's files are not the cell root's",
    "FS-09": "as FS-07, for every trusted file",
    "ID-01": "the launcher always maps the slot's uid range; no policy runs a cell as guest root",
    "ID-02": "the policy check refuses partly overlapping uid ranges; identical ones (the shared-uid mode) would "
             "need slot B's workspace re-owned for the run",
    "ID-05": "the policy check refuses no_new_privileges: false",
    "ID-06": "the policy check refuses a syscall_deny without the io_uring calls (the floor)",
    "ID-08": "the policy check refuses a drop_capabilities without CAP_SYS_ADMIN (the floor)",
    "ID-09": "two layers: CAP_MKNOD (the floor) and the kernel, which refuses device nodes in a user namespace",
    "ID-10": "the policy check refuses a drop_capabilities without CAP_NET_RAW (the floor)",
    "ID-11": "the policy check refuses keeping CAP_SYS_PTRACE (the floor), and the cell has its own PID namespace",
    "ID-12": "the policy check refuses keeping CAP_SYS_ADMIN (the floor), and the guest's namespaces are not in "
             "the cell's /proc",
    "ID-13": "every cell has its own PID namespace; no policy shares the guest's",
    "ID-14": "the policy check refuses keeping CAP_NET_ADMIN (the floor)",
    "ID-15": "as ID-14",
    "NET-01": "a positive case: its counter-proof is every NET case beside it",
    "NET-06": "the launcher gives cells no IPv6 address or route, and the ruleset drops IPv6 from cells: two layers",
    "NET-07": "the policy check refuses a loopback resolver in dns_servers",
    "IPC-01": "a positive case: the broker answering the cell is the control of IPC-02 to IPC-04",
    "IPC-02": "needs a build of chv-broker without its peer check; the refusals are tested on real sockets in "
              "tests/integration/broker",
    "IPC-03": "as IPC-02",
    "IPC-04": "needs a build of chv-broker whose dispatch accepts unknown operations (tests/unit/broker)",
    "BRW-04": "needs a build of chv-browser that returns the page's HTML",
    "LIFE-01": "the launcher's own cleanup: nothing in a policy keeps a cell's interface or record",
    "LIFE-02": "a positive case",
    "LIFE-03": "the claim locks are not configurable",
    "LIFE-04": "the claim lock is released by the kernel when its holder dies; nothing to loosen",
    "LIM-01": "the probe sets --runtime-max itself",
    "LIM-02": "not yet: a TasksMax loosening needs the lifecycle run and a guest with the pids controller delegated",
    "TEN-01": "needs a build of chv-broker without its git directory checks and the worker's mount namespace; "
              "tests/integration/broker/test_sync_tenants.py shows the leak on the old code",
    "TEN-02": "the quota is chv-broker's configuration, read when it starts: loosening it restarts every slot's "
              "door, not one slot's cells for one run; tests/integration/broker/test_door_fairness.py shows the "
              "old global cap refusing the other slot",
    "TEN-03": "a policy copy without the launcher's end (browser_socket empty) leaves run 1's context to run 2 only "
              "when chv-broker's reaper (every reap_interval) does not see the slot empty between the two runs: not "
              "deterministic on a guest; tests/integration/browser/test_browser_state_across_runs.py shows it with "
              "the reaper off",
    "TEN-05": "the quota is the slot's own file system: loosening it would unmount it (or move the slot onto /) while "
              "slots may run, and the launcher refuses a slot whose directories are not on a file system of their "
              "own (disk.check_slot)",
    "TEN-07": "the launcher starts every cell with the fds above 2 closed: no policy hands the status fd to a "
              "payload",
    "TEN-08": "needs a build of chv-cell read that follows links (slotfiles.read_file); "
              "tests/integration/cells/test_slot_files.py reads the same plants",
    "TEN-09": "re-owning a slot's directories while its cells may run is no loosening of one run; FS-03's loosening "
              "is what a directory other users can read would give",
}


class Loosening(object):
    """One boundary loosened: `edit(raw, ctx)` changes a copy of the raw
    policy, `rules(ctx)` returns (chain, rule) pairs to insert; `needs(ctx)`
    returns why this guest cannot show it, or None."""

    def __init__(self, name: str, cases: Iterable[str], how: str, edit: Optional[Edit] = None,
                 rules: Optional[Pairs] = None, needs: Optional[Needs] = None,
                 elements: Optional[Pairs] = None) -> None:
        self.name, self.cases, self.how = name, tuple(cases), how
        self.edit, self.rules, self.needs = edit, rules, needs
        self.elements = elements  # elements(ctx): (set, element) pairs to add to the table's sets


def readable_by_others(path: str) -> bool:
    """Whether a user that owns nothing on the guest (the cell's root, seen
    from the guest) may read `path`: every directory above it searchable,
    the path itself readable (and, for a directory, searchable) by others."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    parent = os.path.dirname(path)
    while parent and parent != "/":
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(parent)
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return st.st_mode & need == need


def _without_inaccessible(paths: Callable[[Context], List[str]]) -> Edit:
    def edit(raw: Dict[str, Any], ctx: Context) -> None:
        raw["inaccessible"] = [p for p in raw.get("inaccessible", ctx["pol"]["inaccessible"]) if p not in paths(ctx)]
    return edit


def _bind(source: Callable[[Context], str], also_accessible: bool = False) -> Edit:
    def edit(raw: Dict[str, Any], ctx: Context) -> None:
        src = source(ctx)
        raw["readonly_binds"] = list(raw.get("readonly_binds", [])) + [{"source": src, "target": src,
                                                                        "optional": False}]
        if also_accessible:
            raw["inaccessible"] = [p for p in raw.get("inaccessible", ctx["pol"]["inaccessible"]) if p != src]
    return edit


def _hidden_readable(ctx: Context) -> List[str]:
    """The paths of FS-05 that only the inaccessible list keeps out."""
    return [p for p in audit.hidden_paths(ctx["pol"]) if readable_by_others(p)]


def _credentials(ctx: Context) -> List[str]:
    return [p for p in ctx["pol"]["inaccessible"] if p.endswith("/.git-credentials")]


def _kept_cap(ctx: Context) -> List[str]:
    dropped = set(ctx["pol"]["drop_capabilities"])
    floor = policymod.REQUIRED_DROPPED_CAPS | {policymod.USERNS_GUARD_CAP}
    return [c for c in KEEPABLE_CAPS if c in dropped and c not in floor][:1]


def _shots_b(ctx: Context) -> str:
    return os.path.join(audit.SHOTS_DIR, ctx["slot_b"]["name"]) if ctx["slot_b"] else ""


def _ws_b(ctx: Context) -> str:
    return argvmod.cell_paths(ctx["pol"], ctx["slot_b"])["workspace"] if ctx["slot_b"] else ""


def _unless(reason: str, test: Callable[[Context], object]) -> Needs:
    """A needs(): `reason` when test(ctx) is false."""
    return lambda ctx: None if test(ctx) else reason


def _a_if(ctx: Context) -> str:
    ifname: str = ctx["slot_a"]["host_ifname"]
    return ifname


LOOSENINGS = [
    Loosening("FS-01", ["FS-01"], "take /etc/chv out of the policy's inaccessible list",
              edit=_without_inaccessible(lambda ctx: ["/etc/chv"]),
              needs=_unless("/etc/chv is not readable by other users on this guest: its permissions keep every cell "
                            "out as well", lambda ctx: readable_by_others("/etc/chv"))),
    Loosening("FS-02", ["FS-02"], "take the .git-credentials paths out of the policy's inaccessible list",
              edit=_without_inaccessible(_credentials),
              needs=_unless("the policy's inaccessible list has no .git-credentials path", _credentials)),
    Loosening("FS-03", ["FS-03"], "bind workspace_root read-only into the cell",
              edit=_bind(lambda ctx: ctx["pol"]["workspace_root"]),
              needs=_unless("no second slot, or its workspace is not readable by other users (its permissions "
                            "keep every cell out as well)",
                            lambda ctx: ctx["slot_b"] and readable_by_others(_ws_b(ctx)))),
    Loosening("FS-04", ["FS-04"], "bind %s read-only into the cell and take it out of inaccessible"
              % audit.SHOTS_DIR,
              edit=_bind(lambda ctx: audit.SHOTS_DIR, also_accessible=True),
              needs=_unless("no second slot, or its screenshot directory is not readable by other users",
                            lambda ctx: ctx["slot_b"] and readable_by_others(_shots_b(ctx)))),
    Loosening("FS-05", ["FS-05"], "take the hidden paths that other users can read out of inaccessible",
              edit=_without_inaccessible(_hidden_readable),
              needs=_unless("no path of chv_cell_inaccessible on this guest is readable by other users (their "
                            "permissions keep every cell out as well)", _hidden_readable)),
    Loosening("ID-03/04", ["ID-03", "ID-04"], "keep a dropped capability outside the floor (%s)"
              % " or ".join(KEEPABLE_CAPS),
              edit=lambda raw, ctx: raw.update(drop_capabilities=[c for c in ctx["pol"]["drop_capabilities"]
                                                                  if c not in _kept_cap(ctx)]),
              needs=_unless("the policy drops none of %s" % ", ".join(KEEPABLE_CAPS), _kept_cap)),
    Loosening("ID-07", ["ID-07"], "allow_user_namespaces: true",
              edit=lambda raw, ctx: raw.update(allow_user_namespaces=True)),
    Loosening("NET-02", ["NET-02"], "accept cell A <-> cell B at the top of the forward chain",
              rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s accept' % (a["host_ifname"], b["address"]))
                                 for a, b in ((ctx["slot_a"], ctx["slot_b"]), (ctx["slot_b"], ctx["slot_a"]))],
              needs=_unless("the policy has one slot", lambda ctx: ctx["slot_b"])),
    Loosening("NET-03", ["NET-03"], "accept cell A to the guest at the top of the input chain (not the metadata "
              "stand-in)",
              rules=lambda ctx: [("input", 'iifname "%s" ip daddr != %s accept' % (_a_if(ctx), audit.METADATA))]),
    Loosening("NET-04", ["NET-04"], "accept cell A to the metadata stand-in at the top of the input chain",
              rules=lambda ctx: [("input", 'iifname "%s" ip daddr %s accept' % (_a_if(ctx), audit.METADATA))],
              needs=_unless("run without --metadata-stand-in", lambda ctx: ctx["opts"]["metadata_stand_in"])),
    Loosening("BRW-01", ["BRW-01"], "accept chv-browser to the guest's audit listener (port %d) at the top of the "
              "output chain" % probe.GUEST_PORT,
              rules=lambda ctx: [("output", "meta skuid @door_uids ip daddr != %s tcp dport %d accept"
                                  % (audit.METADATA, probe.GUEST_PORT))],
              needs=_unless("run without --allow-url", lambda ctx: ctx["opts"].get("allow_url"))),
    Loosening("BRW-02", ["BRW-02"], "accept chv-browser to the metadata stand-in at the top of the output chain",
              rules=lambda ctx: [("output", "meta skuid @door_uids ip daddr %s tcp dport %d accept"
                                  % (audit.METADATA, probe.GUEST_PORT))],
              needs=_unless("run without --allow-url or --metadata-stand-in",
                            lambda ctx: ctx["opts"].get("allow_url") and ctx["opts"]["metadata_stand_in"])),
    Loosening("BRW-03", ["BRW-03"], "accept chv-browser to cell B's listener at the top of the output chain",
              rules=lambda ctx: [("output", "meta skuid @door_uids ip daddr %s tcp dport %d accept"
                                  % (ctx["slot_b"]["address"], probe.LISTENER_PORT))],
              needs=_unless("run without --allow-url, or the policy has one slot",
                            lambda ctx: ctx["opts"].get("allow_url") and ctx["slot_b"])),
    Loosening("TEN-04", ["TEN-04"], 'socket_families: "any" (no socket family filter)',
              edit=lambda raw, ctx: raw.update(socket_families="any"),
              needs=_unless("the policy's socket_families is already \"any\"",
                            lambda ctx: ctx["pol"].get("socket_families") != "any")),
    Loosening("TEN-06", ["TEN-06"], "the --special stand-in (a /32) as an element of the carve-out set carve_nets",
              elements=lambda ctx: [("carve_nets", ctx["opts"]["special"].rsplit(":", 1)[0])],
              needs=_unless("run without --special HOST:PORT", lambda ctx: ctx["opts"].get("special"))),
    Loosening("NET-05", ["NET-05"], "accept cell A to the --deny destinations at the top of the forward chain",
              rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s accept' % (_a_if(ctx), host))
                                 for host in sorted(set(t.rsplit(":", 1)[0] for t in ctx["opts"]["deny"]))],
              needs=_unless("run without --deny HOST:PORT", lambda ctx: ctx["opts"]["deny"])),
]


def _nft(pol: policymod.Policy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([pol["nft"]] + list(args), capture_output=True, text=True, check=False, timeout=30)


def remove_rules(pol: policymod.Policy) -> int:
    """Delete every rule of ours (COMMENT) from the table's base chains;
    returns how many."""
    removed = 0
    for chain in CHAINS:
        p = _nft(pol, "-j", "-a", "list", "chain", rulesetmod.FAMILY, rulesetmod.TABLE, chain)
        if p.returncode != 0:
            continue
        for item in json.loads(p.stdout).get("nftables", []):
            rule = item.get("rule") if isinstance(item, dict) else None
            if rule and rule.get("comment") == COMMENT:
                _nft(pol, "delete", "rule", rulesetmod.FAMILY, rulesetmod.TABLE, chain, "handle", str(rule["handle"]))
                removed += 1
    return removed


def remove_elements(pol: policymod.Policy) -> int:
    """Delete every element of ours (COMMENT) from the table's SETS; returns how many."""
    removed = 0
    for name in SETS:
        p = _nft(pol, "-j", "list", "set", rulesetmod.FAMILY, rulesetmod.TABLE, name)
        if p.returncode != 0:
            continue
        for item in json.loads(p.stdout).get("nftables", []):
            for elem in (item.get("set") or {}).get("elem", []) if isinstance(item, dict) else []:
                inner = elem.get("elem") if isinstance(elem, dict) else None
                if isinstance(inner, dict) and inner.get("comment") == COMMENT:
                    _nft(pol, "delete", "element", rulesetmod.FAMILY, rulesetmod.TABLE, name,
                         "{ %s }" % inner["val"])
                    removed += 1
    return removed


def insert_elements(pol: policymod.Policy, elements: Sequence[Tuple[str, str]]) -> None:
    for name, value in elements:
        try:
            p = _nft(pol, "add", "element", rulesetmod.FAMILY, rulesetmod.TABLE, name,
                     '{ %s comment "%s" }' % (value, COMMENT))
        except OSError as exc:
            raise RuntimeError("nft add element %s %s: %s" % (name, value, exc))
        if p.returncode != 0:
            raise RuntimeError("nft add element %s %s: %s" % (name, value, p.stderr.strip()))


def insert_rules(pol: policymod.Policy, rules: Sequence[Tuple[str, str]]) -> None:
    for chain, rule in rules:
        p = _nft(pol, "insert", "rule", rulesetmod.FAMILY, rulesetmod.TABLE, chain, *(rule.split() +
                                                                                      ["comment", '"%s"' % COMMENT]))
        if p.returncode != 0:
            raise RuntimeError("nft insert rule %s %s: %s" % (chain, rule, p.stderr.strip()))


def not_applicable(loosening: Loosening, ctx: Context, before: Dict[str, Any]) -> Optional[str]:
    """Why this guest cannot show the loosening, or None: its own needs,
    or its cases skipped in the run before (a loosening cannot make a case
    fail that this guest does not run)."""
    reason = loosening.needs(ctx) if loosening.needs else None
    if reason:
        return reason
    skipped = dict((c["id"], c["probe"]) for c in before["cases"] if c["verdict"] == "skip")
    if all(cid in skipped for cid in loosening.cases):
        return "skipped in the run before: %s" % skipped[loosening.cases[0]]
    return None


def loosened_policy(raw: Dict[str, Any], loosening: Loosening, ctx: Context) -> Dict[str, Any]:
    out = copy.deepcopy(raw)
    assert loosening.edit is not None, loosening.name  # called for the loosenings that edit the policy only
    loosening.edit(out, ctx)
    return out


def outcome(loosening: Loosening, rep: Dict[str, Any]) -> Dict[str, Any]:
    """proven when exactly the loosening's cases failed (errors and the
    lifecycle cases, not run, aside); the evidence of each failed case."""
    failed = sorted(c["id"] for c in rep["cases"] if c["verdict"] == "fail")
    errors = sorted(c["id"] for c in rep["cases"] if c["verdict"] == "error")
    evidence = dict((c["id"], c["probe"]) for c in rep["cases"] if c["id"] in loosening.cases)
    # an errored case: what its control saw (why nothing could be judged)
    evidence.update((c["id"], "%s | control: %s" % (c["probe"], c["control"])) for c in rep["cases"]
                    if c["verdict"] == "error")
    if errors:
        verdict = "error"
    elif failed == sorted(loosening.cases):
        verdict = "proven"
    else:
        verdict = "not proven"
    return {"name": loosening.name, "how": loosening.how, "expected": list(loosening.cases), "failed": failed,
            "errors": errors, "verdict": verdict, "evidence": evidence}


def attempt(loosening: Loosening, run_cells: Callable[[], Dict[str, Any]], tries: int = 2) -> Dict[str, Any]:
    """The outcome of the loosened run; a run whose control failed (an
    error: nothing could be judged, a page open or a cell's start that did
    not come through on a loaded guest) is run once more, and the first
    attempt's errors and their evidence stay in the result
    (``earlier_errors``). Only an error is run again: a failed case or a
    run that is not proven is the result."""
    earlier: List[Dict[str, Any]] = []
    for dummy in range(tries):
        out = outcome(loosening, run_cells())
        if out["verdict"] != "error":
            break
        earlier.append({"errors": out["errors"], "evidence": out["evidence"]})
    else:
        earlier.pop()
    if earlier:
        out["earlier_errors"] = earlier
    return out


def run(policy_path: str, opts: Dict[str, Any]) -> Dict[str, Any]:
    """Before (the whole catalog), every loosening (the cells only), after
    (the cells only); returns the counter-proof report."""
    pol = policymod.load(policy_path)
    with open(policy_path) as fh:
        raw = json.load(fh)
    slot_a = policymod.slot_by_name(pol, opts["slot"]) if opts.get("slot") else pol["slots"][0]
    others = [s for s in pol["slots"] if s["name"] != slot_a["name"]]
    ctx = {"pol": pol, "slot_a": slot_a, "slot_b": others[0] if others else None, "opts": opts}
    stale = remove_rules(pol) + remove_elements(pol)
    before = audit.run(policy_path, opts)
    results: List[Dict[str, Any]] = []
    inapplicable: List[Dict[str, Any]] = []
    # the cells only: the lifecycle cases are not run (skipped), whatever --strict-skips says
    cells_only = dict(opts, lifecycle=False, strict_skips=False)
    for loosening in LOOSENINGS:
        reason = not_applicable(loosening, ctx, before)
        if reason:
            inapplicable.append({"name": loosening.name, "how": loosening.how, "expected": list(loosening.cases),
                                 "verdict": "not applicable", "reason": reason})
            continue
        copy_path = None
        try:
            if loosening.edit:
                fd, copy_path = tempfile.mkstemp(prefix="audit-policy-", suffix=".json", dir=pol["state_dir"])
                with os.fdopen(fd, "w") as fh:
                    json.dump(loosened_policy(raw, loosening, ctx), fh)
                os.chmod(copy_path, 0o644)
            if loosening.rules:
                insert_rules(pol, loosening.rules(ctx))
            if loosening.elements:
                insert_elements(pol, loosening.elements(ctx))
            results.append(attempt(loosening, lambda: audit.run(policy_path, dict(cells_only, cell_policy=copy_path))))
        except RuntimeError as exc:  # nft refused a rule: nothing was loosened, nothing proven
            results.append({"name": loosening.name, "how": loosening.how, "expected": list(loosening.cases),
                            "failed": [], "errors": list(loosening.cases), "verdict": "error",
                            "evidence": {"loosening": str(exc)[:300]}})
        finally:
            remove_rules(pol)
            if loosening.elements:
                remove_elements(pol)
            if copy_path:
                os.unlink(copy_path)
    after = audit.run(policy_path, cells_only)
    return summary(before, after, results, inapplicable, stale)


def summary(before: Dict[str, Any], after: Dict[str, Any], results: List[Dict[str, Any]], inapplicable: List[Dict[str, Any]],
            stale: int = 0) -> Dict[str, Any]:
    proven = [r for r in results if r["verdict"] == "proven"]
    errors = [r for r in results if r["verdict"] == "error"]
    if before["verdict"] != "passed" or after["verdict"] != "passed" or errors:
        verdict, code = "error", EXIT_ERROR
    elif len(proven) != len(results):
        verdict, code = "not proven", EXIT_NOT_PROVEN
    else:
        verdict, code = "proven", 0
    if before["verdict"] == "failed" or after["verdict"] == "failed":
        verdict, code = "failed", EXIT_NOT_PROVEN
    return {"verdict": verdict, "exit": code, "header": before["header"],
            "before": {"verdict": before["verdict"], "counts": before["counts"]},
            "after": {"verdict": after["verdict"], "counts": after["counts"]},
            "loosenings": results, "not_applicable": inapplicable, "stale_rules_removed": stale,
            "not_counter_provable": dict(NOT_COUNTER_PROVABLE), "before_report": before}


def write_reports(rep: Dict[str, Any], directory: str) -> None:
    """counter-proof.json and .md, and the run before as audit.json, .xml
    and .md."""
    files = audit.report_files(rep["before_report"])
    files.update({"counter-proof.json": json.dumps(rep, indent=2, sort_keys=True) + "\n",
                  "counter-proof.md": to_markdown(rep)})
    audit.write_files(directory, files)


def to_markdown(rep: Dict[str, Any]) -> str:
    lines = ["# chv-cell audit --counter-proof: %s on %s" % (rep["verdict"].upper(), rep["header"].get("guest")), "",
             "- before: %s (%s)" % (rep["before"]["verdict"], _counts(rep["before"]["counts"])),
             "- after: %s (%s, the cells only)" % (rep["after"]["verdict"], _counts(rep["after"]["counts"])), "",
             "| loosened | how | must fail | failed | verdict | evidence |", "|---|---|---|---|---|---|"]
    for r in rep["loosenings"]:
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            r["name"], r["how"], ", ".join(r["expected"]), ", ".join(r["failed"] + r["errors"]) or "none",
            r["verdict"].upper(), audit.cell_text("; ".join("%s: %s" % kv for kv in sorted(r["evidence"].items()))
                                                  + "".join("; run again after a control failed: %s"
                                                            % "; ".join("%s: %s" % kv for kv in
                                                                        sorted(e["evidence"].items()))
                                                            for e in r.get("earlier_errors", [])))))
    for r in rep["not_applicable"]:
        lines.append("| %s | %s | %s | | NOT APPLICABLE | %s |"
                     % (r["name"], r["how"], ", ".join(r["expected"]), r["reason"]))
    return "\n".join(lines) + "\n"


def _counts(c: Dict[str, int]) -> str:
    return "%(pass)d passed, %(fail)d failed, %(error)d errors, %(skip)d skipped" % c


def counter_proof_of(cid: str) -> str:
    """How a case is counter-proven, or why it is not, in words."""
    for lo in LOOSENINGS:
        if cid in lo.cases:
            return lo.how
    return "none here: %s" % NOT_COUNTER_PROVABLE[cid]


def catalog_markdown() -> str:
    """The catalog as the Markdown table of docs/isolation-cases.md (and
    ``chv-cell audit --list``)."""
    rows = ["| id | boundary | probe (must be stopped) | control (must succeed) | counter-proof |",
            "|---|---|---|---|---|"]
    for c in audit.CASES:
        rows.append("| %s | %s | %s | %s | %s |" % (c.id, c.title, c.probe, c.control, counter_proof_of(c.id)))
    return "\n".join(rows) + "\n"
