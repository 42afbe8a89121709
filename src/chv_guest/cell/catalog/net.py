"""NET: where a cell's packets may go (the cell_nat ruleset)."""

from __future__ import annotations

from typing import List, Tuple

from .case import Case, Result, pair, skip
from .facts import METADATA, Facts, dropped
from .loosen import Loosening, a_if, unless


def _gateway_answers(facts: Facts) -> bool:
    return "lladdr" in facts["a"].get("neigh_out", "")


def _dropped_here(case: Case, facts: Facts, results: List[str]) -> Tuple[bool, str]:
    """(held, evidence): every connect timed out and the case's own drop counter moved."""
    name = case.drop_counter
    assert name is not None, case.id  # the NET cases that judge drops declare their counter
    moved = (facts["guest"].get("counters_moved") or {}).get(name, 0)
    return bool(results) and all(dropped(r) for r in results) and moved > 0, "; %s +%d" % (name, moved)


def _reached(facts: Facts, keys: List[str], cut: int) -> str:
    """The guest's own connects to the destinations ``keys`` (their prefix ``cut`` long)."""
    return ", ".join("%s: %s" % (key[cut:], facts["guest"]["reach"].get(key[cut:])) for key in keys)


def _guest_reaches(facts: Facts, keys: List[str], cut: int) -> bool:
    return all(facts["guest"]["reach"].get(key[cut:], "").startswith("connected") for key in keys)


def _net01(case: Case, facts: Facts) -> Result:
    tcp = facts["a"]["tcp"]
    allow = [key for key in tcp if key.startswith("allow:")]
    if not allow:
        return skip("--allow HOST:PORT, a destination cells may reach")
    return pair(all(tcp[key].startswith("connected") for key in allow),
                ", ".join("%s: %s" % (key[6:], tcp[key]) for key in allow),
                _guest_reaches(facts, allow, 6), "guest: %s" % _reached(facts, allow, 6))


def _net02(case: Case, facts: Facts) -> Result:
    if facts.get("slot_b") is None:
        return skip("a second slot")
    b = facts.get("b")
    result = facts["a"]["tcp"].get("cell_b", "not probed")
    ok, ev = _dropped_here(case, facts, [result])
    return pair(ok, "to cell B: %s%s" % (result, ev), b is not None and b.get("self", "").startswith("connected"),
                "cell B to itself: %s" % (b or {}).get("self", "cell B did not run"))


def _net03(case: Case, facts: Facts) -> Result:
    tcp = facts["a"]["tcp"]
    guest = [key for key in tcp if key.startswith("guest:")]
    # cell A's own gateway exists only while A runs: its control is the
    # gateway's ARP answer to A (the listener is bound to every address)
    own_gw = "guest:" + facts["slot_a"]["gateway"]
    reached = [key for key in guest if key != own_gw]
    ok, ev = _dropped_here(case, facts, [tcp[key] for key in guest])
    return pair(ok, ", ".join("%s: %s" % (key[6:], tcp[key]) for key in guest) + ev,
                _gateway_answers(facts) and _guest_reaches(facts, reached, 6),
                "cell A's gateway answers ARP: %s; the guest reaches the listener on %s"
                % (facts["a"].get("neigh_out") or "no", _reached(facts, reached, 6) or "no other address"))


def _net04(case: Case, facts: Facts) -> Result:
    tcp, reach = facts["a"]["tcp"], facts["guest"]["reach"]
    if "metadata" not in tcp:
        return skip("--metadata-stand-in (the audit adds %s to the guest's loopback for the run)" % METADATA)
    ok, ev = _dropped_here(case, facts, [tcp["metadata"]])
    return pair(ok, "%s: %s%s" % (METADATA, tcp["metadata"], ev), reach.get("metadata", "").startswith("connected"),
                "guest: %s" % reach.get("metadata"))


def _net05(case: Case, facts: Facts) -> Result:
    tcp = facts["a"]["tcp"]
    deny = [key for key in tcp if key.startswith("deny:")]
    if not deny:
        return skip("--deny HOST:PORT, a destination the egress policy denies that the guest reaches")
    ok, ev = _dropped_here(case, facts, [tcp[key] for key in deny])
    return pair(ok, ", ".join("%s: %s" % (key[5:], tcp[key]) for key in deny) + ev,
                _guest_reaches(facts, deny, 5), "guest: %s" % _reached(facts, deny, 5))


