"""Unit and property tests of the lab's pure functions (lab/plugins/module_utils/lab.py):
name validation, guest names, the address plan, route overlaps, apt source
parsing, mmdebstrap source lines and image cache keys."""

import ipaddress

import pytest
from hypothesis import given, strategies as st

from ansible_collections.chv.fleet_lab.plugins.module_utils import lab
from ansible_collections.chv.fleet_lab.plugins.module_utils.lab import LabError


# ---------------------------------------------------------------------------
# validate_name

@pytest.mark.parametrize("name", ["a", "lab", "lab1", "a-b", "x9", "abcdefghijkl"])
def test_valid_names_are_returned(name):
    assert lab.validate_name(name, "lab_name") == name


@pytest.mark.parametrize("name", ["", "Lab", "1lab", "-lab", "lab-", "la--b", "la_b", "la.b", "lab 1", None, 3,
                                  ["lab"]])
def test_invalid_names_are_refused_naming_the_variable(name):
    with pytest.raises(LabError, match=r"^lab_guests entry .* is not a valid hostname label"):
        lab.validate_name(name, "lab_guests entry")


def test_names_longer_than_the_veth_allows_are_refused():
    assert lab.validate_name("a" * lab.MAX_GUEST_NAME, "lab_name")  # control: exactly at the limit
    with pytest.raises(LabError, match="is 13 characters; at most 12 fit the host-side veth name"):
        lab.validate_name("a" * (lab.MAX_GUEST_NAME + 1), "lab_name")
    assert len("ve-" + "a" * lab.MAX_GUEST_NAME) == 15  # IFNAMSIZ minus the NUL


# ---------------------------------------------------------------------------
# guest_specs

def guest_names(*args):
    return [spec["name"] for spec in lab.guest_specs(*args)]


def test_generated_guest_names_count_from_one():
    assert guest_names("demo", 3) == ["demo1", "demo2", "demo3"]
    assert guest_names("demo", 1) == ["demo1"]


def test_explicit_guest_names_win_over_the_count():
    assert guest_names("demo", 5, ["b", "a"]) == ["b", "a"]
    assert guest_names("demo", 5, []) == ["demo1", "demo2", "demo3", "demo4", "demo5"]  # empty: the count


@pytest.mark.parametrize("count", [0, 65, -1, True, "2", 1.0, None])
def test_bad_counts_are_refused(count):
    with pytest.raises(LabError, match="lab_count .* is invalid: an integer from 1 to 64 is required"):
        guest_names("demo", count)


def test_count_bounds_are_inclusive():
    assert len(guest_names("d", 64)) == 64
    assert guest_names("d", 64)[-1] == "d64"


@pytest.mark.parametrize("names, message", [
    ("a,b", "lab_guests must be a list of names"),
    ([{"name": "a", "distro": "sid"}], "lab_guests entry a: distro 'sid' is not supported; choose one of bookworm"),
    ([{"name": "a", "ifname": "Ens5"}], "lab_guests entry a: ifname 'Ens5' is not an interface name"),
    ([{"name": "a", "ifname": "e" * 16}], "lab_guests entry a: ifname 'e{16}' is not an interface name"),
    ([{"name": "a", "image": "x"}], r"lab_guests entry .* has unknown keys image \(known: name, distro, ifname\)"),
    ([{"distro": "trixie"}], "lab_guests entry None is not a valid hostname label"),
    (["a", {"name": "a"}], "lab_guests has duplicate names"),
    (["a", "a"], "lab_guests has duplicate names"),
    (["a", "B"], "lab_guests entry 'B' is not a valid hostname label"),
])
def test_bad_explicit_names_are_refused(names, message):
    with pytest.raises(LabError, match=message):
        guest_names("demo", None, names)


def test_the_lab_name_is_checked_even_with_explicit_names():
    with pytest.raises(LabError, match="lab_name 'Demo'"):
        guest_names("Demo", None, ["a"])


def test_a_generated_name_too_long_is_refused():
    assert guest_names("abcdefghijk", 9)[-1] == "abcdefghijk9"  # 12 characters: fits
    with pytest.raises(LabError, match="generated guest name 'abcdefghijk10' is 13 characters"):
        guest_names("abcdefghijk", 10)


# ---------------------------------------------------------------------------
# plan

def test_plan_gives_each_guest_a_30_of_its_own():
    p = lab.plan("demo", "bookworm", "10.99.0.0/24", count=2)
    assert p == {"lab": "demo", "network": "10.99.0.0/24", "distro": "bookworm", "distros": ["bookworm"], "resolver_names": {}, "guests": [
        {"name": "demo1", "distro": "bookworm", "ifname": "host0", "link": "10.99.0.0/30", "host_ifname": "ve-demo1",
         "host_address": "10.99.0.1", "address": "10.99.0.2", "prefixlen": 30},
        {"name": "demo2", "distro": "bookworm", "ifname": "host0", "link": "10.99.0.4/30", "host_ifname": "ve-demo2",
         "host_address": "10.99.0.5", "address": "10.99.0.6", "prefixlen": 30},
    ]}


