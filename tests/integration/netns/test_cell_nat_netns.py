"""The cell_nat ruleset, rendered from the role's template, loaded into real network namespaces.

Every negative check runs beside a positive control from the same cell,
and the baseline test shows each path open when only masquerade (and no
chv_cell table) is loaded: the boundaries are what closes them.
"""

import json
import os
import shutil

import pytest

import cellnat_lab
from cellnat_lab import lab, make_slots, rule_count, run, table_json  # noqa: F401  # pylint: disable=unused-import

from ansible_collections.chv.fleet.plugins.module_utils import cell_nat

_SKIP = cellnat_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

OUT = "198.20.0.1"          # outside, on the uplink network
GUEST_UPLINK = "198.20.0.2"
NAT_ONLY = """
table inet cnt_natonly {
    chain post {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "%s" ip saddr 10.200.0.0/16 masquerade
    }
}
"""


@pytest.fixture
def policy(lab):
    """Load the default policy before a test; drop foreign test tables afterwards."""
    lab.apply()
    yield lab
    for table in ("inet cnt_natonly", "ip cnt_foreign", "inet cnt_other"):
        run("nft", "delete", "table", *table.split(), ns=lab.guest, check=False)


def delta(before, after, *names):
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}


def test_baseline_nat_only_leaves_every_path_open(lab):
    """Counter-proof: without table inet chv_cell every boundary below is open."""
    lab.remove_table()
    a = lab.cell_a
    assert lab.probe(a, OUT, 8080) is None, "outside must not route back to cells without masquerade"
    lab.load_text(NAT_ONLY % lab.uplink)
    try:
        assert lab.probe(a, OUT, 8080) == GUEST_UPLINK
        assert lab.probe(a, "10.200.1.2", 7000) == "10.200.0.2"           # the other cell
        assert lab.probe(a, "10.200.0.1", 2222) == "10.200.0.2"           # the guest's TCP service
        assert lab.probe(a, GUEST_UPLINK, 2222) == "10.200.0.2"
        assert lab.probe(a, "169.254.169.254", 8080) == GUEST_UPLINK      # metadata address
        assert lab.probe(a, "198.20.2.1", 8080) == GUEST_UPLINK           # the CIDR denied later
        assert lab.probe(a, "fd00:cafe:1::2", 7000) == "fd00:cafe::2"     # IPv6 to the other cell
        assert lab.probe(a, "10.200.0.1", 53, proto="udp") == "10.200.0.2"
    finally:
        run("nft", "delete", "table", "inet", "cnt_natonly", ns=lab.guest)


def test_cell_reaches_outside_through_masquerade(policy):
    lab = policy
    before = lab.counters()
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_b, OUT, 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, OUT, 8053, proto="udp") == GUEST_UPLINK
    d = delta(before, lab.counters(), "nat_masquerade", "accept_egress", "accept_reply",
              "slot0_accepted", "slot1_accepted")
    print("counter deltas after 3 egress connections:", d)
    assert d["nat_masquerade"] == 3
    assert d["slot0_accepted"] >= 2 and d["slot1_accepted"] >= 1
    assert d["accept_egress"] >= 3 and d["accept_reply"] >= 3


def test_cell_cannot_reach_other_cell(policy):
    lab = policy
    before = lab.counters()
    assert lab.probe(lab.cell_a, "10.200.1.2", 7000) is None
    assert lab.probe(lab.cell_b, OUT, 8080) == GUEST_UPLINK        # positive control (the target cell)
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK        # positive control (same cell)
    d = delta(before, lab.counters(), "drop_cell_to_cell", "slot0_dropped")
    assert d["drop_cell_to_cell"] >= 1 and d["slot0_dropped"] >= 1


def test_cell_cannot_reach_guest_services(policy):
    lab = policy
    before = lab.counters()
    for addr in ("10.200.0.1", GUEST_UPLINK, "10.200.1.1"):
        assert lab.probe(lab.cell_a, addr, 2222) is None, addr
    assert lab.probe(lab.outside, GUEST_UPLINK, 2222) == OUT        # the service is up
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK         # same cell, egress works
    assert delta(before, lab.counters(), "drop_cell_to_guest")["drop_cell_to_guest"] >= 3


