"""Command line: chv-cell run | read | argv | validate-policy | status | health | audit | cordon | uncordon | drain.

As root everything runs here.  A non-root user asking for ``run``,
``status`` or ``read`` is handed to ``agent.delegate`` (sudo and the
root-only ``chv-cell-agent``); ``argv`` and ``validate-policy`` only read the
world-readable policy and run as that user; ``health``, ``audit``,
``cordon``, ``uncordon`` and ``drain`` are root's only (``audit --list`` prints the catalog for anyone)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, List, Optional, Sequence, cast

from . import agent as agentmod
from . import argv as argvmod
from . import exits
from . import log as logmod
from . import policy as policymod
from . import host
from .actions import load_policy, print_status, read_request, refuse_with_status, run_request, start_run
from .launcher import SHARED_NETWORK_REFUSAL

if TYPE_CHECKING:
    import argparse

# The rest is imported where it is used: a plain `chv-cell run -- CMD`
# (fast_run) needs neither argparse nor the audit's modules, which are most
# of the launcher's start-up (docs/performance.md).


def _command(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> List[str]:
    cmd = list(ns.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("a command is required after --")
    return cmd


def _pick_slot(pol: policymod.Policy, name: Optional[str]) -> policymod.Slot:
    if name is None:
        return cast("policymod.Slot", pol["slots"][0])
    try:
        return policymod.slot_by_name(pol, name)
    except KeyError:
        raise policymod.PolicyError(
            ["no slot named %r (have: %s)" % (name, ", ".join(s["name"] for s in pol["slots"]))]
        )


def _repeated(parser: argparse.ArgumentParser, option: str, metavar: str, text: str) -> None:
    """An option given any number of times (a list, empty by default); ``text``: its help."""
    parser.add_argument(option, action="append", default=[], metavar=metavar, help=text)


def build_parser() -> argparse.ArgumentParser:
    import argparse  # noqa: PLC0415 (see the imports above)

    from . import audit as auditmod  # noqa: PLC0415
    from . import catalog  # noqa: PLC0415
    from . import counterproof  # noqa: PLC0415
    from . import egresslog  # noqa: PLC0415
    from . import health as healthmod  # noqa: PLC0415

    ap = argparse.ArgumentParser(
        prog="chv-cell",
        allow_abbrev=False,
        description="Run a command in a hardened systemd-nspawn cell.",
        epilog="exit codes: the payload's own; %d cell setup failed or a fail-closed check refused it "
        "(ruleset, limits, user namespaces; the payload did not run); %d every slot busy until the "
        "timeout; %d unusable policy, or a run the policy forbids (--shared-network, --runtime-max above "
        "runtime_max); %d wall-clock limit (runtime_max / --runtime-max) reached; %d the guest is cordoned "
        "(chv-cell cordon: retry on another guest); 128+N stopped by signal N"
        % (exits.EXIT_SETUP, exits.EXIT_BUSY, exits.EXIT_CONFIG, exits.EXIT_RUNTIME, exits.EXIT_CORDONED),
    )
    ap.add_argument("--policy", help="policy file (default %s; root only for run and status)"
                    % policymod.DEFAULT_POLICY_PATH)
    ap.add_argument("-v", "--verbose", action="store_true", help="log slot claim and timing to stderr")
    sub = ap.add_subparsers(dest="action", required=True)

    r = sub.add_parser("run", allow_abbrev=False, help="claim a free slot and run CMD in a cell")
    r.add_argument("-v", "--verbose", dest="run_verbose", action="store_true", help="same as chv-cell -v run")
    r.add_argument("--slot", help="use only this slot (default: the first free one)")
    r.add_argument("--task", metavar="ID", help="a turn of this task (chv-cell task start), in its slot")
    r.add_argument("--timeout", type=float, help="seconds to wait for a free slot (default: policy claim_timeout)")
    r.add_argument(
        "--shared-network",
        action="store_true",
        help="run in the host's network namespace (explicit, logged; never a fallback; only when the "
        "policy's allow_shared_network is true)",
    )
    r.add_argument(
        "--runtime-max",
        type=float,
        metavar="S",
        help="stop the cell after S seconds (exit %d); may only lower the policy's runtime_max"
        % exits.EXIT_RUNTIME,
    )
    r.add_argument(
        "--status-fd",
        type=int,
        metavar="N",
        help="write the launcher's verdict as one JSON line to file descriptor N (3 or more) when the run ends: "
        "{verdict: ran|runtime|signal|setup|busy|config|unknown, exit, slot, payload_started, payload_exit}; "
        "the payload never gets fd N (docs/executor.md)",
    )
    r.add_argument("--env-fd", type=int, metavar="N",
                   help="read NAME=VALUE lines up to an empty line from fd N (0: stdin, whose rest is the payload's) "
                   "and pass them to the payload's environment only; names the policy's env_allow lists "
                   "(docs/executor.md)")
    r.add_argument("--ignore-cordon", action="store_true",
                   help="start even on a cordoned guest (root's; the health gate's own run after a drain)")
    r.add_argument("command", nargs=argparse.REMAINDER)

    from . import slotfiles  # noqa: PLC0415

    rd = sub.add_parser("read", allow_abbrev=False,
                        help="print a regular file of a slot's workspace or home, never following a link "
                        "(exit %d refused: a symlink on the way, not a regular file, not the slot's; %d no such "
                        "file; %d larger than the policy's read_max_bytes; %d the request is refused)"
                        % (slotfiles.EXIT_REFUSED, slotfiles.EXIT_MISSING, slotfiles.EXIT_TOO_BIG,
                           exits.EXIT_CONFIG))
    rd.add_argument("--slot", required=True, help="the slot whose file it is")
    rd.add_argument("path", help="a path in the slot's cell (/workspace/..., a workspace alias, the agent's home) "
                    "or relative to its workspace")

    a = sub.add_parser("argv", allow_abbrev=False, help="print the systemd-nspawn command line without starting anything")
    a.add_argument("--slot", help="slot to show (default: the first)")
    a.add_argument("--shared-network", action="store_true")
    a.add_argument("--json", action="store_true", help="print a JSON list instead of a shell command")
    a.add_argument("command", nargs=argparse.REMAINDER)

    v = sub.add_parser("validate-policy", allow_abbrev=False, help="check a policy file; exit 0 when usable")
    v.add_argument("path", nargs="?", help="file to check (default: --policy)")

    st = sub.add_parser("status", allow_abbrev=False,
                        help="list slots and the cells running in them (and the cordon, when the guest is cordoned)")
    st.add_argument("--json", action="store_true", help="print one JSON object: cordoned, cordon, slots (root's)")

    c = sub.add_parser("cordon", allow_abbrev=False,
                       help="refuse new cells on this guest (chv-cell run exits %d naming the cordon); running "
                       "cells are untouched" % exits.EXIT_CORDONED)
    c.add_argument("--reason", help="why, shown to every refused run and in chv-cell status")
    c.add_argument("--rollout", action="store_true",
                   help="a rollout's cordon (its drain's): `uncordon --rollout` lifts it, a cordon by hand stays")
    u = sub.add_parser("uncordon", allow_abbrev=False, help="let new cells start on this guest again")
    u.add_argument("--rollout", action="store_true",
                   help="only a cordon a rollout set (chv-cell cordon --rollout); one set by hand is kept")
    dr = sub.add_parser("drain", allow_abbrev=False,
                        help="one progress line naming each running cell (slot, pid, age); exit 0 when none "
                        "runs, %d while some do (read-only: chv-cell cordon first)" % exits.EXIT_BUSY)
    dr.add_argument("--wait", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for the cells to end before printing (default 0: look once)")

    t = sub.add_parser("task", allow_abbrev=False,
                       help="a task: a slot of its own from start to end, fresh and emptied again at the end "
                       "(docs/executor.md 'Tasks'; exit %d no such task of yours, %d expired)"
                       % (exits.EXIT_NO_TASK, exits.EXIT_TASK_EXPIRED))
    tsub = t.add_subparsers(dest="verb", required=True)
    ts = tsub.add_parser("start", allow_abbrev=False, help="claim a free slot for a new task; print its JSON")
    ts.add_argument("--ttl", type=float, metavar="S", help="tear the task down S seconds after its last use "
                    "(default and upper bound: the policy's task_ttl)")
    ts.add_argument("--env-fd", type=int, metavar="N", help="the task's variables, as run --env-fd: every turn's "
                    "payload gets them")
    ts.add_argument("--repo", metavar="URL", help="clone this repository into the task's workspace, outside the "
                    "cell, with chv-broker's sync door and the guest's credential")
    ts.add_argument("--ref", metavar="REF", help="with --repo: check out this branch, tag or commit")
    te = tsub.add_parser("end", allow_abbrev=False, help="tear the task down and free its slot")
    te.add_argument("id", metavar="ID")
    tsub.add_parser("list", allow_abbrev=False, help="the caller's live tasks (root: all)")
    tx = tsub.add_parser("export", allow_abbrev=False,
                         help="a tar of the task's regular files at PATHs (cell paths; directories walked) on stdout, "
                         "never following a link (docs/executor.md 'Results out')")
    tx.add_argument("id", metavar="ID")
    tx.add_argument("--max-bytes", type=int, metavar="N", help="at most N bytes of files (default and upper bound: "
                    "the policy's read_max_bytes); more: nothing written, exit 73")
    tx.add_argument("paths", nargs="+", metavar="PATH")
    tsub.add_parser("reap", allow_abbrev=False, help="tear down the expired tasks (root; the timer's)")

    w = sub.add_parser("warm", allow_abbrev=False,
                       help="keep one cell of a warm slot (policy warm_slots) started and waiting for a payload, "
                       "serve one run, then exit (the unit chv-cell-warm@SLOT.service)")
    w.add_argument("--slot", required=True, help="the warm slot")

    h = sub.add_parser("health", allow_abbrev=False,
                       help="run a cell with a probe and report whether this guest can run isolated cells "
                       "(exit 0 healthy, %d not, %d busy, not unhealthy: every slot runs a cell); the defaults "
                       "are the health gate's" % (healthmod.EXIT_UNHEALTHY, healthmod.EXIT_HEALTH_BUSY))
    h.add_argument("--unit", action="append", default=None,
                   help="a unit that must be active and not restarting (default: %s, and %s when the policy "
                   "names chv-browser's socket)" % (", ".join(healthmod.DEFAULT_UNITS), healthmod.BROWSER_UNIT))
    h.add_argument("--broker-client", metavar="PATH",
                   help="the broker's client.py: ping the broker from the cell (default: the one beside the "
                   "launcher, %s)" % healthmod.default_broker_client())
    _repeated(h, "--allow", "HOST:PORT", "a destination the cell must reach")
    _repeated(h, "--deny", "HOST:PORT", "a destination the ruleset must refuse (the guest at the cell's gateway, "
              "port %d, always is)" % healthmod.GUEST_PROBE_PORT)
    h.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a free slot (default 30)")
    h.add_argument("--json", action="store_true", help="print the checks as JSON")

    eg = sub.add_parser("egress-log", allow_abbrev=False,
                        help="the egress proxy's counters per slot and verdict (allowed, denied, failed), from its "
                        "audit log (proxy mode, docs/network.md)")
    eg.add_argument("--log", default=egresslog.DEFAULT_LOG, help="the log to read (default %(default)s)")
    eg.add_argument("--json", action="store_true", help="print JSON")

    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    u = sub.add_parser("audit", allow_abbrev=False,
                       help="run the isolation case catalog in real cells on this guest and report each case "
                       "(exit 0 passed, %d a case failed, %d a control failed)"
                       % (auditmod.EXIT_FAILED, auditmod.EXIT_ERROR))
    u.add_argument("--list", action="store_true", help="print the catalog (Markdown) and run nothing")
    u.add_argument("--slot", help="the slot of cell A (default: the first free one); cell B takes another free one")
    u.add_argument("--exclusive", action="store_true",
                   help="run the cases that need every slot free (LIFE-03), on an idle guest; without it they "
                   "are skipped (\"needs every slot free\"; --strict-skips then fails the run)")
    _repeated(u, "--allow", "HOST:PORT", "a destination cells may reach (NET-01)")
    _repeated(u, "--deny", "HOST:PORT", "a destination the egress policy denies and the guest reaches (NET-05)")
    _repeated(u, "--allow-name", "HOST:PORT", "proxy mode: a name the proxy's list allows for the slot, resolving to "
              "a listener the guest reaches (EGR-01, EGR-03, EGR-05, EGR-06)")
    _repeated(u, "--deny-name", "HOST:PORT", "proxy mode: a name no entry of the list allows for the slot, "
              "resolving to a listener the guest reaches (EGR-02)")
    _repeated(u, "--inside-name", "NAME", "proxy mode: a name the list allows that resolves to the guest's "
              "loopback or another guest address (EGR-04)")
    u.add_argument("--allow-url", metavar="URL",
                   help="an http(s) page cells may open through chv-browser (BRW cases; BRW-04 needs the page "
                   "chv-cell audit's own listener serves)")
    u.add_argument("--special", metavar="HOST:PORT",
                   help="a stand-in in a private or special-purpose range that no deny entry or carve-out covers "
                   "and the guest reaches (TEN-06)")
    u.add_argument("--metadata-stand-in", action="store_true",
                   help="add %s to the guest's loopback for the run (NET-04)" % catalog.facts.METADATA)
    _repeated(u, "--trusted", "PATH", "another file cells must not be able to write (FS-09), e.g. the ruleset")
    u.add_argument("--broker-client", default=os.path.join(lib, "chv_guest", "broker", "client.py"), metavar="PATH",
                   help="chv-broker's client.py (default: %(default)s; IPC cases skipped when missing)")
    u.add_argument("--runs", type=int, default=100, help="consecutive runs of LIFE-02 (default 100)")
    u.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a free slot (default 30)")
    u.add_argument("--report-dir", metavar="DIR", help="write audit.json, audit.xml (JUnit) and audit.md there")
    _repeated(u, "--label", "KEY=VALUE", "a line for the report's header (the collection version, a git commit)")
    u.add_argument("--strict-skips", action="store_true", help="a skipped case fails the run")
    _repeated(u, "--case", "ID", "run and report this case only (repeatable; the cells' probes still run whole, "
              "the lifecycle runs only for a lifecycle case); with --counter-proof: loosen this case's boundary "
              "only, every run still judging the whole catalog")
    u.add_argument("--keep", action="store_true",
                   help="keep the files the audit put into the slots for inspection (their paths in the report's "
                   "header); its processes and guest changes are still undone")
    u.add_argument("--counter-proof", action="store_true",
                   help="loosen each boundary that can be loosened here for one run of the cells (a copy of the "
                   "policy, or accept rules for cell A only) and show that exactly its cases fail, and pass "
                   "before and after (exit 0 proven, %d not proven, %d a run did not pass or a cell did not start)"
                   % (counterproof.EXIT_NOT_PROVEN, counterproof.EXIT_ERROR))
    u.add_argument("--json", action="store_true", help="print the report as JSON instead of Markdown")
    return ap


def _targets_ok(ns: argparse.Namespace) -> bool:
    """--allow and --deny of health and audit: HOST:PORT each, or logged."""
    from . import health as healthmod  # noqa: PLC0415

    try:
        for target in ns.allow + ns.deny + getattr(ns, "allow_name", []) + getattr(ns, "deny_name", []):
            healthmod.parse_target(target)
    except ValueError as exc:
        logmod.log("%s: %s" % (ns.action, exc))
        return False
    return True


def health(ns: argparse.Namespace) -> int:
    """``chv-cell health``: the checks on this guest, one line each (or JSON); 0 healthy."""
    from . import health as healthmod  # noqa: PLC0415

    if not _targets_ok(ns):
        return exits.EXIT_CONFIG
    request = {"broker_client": ns.broker_client, "allow": ns.allow, "deny": ns.deny}
    checks = healthmod.run(ns.policy, ns.unit, request, claim_timeout=ns.timeout)
    rc = healthmod.exit_code(checks)
    if ns.json:
        from . import cordon as cordonmod  # noqa: PLC0415

        # the host's cordon (the gate's own cell ignores it): site.yml lifts a rollout's after a passed gate
        print(json.dumps({"healthy": rc == 0, "busy": rc == healthmod.EXIT_HEALTH_BUSY,
                          "verdict": healthmod.outcome(checks), "summary": healthmod.summary(None, checks),
                          "checks": checks, "cordon": cordonmod.read(policymod.load(ns.policy)["state_dir"])}))
    else:
        for c in checks:
            print("%-4s %s: %s" % ("ok" if c["ok"] else "busy" if c["detail"].startswith(healthmod.BUSY) else "FAIL",
                                   c["check"], c["detail"]))
        print(healthmod.summary(None, checks))
    sys.stdout.flush()
    return rc


def audit(ns: argparse.Namespace) -> int:
    """``chv-cell audit``: the catalog on this guest; the report on stdout
    (and in --report-dir); 0 passed, 1 a case failed, 2 a control failed."""
    from . import audit as auditmod  # noqa: PLC0415
    from . import catalog  # noqa: PLC0415
    from . import counterproof  # noqa: PLC0415

    labels = {}
    for label in ns.label:
        key, sep, value = label.partition("=")
        if not sep or not key:
            logmod.log("audit: --label %r is not KEY=VALUE" % label)
            return exits.EXIT_CONFIG
        labels[key] = value
    if not _targets_ok(ns):
        return exits.EXIT_CONFIG
    if ns.special:
        from . import health as healthmod  # noqa: PLC0415

        try:
            healthmod.parse_target(ns.special)
        except ValueError as exc:
            logmod.log("audit: --special: %s" % exc)
            return exits.EXIT_CONFIG
    if ns.runs < 1:
        logmod.log("audit: --runs must be at least 1, got %d" % ns.runs)
        return exits.EXIT_CONFIG
    if ns.allow_url and not ns.allow_url.startswith(("http://", "https://")):
        logmod.log("audit: --allow-url must be an http:// or https:// URL, got %r" % ns.allow_url)
        return exits.EXIT_CONFIG
    unknown = [cid for cid in ns.case if cid not in catalog.BY_ID]
    if unknown:
        logmod.log("audit: --case %s: no such case (chv-cell audit --list)" % ", ".join(unknown))
        return exits.EXIT_CONFIG
    mode = catalog.case.egress_mode(policymod.load(ns.policy))
    other = [cid for cid in ns.case if not catalog.BY_ID[cid].applies(mode)]
    if other:
        logmod.log("audit: --case %s: not judged on this guest, whose egress mode is %s (chv-cell audit --list)"
                   % (", ".join(other), mode))
        return exits.EXIT_CONFIG
    unprovable = [cid for cid in ns.case if cid in catalog.NOT_COUNTER_PROVABLE]
    if ns.counter_proof and unprovable:
        logmod.log("audit: --counter-proof --case %s: not counter-provable here (chv-cell audit --list)"
                   % ", ".join(unprovable))
        return exits.EXIT_CONFIG
    opts = {"slot": ns.slot, "allow": ns.allow, "deny": ns.deny, "metadata_stand_in": ns.metadata_stand_in,
            "allow_name": ns.allow_name, "deny_name": ns.deny_name, "inside_name": ns.inside_name,
            "allow_url": ns.allow_url, "special": ns.special,
            "trusted": ns.trusted, "broker_client": ns.broker_client, "runs": ns.runs, "timeout": ns.timeout,
            "labels": labels, "strict_skips": ns.strict_skips, "cases": ns.case, "keep": ns.keep,
            "exclusive": ns.exclusive}
    if ns.counter_proof:
        rep = counterproof.run(ns.policy, opts)
        text = counterproof.to_markdown(rep)
        if ns.report_dir:
            counterproof.write_reports(rep, ns.report_dir)
    else:
        rep = auditmod.run(ns.policy, opts)
        text = auditmod.to_markdown(rep)
        if ns.report_dir:
            auditmod.write_reports(rep, ns.report_dir)
    sys.stdout.write(json.dumps(rep, indent=2, sort_keys=True) + "\n" if ns.json else text)
    sys.stdout.flush()
    return int(rep["exit"])


def cordon(ns: argparse.Namespace, pol: policymod.Policy) -> int:
    """``chv-cell cordon`` / ``uncordon``: one line saying what changed
    ("cordoned", "already cordoned", "uncordoned", "not cordoned"); 0."""
    import time  # noqa: PLC0415

    from . import cordon as cordonmod  # noqa: PLC0415

    if ns.action == "uncordon":
        done = cordonmod.clear(pol["state_dir"], only_rollout=ns.rollout)
        print("kept: %s (set by hand, not by a rollout)" % cordonmod.describe(cordonmod.read(pol["state_dir"]) or {},
                                                                              time.time())
              if done == "kept" else done)
        return 0
    by = os.environ.get("SUDO_USER") or "root"
    new, rec = cordonmod.set_cordon(pol["state_dir"], ns.reason, by, rollout=ns.rollout)
    print("%s: %s" % ("cordoned" if new else "already cordoned", cordonmod.describe(rec, time.time())))
    return 0


def drain(ns: argparse.Namespace, pol: policymod.Policy) -> int:
    """``chv-cell drain``: the progress line; 0 drained, EXIT_BUSY not yet."""
    import time  # noqa: PLC0415

    from . import cordon as cordonmod  # noqa: PLC0415
    from .actions import slot_states  # noqa: PLC0415

    deadline = time.monotonic() + max(0.0, ns.wait)
    while True:
        running = [(s["slot"], s["pid"], s["started"]) for s in slot_states(pol) if s["state"] == "running"]
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    print(cordonmod.drain_line(running, time.time(), cordonmod.read(pol["state_dir"])))
    sys.stdout.flush()
    return exits.EXIT_BUSY if running else 0


def egress_log(path: str, as_json: bool) -> int:
    """chv-cell egress-log: the proxy's counters per slot and verdict."""
    from . import egresslog  # noqa: PLC0415 (see the imports above)

    try:
        with open(path, "r", encoding="utf-8", errors="replace") as stream:
            text, _other = egresslog.report(stream, as_json)
    except OSError as exc:
        logmod.log("egress-log: cannot read %s: %s (is this guest in proxy mode?)" % (path, exc.strerror))
        return exits.EXIT_CONFIG
    sys.stdout.write(text)
    return 0


