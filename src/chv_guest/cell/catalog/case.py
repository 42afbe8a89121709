"""An isolation case as one object: its ID, the words of its probe and
control, its judge (facts -> verdict), its counter-proof (a Loosening, or
why there is none here) and what the runner must know of it. The areas'
modules (fs.py ... lim.py) define the cases; the package's registry
(__init__.py) lists them in catalog order and derives the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple, TypedDict, Union

from .facts import Facts
from .loosen import Loosening


class Result(TypedDict):
    """One case's verdict (pass, fail, error, skip) and its evidence."""
    verdict: str
    probe: str
    control: str


def result(verdict: str, probe_ev: str, control_ev: str) -> Result:
    return {"verdict": verdict, "probe": probe_ev, "control": control_ev}


def pair(probe_ok: object, probe_ev: str, control_ok: object, control_ev: str) -> Result:
    """pass when the probe was stopped; error, whatever the probe did,
    when the control did not succeed."""
    if not control_ok:
        return result("error", probe_ev, "CONTROL FAILED: %s" % control_ev)
    return result("pass" if probe_ok else "fail", probe_ev, control_ev)


def skip(requirement: str) -> Result:
    return result("skip", "needs %s" % requirement, "")


def error(why: str) -> Result:
    """Nothing could be judged: the control did not even run."""
    return result("error", "", "CONTROL FAILED: %s" % why)


def missing(facts: Facts, skip_key: str, got: object, why: str) -> Optional[Result]:
    """The verdict of a case whose facts are not there: a skip when the
    guest side named what it lacks (``facts[skip_key]``), an error when the
    cell should have reported ``got`` and did not; None when they are there."""
    if facts.get(skip_key):
        return skip(facts[skip_key])
    if got is None:
        return error(why)
    return None


# a guest's egress mode (docs/network.md): cidr, the policy's CIDRs through
# the NAT; proxy, names only, through the egress proxy (the policy's egress_proxy)
MODES = ("cidr", "proxy")


def egress_mode(policy: Mapping[str, Any]) -> str:
    return "proxy" if policy.get("egress_proxy") else "cidr"


# judge(case, facts): the case's verdict from one run's facts
Judge = Callable[["Case", Facts], Result]


@dataclass(frozen=True)
class Case:
    """One boundary. ``probe`` and ``control`` are the catalog's words (the
    docs table); ``judge(case, facts)`` returns the verdict from one run's
    facts; ``loosening`` is how --counter-proof loosens it, or the reason
    it cannot here."""
    id: str
    # the sections of cell A's report its judge reads (audit_probe.SECTIONS; cell A's
    # uid, capabilities, resolv.conf and gateway are in every report)
    probes: Tuple[str, ...]
    title: str
    probe: str
    control: str
    judge: Judge
    loosening: Union[Loosening, str]
    # judged from the lifecycle runs after cell A's (a counter-proof run, the cells only, skips it)
    lifecycle: bool = False
    # needs every slot of the guest free (a cell in each): run only with --exclusive
    every_slot: bool = False
    # the ruleset's counter (roles/cell_nat) that this case's drops must move
    drop_counter: Optional[str] = None
    # the egress mode whose guests judge this case (MODES), None: every guest
    mode: Optional[str] = None

    @property
    def area(self) -> str:
        return self.id.split("-")[0]

    @property
    def label(self) -> str:
        """The title, with the egress mode of a mode's own case (the docs table)."""
        return self.title + (" (%s mode only)" % self.mode if self.mode else "")

    def applies(self, mode: str) -> bool:
        """Whether a guest in egress ``mode`` judges this case."""
        return self.mode is None or self.mode == mode

    def verdict(self, facts: Facts) -> Result:
        return self.judge(self, facts)

    def counter_proof(self) -> str:
        """How the case is counter-proven, or why it is not, in words (the docs table)."""
        if isinstance(self.loosening, str):
            return "none here: %s" % self.loosening
        return self.loosening.how
