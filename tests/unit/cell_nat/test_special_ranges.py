"""The default deny of the private and special-purpose ranges: the list
(one home, cell_nat.SPECIAL_PURPOSE), the carve-outs, the checks of allow
entries, and where the rules sit in the rendered ruleset."""

import ipaddress
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cellnat_lab
from ansible_collections.chv.fleet.plugins.filter.cell_resolvers import cell_resolvers
from ansible_collections.chv.fleet.plugins.module_utils import cell_nat as cn
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import CellNatError
from testpaths import ROOT

# issue 29's list, written out by hand
EXPECTED = ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
            "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
            "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32"]


def plan(**params):
    params.setdefault("slots", cellnat_lab.make_slots(2))
    params.setdefault("uplink", "eth0")
    return cn.plan(params, {"eth0", "chvh0", "chvh1"}, None)


def test_the_list_is_rfc_6890s_and_the_docs_name_each_range():
    assert [c for c, _comment in cn.SPECIAL_PURPOSE] == EXPECTED
    docs = (Path(ROOT) / "docs" / "network.md").read_text()
    for cidr in EXPECTED:
        assert "`%s`" % cidr in docs, cidr


@given(st.integers(min_value=0, max_value=2 ** 32 - 1))
def test_the_rendered_set_holds_exactly_the_listed_addresses(value):
    addr = ipaddress.IPv4Address(value)
    in_list = any(addr in ipaddress.IPv4Network(c) for c in EXPECTED)
    in_set = any(addr in ipaddress.IPv4Network(n) for n in cn.special_purpose_nets())
    assert in_list == in_set


def test_defaults_deny_the_ranges_to_cells_and_doors_after_dns_and_carve_outs():
    data = plan()
    assert data["allow_mode"] is False and data["carve_nets"] == [] and data["carve_ports"] == []
    text = cellnat_lab.render(data)
    assert "elements = { %s }" % ", ".join(cn.special_purpose_nets()) in text
    for chain in ("from_cell", "door_out"):
        body = re.search(r"chain %s \{\n(.*?)\n\t\}" % chain, text, re.S).group(1)
        order = ["drop_link_local", "drop_denied", "accept_dns", "accept_carve_out", "drop_special_range"]
        positions = [body.index('"%s"' % name) for name in order]
        assert positions == sorted(positions), (chain, body)
        assert body.rstrip().endswith("goto %s" % ("cell_admit" if chain == "from_cell" else "door_admit"))


def test_an_allow_entry_inside_a_range_is_a_carve_out():
    data = plan(egress_allow=[{"cidr": "0.0.0.0/0"}, {"cidr": "10.99.1.0/24"},
                              {"cidr": "192.168.7.7", "proto": "tcp", "ports": [3128]}])
    assert data["carve_nets"] == ["10.99.1.0/24"]
    assert data["carve_ports"] == ["192.168.7.7/32 . tcp . 3128"]
    assert data["allow_nets"] == ["0.0.0.0/0"]
    assert plan(egress_allow=[{"cidr": "8.8.8.0/24"}])["allow_nets"] == ["8.8.8.0/24"]   # public: as before
    text = cellnat_lab.render(data)
    assert "set carve_nets {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = { 10.99.1.0/24 }" in text
    assert data["allow_mode"] is True


def test_a_carve_out_alone_keeps_allow_list_mode():
    """An allow list that names only a private proxy stays an allow list (no config gets wider)."""
    data = plan(egress_allow=[{"cidr": "10.0.0.5", "proto": "tcp", "ports": [3128]}])
    assert data["allow_mode"] is True and data["allow_nets"] == [] and data["allow_ports"] == []
    assert 'counter name "drop_not_allowed"' in cellnat_lab.render(data)


def test_carve_outs_may_not_overlap_each_other_nor_general_entries_each_other():
    with pytest.raises(CellNatError, match=r"^cell_nat_egress_allow\[1\]: 10.1.2.0/24 overlaps cell_nat_egress_allow\[0\]"):
        plan(egress_allow=[{"cidr": "10.1.0.0/16"}, {"cidr": "10.1.2.0/24"}])
    with pytest.raises(CellNatError, match=r"^cell_nat_egress_allow\[1\]: 8.8.8.8/32 overlaps cell_nat_egress_allow\[0\]"):
        plan(egress_allow=[{"cidr": "0.0.0.0/0"}, {"cidr": "8.8.8.8"}])


