"""Egress by name (issue 33), the controller's side: the mode, the names
(exact and wildcard) and their checks, the layers, slot groups, and what
squid's configuration and the ruleset get from them
(plugins/module_utils/egress_names.py)."""

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cellnat_lab
from egress_render import render_proxy
from ansible_collections.chv.fleet.plugins.module_utils import cell_nat as cn
from ansible_collections.chv.fleet.plugins.module_utils import egress_names as en
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import CellNatError

SLOTS = cellnat_lab.make_slots(3)
RESOLVER = "198.20.0.53"


def plan(**params):
    params.setdefault("slots", SLOTS)
    params.setdefault("uplink", "eth0")
    params.setdefault("dns_resolvers", [RESOLVER])
    return en.plan(params, {"eth0", "chvh0", "chvh1", "chvh2"}, None)


def error_of(**params):
    with pytest.raises(CellNatError) as err:
        plan(**params)
    return str(err.value)


# ------------------------------------------------------------------ names

@pytest.mark.parametrize("value,name,wildcard", [
    ("api.example.com", "api.example.com", False),
    ("API.Example.COM.", "api.example.com", False),
    ("*.example.com", "*.example.com", True),
    (" *.pypi.org ", "*.pypi.org", True),
    ("xn--bcher-kva.example", "xn--bcher-kva.example", False),
    ("a-b.c-d.io", "a-b.c-d.io", False),
])
def test_a_name_is_accepted_and_normalised(value, name, wildcard):
    assert en.parse_name(value, "v") == (name, wildcard)


@pytest.mark.parametrize("value,reason", [
    ("203.0.113.5", "is an IP address, not a name"),
    ("127.1", "is an IP address, not a name"),
    ("0x7f.0.0.1", "is an IP address, not a name"),
    ("2130706433", "is an IP address, not a name"),
    ("::1", "is an IP address, not a name"),
    ("[2001:db8::1]", "is an IP address, not a name"),
    ("https://pypi.org/simple", "not a host name (a URL or host:port?"),
    ("pypi.org:443", "not a host name (a URL or host:port?"),
    ("localhost", "has one label"),
    ("*.com", "has one label"),
    ("api.*.example.com", "a wildcard is only allowed as the whole first label"),
    ("*example.com", "a wildcard is only allowed as the whole first label"),
    ("bücher.example", "not a host name"),
    ("a..example.com", "not a host name"),
    ("-a.example.com", "not a host name"),
    ("under_score.example.com", "not a host name"),
    ("host.123", "ends in a numeric label"),
    ("", "is not a host name"),
])
def test_a_bad_name_is_refused_naming_the_variable_and_the_value(value, reason):
    msg = error_of(egress_mode="proxy", egress_names={"_host": ["ok.example.com", {"name": value, "port": 80}]})
    assert msg.startswith("cell_nat_egress_names_host[1].name: %r " % value), msg
    assert reason in msg


@given(st.integers(min_value=0, max_value=2 ** 32 - 1), st.sampled_from(["dotted", "int", "hex", "short"]))
def test_no_form_of_an_ipv4_address_passes_as_a_name(value, form):
    addr = ipaddress.IPv4Address(value)
    text = {"dotted": str(addr), "int": str(value), "hex": "0x%x" % value,
            "short": "%d.%d" % (value >> 24, value & 0xFFFFFF)}[form]
    with pytest.raises(CellNatError) as err:
        en.parse_name(text, "cell_nat_egress_names")
    assert "is an IP address" in str(err.value)


LABEL = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?\Z", fullmatch=True)


@given(st.lists(LABEL, min_size=1, max_size=4), st.from_regex(r"\A[a-z][a-z0-9]{1,5}\Z", fullmatch=True),
       st.booleans())
def test_every_well_formed_name_is_accepted_as_written(labels, tld, wildcard):
    name = ".".join(labels + [tld])
    text = ("*." if wildcard else "") + name
    assert en.parse_name(text.upper(), "v") == (text, wildcard)


