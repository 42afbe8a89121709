"""Pure logic of the cell_nat role: validation, uplink discovery, coexistence, rendering."""

import ipaddress
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cellnat_lab
from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci
from ansible_collections.chv.fleet.plugins.module_utils import cell_nat as cn
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import CellNatError

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def slots(n=2):
    return cellnat_lab.make_slots(n)


def plan(**params):
    params.setdefault("slots", slots())
    params.setdefault("uplink", "eth0")
    return cn.plan(params, {"eth0", "ens3", "chvh0", "chvh1"}, None)


# --------------------------------------------------------------- CIDRs, ports

@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.1/24", "300.1.1.1", "", "eth0", None, 5])
def test_invalid_cidr_names_the_variable_and_value(value):
    with pytest.raises(CellNatError) as err:
        plan(egress_deny=[{"cidr": value}])
    assert str(err.value).startswith("cell_nat_egress_deny[0].cidr: %r" % (value,))


def test_ipv6_cidr_rejected_because_cells_have_no_ipv6():
    with pytest.raises(CellNatError, match=r"cell_nat_egress_allow\[1\]\.cidr: '2001:db8::/32' is IPv6"):
        plan(egress_allow=[{"cidr": "192.0.2.0/24"}, {"cidr": "2001:db8::/32"}])


def test_address_without_prefix_is_a_host_route():
    data = plan(egress_deny=["192.0.2.7"])
    assert data["deny_nets"] == ["192.0.2.7/32"]


def test_ports_are_merged_and_validated():
    assert cn.parse_ports([443, "80", "8000-8080", 8080, "8081"], "x") == ((80, 80), (443, 443), (8000, 8081))
    for bad in ([0], ["70000"], ["9-3"], [True], ["http"], []):
        with pytest.raises(CellNatError, match=r"^p: "):
            cn.parse_ports(bad, "p")


def test_entry_shapes_render_as_set_elements():
    data = plan(egress_allow=[
        {"cidr": "192.0.2.0/24"},
        {"cidr": "198.51.100.0/24", "proto": "tcp", "ports": [443, "8000-8080"]},
        {"cidr": "203.0.113.0/24", "ports": [53]},
        {"cidr": "203.0.114.0/24", "proto": "udp"},
    ])
    assert data["allow_mode"] is True
    # the TEST-NETs are special-purpose ranges: these entries are carve-outs
    assert data["carve_nets"] == ["192.0.2.0/24"]
    assert data["carve_ports"] == [
        "198.51.100.0/24 . tcp . 443", "198.51.100.0/24 . tcp . 8000-8080",
        "203.0.113.0/24 . tcp . 53", "203.0.113.0/24 . udp . 53",
    ]
    assert data["allow_nets"] == []
    assert data["allow_ports"] == ["203.0.114.0/24 . udp . 1-65535"]


@pytest.mark.parametrize("entry, message", [
    ({"cidr": "192.0.2.0/24", "port": 443}, r"unknown keys port"),
    ({"proto": "tcp"}, r"'cidr' is required"),
    ({"cidr": "192.0.2.0/24", "proto": "icmp"}, r"\.proto: 'icmp' is not one of"),
    ({"cidr": "192.0.2.0/24", "comment": 'a "quoted" one'}, r"\.comment"),
    (42, r"is not a mapping"),
])
def test_malformed_entries_name_the_variable(entry, message):
    with pytest.raises(CellNatError, match=r"^cell_nat_egress_allow\[0\].*" + message):
        plan(egress_allow=[entry])


# ------------------------------------------------------------ overlaps

def test_overlap_within_one_list_fails_naming_both_entries():
    with pytest.raises(CellNatError) as err:
        plan(egress_allow=[{"cidr": "10.1.0.0/16"}, {"cidr": "192.0.2.0/24"}, {"cidr": "10.1.2.0/24", "proto": "tcp"}])
    assert "cell_nat_egress_allow[2]" in str(err.value) and "cell_nat_egress_allow[0]" in str(err.value)


def test_port_disjoint_entries_do_not_overlap():
    plan(egress_allow=[{"cidr": "192.0.2.0/24", "proto": "tcp", "ports": [443]},
                       {"cidr": "192.0.2.0/24", "proto": "tcp", "ports": [80]},
                       {"cidr": "192.0.2.0/24", "proto": "udp", "ports": [443]}])


