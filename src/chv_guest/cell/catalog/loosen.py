"""What --counter-proof loosens for a case (counterproof.py runs it): a
Loosening, and the helpers the areas' modules build theirs from."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

# What a loosening reads: "pol" (the policy), "slot_a", "slot_b" (None with one
# slot) and "opts" (the audit's options). A plain mapping, not a TypedDict: a
# loosening's needs() is what makes sure "slot_b" is there before its rules()
# index it, which mypy cannot follow.
Context = Dict[str, Any]
# an edit(raw, ctx) of a policy copy; rules(ctx) or elements(ctx): (chain or set, text) pairs
Edit = Callable[[Dict[str, Any], Context], None]
Pairs = Callable[[Context], List[Tuple[str, str]]]
Needs = Callable[[Context], Optional[str]]


# where cells have chv-broker's socket (the client's default), the target of the bind through_doors moves
CELL_BROKER_DIR = "/run/chv"


@dataclass
class Loosening:
    """One boundary loosened: ``edit(raw, ctx)`` changes a copy of the raw
    policy, ``rules(ctx)`` returns (chain, rule) pairs to insert,
    ``elements(ctx)`` (set, element) pairs to add to the table's sets,
    ``proxy`` edits the egress proxy's configuration for the run,
    ``doors`` names the doors' test builds to start for the run ((service,
    variant) pairs, chv_guest/cell/doorbuild.py; the policy copy then takes
    cells A and B to them: through_doors);
    ``needs(ctx)`` returns why this guest cannot show it, or None.
    ``cases`` (and ``name``, when not given) come from the cases that name
    it (the registry fills them in)."""
    how: str
    edit: Optional[Edit] = None
    rules: Optional[Pairs] = None
    needs: Optional[Needs] = None
    elements: Optional[Pairs] = None
    doors: Tuple[Tuple[str, str], ...] = ()
    # proxy mode: proxy(conf, ctx), the egress proxy's configuration for the run (counterproof.py
    # writes it, reconfigures squid and puts the original back after the run)
    proxy: Optional[Callable[[str, Context], str]] = None
    name: str = ""
    cases: Tuple[str, ...] = ()


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


def without_inaccessible(paths: Callable[[Context], List[str]]) -> Edit:
    def edit(raw: Dict[str, Any], ctx: Context) -> None:
        raw["inaccessible"] = [p for p in raw.get("inaccessible", ctx["pol"]["inaccessible"]) if p not in paths(ctx)]
    return edit


def bind(source: Callable[[Context], str], also_accessible: bool = False) -> Edit:
    def edit(raw: Dict[str, Any], ctx: Context) -> None:
        src = source(ctx)
        raw["readonly_binds"] = list(raw.get("readonly_binds", [])) + [{"source": src, "target": src,
                                                                        "optional": False}]
        if also_accessible:
            raw["inaccessible"] = [p for p in raw.get("inaccessible", ctx["pol"]["inaccessible"]) if p != src]
    return edit


def unless(reason: str, test: Callable[[Context], object]) -> Needs:
    """A needs(): `reason` when test(ctx) is false."""
    return lambda ctx: None if test(ctx) else reason


def in_cidr_mode(reason: str, needs: Needs) -> Needs:
    """A needs() that a proxy-mode guest does not meet (``reason``); on
    the others, ``needs``."""
    return lambda ctx: reason if ctx["pol"].get("egress_proxy") else needs(ctx)


def a_if(ctx: Context) -> str:
    """Cell A's host-side interface, which the ruleset loosenings match."""
    ifname: str = ctx["slot_a"]["host_ifname"]
    return ifname


def through_doors(raw: Dict[str, Any], ctx: Context) -> None:
    """A policy copy whose cells reach the run's test builds (``ctx["doors"]``,
    doorbuild.DoorBuilds.paths): the bind that gives cells /run/chv (where
    they have chv-broker's socket) from the broker build's directory, and
    browser_socket (where the launcher ends a run's browser state) the
    browser build's socket when there is one."""
    doors = ctx["doors"]
    binds = list(raw.get("writable_binds", ctx["pol"]["writable_binds"]))
    moved = [dict(b, source=doors["cell_run_dir"]) if b.get("target", b["source"]) == CELL_BROKER_DIR else b
             for b in binds]
    if moved == binds:
        raise RuntimeError("the policy binds nothing at %s, where cells have chv-broker" % CELL_BROKER_DIR)
    raw["writable_binds"] = moved
    if doors.get("browser_socket"):
        raw["browser_socket"] = doors["browser_socket"]
