"""The isolation case catalog (docs/isolation-cases.md): every case, one
object each (case.py), defined in its area's module, listed here in the
catalog's order. What the runner, the counter-proof and the docs need of
the cases as a whole is derived here from their attributes."""

from __future__ import annotations

from typing import Collection, Dict, List, Optional

from . import brw, egr, fs, ipc, life, lim, net, ten
from . import id as id_
from .case import Case, Result, egress_mode, error, skip
from .facts import Facts
from .loosen import Loosening

CASES: List[Case] = (fs.CASES + id_.CASES + net.CASES + egr.CASES + ipc.CASES + brw.CASES + ten.CASES + life.CASES
                     + lim.CASES)
BY_ID: Dict[str, Case] = dict((c.id, c) for c in CASES)
# the cases judged from the lifecycle runs (a counter-proof run, the cells only, skips them)
LIFECYCLE_CASES = tuple(c.id for c in CASES if c.lifecycle)
# the cases that need every slot free (chv-cell audit --exclusive; otherwise skipped with EXCLUSIVE_SKIP)
EVERY_SLOT_CASES = tuple(c.id for c in CASES if c.every_slot)
EXCLUSIVE_SKIP = "every slot free: run with --exclusive on an idle host"  # skip() says "needs ..."
# case id -> the ruleset's counter its drops must move (roles/cell_nat)
DROP_COUNTERS: Dict[str, str] = dict((c.id, c.drop_counter) for c in CASES if c.drop_counter)
# case id -> why it is not counter-proven on these guests
NOT_COUNTER_PROVABLE: Dict[str, str] = dict((c.id, c.loosening) for c in CASES if isinstance(c.loosening, str))


def _loosenings() -> List[Loosening]:
    """Each case's loosening once (ID-03 and ID-04 share one), its cases and name filled in."""
    out: List[Loosening] = []
    for c in CASES:
        lo = c.loosening
        if isinstance(lo, Loosening) and all(lo is not seen for seen in out):
            lo.cases = tuple(other.id for other in CASES if other.loosening is lo)
            lo.name = lo.name or lo.cases[0]
            out.append(lo)
    return out


LOOSENINGS = _loosenings()


def cases_for(mode: str) -> List[Case]:
    """The cases a guest in egress ``mode`` judges (case.MODES)."""
    return [c for c in CASES if c.applies(mode)]


def judge(facts: Facts, only: Optional[Collection[str]] = None) -> Dict[str, Result]:
    """The verdict of every case of the guest's egress mode (or of those
    ``only`` names) from the facts of one run (the cells' reports and the
    guest's observations)."""
    cases = [c for c in cases_for(egress_mode(facts.get("policy") or {})) if only is None or c.id in only]
    if facts.get("a") is None:
        # nothing was proven: every case is an error, the lifecycle ones too (not run)
        why = "cell A did not run: %s" % facts.get("a_error", "no report")
        return dict((c.id, error(why)) for c in cases)
    no_lifecycle = facts["guest"].get("lifecycle") is False
    return dict((c.id, skip("a run with the lifecycle cases (this run probes the cells only)")
                 if c.lifecycle and no_lifecycle else c.verdict(facts)) for c in cases)


def catalog_markdown() -> str:
    """The catalog as the Markdown table of docs/isolation-cases.md (and
    ``chv-cell audit --list``)."""
    rows = ["| id | boundary | probe (must be stopped) | control (must succeed) | counter-proof |",
            "|---|---|---|---|---|"]
    for c in CASES:
        rows.append("| %s | %s | %s | %s | %s |" % (c.id, c.label, c.probe, c.control, c.counter_proof()))
    return "\n".join(rows) + "\n"