def _net06(case: Case, facts: Facts) -> Result:
    v6 = facts["a"]["tcp6"]
    return pair(bool(v6) and not any(r.startswith("connected") for r in v6.values()),
                ", ".join("[%s]: %s" % kv for kv in sorted(v6.items())), _gateway_answers(facts),
                "IPv4 gateway ARP: %s" % (facts["a"].get("neigh_out") or "none"))


def _net07(case: Case, facts: Facts) -> Result:
    resolv = facts["a"].get("resolv", "")
    servers = [line.split()[1] for line in resolv.splitlines()
               if line.startswith("nameserver") and len(line.split()) > 1]
    return pair("127.0.0.53" not in servers, "nameservers: %s" % (", ".join(servers) or "none"),
                bool(servers), "resolv.conf lists %d resolver(s)" % len(servers))


CASES = [
    Case("NET-01", ("tcp",), "Egress through the NAT works",
         "connect to each --allow destination from the cell",
         "the guest connects to it", _net01, "a positive case: its counter-proof is every NET case beside it",
         mode="cidr"),
    Case("NET-02", ("tcp",), "Another cell is unreachable",
         "connect from cell A to cell B's listener: no answer, and drop_cell_to_cell moves",
         "cell B reaches its own listener", _net02,
         Loosening("accept cell A <-> cell B at the top of the forward chain",
                   rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s accept' % (a["host_ifname"], b["address"]))
                                      for a, b in ((ctx["slot_a"], ctx["slot_b"]), (ctx["slot_b"], ctx["slot_a"]))],
                   needs=unless("the policy has one slot", lambda ctx: ctx["slot_b"])),
         drop_counter="drop_cell_to_cell"),
    Case("NET-03", ("tcp",), "Guest services are unreachable on every guest address",
         "connect from the cell to a guest listener on each guest IPv4 address and each slot gateway: no answer, "
         "and drop_cell_to_guest moves",
         "the guest reaches the listener on each (cell A's own gateway, which exists only while A runs: it answers "
         "A's ARP)", _net03,
         Loosening("accept cell A to the guest at the top of the input chain (not the metadata stand-in)",
                   rules=lambda ctx: [("input", 'iifname "%s" ip daddr != %s accept' % (a_if(ctx), METADATA))]),
         drop_counter="drop_cell_to_guest"),
    # the metadata stand-in is an address of the guest, so its drop is the input path's
    Case("NET-04", ("tcp",), "The metadata stand-in is unreachable",
         "connect to 169.254.169.254 (added to the guest's loopback for the run): no answer, and "
         "drop_cell_to_guest moves",
         "the guest connects to it", _net04,
         Loosening("accept cell A to the metadata stand-in at the top of the input chain",
                   rules=lambda ctx: [("input", 'iifname "%s" ip daddr %s accept' % (a_if(ctx), METADATA))],
                   needs=unless("run without --metadata-stand-in", lambda ctx: ctx["opts"]["metadata_stand_in"])),
         drop_counter="drop_cell_to_guest"),
    Case("NET-05", ("tcp",), "Denied destinations are dropped",
         "connect to each --deny destination from the cell: no answer, and drop_denied moves",
         "the guest connects to it", _net05,
         Loosening("accept cell A to the --deny destinations at the top of the forward chain",
                   rules=lambda ctx: [("forward", 'iifname "%s" ip daddr %s accept' % (a_if(ctx), host))
                                      for host in sorted(set(t.rsplit(":", 1)[0] for t in ctx["opts"]["deny"]))],
                   needs=unless("run without --deny HOST:PORT", lambda ctx: ctx["opts"]["deny"])),
         drop_counter="drop_denied", mode="cidr"),
    # its control, the gateway's ARP entry, is there once cell A's IPv4 connects (tcp) went out
    Case("NET-06", ("tcp6", "tcp"), "IPv6 is unreachable",
         "connect over IPv6 to the guest's global addresses and to 2001:db8::1 (no route leaves the cell)",
         "the cell's IPv4 gateway answers ARP", _net06,
         "the launcher gives cells no IPv6 address or route, and the ruleset drops IPv6 from cells: two layers"),
    Case("NET-07", (), "The cell's resolvers are real ones, not the guest's 127.0.0.53 stub",
         "no 127.0.0.53 in the cell's /etc/resolv.conf",
         "the file names at least one resolver", _net07, "the policy check refuses a loopback resolver in dns_servers",
         mode="cidr"),
]
