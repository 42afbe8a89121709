"""EGR: egress by name (proxy mode, docs/network.md "Egress by name"):
what a cell reaches through the egress proxy on its gateway, and that it
reaches nothing past it. Judged on guests in proxy mode only (the NET
cases of the NAT's egress, NET-01, NET-05 and NET-07, on the others)."""

from __future__ import annotations

import socket
from typing import Any, Dict, List, Tuple

from .. import resolver as resolvermod
from .case import Case, Result, error, pair, skip
from .facts import Facts, dropped
from .loosen import Context, Loosening, a_if, unless

NO_ALLOW_NAME = "--allow-name HOST:PORT, a name the proxy's list allows for the slot, resolving to a listener"
DENIED = "status 403"  # squid's answer to a CONNECT its list refuses
OPENED = "status 200"  # a tunnel: the far end accepted the connection


def _facts(facts: Facts) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Cell A's egress report and the guest's (the controls)."""
    return facts["a"].get("egress") or {}, facts["guest"].get("egress") or {}


def _keys(cell: Dict[str, Any], kind: str) -> List[str]:
    return sorted(k for k in cell.get("connect", {}) if k.startswith(kind + ":"))


def _host(key: str) -> str:
    """The host of a connect key KIND:HOST:PORT."""
    return key.split(":", 1)[1].rsplit(":", 1)[0]


def _logged(guest: Dict[str, Any], key: str, verdict: str) -> bool:
    """The proxy's log has a line for this attempt (its host and port) with ``verdict``; a denied one
    with no address connected to (dst=-)."""
    host, port = _host(key), key.rsplit(":", 1)[1]
    return any(line["host"] == host and str(line["port"]) == port and line["verdict"] == verdict
               and (verdict != "denied" or line["dst"] == "-") for line in guest.get("log", []))


def _connects(cell: Dict[str, Any], keys: List[str]) -> str:
    return ", ".join("%s: %s" % (k, cell["connect"][k]) for k in keys)


def _guest_reached(guest: Dict[str, Any], keys: List[str]) -> bool:
    return bool(keys) and all(guest.get("reach", {}).get(k, "").startswith("connected") for k in keys)


def _reach_text(guest: Dict[str, Any], keys: List[str]) -> str:
    return "guest: " + ", ".join("%s: %s" % (k, guest.get("reach", {}).get(k, "not tried")) for k in keys)


def _refused(case: Case, facts: Facts, keys: List[str], control_ok: bool, control_ev: str) -> Result:
    """Each CONNECT of ``keys`` answered 403 by the proxy, with its denied line in the log."""
    cell, guest = _facts(facts)
    logged = [k for k in keys if _logged(guest, k, "denied")]
    return pair(all(cell["connect"][k] == DENIED for k in keys) and logged == keys,
                "%s; denied in the proxy's log: %d of %d" % (_connects(cell, keys), len(logged), len(keys)),
                control_ok, control_ev)


def _egr01(case: Case, facts: Facts) -> Result:
    cell, guest = _facts(facts)
    keys = _keys(cell, "allow")
    if not keys:
        return skip(NO_ALLOW_NAME)
    logged = [k for k in keys if _logged(guest, k, "allowed")]
    return pair(all(cell["connect"][k] == OPENED for k in keys) and logged == keys,
                "through %s: %s; allowed in the proxy's log: %d of %d"
                % (cell.get("proxy") or "no HTTPS_PROXY", _connects(cell, keys), len(logged), len(keys)),
                _guest_reached(guest, keys), _reach_text(guest, keys))


def _egr02(case: Case, facts: Facts) -> Result:
    cell, guest = _facts(facts)
    keys = _keys(cell, "deny")
    if not keys:
        return skip("--deny-name HOST:PORT, a name no entry allows for the slot, resolving to a listener the guest "
                    "reaches")
    return _refused(case, facts, keys, _guest_reached(guest, keys), _reach_text(guest, keys))


def _allowed_works(facts: Facts) -> Tuple[bool, str]:
    """The control of the cases that judge an allowed name's address: EGR-01's tunnel opened."""
    cell, dummy = _facts(facts)
    keys = _keys(cell, "allow")
    return (bool(keys) and all(cell["connect"][k] == OPENED for k in keys),
            "by name: %s" % (_connects(cell, keys) or "no --allow-name"))


def _egr03(case: Case, facts: Facts) -> Result:
    cell, dummy = _facts(facts)
    keys = _keys(cell, "literal")
    if not keys:
        return skip(NO_ALLOW_NAME)
    return _refused(case, facts, keys, *_allowed_works(facts))


def _egr04(case: Case, facts: Facts) -> Result:
    cell, guest = _facts(facts)
    keys = _keys(cell, "inside")
    if not keys:
        return skip("--inside-name NAME, a name the proxy's list allows that resolves to the guest's loopback or "
                    "another address of the guest")
    arrived = [s["peer"] for s in facts["guest"].get("listener_seen", []) if s["peer"] != facts["slot_a"]["address"]]
    return pair(bool(keys) and not any(cell["connect"][k] == OPENED for k in keys) and not arrived,
                "%s; reached the guest's listener: %s" % (_connects(cell, keys), ", ".join(arrived) or "nothing"),
                _guest_reached(guest, keys), _reach_text(guest, keys))


def _moved(case: Case, facts: Facts) -> Tuple[int, str]:
    name = case.drop_counter or ""
    n = (facts["guest"].get("counters_moved") or {}).get(name, 0)
    return n, "%s +%d" % (name, n)


def _egr05(case: Case, facts: Facts) -> Result:
    cell, guest = _facts(facts)
    dns, ctl = cell.get("dns", {}), guest.get("dns", {})
    if not ctl:
        return error("no resolver to query: the guest has none a cell would get outside proxy mode")
    servers = [line.split()[1] for line in facts["a"].get("resolv", "").splitlines()
               if line.startswith("nameserver") and len(line.split()) > 1]
    n, moved = _moved(case, facts)
    return pair(bool(dns) and all(dropped(r) for r in dns.values()) and not servers and n > 0,
                "queries for %s: %s; the cell's resolv.conf names: %s; %s"
                % (guest.get("qname"), ", ".join("%s: %s" % kv for kv in sorted(dns.items())),
                   ", ".join(servers) or "none", moved),
                all(r == "answered" for r in ctl.values()),
                "guest: %s" % ", ".join("%s: %s" % kv for kv in sorted(ctl.items())))


def _egr06(case: Case, facts: Facts) -> Result:
    cell, guest = _facts(facts)
    direct = cell.get("direct", {})
    if not direct:
        return skip(NO_ALLOW_NAME)
    allow = _keys(cell, "allow")
    n, moved = _moved(case, facts)
    return pair(all(dropped(r) for r in direct.values()) and n > 0,
                "%s; %s" % (", ".join("%s: %s" % kv for kv in sorted(direct.items())), moved),
                _guest_reached(guest, allow), _reach_text(guest, allow))


def _resolved(ctx: Context) -> List[Tuple[str, int]]:
    """The --allow-name destinations' addresses (as the guest resolves them) and ports."""
    out = []
    for target in ctx["opts"].get("allow_name") or []:
        host, dummy, port = target.rpartition(":")
        try:
            out.append((str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]), int(port)))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _widen(conf: str, ctx: Context) -> str:
    """The proxy's configuration with cell A's slot allowed every name and
    address (before the list's first rule): the list widened for that slot only."""
    slot = ctx["slot_a"]["name"]
    acls = [line.split()[3] for line in conf.splitlines()
            if line.startswith("note chv_slot ") and len(line.split()) == 4 and line.split()[2] == slot]
    if not acls:
        raise RuntimeError("the proxy's configuration has no ACL of slot %s" % slot)
    lines = conf.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("http_access "))
    return "".join(lines[:first] + ["http_access allow %s\n" % acls[0]] + lines[first:])


