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
stand-in, a /32 in the carve-out set, for that run), or test builds of
the doors started for that run only (IPC-02 to IPC-04, BRW-04:
doorbuild.py; the policy copy binds the broker build's directory as the
cells' /run/chv). Inserted rules and
elements carry COMMENT and are removed after the run, and by the next
counter-proof run or a reload of the ruleset (chv-cell-nat.service) if the
audit was killed in between; so are the test builds and policy copies
of a killed counter-proof (doorbuild.remove_stale, remove_stale_copies).

Each case names its loosening, or the reason it cannot be loosened here
(catalog/, its area's module; NOT_COUNTER_PROVABLE collects the reasons);
a loosening this guest cannot show (a path that its permissions
keep out of every cell anyway) is reported as not applicable, with the
reason, never as proven."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import audit
from . import catalog
from . import policy as policymod
from . import ruleset as rulesetmod
from . import doorbuild
from . import egresslog
from .catalog.loosen import Context, Loosening, through_doors

COMMENT = "chv-audit counter-proof"
COPY_PREFIX = "audit-policy-"  # a loosening's policy copy in the state directory: COPY_PREFIX<pid>-XXXX.json
CHAINS = ("forward", "input", "output")  # the table's base chains a loosening inserts into
SETS = ("carve_nets",)  # the table's sets a loosening adds elements to
EXIT_NOT_PROVEN = audit.EXIT_FAILED
EXIT_ERROR = audit.EXIT_ERROR
# the catalog's, re-exported for the callers and tests that read them here
LOOSENINGS = catalog.LOOSENINGS
NOT_COUNTER_PROVABLE = catalog.NOT_COUNTER_PROVABLE
catalog_markdown = catalog.catalog_markdown


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


PROXY_ORIG = egresslog.PROXY_CONF + ".chv-audit-orig"  # the proxy's configuration while a loosening widens it
ACCEPTING = "Accepting HTTP Socket connections"  # squid's cache.log, at each start and reconfigure


def _accepting() -> int:
    try:
        with open(egresslog.CACHE_LOG, "r", encoding="utf-8", errors="replace") as fh:
            return fh.read().count(ACCEPTING)
    except OSError:
        return 0


def reload_proxy(pol: policymod.Policy, wait: float = 20.0) -> None:
    """Reconfigure the egress proxy (its unit's reload) and wait until it accepts connections again."""
    before = _accepting()
    systemctl = os.path.join(os.path.dirname(pol["systemd_run"]), "systemctl")
    p = subprocess.run([systemctl, "reload", egresslog.PROXY_UNIT], capture_output=True, text=True, check=False,
                       timeout=60)
    if p.returncode != 0:
        raise RuntimeError("systemctl reload %s: %s" % (egresslog.PROXY_UNIT, p.stderr.strip()))
    deadline = time.monotonic() + wait
    while _accepting() <= before:
        if time.monotonic() > deadline:
            raise RuntimeError("%s did not accept connections again within %.0f s of its reload"
                               % (egresslog.PROXY_UNIT, wait))
        time.sleep(0.1)


def _write_in_place(path: str, text: str) -> None:
    """The file's new text, its owner and mode kept (the same inode)."""
    with open(path, "r+") as fh:
        fh.write(text)
        fh.truncate()


def widen_proxy(pol: policymod.Policy, edit: Callable[[str, Context], str], ctx: Context) -> None:
    """The proxy's configuration as ``edit`` makes it, for one run: the
    original is kept in PROXY_ORIG first (put back by restore_proxy, also
    after a killed audit: the next counter-proof's start)."""
    with open(egresslog.PROXY_CONF) as fh:
        text = fh.read()
    widened = edit(text, ctx)
    with open(PROXY_ORIG, "w") as fh:
        fh.write(text)
    _write_in_place(egresslog.PROXY_CONF, widened)
    reload_proxy(pol)


def restore_proxy(pol: policymod.Policy) -> bool:
    """Put back the proxy's configuration a loosening widened (PROXY_ORIG)
    and reconfigure it; False when there is none to put back."""
    try:
        with open(PROXY_ORIG) as fh:
            text = fh.read()
    except OSError:
        return False
    _write_in_place(egresslog.PROXY_CONF, text)
    os.unlink(PROXY_ORIG)
    reload_proxy(pol)
    return True


def copy_prefix(pid: int) -> str:
    """The name a policy copy of counter-proof ``pid`` starts with, in the state directory."""
    return "%s%d-" % (COPY_PREFIX, pid)


def remove_stale_copies(state_dir: str) -> int:
    """Remove the policy copies a killed counter-proof left (its pid, in the name, gone); returns how many."""
    removed = 0
    try:
        names = os.listdir(state_dir)
    except OSError:
        return 0
    for name in names:
        pid = name[len(COPY_PREFIX):].split("-", 1)[0]
        if not name.startswith(COPY_PREFIX) or not pid.isdigit() or int(pid) == os.getpid() or \
                os.path.exists("/proc/%s" % pid):
            continue
        try:
            os.unlink(os.path.join(state_dir, name))
            removed += 1
        except OSError:
            pass
    return removed


def not_applicable(loosening: Loosening, ctx: Context, before: Dict[str, Any]) -> Optional[str]:
    """Why this guest cannot show the loosening, or None: its cases are of
    the other egress mode, its own needs, or its cases skipped in the run
    before (a loosening cannot make a case fail that this guest does not
    run)."""
    judged = set(c["id"] for c in before["cases"])
    if not judged & set(loosening.cases):
        modes = ["%s is of %s mode" % (cid, catalog.BY_ID[cid].mode) for cid in loosening.cases]
        return "not judged on this guest: %s" % ", ".join(modes)
    reason = loosening.needs(ctx) if loosening.needs else None
    if reason:
        return reason
    skipped = dict((c["id"], c["probe"]) for c in before["cases"] if c["verdict"] == "skip")
    if all(cid in skipped for cid in loosening.cases):
        return "skipped in the run before: %s" % skipped[loosening.cases[0]]
    return None


def loosened_policy(raw: Dict[str, Any], loosening: Loosening, ctx: Context) -> Dict[str, Any]:
    """The policy copy of the loosening's run: its edit, and the bind and socket
    of the run's test builds when it has any (loosen.through_doors)."""
    out = copy.deepcopy(raw)
    assert loosening.edit or loosening.doors, loosening.name  # called for the loosenings that copy the policy only
    if loosening.edit:
        loosening.edit(out, ctx)
    if loosening.doors:
        through_doors(out, ctx)
    return out


def selected(cases: Sequence[str]) -> List[Loosening]:
    """The loosenings of ``cases`` (--case), every one for none."""
    return [lo for lo in LOOSENINGS if not cases or set(lo.cases) & set(cases)]


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
    """Before (the whole catalog), every loosening (the cells only; with
    --case, those of the cases named), after (the cells only); returns the
    counter-proof report. Every run judges the whole catalog: a loosening
    is proven only when no case but its own fails."""
    pol = policymod.load(policy_path)
    with open(policy_path) as fh:
        raw = json.load(fh)
    slot_a = policymod.slot_by_name(pol, opts["slot"]) if opts.get("slot") else pol["slots"][0]
    others = [s for s in pol["slots"] if s["name"] != slot_a["name"]]
    ctx = {"pol": pol, "slot_a": slot_a, "slot_b": others[0] if others else None, "opts": opts}
    stale = remove_rules(pol) + remove_elements(pol)
    stale_builds = doorbuild.remove_stale(os.path.join(os.path.dirname(pol["systemd_run"]), "systemctl"))
    stale_copies = remove_stale_copies(pol["state_dir"])
    stale_proxy = restore_proxy(pol)
    loosenings = selected(opts.get("cases") or [])
    opts = dict(opts, cases=[])
    before = audit.run(policy_path, opts)
    results: List[Dict[str, Any]] = []
    inapplicable: List[Dict[str, Any]] = []
    # the cells only: the lifecycle cases are not run (skipped), whatever --strict-skips says
    cells_only = dict(opts, lifecycle=False, strict_skips=False)
    for loosening in loosenings:
        reason = not_applicable(loosening, ctx, before)
        if reason:
            inapplicable.append({"name": loosening.name, "how": loosening.how, "expected": list(loosening.cases),
                                 "verdict": "not applicable", "reason": reason})
            continue
        copy_path = None
        doors = doorbuild.DoorBuilds(pol["systemd_run"], slot_a["uid_base"]) if loosening.doors else None
        try:
            run_opts = dict(cells_only)
            if doors:
                doors.start(loosening.doors)
                ctx["doors"] = doors.paths()
                run_opts["broker_socket"] = doors.broker_socket  # the guest's own pings (IPC-02, IPC-03)
            if loosening.edit or loosening.doors:
                fd, copy_path = tempfile.mkstemp(prefix=copy_prefix(os.getpid()), suffix=".json",
                                                 dir=pol["state_dir"])
                with os.fdopen(fd, "w") as fh:
                    json.dump(loosened_policy(raw, loosening, ctx), fh)
                os.chmod(copy_path, 0o644)
            if loosening.rules:
                insert_rules(pol, loosening.rules(ctx))
            if loosening.elements:
                insert_elements(pol, loosening.elements(ctx))
            if loosening.proxy:
                widen_proxy(pol, loosening.proxy, ctx)
            results.append(attempt(loosening, lambda: audit.run(policy_path, dict(run_opts, cell_policy=copy_path))))
        except RuntimeError as exc:  # nft refused a rule, a test build did not start: nothing proven
            results.append({"name": loosening.name, "how": loosening.how, "expected": list(loosening.cases),
                            "failed": [], "errors": list(loosening.cases), "verdict": "error",
                            "evidence": {"loosening": str(exc)[:300]}})
        finally:
            remove_rules(pol)
            if loosening.elements:
                remove_elements(pol)
            if doors:
                doors.stop()
                ctx.pop("doors", None)
            if copy_path:
                os.unlink(copy_path)
            if loosening.proxy:
                restore_proxy(pol)
    after = audit.run(policy_path, cells_only)
    return dict(summary(before, after, results, inapplicable, stale, stale_builds), stale_copies_removed=stale_copies,
                stale_proxy_restored=stale_proxy)


def summary(before: Dict[str, Any], after: Dict[str, Any], results: List[Dict[str, Any]], inapplicable: List[Dict[str, Any]],
            stale: int = 0, stale_builds: int = 0) -> Dict[str, Any]:
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
            "stale_builds_removed": stale_builds,
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
