"""The default deny of the private and special-purpose ranges
(cell_nat.SPECIAL_PURPOSE), in the role's ruleset loaded into real network
namespaces (cellnat_lab): stand-ins of those ranges live on the outside
namespace's loopback, beside the public control (198.20.0.1, public address
space that exists only inside these namespaces; no packet leaves them).

Every refused probe runs beside its controls in the same run: the same
cell (or door) reaches the public control, and the guest's root reaches the
refused stand-in (routed, listening: only the ruleset refuses it)."""

import pytest

import cellnat_lab
from cellnat_lab import lab, make_slots, run  # noqa: F401  # pylint: disable=unused-import

from ansible_collections.chv.fleet.plugins.filter.cell_resolvers import cell_resolvers

_SKIP = cellnat_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

OUT = "198.20.0.1"              # the public control
GUEST_UPLINK = "198.20.0.2"     # what the outside sees (masquerade)
RESOLVER = "10.77.0.53"         # the guest's resolver, on a private address (as from DHCP)
# one stand-in per kind of range, on the outside namespace's loopback
STAND_INS = ("10.77.1.1", "10.77.1.200", "10.77.2.1", "172.16.77.1", "192.168.77.1", "100.64.77.1",
             "198.18.1.1", "192.0.2.1", "198.51.100.1", "203.0.113.1", RESOLVER)
DOOR = make_slots(2)[1]["uid_base"] + 17   # a sync worker's uid (inside slot1's range)
PUBLIC = {"cidr": "0.0.0.0/0", "comment": "every public address, as before"}


@pytest.fixture(scope="module")
def ranges(lab):
    for addr in STAND_INS:
        run("ip", "addr", "add", addr + "/32", "dev", "lo", ns=lab.outside)
    # UDP answers come from the address asked (a wildcard socket would answer from wan0's)
    lab.serve(lab.outside, "tcp:0.0.0.0:53", "udp:%s:53" % RESOLVER, "udp:10.77.1.1:53")
    yield lab
    lab.apply()