@given(st.lists(LABEL, min_size=1, max_size=3), st.lists(LABEL, min_size=0, max_size=2), LABEL)
def test_a_wildcard_matches_names_under_it_and_never_the_name_itself_or_a_lookalike(base, sub, other):
    base_name = ".".join(base + ["example"])
    entry = en.NameEntry("*." + base_name, True, 443, None, "", "")
    regex = re.compile(en._regex_of(entry))  # pylint: disable=protected-access
    assert regex.match(".".join(sub + [other, base_name]))            # under it, at any depth
    assert not regex.match(base_name)                                 # not the name itself
    assert not regex.match(other + base_name)                         # not evilexample.com
    assert not regex.match(base_name + "." + other)                   # not example.com.evil


# ----------------------------------------------------------------- layers

def test_the_layers_join_lowest_first_and_keep_an_entry_once():
    data, proxy = plan(egress_mode="proxy", egress_names={
        "_default": ["pypi.org", {"name": "*.pythonhosted.org"}],
        "": [{"name": "github.com", "port": 22}],
        "_group": ["pypi.org", {"name": "pypi.org", "port": 80}],
        "_host": [{"name": "GITHUB.com.", "port": "22"}]})
    assert [(n["name"], n["label"]) for n in proxy["names"]] == [
        ("pypi.org", "cell_nat_egress_names_default[0]"),
        ("*.pythonhosted.org", "cell_nat_egress_names_default[1]"),
        ("github.com", "cell_nat_egress_names[0]"),
        ("pypi.org", "cell_nat_egress_names_group[1]")]
    assert proxy["ports"] == [22, 80, 443]
    assert data["egress_mode"] == "proxy" and data["proxy_port"] == 3128


@pytest.mark.parametrize("layer,entries,msg", [
    ("_default", "pypi.org", "cell_nat_egress_names_default: must be a list"),
    ("", [{"name": "pypi.org", "ports": [443]}], "cell_nat_egress_names[0]: unknown keys ports"),
    ("_group", [{"port": 443}], "cell_nat_egress_names_group[0]: 'name' is required"),
    ("_host", [{"name": "pypi.org", "port": 0}], "cell_nat_egress_names_host[0].port: 0 is not a port"),
    ("_host", [{"name": "pypi.org", "port": True}], "cell_nat_egress_names_host[0].port: True is not a port"),
    ("_host", [{"name": "pypi.org", "slot_group": "nope"}],
     "cell_nat_egress_names_host[0].slot_group: 'nope' is not a group of cell_nat_slot_groups (has: none)"),
    ("_host", [{"name": "pypi.org", "comment": 'a "quote"'}], "cell_nat_egress_names_host[0].comment"),
    ("_host", [42], "cell_nat_egress_names_host[0]: 42 is not a name or a mapping"),
])
def test_errors_name_the_layer_the_entry_and_the_value(layer, entries, msg):
    assert error_of(egress_names={layer: entries}).startswith(msg)


def test_names_are_checked_in_cidr_mode_too_and_change_nothing_there():
    """site.yml validates before a host's mode changes: a bad name fails in either mode."""
    assert error_of(egress_names={"": ["10.0.0.1"]}).startswith("cell_nat_egress_names[0]: '10.0.0.1' is an IP")
    data, proxy = plan(egress_names={"": ["pypi.org"]})
    assert proxy is None and data["egress_mode"] == "cidr" and data["proxy_port"] is None


def test_the_mode_and_the_port_are_checked():
    assert error_of(egress_mode="squid") == "cell_nat_egress_mode: 'squid' is not one of cidr, proxy"
    assert error_of(egress_mode="proxy", proxy_port=70000) == "cell_nat_proxy_port: 70000 is not a port (1-65535)"
    assert error_of(egress_mode="proxy", dns_resolvers=[]).startswith(
        "cell_nat_dns_resolvers: the proxy (cell_nat_egress_mode: proxy) resolves names")
    assert error_of(egress_mode="proxy", dns_resolvers=["127.0.0.53"]).startswith(
        "cell_nat_dns_resolvers: 127.0.0.53 is on loopback")


