"""IPC: chv-broker, the cells' one door out (its peer check and dispatch)."""

from __future__ import annotations

import os
from typing import Optional, Tuple

from .case import Case, Judge, Result, pair, skip
from .facts import Facts, answer
from .loosen import Loosening

NO_CLIENT = "chv-broker's client (--broker-client)"


def _pinged(facts: Facts) -> Tuple[bool, str]:
    """Whether the cell's ping was answered (IPC-01's probe, the control of IPC-02 and IPC-03), and what it got."""
    ping = facts["a"]["broker"]["ping"]
    return (answer(ping) or {}).get("ok") is True, "cell ping: %s" % (ping["out"] or ping["err"])


def _no_broker(facts: Facts) -> Optional[Result]:
    return None if "broker" in facts["a"] else skip(NO_CLIENT)


def _ipc01(case: Case, facts: Facts) -> Result:
    skipped = _no_broker(facts)
    if skipped:
        return skipped
    pinged, ping_ev = _pinged(facts)
    return pair(pinged, ping_ev, os.path.exists(facts["broker_client"]), "client %s" % facts["broker_client"])


def _outside(key: str) -> Judge:
    """The judge of a ping from a guest process outside any cell (the guest's ``key`` fact)."""
    def judge(case: Case, facts: Facts) -> Result:
        skipped = _no_broker(facts)
        if skipped:
            return skipped
        pinged, ping_ev = _pinged(facts)
        reply = facts["guest"].get(key, {})
        return pair((answer(reply) or {}).get("ok") is False, "reply: %s" % (reply.get("out") or reply.get("err")),
                    pinged, ping_ev)
    return judge


def _ipc04(case: Case, facts: Facts) -> Result:
    skipped = _no_broker(facts)
    if skipped:
        return skipped
    br = facts["a"]["broker"]
    unknown, after = answer(br["unknown"]) or {}, answer(br["ping_after"]) or {}
    return pair(unknown.get("ok") is False, "reply: %s" % br["unknown"]["out"], after.get("ok") is True,
                "ping after: %s" % br["ping_after"]["out"])


# IPC-02 and IPC-03: one test build, the guest's pings to it as root and as cell A's uid
ANY_PEER = Loosening("a test build of the installed chv-broker whose peer check lets any peer in "
                     "(chv_guest/broker/testbuild.py, any-peer), for the run only, on a socket that root and cell "
                     "A's uid reach and cells A and B have as their /run/chv", doors=(("broker", "any-peer"),))

CASES = [
    Case("IPC-01", ("broker",), "The broker answers a cell",
         "ping through the broker socket from the cell",
         "the broker's client is installed", _ipc01,
         "a positive case: the broker answering the cell is the control of IPC-02 to IPC-04"),
    Case("IPC-02", ("broker",), "The broker refuses a guest process",
         "ping as guest root outside any cell",
         "the cell's ping (IPC-01) was answered", _outside("broker_root"), ANY_PEER),
    Case("IPC-03", ("broker",), "The broker refuses a guest process that has a cell's uid",
         "ping as the slot's uid_base outside any cell",
         "the cell's ping (IPC-01) was answered", _outside("broker_cell_uid"), ANY_PEER),
    Case("IPC-04", ("broker",), "Unknown operations are refused and the broker survives",
         "an unknown op from the cell",
         "a ping after it is answered", _ipc04,
         Loosening("a test build of the installed chv-broker whose dispatch answers an unknown operation "
                   "(chv_guest/broker/testbuild.py, any-op), for the run only, that cells A and B reach as their "
                   "/run/chv", doors=(("broker", "any-op"),))),
]