@pytest.mark.parametrize("allow, deny", [
    ({"cidr": "192.0.2.0/24"}, {"cidr": "192.0.2.0/24"}),                       # identical
    ({"cidr": "192.0.2.0/25"}, {"cidr": "192.0.2.0/24"}),                       # allow shadowed entirely
    ({"cidr": "192.0.2.0/24", "proto": "tcp"}, {"cidr": "192.0.2.0/24", "ports": [443]}),  # straddles udp
    ({"cidr": "192.0.2.0/24", "proto": "tcp", "ports": ["1-1000"]},
     {"cidr": "192.0.2.0/24", "proto": "tcp", "ports": ["900-2000"]}),          # port ranges straddle
])
def test_ambiguous_allow_deny_overlap_fails_before_any_change(allow, deny):
    with pytest.raises(CellNatError) as err:
        plan(egress_allow=[allow], egress_deny=[deny])
    assert str(err.value).startswith("cell_nat_egress_allow[0]: ")
    assert "cell_nat_egress_deny[0]" in str(err.value)


@pytest.mark.parametrize("allow, deny", [
    ({"cidr": "192.0.2.0/24"}, {"cidr": "192.0.2.9"}),
    ({"cidr": "192.0.2.0/24"}, {"cidr": "192.0.2.0/24", "proto": "udp"}),
    ({"cidr": "192.0.2.0/24", "proto": "tcp"}, {"cidr": "192.0.2.0/24", "proto": "tcp", "ports": [25]}),
    ({"cidr": "192.0.2.0/24"}, {"cidr": "198.51.100.0/24"}),
])
def test_carve_outs_and_disjoint_entries_are_accepted(allow, deny):
    data = plan(egress_allow=[allow], egress_deny=[deny])
    assert data["allow_mode"]


_NETS = [ipaddress.ip_network("10.0.0.%d/%d" % (base, plen), strict=False)
         for plen in (29, 30, 31, 32) for base in range(0, 8)]
_entry = st.builds(
    cn.EgressEntry,
    st.sampled_from(_NETS),
    st.sampled_from([None, ("tcp",), ("udp",), ("tcp", "udp")]),
    st.sampled_from([None, ((1, 2),), ((2, 3),), ((1, 1), (3, 3)), ((1, 3),)]))


def _packets(entry):
    """Brute force over a small universe: ports 1-3 and 4 standing for every port above 3."""
    protos = ("tcp", "udp", "icmp") if entry.protos is None else entry.protos
    return {(addr, proto, port)
            for addr in entry.net for proto in protos
            for port in (range(1, 5) if proto != "icmp" else (0,))
            if entry.protos is None or any(lo <= port <= hi for lo, hi in entry.ports)}


@settings(max_examples=300, deadline=None)
@given(_entry, _entry)
def test_overlap_math_agrees_with_brute_force(a, b):
    pa, pb = _packets(a), _packets(b)
    assert cn.entries_intersect(a, b) == bool(pa & pb)
    assert cn.entry_subset(a, b) == (pa <= pb)


# ---------------------------------------------------------------- slots

@pytest.mark.parametrize("count, index, change, message", [
    (3, 2, {"subnet": "10.200.1.128/25", "gateway": "10.200.1.129"},
     r"^cell_nat_slots\[2\]\.subnet: 10.200.1.128/25 overlaps slot slot1"),
    (2, 1, {"host_ifname": "chvh0"}, r"^cell_nat_slots\[1\]\.host_ifname: 'chvh0' duplicates"),
    (1, 0, {"host_ifname": "a-very-long-name"}, r"^cell_nat_slots\[0\]\.host_ifname"),  # 16 bytes > IFNAMSIZ-1
    (1, 0, {"gateway": "10.201.0.1"}, r"^cell_nat_slots\[0\]\.gateway: 10.201.0.1 is not inside"),
])
def test_slots_are_validated_with_their_position(count, index, change, message):
    bad = slots(count)
    bad[index].update(change)
    with pytest.raises(CellNatError, match=message):
        plan(slots=bad)


def test_a_slot_without_a_subnet_is_refused():
    with pytest.raises(CellNatError, match=r"^cell_nat_slots\[0\]: missing 'subnet'"):
        plan(slots=[{"name": "s", "host_ifname": "chvh0"}])


@pytest.mark.parametrize("field, value", [("name", "slot0\n"), ("host_ifname", "chvh0\n")])
def test_a_trailing_newline_in_a_slot_record_is_refused(field, value):
    # `^...$` with re.match would let it through; the patterns end in \Z
    bad = slots(1)
    bad[0][field] = value
    with pytest.raises(CellNatError, match=r"^cell_nat_slots\[0\]\.%s: %s" % (field, re.escape(repr(value)))):
        plan(slots=bad)


