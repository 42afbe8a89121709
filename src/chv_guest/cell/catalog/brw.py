"""BRW: chv-browser, the door that opens pages for a cell (what it must
not open for it, and what it returns)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .. import audit_probe as probe
from .case import Case, Judge, Result, egress_mode, pair, skip
from .facts import METADATA, NO_BROWSER, NO_BROWSER_OP, RAW_MARKER, SNAPSHOT_KEYS, Facts, answer, result_of
from .loosen import Loosening, in_cidr_mode, unless


@dataclass
class Door:
    """What every BRW case reads: the cell's replies, the allowed page's
    snapshot (the control) and what reached the guest's listener."""
    denied: Dict[str, Any]
    result: Dict[str, Any]
    snapshot: str
    ctl_ok: bool
    ctl_ev: str
    moved: Dict[str, int]
    arrivals: List[Dict[str, str]]  # at the guest's listener, but cell A's own (NET's)
    # proxy mode: the proxy's denied and failed lines of the doors acting for cell A (from its gateway);
    # None otherwise
    proxy_denied: Optional[int] = None

    def _by_proxy(self, reply: Dict[str, Any]) -> bool:
        """Proxy mode: the open came back as the proxy's error page: its 403
        (the list refused it) or its 5xx (the kernel refused the proxy's own
        connection). The audit's listeners never answer with an error."""
        status = (reply.get("result") or {}).get("status")
        return self.proxy_denied is not None and reply.get("ok") is True and isinstance(status, int) and status >= 400

    def refused(self, keys: List[str]) -> Tuple[bool, str]:
        """Whether chv-browser refused every open of ``keys`` (in proxy mode:
        or got the proxy's error page for it, each with its denied or failed
        line in the proxy's log), and the replies."""
        replies = dict((key, answer(self.denied[key]) or {}) for key in keys)
        by_proxy = [key for key, r in replies.items() if self._by_proxy(r)]
        # each of the proxy's 403s of the run (every case's opens) has its denied line
        all_by_proxy = len([r for r in self.denied.values() if self._by_proxy(answer(r) or {})])
        ok = bool(keys) and all(r.get("ok") is False or key in by_proxy for key, r in replies.items()) and \
            all_by_proxy <= (self.proxy_denied or 0)
        text = ", ".join("%s: %s" % (key.split(":", 1)[-1], "refused: %s" % str(r.get("error", ""))[:60]
                                     if r.get("ok") is False else "refused by the proxy: %s" % (r.get("result") or {}).get("status") if key in by_proxy
                                     else "OPENED" if r.get("ok") else "no reply")
                         for key, r in sorted(replies.items()))
        if self.proxy_denied is not None:
            text += "; the doors' denied or failed lines in the proxy's log: %d for %d error pages" % (
                self.proxy_denied, all_by_proxy)
        return ok, text

    def dropped(self, counter: str) -> Tuple[bool, str]:
        """The kernel's drop of the doors' connections: its counter moved; in
        proxy mode the proxy refuses them first (its log lines are the evidence)."""
        n = self.moved.get(counter, 0)
        return self.proxy_denied is not None or n > 0, "%s +%d" % (counter, n)


def door(facts: Facts) -> Union[Door, Result]:
    """The door's facts, or the skip of every BRW case (no chv-browser to ask)."""
    br = facts["a"].get("browser")
    if br is None or br.get("allowed") is None:
        return skip(NO_BROWSER)
    ctl = answer(br["allowed"]) or {}
    if "unknown or disabled op" in str(ctl.get("error", "")):
        return skip(NO_BROWSER_OP)
    result = result_of(br["allowed"])
    snapshot = str(result.get("aria_snapshot", ""))
    ctl_ok = ctl.get("ok") is True and bool(snapshot)
    ctl_ev = "allowed page: %s" % (("title %r, %d characters of snapshot" % (result.get("title"), len(snapshot)))
                                   if ctl_ok else (br["allowed"]["out"] or br["allowed"]["err"])[-200:])
    g = facts["guest"]
    cell_a = facts["slot_a"]["address"]
    proxy_denied = None
    if egress_mode(facts.get("policy") or {}) == "proxy":
        gateway = facts["slot_a"]["gateway"]
        proxy_denied = len([line for line in (g.get("egress") or {}).get("log", [])
                            if line["src"] == gateway and line["verdict"] in ("denied", "failed")])
    return Door(br["denied"], result, snapshot, ctl_ok, ctl_ev, g.get("counters_moved") or {},
                [s for s in g.get("listener_seen", []) if s["peer"] != cell_a], proxy_denied)


def _judge_door(judge: Callable[[Case, Facts, Door], Result]) -> Judge:
    """A BRW judge(case, facts, door), as a case's judge (case, facts)."""
    def judged(case: Case, facts: Facts) -> Result:
        d = door(facts)
        return judge(case, facts, d) if isinstance(d, Door) else d
    return judged


@_judge_door
def _brw01(case: Case, facts: Facts, d: Door) -> Result:
    ok, ev = d.refused([key for key in d.denied if key.startswith("guest:")])
    arrived = [s["local"] for s in d.arrivals if s["local"] != METADATA]
    held, moved = d.dropped(case.drop_counter or "")
    return pair(ok and not arrived and held, "%s; reached the listener: %s; %s"
                % (ev, ", ".join(arrived) or "nothing", moved), d.ctl_ok, d.ctl_ev)