def test_a_guest_entry_may_name_its_own_distro_and_interface():
    p = lab.plan("f", "bookworm", "10.99.0.0/28",
                 names=["guest-a", {"name": "guest-c", "distro": "trixie", "ifname": "ens5"}, {"name": "b"}])
    assert [(g["name"], g["distro"], g["ifname"]) for g in p["guests"]] == [
        ("guest-a", "bookworm", "host0"), ("guest-c", "trixie", "ens5"), ("b", "bookworm", "host0")]
    assert p["distros"] == ["bookworm", "trixie"]


def test_a_30_network_holds_exactly_one_guest():
    assert [g["address"] for g in lab.plan("d", "trixie", "10.1.2.4/30", count=1)["guests"]] == ["10.1.2.6"]
    with pytest.raises(LabError, match="lab_network 10.1.2.4/30 holds 1 /30 links, 2 guests requested"):
        lab.plan("d", "trixie", "10.1.2.4/30", count=2)


@pytest.mark.parametrize("network, message", [
    ("10.1.2.0/31", "is smaller than one /30"),
    ("10.1.2.1/24", "is not an IPv4 network"),          # host bits set
    ("fd00::/64", "is not an IPv4 network"),
    ("nope", "is not an IPv4 network"),
    (None, "is not an IPv4 network"),
])
def test_bad_networks_are_refused(network, message):
    with pytest.raises(LabError, match="lab_network .*" + message):
        lab.plan("d", "bookworm", network, count=1)


def test_unknown_distros_are_refused_with_the_choices():
    with pytest.raises(LabError, match="lab_distro 'sid' is not supported; choose one of bookworm, trixie"):
        lab.plan("d", "sid", "10.99.0.0/24", count=1)


def test_the_network_must_hold_every_guest():
    assert len(lab.plan("d", "bookworm", "10.99.0.0/28", count=4)["guests"]) == 4
    with pytest.raises(LabError, match="holds 4 /30 links, 5 guests requested"):
        lab.plan("d", "bookworm", "10.99.0.0/28", count=5)


@given(prefix=st.integers(16, 30), count=st.integers(1, 64), base=st.integers(0, (1 << 16) - 1))
def test_plan_links_are_disjoint_inside_the_network(prefix, count, base):
    net = ipaddress.IPv4Network(((10 << 24) | (base << 8)) & ~((1 << (32 - prefix)) - 1)).supernet(new_prefix=prefix)
    if count > net.num_addresses // 4:
        with pytest.raises(LabError, match="guests requested"):
            lab.plan("p", "bookworm", str(net), count=count)
        return
    guests = lab.plan("p", "bookworm", str(net), count=count)["guests"]
    links = [ipaddress.IPv4Network(g["link"]) for g in guests]
    assert all(link.subnet_of(net) and link.prefixlen == 30 for link in links)
    assert len(set(links)) == len(links)
    for g, link in zip(guests, links):
        host, guest = ipaddress.IPv4Address(g["host_address"]), ipaddress.IPv4Address(g["address"])
        assert host in link and guest in link and host != guest
        assert host not in (link.network_address, link.broadcast_address)
        assert guest not in (link.network_address, link.broadcast_address)
        assert g["host_ifname"] == "ve-" + g["name"] and len(g["host_ifname"]) <= 15


# ---------------------------------------------------------------------------
# overlapping_routes