def test_the_ifname_prefix_limit_is_the_allocators():
    # host ifname = prefix + slot index in 15 bytes: 12 leaves room for indexes up to 999
    assert cn.validate_ifname_prefix("a" * ci.IFNAME_PREFIX_MAX, "p") == "a" * 12
    for bad in ("a" * (ci.IFNAME_PREFIX_MAX + 1), "chvh\n", ""):
        with pytest.raises(CellNatError, match=r"^cell_nat_ifname_prefix: %s must be 1-12 characters" % re.escape(repr(bad))):
            plan(ifname_prefix=bad)


def test_slots_from_ledger_follow_index_order():
    ledger = {"version": 1, "pool": "10.200.0.0/16", "prefix": 24, "uid_mode": "private",
              "slots": {"slot1": dict(slots(2)[1]), "slot0": dict(slots(2)[0])}}
    del ledger["slots"]["slot1"]["name"]
    records = cn.slots_from_ledger(json.dumps(ledger), "/var/lib/chv-fleet/identities.json")
    assert [r["name"] for r in records] == ["slot0", "slot1"]
    assert [s["host_ifname"] for s in cn.normalize_slot_records(records, "x")] == ["chvh0", "chvh1"]
    with pytest.raises(CellNatError, match="not valid JSON"):
        cn.slots_from_ledger("{", "ledger")


# --------------------------------------------------------------- uplink

def test_default_route_prefers_the_lowest_metric():
    routes = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "wlan0", "protocol": "dhcp", "metric": 600, "flags": []},
        {"type": "blackhole", "dst": "default", "metric": 1, "flags": []},
        {"dst": "default", "gateway": "198.51.100.1", "dev": "ens3", "protocol": "dhcp", "metric": 100, "flags": []},
        {"dst": "default", "gateway": "203.0.113.1", "dev": "eth9", "metric": 50, "flags": ["linkdown"]},
    ]
    assert cn.default_route_dev(json.dumps(routes)) == "ens3"
    assert cn.default_route_dev("[]") is None
    assert cn.default_route_dev("") is None
    multipath = [{"dst": "default", "protocol": "static", "metric": 10, "flags": [],
                  "nexthops": [{"gateway": "192.0.2.1", "dev": "bond0", "weight": 1, "flags": []}]}]
    assert cn.default_route_dev(multipath) == "bond0"


def test_uplink_discovered_or_overridden_or_refused():
    route = '[{"dst":"default","gateway":"192.0.2.1","dev":"ens3","flags":[]}]'
    data = cn.plan({"slots": slots(), "uplink": ""}, {"ens3", "lo"}, route)
    assert (data["uplink"], data["uplink_source"]) == ("ens3", "default_route")
    data = cn.plan({"slots": slots(), "uplink": "lo"}, {"ens3", "lo"}, route)
    assert (data["uplink"], data["uplink_source"]) == ("lo", "override")
    with pytest.raises(CellNatError, match=r"^cell_nat_uplink: 'eth7' is not an interface on this host \(have: ens3, lo\)"):
        cn.plan({"slots": slots(), "uplink": "eth7"}, {"ens3", "lo"}, route)
    with pytest.raises(CellNatError, match=r"^cell_nat_uplink: not set and this host has no IPv4 default route"):
        cn.plan({"slots": slots()}, {"ens3"}, "[]")
    with pytest.raises(CellNatError, match=r"^cell_nat_uplink: uplink 'chvh1' is one of the slots"):
        cn.plan({"slots": slots(), "uplink": "chvh1"}, {"chvh1"}, None)


def test_other_knobs_are_checked():
    with pytest.raises(CellNatError, match=r"^cell_nat_dns_resolvers\[0\]: '10.0.0.300'"):
        plan(dns_resolvers=["10.0.0.300"])
    with pytest.raises(CellNatError, match=r"^cell_nat_dns_resolvers\[1\]: 192.0.2.53 is listed twice"):
        plan(dns_resolvers=["192.0.2.53", "192.0.2.53"])
    with pytest.raises(CellNatError, match=r"^cell_nat_ratelimit: -1"):
        plan(ratelimit=-1)
    with pytest.raises(CellNatError, match=r"^cell_nat_ratelimit_burst: must be at least 1"):
        plan(ratelimit=5, ratelimit_burst=0)


# ---------------------------------------------------------- coexistence