def fast_run(verbose: bool, rest: Sequence[str]) -> Optional[int]:
    """Root's ``chv-cell [-v] run OPTIONS -- CMD`` with the installed policy,
    in the form the agent accepts (agent.parse_agent_args), without
    argparse: the exit code.  None for any other form (argparse then parses
    it and reports what is wrong)."""
    try:
        req = agentmod.parse_agent_args(["run"] + (["-v"] if verbose else []) + list(rest))
    except agentmod.Refused:
        return None
    pol = load_policy(policymod.DEFAULT_POLICY_PATH)
    return refuse_with_status(req.status_fd) if pol is None else run_request(pol, req)


def _asks_for_help(rest: Sequence[str]) -> bool:
    """-h/--help among the options before '--'."""
    opts = rest[:rest.index("--")] if "--" in rest else rest
    return "-h" in opts or "--help" in opts


def main(args: Optional[Sequence[str]] = None, euid: Optional[int] = None) -> int:
    """Run the command line ``args`` (default sys.argv[1:]); return the exit
    code.  A non-root caller's run/status goes to agent.delegate (which execs
    sudo); any other form of run/status from a non-root caller is refused
    with 78."""
    args = sys.argv[1:] if args is None else list(args)
    euid = os.geteuid() if euid is None else euid
    top = agentmod.split_top(args)
    if euid != 0:
        if top is not None and top[2] in ("run", "status", "read", "task") and not _asks_for_help(top[3]):
            return agentmod.delegate(*top)
    elif top is not None and top[2] == "run" and not top[1] and not _asks_for_help(top[3]):
        rc = fast_run(top[0], top[3])
        if rc is not None:
            return rc
    ap = build_parser()
    ns = ap.parse_args(args)
    if euid != 0 and ns.action in ("run", "status", "read", "task"):
        logmod.log("as a non-root user, run and status take exactly this form: %s" % agentmod.USAGE)
        return exits.EXIT_CONFIG
    if ns.action == "audit" and ns.list:
        from . import counterproof  # noqa: PLC0415

        sys.stdout.write(counterproof.catalog_markdown())
        return 0
    if euid != 0 and ns.action in ("health", "audit", "warm", "cordon", "uncordon", "drain", "egress-log"):
        logmod.log("chv-cell %s runs as root only" % ns.action)
        return exits.EXIT_CONFIG
    if ns.policy is None:
        ns.policy = policymod.DEFAULT_POLICY_PATH
    if ns.action == "egress-log":
        return egress_log(ns.log, ns.json)

    if ns.action == "validate-policy":
        path = ns.path or ns.policy
        try:
            valid = policymod.load(path)
        except policymod.PolicyError as exc:
            for e in exc.errors:
                sys.stderr.write("%s: %s\n" % (path, e))
            return exits.EXIT_CONFIG
        print("%s: valid, %d slot(s)" % (path, len(valid["slots"])))
        return 0

    pol = load_policy(ns.policy)
    if pol is None:
        return refuse_with_status(getattr(ns, "status_fd", None))

    if ns.action == "argv":
        import shlex  # noqa: PLC0415

        cmd = _command(ns, ap)
        if ns.shared_network and not pol["allow_shared_network"]:
            logmod.log(SHARED_NETWORK_REFUSAL)
            return exits.EXIT_CONFIG
        try:
            slot = _pick_slot(pol, ns.slot)
        except policymod.PolicyError as exc:
            logmod.log(exc.errors[0])
            return exits.EXIT_CONFIG
        facts = argvmod.HostFacts(
            scope=host.resolve_scope(pol),
            existing=host.probe(argvmod.probe_paths(pol, slot)),
            shared_network=ns.shared_network,
            run_id="<pid>",  # a run uses the launcher's pid
        )
        out = argvmod.build_argv(pol, slot, cmd, facts)
        if ns.json:
            print(json.dumps(out, indent=1))
        else:
            print(" \\\n    ".join(shlex.quote(a) for a in out))
        return 0

    if ns.action == "status":
        return print_status(pol, as_json=ns.json)
    if ns.action in ("cordon", "uncordon"):
        return cordon(ns, pol)
    if ns.action == "drain":
        return drain(ns, pol)
    if ns.action == "read":
        return read_request(pol, agentmod.AgentRequest("read", ns.slot, None, None, False, False, [], None, ns.path))

    if ns.action == "task":
        from . import tasks  # noqa: PLC0415

        if ns.verb == "export":
            return tasks.export(pol, ns.id, tasks.caller_uid(), ns.paths, ns.max_bytes)
        repo = getattr(ns, "repo", None)
        if getattr(ns, "ref", None) is not None and repo is None:
            logmod.log("task start: --ref goes with --repo")
            return exits.EXIT_CONFIG
        return tasks.command(pol, ns.verb, tasks.caller_uid(), getattr(ns, "id", None), getattr(ns, "ttl", None),
                             env_fd=getattr(ns, "env_fd", None), repo=None if repo is None else (repo, ns.ref))
    if ns.action == "health":
        return health(ns)
    if ns.action == "warm":
        from . import warm as warmmod  # noqa: PLC0415

        try:
            slot = policymod.slot_by_name(pol, ns.slot)
        except KeyError:
            logmod.log("warm: no slot named %r in the policy" % ns.slot)
            return exits.EXIT_CONFIG
        return warmmod.WarmCell(pol, ns.policy, slot, verbose=ns.verbose).serve()
    if ns.action == "audit":
        try:
            return audit(ns)
        except policymod.PolicyError as exc:
            for e in exc.errors:
                logmod.log(e)
            return exits.EXIT_CONFIG

    cmd = _command(ns, ap)
    if ns.task is not None and ns.slot is not None:
        logmod.log("--task and --slot do not go together (a task's turns run in its slot)")
        return exits.EXIT_CONFIG
    return start_run(pol, cmd, ns.slot, ns.timeout, ns.shared_network, ns.runtime_max, ns.status_fd,
                     verbose=ns.verbose or ns.run_verbose, ignore_cordon=ns.ignore_cordon, task=ns.task,
                     caller_uid=0, env_fd=ns.env_fd)