def test_link_local_and_denied_cidr_dropped(lab):
    lab.apply(egress_deny=[{"cidr": "198.20.2.0/24"}])
    before = lab.counters()
    assert lab.probe(lab.cell_a, "169.254.169.254", 8080) is None
    assert lab.probe(lab.cell_a, "198.20.2.1", 8080) is None
    assert lab.probe(lab.guest, "169.254.169.254", 8080) == GUEST_UPLINK   # routed and listening
    assert lab.probe(lab.guest, "198.20.2.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "198.20.1.1", 8080) == GUEST_UPLINK       # same cell, other dest
    d = delta(before, lab.counters(), "drop_link_local", "drop_denied")
    assert d["drop_link_local"] >= 1 and d["drop_denied"] >= 1
    # Loosening only the deny list reopens the denied CIDR (the link-local drop stays).
    lab.apply()
    assert lab.probe(lab.cell_a, "198.20.2.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "169.254.169.254", 8080) is None


def test_allow_list_mode_admits_only_listed_destinations(lab):
    lab.apply(egress_allow=[{"cidr": "198.20.1.0/24"}, {"cidr": "198.20.3.1", "proto": "tcp", "ports": [8080]}],
              egress_deny=[{"cidr": "198.20.1.200/32", "comment": "carve-out"}])
    before = lab.counters()
    assert lab.probe(lab.cell_a, "198.20.1.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "198.20.3.1", 8080) == GUEST_UPLINK
    assert lab.probe(lab.cell_a, "198.20.3.1", 8081) is None           # port not listed
    assert lab.probe(lab.cell_a, OUT, 8080) is None                    # address not listed
    assert lab.probe(lab.cell_a, "198.20.1.200", 8080) is None         # deny wins inside an allowed range
    d = delta(before, lab.counters(), "drop_not_allowed", "drop_denied")
    assert d["drop_not_allowed"] >= 2 and d["drop_denied"] >= 1
    lab.apply()                                                        # back to no allow list
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK


def test_dns_only_to_own_gateway_when_enabled(lab):
    lab.apply()
    assert lab.probe(lab.cell_a, "10.200.0.1", 53, proto="udp") is None
    lab.apply(dns_via_gateway=True)
    before = lab.counters()
    assert lab.probe(lab.cell_a, "10.200.0.1", 53, proto="udp") == "10.200.0.2"
    assert lab.probe(lab.cell_a, "10.200.1.1", 53, proto="udp") is None     # another slot's gateway
    assert lab.probe(lab.cell_a, "10.200.0.1", 2222) is None                # other guest ports stay closed
    assert delta(before, lab.counters(), "accept_dns")["accept_dns"] >= 1
    lab.apply(dns_resolvers=[GUEST_UPLINK])
    assert lab.probe(lab.cell_b, GUEST_UPLINK, 53, proto="udp") == "10.200.1.2"
    assert lab.probe(lab.cell_b, "10.200.1.1", 53, proto="udp") is None


def test_no_ipv6_path_and_no_spoofing(policy):
    lab = policy
    before = lab.counters()
    assert lab.probe(lab.cell_a, "fd00:cafe:1::2", 7000) is None       # v6 to the other cell
    assert lab.probe(lab.cell_a, "fd00:cafe:0::1", 2222) is None       # v6 to the guest
    run("ip", "addr", "add", "10.200.1.77/32", "dev", "eth0", ns=lab.cell_a)
    try:
        assert lab.probe(lab.cell_a, OUT, 8080, source="10.200.1.77") is None
    finally:
        run("ip", "addr", "del", "10.200.1.77/32", "dev", "eth0", ns=lab.cell_a)
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK
    d = delta(before, lab.counters(), "drop_ipv6", "drop_spoofed")
    assert d["drop_ipv6"] >= 2 and d["drop_spoofed"] >= 1


def test_per_destination_rate_limit(lab):
    lab.apply(ratelimit=1, ratelimit_burst=2)
    results = [lab.probe(lab.cell_a, "198.20.3.1", 8080) for _attempt in range(6)]
    admitted = sum(1 for r in results if r)
    print("rate limit 1/s burst 2: %d of 6 back-to-back connections admitted" % admitted)
    assert 1 <= admitted <= 5
    assert lab.counters()["drop_ratelimit"] >= 1
    assert lab.probe(lab.cell_a, "198.20.1.1", 8080) == GUEST_UPLINK    # other destination unaffected
    lab.apply()
    assert all(lab.probe(lab.cell_a, "198.20.3.1", 8080) for _attempt in range(6))


def test_rule_count_does_not_grow_with_slots(lab):
    ns = lab.namespaces[0] + "s"
    run("ip", "netns", "add", ns)
    lab.namespaces.append(ns)
    counts, elements = {}, {}
    policy = dict(egress_allow=[{"cidr": "198.20.1.0/24"}], egress_deny=[{"cidr": "198.20.1.9"}],
                  dns_via_gateway=True, ratelimit=50, uplink="upA")
    for n in (4, 256):
        data = cell_nat.plan(dict(policy, slots=make_slots(n)), None, None)
        lab.load_text(cellnat_lab.render(data), ns=ns)
        counts[n] = rule_count(ns)
        items = table_json(ns)
        elements[n] = next(len(i["set"].get("elem", [])) for i in items if i.get("set", {}).get("name") == "cell_ifs")
    print("rules with 4 slots: %d, rules with 256 slots: %d (cell_ifs elements %d / %d)"
          % (counts[4], counts[256], elements[4], elements[256]))
    assert elements == {4: 4, 256: 256}
    assert counts[4] == counts[256]


def test_foreign_drop_chain_is_detected(policy):
    lab = policy
    ruleset = run("nft", "-j", "list", "ruleset", ns=lab.guest).stdout
    assert cell_nat.detect_conflicts(ruleset) == []                    # our own drop rules are not reported
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK
    lab.nft("add table ip cnt_foreign; add chain ip cnt_foreign FORWARD "
            "{ type filter hook forward priority 10; policy drop; }")
    conflicts = cell_nat.detect_conflicts(run("nft", "-j", "list", "ruleset", ns=lab.guest).stdout)
    print("detected:", [cell_nat.conflict_message(c) for c in conflicts])
    assert [(c["family"], c["table"], c["chain"], c["policy"]) for c in conflicts] == \
        [("ip", "cnt_foreign", "FORWARD", "drop")]
    # The report is not hypothetical: that chain really drops what chv_cell accepts.
    assert lab.probe(lab.cell_a, OUT, 8080) is None
    run("nft", "delete", "table", "ip", "cnt_foreign", ns=lab.guest)
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK


def test_only_own_table_is_replaced_and_removed(policy):
    lab = policy
    lab.nft("add table inet cnt_other; add set inet cnt_other keep { type ipv4_addr; elements = { 192.0.2.1 }; }")
    lab.apply()                                                        # re-apply: atomic replace
    lab.apply()
    assert any(i.get("set", {}).get("name") == "keep" for i in table_json(lab.guest, "inet", "cnt_other"))
    lab.remove_table()
    lab.remove_table()                                                 # stop file works when absent
    tables = run("nft", "list", "tables", ns=lab.guest).stdout
    assert "chv_cell" not in tables and "cnt_other" in tables
    lab.apply()


def test_uplink_rename_leaves_no_stale_rule(lab):
    g = lab.guest
    data = lab.apply()
    assert data["uplink"] == "upA" and data["uplink_source"] == "default_route"
    run("ip", "link", "set", "upA", "down", ns=g)
    run("ip", "link", "set", "upA", "name", "upB", ns=g)
    run("ip", "link", "set", "upB", "up", ns=g)
    run("ip", "route", "replace", "default", "via", OUT, ns=g)
    lab.uplink = "upB"
    # The stale ruleset masquerades out of upA only: the cell is cut off.
    assert lab.probe(lab.cell_a, OUT, 8080) is None
    data = lab.apply()
    assert data["uplink"] == "upB"
    text = json.dumps(table_json(g))
    assert "upA" not in text and '"upB"' in text
    assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK
    with pytest.raises(cell_nat.CellNatError, match="cell_nat_uplink: 'upA' is not an interface"):
        lab.plan(uplink="upA")


def door_probe(lab, uid, host, port, proto="tcp"):
    """Probe from the guest itself as socket owner ``uid`` (a door acts from the guest, not from a cell)."""
    argv = ["setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups", "/usr/bin/python3",
            cellnat_lab.PROBE, "probe", proto, host, port, cellnat_lab.TIMEOUT]
    proc = run(*argv, ns=lab.guest, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_doors_get_the_cells_egress_policy(lab):
    """A socket owned by a slot's UID range on the guest (sync's git, or chv-browser through its drop-in)
    reaches what a cell may and nothing of the guest or the cells; the same probes as root are the control."""
    lab.apply(egress_deny=[{"cidr": "198.20.2.1/32"}])
    door, other = make_slots(2)[1]["uid_base"] + 17, 65534   # inside slot1's range; nobody is no door
    refused = [("127.0.0.1", 2222), (GUEST_UPLINK, 2222), ("10.200.0.1", 2222), ("10.200.1.2", 7000),
               ("169.254.169.254", 8080), ("198.20.2.1", 8080)]
    before = lab.counters()
    assert door_probe(lab, door, OUT, 8080) == GUEST_UPLINK                       # control: allowed egress
    for host, port in refused:
        assert door_probe(lab, door, host, port) is None, (host, port)
        assert door_probe(lab, 0, host, port) is not None, (host, port)          # root is no door
        assert door_probe(lab, other, host, port) is not None, (host, port)      # nor is nobody
    got = delta(before, lab.counters(), "accept_door", "drop_door_to_guest", "drop_door_to_cell",
                "drop_link_local", "drop_denied")
    assert got["accept_door"] > 0 and got["drop_door_to_guest"] >= 3 and got["drop_door_to_cell"] >= 1
    assert got["drop_link_local"] >= 1 and got["drop_denied"] >= 1
    # the drop-in directory adds a UID: nobody becomes a door too
    dropin = lab.plan()
    dropin["door_dir"] = "/tmp/cnt-%d-door.d" % os.getpid()
    os.makedirs(dropin["door_dir"], exist_ok=True)
    try:
        with open(dropin["door_dir"] + "/x.nft", "w") as fh:
            fh.write("add element inet chv_cell door_uids { %d }\n" % other)
        lab.load_text(cellnat_lab.render(dropin))
        assert door_probe(lab, other, "127.0.0.1", 2222) is None
        assert door_probe(lab, other, OUT, 8080) == GUEST_UPLINK
    finally:
        shutil.rmtree(dropin["door_dir"])
        lab.apply()


def test_a_released_slot_interface_is_cut_off(lab):
    """A cell whose slot is no longer in the ruleset (released while it ran) reaches nothing."""
    lab.apply()
    b = lab.cell_b
    assert lab.probe(b, OUT, 8080) == GUEST_UPLINK                                # control: slot1 is current
    lab.apply(slots=lab.slots[:1])
    try:
        before = lab.counters()
        assert lab.probe(b, OUT, 8080) is None
        assert lab.probe(b, GUEST_UPLINK, 2222) is None
        assert lab.probe(lab.cell_a, OUT, 8080) == GUEST_UPLINK                   # slot0 is unaffected
        assert delta(before, lab.counters(), "drop_stale_cell")["drop_stale_cell"] > 0
    finally:
        lab.apply()