def test_conflicts_in_a_real_docker_and_firewalld_ruleset():
    """Fixture: `nft -j list ruleset` (nft 1.0.6) with Docker- and firewalld-shaped tables,
    a harmless inet table, ip6 and bridge chains, and table inet chv_cell itself."""
    conflicts = cn.detect_conflicts((FIXTURES / "ruleset_docker_firewalld.json").read_text())
    assert [(c["family"], c["table"], c["chain"], c["hook"], c["policy"]) for c in conflicts] == [
        ("inet", "firewalld", "filter_FORWARD", "forward", "accept"),
        ("ip", "filter", "FORWARD", "forward", "drop"),
    ]
    firewalld, docker = conflicts
    assert firewalld["reasons"] == ["drop/reject rules: filter_FWD_public rule handle 9"]
    assert docker["reasons"][0] == "policy drop"
    assert "DOCKER-ISOLATION-STAGE-2" in docker["reasons"][1]
    message = cn.conflict_message(docker)
    assert message.startswith("table ip filter, chain FORWARD (hook forward, priority 0): policy drop")


def test_no_conflicts_for_an_empty_or_own_ruleset():
    assert cn.detect_conflicts("") == []
    own = json.loads((FIXTURES / "ruleset_docker_firewalld.json").read_text())
    own["nftables"] = [i for i in own["nftables"]
                       if list(i.values())[0].get("table", list(i.values())[0].get("name")) in ("chv_cell", None)
                       or "metainfo" in i]
    assert any("rule" in i for i in own["nftables"])
    assert cn.detect_conflicts(own) == []


def test_table_loaded_finds_only_the_collections_table():
    listed = json.loads((FIXTURES / "ruleset_docker_firewalld.json").read_text())
    assert cn.table_loaded(listed) is True
    listed["nftables"] = [i for i in listed["nftables"]
                          if not ("table" in i and i["table"].get("name") == "chv_cell")]
    assert cn.table_loaded(listed) is False  # the control: same ruleset, the table dropped
    assert cn.table_loaded(json.dumps(listed)) is False
    assert cn.table_loaded("") is False
    assert cn.table_loaded({"nftables": [{"table": {"family": "ip", "name": "chv_cell"}}]}) is False


def test_jump_loops_do_not_hang():
    rs = {"nftables": [
        {"chain": {"family": "ip", "table": "t", "name": "base", "hook": "input", "prio": 0, "policy": "accept"}},
        {"chain": {"family": "ip", "table": "t", "name": "a"}},
        {"rule": {"family": "ip", "table": "t", "chain": "base", "handle": 1, "expr": [{"jump": {"target": "a"}}]}},
        {"rule": {"family": "ip", "table": "t", "chain": "a", "handle": 2, "expr": [{"jump": {"target": "base"}}]}},
    ]}
    assert cn.detect_conflicts(rs) == []


# --------------------------------------------------------------- ruleset

def _rules_text(text):
    """The chain bodies of a rendered ruleset (sets and counters removed)."""
    return re.findall(r"\n\tchain [^\n]*\{\n(.*?)\n\t\}", text, re.S)


def test_rendered_rules_are_identical_for_4_and_256_slots():
    policy = dict(egress_allow=[{"cidr": "198.18.1.0/24"}], egress_deny=[{"cidr": "198.18.1.9"}],
                  dns_via_gateway=True, ratelimit=10, uplink="eth0")
    text4 = cellnat_lab.render(cn.plan(dict(policy, slots=slots(4)), None, None))
    text256 = cellnat_lab.render(cn.plan(dict(policy, slots=slots(256)), None, None))
    assert _rules_text(text4) == _rules_text(text256) and len(_rules_text(text4)) == 14
    # as elements of cell_ifs, slot_src, slot_gateways, slot_accepted, slot_dropped
    assert text256.count('"chvh255"') == 5
    assert len(text256) > len(text4)


def test_rendered_ruleset_only_touches_its_own_table():
    text = cellnat_lab.render(plan())
    statements = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith(("#", "\t", " ", "}"))]
    assert statements == ["table inet chv_cell {}", "delete table inet chv_cell", "table inet chv_cell {"]
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    assert "flush" not in code and "ruleset" not in code
    stop = [l for l in cellnat_lab.STOP_FILE.read_text().splitlines() if l and not l.startswith("#")]
    assert stop == ["table inet chv_cell {}", "delete table inet chv_cell"]


def test_counters_exist_per_verdict_and_per_slot():
    data = plan(slots=slots(3), egress_allow=[{"cidr": "192.0.2.0/24"}], ratelimit=5)
    text = cellnat_lab.render(data)
    for name, _comment in cn.VERDICT_COUNTERS:
        assert "\tcounter %s {" % name in text
        assert 'counter name "%s"' % name in text, name + " is declared but never used"
    for i in range(3):
        assert '"chvh%d" : "slot%d_accepted"' % (i, i) in text and '"chvh%d" : "slot%d_dropped"' % (i, i) in text