def _resolvers(ctx: Context) -> List[str]:
    """The resolvers EGR-05 queries: those a cell would get outside proxy mode."""
    try:
        return list(resolvermod.host_upstream(ctx["pol"]["dns_servers"] or None)[0])
    except resolvermod.ResolverError:
        return []


# EGR-02 and EGR-03: one loosening, the proxy's list
WIDEN = Loosening("the proxy's list widened for cell A's slot (http_access allow, its ACL, before the list's rules; "
                  "squid reconfigured for the run)", proxy=_widen,
                  needs=unless("run without --allow-name and --deny-name",
                               lambda ctx: ctx["opts"].get("allow_name") and ctx["opts"].get("deny_name")))

CASES = [
    Case("EGR-01", ("egress",), "Egress by name through the proxy works",
         "CONNECT each --allow-name destination through the proxy the cell's HTTPS_PROXY names: 200, and an allowed "
         "line in the proxy's log",
         "the guest connects to it", _egr01, "a positive case: its counter-proof is every EGR case beside it",
         mode="proxy"),
    Case("EGR-02", ("egress",), "A name no entry allows is refused before anything reaches it",
         "CONNECT each --deny-name destination through the proxy: 403, and a denied line in the proxy's log with no "
         "address connected to",
         "the guest connects to it", _egr02,
         WIDEN,
         mode="proxy"),
    Case("EGR-03", ("egress",), "An IP literal is refused",
         "CONNECT the first --allow-name's address through the proxy: 403, and a denied line in the proxy's log",
         "the same destination by name opens (EGR-01)", _egr03, WIDEN, mode="proxy"),
    Case("EGR-04", ("egress",), "A listed name that resolves to the guest reaches nothing of it",
         "CONNECT each --inside-name (listed, resolving to the guest's loopback or another guest address) on the "
         "guest's listener port through the proxy: no tunnel, nothing reaches the listener",
         "the guest connects to its listener there", _egr04,
         "two layers: the proxy's dst ACL (loopback, link-local, the cells, the special ranges) and the kernel's "
         "drop_door_to_guest for the proxy's own connections", mode="proxy"),
    Case("EGR-05", ("egress",), "A cell gets no DNS",
         "query each resolver a cell would get outside proxy mode for the first --allow-name, over UDP: no answer, "
         "the cell's resolv.conf names none, and drop_proxy_mode moves",
         "the guest's query to each is answered", _egr05,
         Loosening("accept cell A's DNS (udp 53) to those resolvers at the top of the forward chain",
                   rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s udp dport 53 accept' % (a_if(ctx), server))
                                      for server in _resolvers(ctx)],
                   needs=unless("the guest has no resolver a cell would get outside proxy mode", _resolvers)),
         drop_counter="drop_proxy_mode", mode="proxy"),
    Case("EGR-06", ("egress",), "A connection past the proxy is dropped",
         "connect from the cell straight to each --allow-name's address and port: no answer, and drop_proxy_mode "
         "moves",
         "the guest connects to it", _egr06,
         Loosening("accept cell A to the --allow-name addresses and ports at the top of the forward chain",
                   rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s tcp dport %d accept' % (a_if(ctx), addr, port))
                                      for addr, port in _resolved(ctx)],
                   needs=unless("run without --allow-name, or its names do not resolve on the guest", _resolved)),
         drop_counter="drop_proxy_mode", mode="proxy"),
]