def test_the_cidr_mode_renders_the_ruleset_of_before():
    """The default mode leaves today's CIDR policy as it was: the same ruleset text."""
    params = {"slots": SLOTS, "uplink": "eth0", "dns_resolvers": [RESOLVER],
              "egress_allow": [{"cidr": "0.0.0.0/0", "proto": "tcp", "ports": [443]}]}
    old = cn.plan(dict(params), {"eth0", "chvh0", "chvh1", "chvh2"}, None)
    new, _proxy = en.plan(dict(params, egress_names={"": ["pypi.org"]}), {"eth0", "chvh0", "chvh1", "chvh2"}, None)
    assert cellnat_lab.render(new) == cellnat_lab.render(old)


# ------------------------------------------------------------ slot groups

def test_slot_groups_limit_an_entry_to_their_slots():
    _data, proxy = plan(egress_mode="proxy", slot_groups={"builders": ["slot2", "slot0"], "idle": ["slot1"]},
                        egress_names={"": ["pypi.org", {"name": "ghcr.io", "slot_group": "builders"}]})
    assert proxy["groups"] == [{"acl": "chv_group_builders", "group": "builders",
                                "nets": ["10.200.0.0/24", "10.200.2.0/24"]}]
    assert [r["acl"] for r in proxy["rules"]] == [["chv_cells", "chv_name_0", "chv_port_443"],
                                                  ["chv_group_builders", "chv_name_1", "chv_port_443"]]


@pytest.mark.parametrize("groups,msg", [
    ({"builders": ["slot0", "slot9"]}, "cell_nat_slot_groups.builders: slot9 is no slot of this host"),
    ({"builders": []}, "cell_nat_slot_groups.builders: [] must be a non-empty list of slot names"),
    ({"9x": ["slot0"]}, "cell_nat_slot_groups: '9x' is not a group name"),
    (["slot0"], "cell_nat_slot_groups: must be a mapping"),
])
def test_a_bad_slot_group_is_refused_naming_it(groups, msg):
    assert error_of(slot_groups=groups).startswith(msg)


def test_a_group_is_not_checked_against_slots_a_fresh_host_does_not_have_yet():
    _data, proxy = plan(slots=[], egress_mode="proxy", slot_groups={"b": ["slot7"]},
                        egress_names={"": [{"name": "ghcr.io", "slot_group": "b"}]})
    assert proxy["rules"] == [] and proxy["groups"] == []


# --------------------------------------------------------- denied addresses

CARVE = {"cidr": "10.20.0.0/24", "comment": "the build cache"}


@given(st.integers(min_value=0, max_value=2 ** 32 - 1))
def test_squid_refuses_exactly_the_addresses_the_kernel_refuses_doors(value):
    """dst: the special-purpose ranges less the carve-outs, the cells, and always loopback,
    0/8 and link-local (a carve-out never opens those)."""
    _data, proxy = plan(egress_mode="proxy", egress_allow=[{"cidr": "0.0.0.0/0"}, CARVE, {"cidr": "127.0.0.0/8"}],
                        egress_names={"": ["pypi.org"]})
    addr = ipaddress.IPv4Address(value)
    denied = any(addr in ipaddress.ip_network(n) for n in proxy["denied_dst"])
    special = any(addr in n for n in cn.SPECIAL_PURPOSE_NETS)
    carved = addr in ipaddress.IPv4Network("10.20.0.0/24")
    cell = addr in ipaddress.IPv4Network("10.200.0.0/22")
    always = any(addr in n for n in en.ALWAYS_DENIED_DST)
    assert denied == ((special and not carved) or cell or always)