ROUTES = [
    {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
    {"dst": "10.99.0.0/30", "dev": "ve-demo1"},          # the lab's own
    {"dst": "10.99.0.128/25", "dev": "docker0"},         # inside the lab network
    {"dst": "10.0.0.0/8", "dev": "wg0"},                 # around it
    {"dst": "10.98.0.0/24", "dev": "br0"},               # beside it
    {"dst": "fd00::/64", "dev": "eth0"},                 # IPv6
    {"dst": "10.99.0.7", "dev": "tun0"},                 # a host route inside
    {"dst": "not-a-route", "dev": "x"},
    {"dev": "lo"},
    {"dst": "10.99.0.64/26"},                            # no device
]


def test_overlapping_routes_are_listed_except_the_labs_own():
    assert lab.overlapping_routes("10.99.0.0/24", ROUTES, {"ve-demo1"}) == [
        "10.99.0.128/25 dev docker0", "10.0.0.0/8 dev wg0", "10.99.0.7 dev tun0", "10.99.0.64/26 dev ?"]


def test_the_labs_own_routes_count_when_not_named_as_its_own():
    assert "10.99.0.0/30 dev ve-demo1" in lab.overlapping_routes("10.99.0.0/24", ROUTES, set())


def test_no_routes_no_overlap():
    assert lab.overlapping_routes("10.99.0.0/24", [], set()) == []
    assert lab.overlapping_routes("172.31.0.0/24", ROUTES, set()) == []


# ---------------------------------------------------------------------------
# parse_apt_sources

DEB822 = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

# security, as Debian's installer writes it
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
"""


def test_deb822_sources_give_archive_and_security():
    assert lab.parse_apt_sources([DEB822], []) == ("http://mirror.example/debian",
                                                   "http://security.example/debian-security")


def test_disabled_and_source_only_stanzas_are_skipped():
    text = """Types: deb
URIs: http://off.example/debian
Suites: trixie
Enabled: no

Types: deb-src deb
URIs: http://on.example/debian
Suites: trixie-updates
"""
    assert lab.parse_apt_sources([text], []) == ("http://on.example/debian", None)
    assert lab.parse_apt_sources([DEB822.split("\n\n")[2]], []) == (None, None)  # deb-src only


def test_one_line_sources_give_archive_and_security():
    text = """# a comment
deb [arch=amd64 signed-by=/usr/share/keyrings/debian.gpg] http://list.example/debian bookworm main
deb-src http://list.example/debian bookworm main
deb http://list.example/security bookworm-security main
deb http://other.example/ubuntu jammy main
"""
    assert lab.parse_apt_sources([], [text]) == ("http://list.example/debian", "http://list.example/security")


def test_the_first_mirror_wins_and_deb822_comes_before_lists():
    later = "deb http://later.example/debian trixie main\ndeb http://later.example/sec trixie-security main\n"
    assert lab.parse_apt_sources([DEB822], [later]) == ("http://mirror.example/debian",
                                                        "http://security.example/debian-security")
    assert lab.parse_apt_sources([], [later, "deb http://last.example/debian trixie main"]) == (
        "http://later.example/debian", "http://later.example/sec")


def test_unknown_suites_and_empty_sources_give_nothing():
    assert lab.parse_apt_sources(["Types: deb\nURIs: http://x/\nSuites: jammy\n"], ["deb http://y/ focal main"]) \
        == (None, None)
    assert lab.parse_apt_sources([], []) == (None, None)
    assert lab.parse_apt_sources(["Types: deb\nSuites: bookworm\n"], ["deb http://z/"]) == (None, None)


# ---------------------------------------------------------------------------
# image_sources and image_key

def test_image_sources_list_the_distros_suites():
    assert lab.image_sources("bookworm", "http://m/debian", "http://s/debian-security") == [
        "deb http://m/debian bookworm bookworm-updates main",
        "deb http://s/debian-security bookworm-security main"]
    assert lab.image_sources("trixie", "http://m/debian", None) == ["deb http://m/debian trixie trixie-updates main"]


def test_image_key_is_short_hex_and_stable():
    key = lab.image_key("bookworm", ["sudo", "python3"], ["deb http://m/ bookworm main"])
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == lab.image_key("bookworm", ["sudo", "python3"], ["deb http://m/ bookworm main"])


@given(st.lists(st.sampled_from(lab.BASE_PACKAGES + ["chromium", "nftables"]), max_size=12), st.randoms())
def test_image_key_ignores_package_order_and_repeats(packages, rnd):
    shuffled = list(packages) + list(packages[:2])
    rnd.shuffle(shuffled)
    assert lab.image_key("trixie", packages, ["s"]) == lab.image_key("trixie", shuffled, ["s"])


def test_image_key_changes_with_what_goes_into_the_image():
    base = lab.image_key("bookworm", ["sudo"], ["deb http://m/ bookworm main"])
    assert lab.image_key("trixie", ["sudo"], ["deb http://m/ bookworm main"]) != base
    assert lab.image_key("bookworm", ["sudo", "curl"], ["deb http://m/ bookworm main"]) != base
    assert lab.image_key("bookworm", ["sudo"], ["deb http://n/ bookworm main"]) != base
    assert lab.image_key("bookworm", ["sudo"], ["deb http://m/ bookworm main", "x"]) != base


def test_the_resolver_stand_ins_names_are_checked_and_sorted():
    assert lab.resolver_names({"b.chv-lab.test": "10.99.0.1", "a.chv-lab.test": "127.0.0.1"}) == \
        {"a.chv-lab.test": "127.0.0.1", "b.chv-lab.test": "10.99.0.1"}
    assert lab.plan("demo", "bookworm", "10.99.0.0/30", count=1)["resolver_names"] == {}


@pytest.mark.parametrize("names, message", [
    (["a.test"], "lab_resolver_names must be a mapping of DNS names to IPv4 addresses"),
    ({"Upper.test": "10.0.0.1"}, r"lab_resolver_names: 'Upper.test' is not a DNS name"),
    ({"single": "10.0.0.1"}, r"lab_resolver_names: 'single' is not a DNS name"),
    ({"a.test": "fe80::1"}, r"lab_resolver_names: a.test maps to 'fe80::1', not an IPv4 address"),
    ({"a.test": "a.test"}, r"lab_resolver_names: a.test maps to 'a.test', not an IPv4 address"),
])
def test_bad_resolver_names_are_refused_naming_the_value(names, message):
    with pytest.raises(LabError, match=message):
        lab.resolver_names(names)
