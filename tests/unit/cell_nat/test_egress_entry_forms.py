"""An egress entry is an IPv4 CIDR or address (a string, or the cidr of a
mapping with proto and ports). A host name, URL or host:port is neither,
and is refused as such, naming the variable and the value; an address with
a typo keeps the CIDR parser's own, more precise reason."""

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import cell_nat as cn

NEITHER = ("is neither an IPv4 CIDR nor an address (host names, URLs and host:port are not resolved; "
           "a port goes in ports)")


@pytest.mark.parametrize("entry", ["https://pypi.org/simple", "pypi.org", "pypi.org:443", "203.0.113.5:443",
                                   "deadbeef", "metadata.google.internal", "eth0"])
def test_a_name_url_or_host_port_is_neither(entry):
    with pytest.raises(cn.CellNatError) as err:
        cn.parse_egress_list([{"cidr": "192.0.2.0/24"}, {"cidr": entry, "ports": [443]}], "cell_nat_egress_allow")
    assert str(err.value) == "cell_nat_egress_allow[1].cidr: %r %s" % (entry, NEITHER)
    with pytest.raises(cn.CellNatError) as err:  # the short form: the entry is the cidr
        cn.parse_egress_list([entry], "cell_nat_egress_deny")
    assert str(err.value) == "cell_nat_egress_deny[0]: %r %s" % (entry, NEITHER)


@pytest.mark.parametrize("entry,reason", [
    ("300.1.2.3/32", "is not a valid IPv4 CIDR"), ("10.0.0.1/24", "has host bits set"),
    ("2001:db8::/32", "is IPv6"), ("fe80::1", "is IPv6"), ("", "is not an IPv4 CIDR"),
])
def test_an_address_with_a_typo_keeps_its_precise_reason(entry, reason):
    with pytest.raises(cn.CellNatError) as err:
        cn.parse_egress_list([{"cidr": entry}], "cell_nat_egress_deny")
    assert str(err.value).startswith("cell_nat_egress_deny[0].cidr: %r " % entry) and reason in str(err.value)
    assert NEITHER not in str(err.value)


@pytest.mark.parametrize("entry,net", [("203.0.113.5", "203.0.113.5/32"), ("203.0.113.0/24", "203.0.113.0/24"),
                                       (" 198.51.100.0/24 ", "198.51.100.0/24")])
def test_the_cidr_next_to_them_is_accepted(entry, net):
    assert [str(e.net) for e in cn.parse_egress_list([entry], "cell_nat_egress_allow")] == [net]
    assert [str(e.net) for e in cn.parse_egress_list([{"cidr": entry}], "cell_nat_egress_allow")] == [net]