def test_squid_refuses_the_special_ipv6_addresses_too():
    _data, proxy = plan(egress_mode="proxy", egress_names={"": ["pypi.org"]})
    v6 = [ipaddress.ip_network(n) for n in proxy["denied_dst"] if ":" in n]
    for addr in ("::1", "fe80::1", "fd00::1", "ff02::1"):
        assert any(ipaddress.ip_address(addr) in n for n in v6), addr
    assert not any(ipaddress.ip_address("2001:4860::8888") in n for n in v6)    # control: a public one
    # squid keeps IPv4 as IPv4-mapped IPv6: :: or ::ffff:0:0/96 would read as 0.0.0.0/0 there
    assert not [n for n in v6 if ipaddress.ip_network(n).overlaps(ipaddress.ip_network("::ffff:0:0/96"))]


# ------------------------------------------------------------------ squid

def test_squid_conf_orders_the_rules_and_names_each_slot():
    _data, proxy = plan(egress_mode="proxy", slot_groups={"b": ["slot1"]}, egress_names={
        "": ["pypi.org", {"name": "*.example.com", "port": 80, "comment": "mirrors"}],
        "_host": [{"name": "ghcr.io", "slot_group": "b"}]})
    conf = render_proxy(proxy)
    lines = [line for line in conf.splitlines() if line and not line.startswith("#")]
    access = [line for line in lines if line.startswith("http_access")]
    assert access == [
        "http_access deny !chv_cells",
        "http_access deny !chv_name_0 !chv_name_2 !chv_name_1",
        "http_access deny chv_denied_dst",
        "http_access allow chv_cells chv_name_0 chv_port_443",
        "http_access allow chv_cells chv_name_1 chv_port_80",
        "http_access allow chv_group_b chv_name_2 chv_port_443",
        "http_access deny all"]
    assert "acl chv_name_1 dstdom_regex -n -i ^([a-z0-9-]+\\.)+example\\.com$" in lines
    assert "acl chv_name_0 dstdomain -n pypi.org" in lines
    assert "acl chv_slot_slot1 src 10.200.1.0/24" in lines and "note chv_slot slot1 chv_slot_slot1" in lines
    assert "dns_nameservers %s" % RESOLVER in lines
    assert "# cell_nat_egress_names[1]: *.example.com (mirrors)" in conf


def test_squid_conf_without_names_refuses_everything():
    _data, proxy = plan(egress_mode="proxy")
    access = [line for line in render_proxy(proxy).splitlines() if line.startswith("http_access")]
    assert access == ["http_access deny !chv_cells", "http_access deny all"]


# ---------------------------------------------------------------- ruleset

def chain(text, name):
    body = text.split("chain %s {" % name, 1)[1]
    return [line.strip() for line in body.split("\n\t}", 1)[0].splitlines() if line.strip()
            and not line.strip().startswith("#")]


def test_proxy_mode_drops_every_forwarded_cell_packet_and_admits_only_the_proxy_on_the_gateway():
    data, _proxy = plan(egress_mode="proxy", dns_via_gateway=True, egress_names={"": ["pypi.org"]})
    text = cellnat_lab.render(data)
    from_cell = chain(text, "from_cell")
    assert from_cell[-1] == 'counter name "drop_proxy_mode" goto cell_drop'
    assert not [line for line in from_cell if "accept" in line or "dns" in line or "admit" in line]
    to_guest = chain(text, "cell_to_guest")
    assert 'iifname . ip daddr @slot_gateways tcp dport 3128 counter name "accept_proxy" accept' in to_guest
    assert not [line for line in to_guest if "53" in line]              # no DNS, not even via the gateway
    assert 'tcp dport 3128 counter name "drop_proxy_outside" drop' in chain(text, "input")
    assert chain(text, "door_out")[0] == 'oifname @cell_ifs ct direction reply counter name "accept_proxy_reply" accept'
    for name, _comment in en.PROXY_COUNTERS:
        assert "counter %s {" % name in text