def test_the_operators_deny_still_beats_allows():
    data = plan(egress_allow=[{"cidr": "10.1.2.0/24"}], egress_deny=[{"cidr": "10.1.2.9"}])   # a strict subset
    assert data["deny_nets"] == ["10.1.2.9/32"] and data["carve_nets"] == ["10.1.2.0/24"]
    with pytest.raises(CellNatError, match=r"^cell_nat_egress_allow\[0\]: 10.1.2.0/24 overlaps cell_nat_egress_deny\[0\]"):
        plan(egress_allow=[{"cidr": "10.1.2.0/24"}], egress_deny=[{"cidr": "10.0.0.0/8"}])


@pytest.mark.parametrize("entry, message", [
    ({"cidr": "169.254.169.254"}, r"^cell_nat_egress_allow\[0\]\.cidr: 169.254.169.254/32 is link-local"),
    ("169.254.0.0/16", r"^cell_nat_egress_allow\[0\]: 169.254.0.0/16 is link-local"),
    ({"cidr": "224.0.0.0/3"}, r"^cell_nat_egress_allow\[0\]\.cidr: 224.0.0.0/3 holds only special-purpose "
                              r"addresses \(224.0.0.0/4, 240.0.0.0/4, 255.255.255.255/32\)"),
    ({"cidr": "10.0.0.0/8:443"}, r"^cell_nat_egress_allow\[0\]\.cidr: '10.0.0.0/8:443' is neither"),
    ({"cidr": "10.99.1.0/23"}, r"^cell_nat_egress_allow\[0\]\.cidr: '10.99.1.0/23' is not a valid IPv4 CIDR"),
    ({"cidr": "10.99.1.0/24", "ports": ["x"]}, r"^cell_nat_egress_allow\[0\]\.ports: 'x' is not a port"),
])
def test_allow_entries_that_open_nothing_or_are_malformed_name_the_variable(entry, message):
    with pytest.raises(CellNatError, match=message):
        plan(egress_allow=[entry])


def test_an_entry_partly_special_is_an_ordinary_allow_entry():
    """10.0.0.0/7 is 10/8 (denied) and 11/8 (public): accepted; only 11/8 is opened (its 10/8 part is dropped
    by the default deny before the allow list)."""
    data = plan(egress_allow=[{"cidr": "10.0.0.0/7"}])
    assert data["allow_nets"] == ["10.0.0.0/7"] and data["carve_nets"] == []


def test_the_pf_anchor_follows_the_same_default():
    from ansible_collections.chv.fleet.plugins.module_utils.pf_anchor import anchor_rules
    rules = anchor_rules([524288], allow=[{"cidr": "10.99.1.0/24"}], dns_resolvers=["10.0.2.3"])
    users = "user { 524288 }"
    carve = "pass out quick inet proto { tcp udp } to 10.99.1.0/24 %s keep state" % users
    dns = "pass out quick inet proto { tcp udp } to 10.0.2.3 port 53 %s keep state" % users
    blocks = ["block drop out quick inet proto { tcp udp } to %s %s" % (n, users) for n in cn.special_purpose_nets()]
    assert rules.index(dns) < rules.index(carve) < rules.index(blocks[0])
    assert rules[rules.index(blocks[0]):rules.index(blocks[-1]) + 1] == blocks


@pytest.mark.parametrize("resolv, resolved, expected", [
    ("nameserver 192.168.1.1\nnameserver 10.0.0.1\n", "", ["192.168.1.1", "10.0.0.1"]),
    ("nameserver 127.0.0.53\n", "nameserver 10.0.2.3\nnameserver fd00::3\n", ["10.0.2.3"]),
    ("nameserver 127.0.0.53\n", "", []),
    ("", "", []),
])
def test_the_resolvers_cells_get_are_the_launchers(resolv, resolved, expected):
    assert cell_resolvers(resolv, resolved) == expected