@_judge_door
def _brw02(case: Case, facts: Facts, d: Door) -> Result:
    if "metadata" not in d.denied:
        return skip("--metadata-stand-in")
    ok, ev = d.refused(["metadata"])
    arrived = [s["local"] for s in d.arrivals if s["local"] == METADATA]
    return pair(ok and not arrived, "%s; reached the stand-in: %s" % (ev, len(arrived)), d.ctl_ok, d.ctl_ev)


@_judge_door
def _brw03(case: Case, facts: Facts, d: Door) -> Result:
    if "cell_b" not in d.denied:
        return skip("a second slot")
    ok, ev = d.refused(["cell_b"])
    reached = facts["guest"].get("b_listener_seen")
    if reached is not None:
        reached = [peer for peer in reached if peer != facts["slot_a"]["address"]]  # cell A's own is NET-02's
    b_ok = (facts.get("b") or {}).get("self", "").startswith("connected")
    held, moved = d.dropped(case.drop_counter or "")
    return pair(ok and reached == [] and held, "%s; reached cell B: %s; %s"
                % (ev, "unknown" if reached is None else len(reached), moved),
                d.ctl_ok and b_ok, "%s; cell B to itself: %s" % (d.ctl_ev, b_ok))


@_judge_door
def _brw04(case: Case, facts: Facts, d: Door) -> Result:
    extra = sorted(set(d.result) - SNAPSHOT_KEYS)
    raw = RAW_MARKER in json.dumps(d.result)
    return pair(not extra and not raw, "keys: %s; raw HTML in the reply: %s"
                % (", ".join(sorted(d.result)) or "none", "yes" if raw else "no"),
                d.ctl_ok and "chv-audit" in d.snapshot,
                "%s; heading chv-audit in the snapshot: %s" % (d.ctl_ev, "chv-audit" in d.snapshot))


# BRW-01 to BRW-03 on a proxy-mode guest: the doors go through the proxy, which refuses those addresses
PROXY_FIRST = ("proxy mode: the egress proxy refuses the doors' opens of the guest's, link-local and cells' "
               "addresses before the kernel would (two layers; EGR-02 counter-proves the proxy's list)")


def _door_rule(daddr: str) -> str:
    """An output rule that lets chv-browser's uids (the doors) reach ``daddr`` (nft words)."""
    return "meta skuid @door_uids ip daddr %s" % daddr


CASES = [
    Case("BRW-01", ("browser",), "chv-browser opens no guest service for a cell",
         "open, for cell A, the guest's listener on 127.0.0.1, each guest IPv4 address and each slot gateway: each "
         "refused, nothing reaches the listener, and drop_door_to_guest moves",
         "the same open of the --allow-url page returns its snapshot", _brw01,
         Loosening("accept chv-browser to the guest's audit listener (port %d) at the top of the output chain"
                   % probe.GUEST_PORT,
                   rules=lambda ctx: [("output", "%s tcp dport %d accept"
                                       % (_door_rule("!= " + METADATA), probe.GUEST_PORT))],
                   needs=in_cidr_mode(PROXY_FIRST, unless("run without --allow-url",
                                                          lambda ctx: ctx["opts"].get("allow_url")))),
         drop_counter="drop_door_to_guest"),
    Case("BRW-02", ("browser",), "chv-browser does not reach the metadata stand-in for a cell",
         "open 169.254.169.254 (the stand-in on the guest's loopback): refused, nothing reaches the listener",
         "the allowed page's snapshot", _brw02,
         Loosening("accept chv-browser to the metadata stand-in at the top of the output chain",
                   rules=lambda ctx: [("output", "%s tcp dport %d accept" % (_door_rule(METADATA), probe.GUEST_PORT))],
                   needs=in_cidr_mode(PROXY_FIRST, unless(
                       "run without --allow-url or --metadata-stand-in",
                       lambda ctx: ctx["opts"].get("allow_url") and ctx["opts"]["metadata_stand_in"])))),
    Case("BRW-03", ("browser",), "chv-browser does not reach another cell for a cell",
         "open cell B's listener: refused, nothing reaches it, and drop_door_to_cell moves",
         "the allowed page's snapshot; cell B reaches its own listener", _brw03,
         Loosening("accept chv-browser to cell B's listener at the top of the output chain",
                   rules=lambda ctx: [("output", "%s tcp dport %d accept"
                                       % (_door_rule(ctx["slot_b"]["address"]), probe.LISTENER_PORT))],
                   needs=in_cidr_mode(PROXY_FIRST, unless("run without --allow-url, or the policy has one slot",
                                                          lambda ctx: ctx["opts"].get("allow_url") and ctx["slot_b"]))),
         drop_counter="drop_door_to_cell"),
    Case("BRW-04", ("browser",), "chv-browser returns snapshots only",
         "the reply to the allowed page carries no key but %s and none of the page's raw HTML (a comment and a "
         "script)" % ", ".join(sorted(SNAPSHOT_KEYS)),
         "the snapshot names the page's heading", _brw04,
         Loosening("a test build of the installed chv-browser whose replies carry the page's HTML "
                   "(chv_guest/browser/testbuild.py, raw-html), for the run only, as chv-browser's user, behind an "
                   "unchanged test build of chv-broker that cells A and B reach as their /run/chv",
                   doors=(("browser", "raw-html"),))),
]