def door_probe(lab, uid, host, port, proto="tcp"):
    """Probe from the guest itself as socket owner ``uid`` (a door acts from the guest)."""
    argv = ["setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups", "/usr/bin/python3",
            cellnat_lab.PROBE, "probe", proto, host, port, cellnat_lab.TIMEOUT]
    proc = run(*argv, ns=lab.guest, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def delta(before, after, *names):
    return dict((n, after.get(n, 0) - before.get(n, 0)) for n in names)


def test_defaults_deny_every_special_range_to_cells_and_doors(ranges):
    lab = ranges
    lab.apply()                                                   # the role's defaults: empty lists
    before = lab.counters()
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK       # control: the same cell reaches public space
    assert door_probe(lab, DOOR, OUT, 8080) == GUEST_UPLINK       # control: the same door too
    for addr in STAND_INS:
        assert lab.probe(lab.guest, addr, 8080) == GUEST_UPLINK, addr   # control: routed and listening
        assert lab.probe(lab.cell_a, addr, 8080) is None, addr
        assert door_probe(lab, DOOR, addr, 8080) is None, addr
    d = delta(before, lab.counters(), "drop_special_range", "slot0_dropped", "accept_door")
    print("defaults: %d stand-ins refused to a cell and a door, counter deltas %s" % (len(STAND_INS), d))
    assert d["drop_special_range"] >= 2 * len(STAND_INS)
    assert d["slot0_dropped"] >= len(STAND_INS) and d["accept_door"] >= 1


def test_a_carve_out_opens_one_private_24_and_nothing_else(ranges):
    """An allow entry inside 10.0.0.0/8 opens that /24 to cells and doors; the rest of 10/8 and the other
    ranges stay denied; 0.0.0.0/0 beside it keeps every public address open."""
    lab = ranges
    lab.apply(egress_allow=[PUBLIC, {"cidr": "10.77.1.0/24", "comment": "the build cache"}])
    before = lab.counters()
    for probe in (lambda host: lab.probe(lab.cell_a, host, 8080), lambda host: door_probe(lab, DOOR, host, 8080)):
        assert probe("10.77.1.1") == GUEST_UPLINK                 # the carve-out
        assert probe(OUT) == GUEST_UPLINK                         # public space, through 0.0.0.0/0
        for addr in ("10.77.2.1", "172.16.77.1", "192.168.77.1", "192.0.2.1"):
            assert probe(addr) is None, addr                      # the rest stays denied
    d = delta(before, lab.counters(), "accept_carve_out", "drop_special_range", "drop_not_allowed")
    print("carve-out 10.77.1.0/24 with 0.0.0.0/0: counter deltas %s" % d)
    assert d["accept_carve_out"] >= 2 and d["drop_special_range"] >= 8 and d["drop_not_allowed"] == 0


def test_a_carve_out_alone_is_an_allow_list(ranges):
    """An allow list, as before, admits only what it lists: a carve-out alone does not open public space."""
    lab = ranges
    lab.apply(egress_allow=[{"cidr": "10.77.1.1", "proto": "tcp", "ports": [8080]}])
    before = lab.counters()
    assert lab.probe(lab.cell_a, "10.77.1.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "10.77.1.1", 8081) is None       # a port the entry does not name
    assert lab.probe(lab.cell_a, "10.77.2.1", 8080) is None
    assert lab.probe(lab.cell_a, OUT, 8080) is None               # not listed
    d = delta(before, lab.counters(), "accept_carve_out", "drop_special_range", "drop_not_allowed")
    assert d["accept_carve_out"] >= 1 and d["drop_special_range"] >= 2 and d["drop_not_allowed"] >= 1


def test_the_operators_deny_beats_a_carve_out(ranges):
    lab = ranges
    lab.apply(egress_allow=[PUBLIC, {"cidr": "10.77.1.0/24"}], egress_deny=[{"cidr": "10.77.1.200"}])
    before = lab.counters()
    assert lab.probe(lab.cell_a, "10.77.1.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "10.77.1.200", 8080) is None
    assert door_probe(lab, DOOR, "10.77.1.200", 8080) is None
    assert lab.probe(lab.guest, "10.77.1.200", 8080) == GUEST_UPLINK
    assert delta(before, lab.counters(), "drop_denied")["drop_denied"] >= 2


def test_a_private_resolver_answers_dns_only(ranges):
    """The guest's resolver on a private address, as chv-cell picks it from resolv.conf
    (chv.fleet.cell_resolvers, the launcher's rule): tcp/udp 53 to it is accepted, any other port of it
    and the rest of its range stay denied. Without it in the set, DNS is refused (the control)."""
    lab = ranges
    lab.apply()
    assert lab.probe(lab.cell_a, RESOLVER, 53, proto="udp") is None       # not a resolver: denied
    assert lab.probe(lab.guest, RESOLVER, 53, proto="udp") == GUEST_UPLINK
    resolvers = cell_resolvers("# from DHCP\nnameserver %s\nsearch lab\n" % RESOLVER, "")
    assert resolvers == [RESOLVER]
    lab.apply(dns_resolvers=resolvers)
    before = lab.counters()
    for probe in (lambda host, port, proto: lab.probe(lab.cell_a, host, port, proto=proto),
                  lambda host, port, proto: door_probe(lab, DOOR, host, port, proto=proto)):
        assert probe(RESOLVER, 53, "udp") == GUEST_UPLINK
        assert probe(RESOLVER, 53, "tcp") == GUEST_UPLINK
        assert probe(RESOLVER, 8080, "tcp") is None                       # the resolver's other ports
        assert probe("10.77.1.1", 53, "udp") is None                      # another host's port 53
    assert lab.probe(lab.guest, "10.77.1.1", 53, proto="udp") == GUEST_UPLINK  # which answers the guest
    d = delta(before, lab.counters(), "accept_dns", "drop_special_range")
    print("private resolver %s: counter deltas %s" % (RESOLVER, d))
    assert d["accept_dns"] >= 4 and d["drop_special_range"] >= 4
