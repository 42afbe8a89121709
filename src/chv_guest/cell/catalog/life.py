"""LIFE: a cell's life in its slot: what is left after it, runs one after
the other, every slot at once, a launcher killed."""

from __future__ import annotations

from .. import exits
from .case import Case, Result, pair, skip
from .facts import Facts


def _life01(case: Case, facts: Facts) -> Result:
    g = facts["guest"]
    left = g.get("left_behind")
    return pair(left == [], "left: %s" % (", ".join(left) if left else "nothing" if left == [] else "unchecked"),
                g.get("b_seen_running") is True,
                "cell B's record and interface while it ran: %s" % g.get("b_seen_running"))


def _life02(case: Case, facts: Facts) -> Result:
    runs = facts["guest"].get("runs", [])
    failed = [(i, rc) for i, rc in enumerate(runs) if rc != 0]
    return pair(bool(runs) and not failed, "%d runs, failed: %s" % (len(runs), failed[:5] or "none"),
                bool(runs) and runs[0] == 0, "first run: exit %s" % (runs[0] if runs else "not run"))


def _life03(case: Case, facts: Facts) -> Result:
    g = facts["guest"]
    busy = g.get("busy")
    if busy is None:
        return skip(g.get("busy_skip", "every slot idle"))
    return pair(busy["extra_rc"] == exits.EXIT_BUSY, "one more run: exit %s" % busy["extra_rc"],
                busy["all_ran"], "cells running at once: %d of %d" % (busy["running"], busy["slots"]))


def _life04(case: Case, facts: Facts) -> Result:
    kill = facts["guest"].get("sigkill", {})
    return pair(kill.get("after_rc") == 0, "run after SIGKILL: exit %s" % kill.get("after_rc"),
                kill.get("started") is True, "the killed launcher's cell had started: %s" % kill.get("started"))


CASES = [
    Case("LIFE-01", (), "Nothing is left after the cells exit",
         "no cell record, host interface or machine of the audit's slots after the runs",
         "while cell B ran, its record and interface existed", _life01,
         "the launcher's own cleanup: nothing in a policy keeps a cell's interface or record"),
    Case("LIFE-02", (), "Consecutive runs all start",
         "--runs cells one after the other in one slot, each exit 0",
         "the first of them ran", _life02, "a positive case", lifecycle=True),
    Case("LIFE-03", (), "All slots at once, then one more is refused as busy",
         "with a cell in every slot, one more run with --timeout 1 exits 75",
         "every slot's cell ran at the same time", _life03, "the claim locks are not configurable", lifecycle=True,
         every_slot=True),
    Case("LIFE-04", (), "A SIGKILLed launcher leaves its slot claimable",
         "after SIGKILL of a launcher, a new run in its slot exits 0",
         "the killed launcher's cell had started", _life04,
         "the claim lock is released by the kernel when its holder dies; nothing to loosen", lifecycle=True),
]
