"""Egress by name (issue 33) in network namespaces of this test's own
(prefix "te-", tests/helpers/egress_lab.py): the role's ruleset in proxy
mode and the real squid with the role's rendered configuration, run in the
guest namespace as a door's UID, and dnsmasq as the resolver stand-in,
answering the test names with addresses that exist only inside the
namespaces (egress_lab.NAMES).

Every listener logs each connection before it reads a byte; each refusal
runs beside its positive control, and the control that the refused
listener logs what reaches it (the guest's root connects to it directly).
Nothing leaves the namespaces."""

import ipaddress
import json
import subprocess
import sys

import pytest

import egress_lab
from cellnat_lab import run
from egress_lab import ENTRIES, PORT, PROBE, RESOLVER, ProxyLab

from chv_guest.cell import argv as argvmod
from chv_guest.cell import egresslog
from chv_guest.cell import ruleset

_SKIP = egress_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def plab():
    lab = ProxyLab()
    try:
        lab.up()
        lab.apply_proxy()
        lab.start_squid()
        yield lab
    finally:
        lab.down()


def test_an_allowed_name_is_reached_and_a_denied_name_refused_before_any_byte_or_query(plab):
    allowed = plab.connect(plab.cell_a, "allowed.test")
    assert allowed["proxy"] == "HTTP/1.1 200 Connection established"
    assert allowed["body"] == "hello from 198.20.1.1:443"                      # control: through the proxy
    denied = plab.connect(plab.cell_a, "denied.test")
    assert denied["proxy"].startswith("HTTP/1.1 403 ") and denied["body"] == ""
    assert plab.reached("198.20.2.1:443") == []                                 # not a byte reached it
    assert plab.queried("allowed.test") and plab.queried("denied.test") == []  # never even resolved
    # control: the listener logs what reaches it (the guest's root, directly)
    plab.probe(plab.guest, "198.20.2.1", 443)
    assert len(plab.reached("198.20.2.1:443")) == 1


def test_an_ip_literal_is_refused_beside_the_name_for_the_same_address(plab):
    assert plab.connect(plab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"    # control
    before = len(plab.reached("198.20.1.1:443"))
    assert plab.connect(plab.cell_a, "198.20.1.1")["proxy"].startswith("HTTP/1.1 403 ")
    assert len(plab.reached("198.20.1.1:443")) == before


@pytest.mark.parametrize("name,addr", [("private.test", "10.77.1.1"), ("metadata.test", "169.254.169.254"),
                                       ("guest.test", "127.0.0.1")])
def test_a_listed_name_resolving_to_a_private_link_local_or_guest_address_is_refused(plab, name, addr):
    assert plab.connect(plab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"    # control
    refused = plab.connect(plab.cell_a, name)
    assert refused["proxy"].startswith("HTTP/1.1 403 ") and refused["body"] == ""
    assert plab.queried(name)                        # listed: resolved, and the address refused
    assert plab.reached("%s:443" % addr) == []
    if addr != "127.0.0.1":                          # control: the guest's root reaches the listener directly
        plab.probe(plab.guest, addr, 443)
        assert len(plab.reached("%s:443" % addr)) == 1


def test_wildcards_ports_and_plain_http(plab):
    assert plab.connect(plab.cell_a, "sub.wild.test")["body"] == "hello from 198.20.1.1:443"
    assert plab.connect(plab.cell_a, "a.b.wild.test")["body"] == "hello from 198.20.1.1:443"
    assert plab.connect(plab.cell_a, "wild.test")["proxy"].startswith("HTTP/1.1 403 ")      # not the base name
    assert plab.get(plab.cell_a, "http://allowed.test/")["body"] == "hello from 198.20.1.1:80"
    assert plab.connect(plab.cell_a, "allowed.test", 80)["body"] == "hello from 198.20.1.1:80"
    assert plab.get(plab.cell_a, "http://denied.test/")["proxy"].startswith("HTTP/1.1 403 ")
    assert plab.get(plab.cell_a, "http://allowed.test:443/")["body"] == "hello from 198.20.1.1:443"
    assert plab.connect(plab.cell_a, "allowed.test", 8080)["proxy"].startswith("HTTP/1.1 403 ")  # no entry for 8080


def test_a_slot_group_entry_is_for_its_slots_only(plab):
    assert plab.connect(plab.cell_b, "group.test")["body"] == "hello from 198.20.1.1:443"        # slot1: in group
    assert plab.connect(plab.cell_a, "group.test")["proxy"].startswith("HTTP/1.1 403 ")         # slot0: not
    assert plab.connect(plab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"     # control


def test_the_cells_environment_leads_curl_through_the_proxy(plab):
    """The variables a cell gets in proxy mode (argv.proxy_environment) are all curl needs."""
    policy = {"egress_proxy": {"port": PORT}}
    env = dict(argvmod.proxy_environment(policy, plab.slots[0]), PATH="/usr/bin:/bin")
    curl = ["env", "-i"] + ["%s=%s" % kv for kv in sorted(env.items())] + ["curl", "-sS", "-m", "5"]
    assert run(*curl, "http://allowed.test/", ns=plab.cell_a).stdout == "hello from 198.20.1.1:80"
    assert run(*curl, "-p", "http://allowed.test:443/", ns=plab.cell_a).stdout == "hello from 198.20.1.1:443"
    denied = run(*curl, "-o", "/dev/null", "-w", "%{http_code}", "http://denied.test/", ns=plab.cell_a,
                 check=False)
    assert denied.stdout == "403"
    # control: without the variables curl has no resolver and no route
    bare = run("env", "-i", "PATH=/usr/bin:/bin", "curl", "-sS", "-m", "3", "http://198.20.1.1/", ns=plab.cell_a,
               check=False)
    assert bare.returncode != 0


def test_a_cell_has_no_path_but_the_proxy_on_its_own_gateway(plab):
    lab = plab
    before = lab.counters()
    assert lab.connect(lab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"      # control
    assert lab.probe(lab.cell_a, "198.20.1.1", 443) is None                       # direct, no proxy
    assert lab.probe(lab.cell_a, RESOLVER, 53, "udp") is None                     # DNS to the resolver
    assert lab.probe(lab.cell_a, lab.slots[0]["gateway"], 53, "udp") is None      # DNS on the gateway
    assert lab.probe(lab.cell_a, lab.slots[0]["gateway"], 2222) is None           # another port of the guest
    other = lab.connect(lab.cell_a, "allowed.test")
    assert other["body"] == "hello from 198.20.1.1:443"
    # the other slot's gateway: the proxy port of the guest, but not this cell's
    argv = [sys.executable, PROBE, "connect", lab.slots[1]["gateway"], PORT, "allowed.test", 443]
    assert json.loads(run(*argv, ns=lab.cell_a).stdout)["proxy"].startswith("ERROR")
    # the proxy's port from outside the guest
    assert json.loads(run(sys.executable, PROBE, "connect", "198.20.0.2", PORT, "allowed.test", 443,
                          ns=lab.outside).stdout)["proxy"].startswith("ERROR")
    after = lab.counters()
    assert after["drop_proxy_mode"] - before["drop_proxy_mode"] >= 2
    assert after["drop_cell_to_guest"] - before["drop_cell_to_guest"] >= 3
    assert after["drop_proxy_outside"] - before["drop_proxy_outside"] >= 1
    assert after["accept_proxy"] - before["accept_proxy"] >= 2


def test_the_kernel_refuses_the_address_when_squid_would_not(plab):
    """Counter-proof of squid's dst check: without it squid connects, and the
    kernel refuses its connection (its UID is a door's): the listener still
    sees nothing, the log says failed, drop_special_range counts it. And
    with squid's UID outside door_uids, the same connection reaches it."""
    lab = plab
    loose = dict(lab.proxy, denied_dst=["127.0.0.0/8"])           # squid no longer checks 10/8 or link-local
    try:
        lab.start_squid(loose)
        before = lab.counters()
        seen = len(lab.reached("10.77.1.1:443"))
        assert lab.connect(lab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"  # control
        refused = lab.connect(lab.cell_a, "private.test")
        assert not refused["body"] and not refused["proxy"].startswith("HTTP/1.1 200")
        assert len(lab.reached("10.77.1.1:443")) == seen
        assert lab.counters()["drop_special_range"] > before["drop_special_range"]
        assert lab.log_lines()[-1]["verdict"] == "failed"
        # widened: squid's UID is no door's (the drop-in gone), the same request reaches the listener
        (lab.door_dir / "chv-egress-proxy.nft").rename(lab.work / "parked.nft")
        lab.apply_proxy()
        assert lab.connect(lab.cell_a, "private.test")["body"] == "hello from 10.77.1.1:443"
        assert len(lab.reached("10.77.1.1:443")) == seen + 1
    finally:
        parked = lab.work / "parked.nft"
        if parked.exists():
            parked.rename(lab.door_dir / "chv-egress-proxy.nft")
        lab.apply_proxy()
        lab.start_squid()


def test_the_audit_log_has_a_line_per_attempt_with_its_verdict(plab):
    lab = plab
    lab.start_squid()                                   # a fresh log
    assert lab.connect(lab.cell_a, "allowed.test")["body"]
    assert lab.connect(lab.cell_a, "denied.test")["proxy"].startswith("HTTP/1.1 403 ")
    assert lab.connect(lab.cell_b, "private.test")["proxy"].startswith("HTTP/1.1 403 ")
    assert lab.get(lab.cell_b, "http://allowed.test/")["body"]
    lines = lab.log_lines()
    assert None not in lines
    got = [(r["slot"], r["src"], r["method"], r["host"], r["port"], r["dst"], r["verdict"]) for r in lines]
    print((lab.squid_dir / "access.log").read_text())
    assert got == [
        ("slot0", "10.200.0.2", "CONNECT", "allowed.test", "443", "198.20.1.1", "allowed"),
        ("slot0", "10.200.0.2", "CONNECT", "denied.test", "443", "-", "denied"),
        ("slot1", "10.200.1.2", "CONNECT", "private.test", "443", "-", "denied"),
        ("slot1", "10.200.1.2", "GET", "allowed.test", "80", "198.20.1.1", "allowed"),
    ]
    assert lines[0]["bytes_in"] > 0 and lines[0]["bytes_out"] > 0
    assert all(float(r["ts"]) > 0 for r in lines)
    assert ipaddress.ip_address(lines[0]["dst"]) == ipaddress.ip_address("198.20.1.1")
    table, other = egresslog.counters((lab.squid_dir / "access.log").read_text().splitlines())
    assert other == 0
    assert {k: v["attempts"] for k, v in table.items()} == {
        ("slot0", "allowed"): 1, ("slot0", "denied"): 1, ("slot1", "denied"): 1, ("slot1", "allowed"): 1}


def test_the_launcher_starts_a_proxy_cell_only_under_the_proxy_modes_table(plab):
    """chv-cell's fail-closed check (ruleset.missing with the policy's egress_proxy) on the loaded tables."""
    listing = run("nft", "-j", "list", "table", "inet", "chv_cell", ns=plab.guest).stdout
    assert ruleset.missing(listing, "chvh0", proxy=True) == []
    try:
        plab.apply_proxy(egress_mode="cidr")
        listing = run("nft", "-j", "list", "table", "inet", "chv_cell", ns=plab.guest).stdout
        assert ruleset.missing(listing, "chvh0") == []                   # control: a cidr policy starts
        (item,) = ruleset.missing(listing, "chvh0", proxy=True)
        assert item.startswith("the proxy mode (counter drop_proxy_mode;")
    finally:
        plab.apply_proxy()


def test_a_new_list_applies_to_new_connections_and_open_tunnels_stay(plab):
    """squid -k reconfigure (chv-egress-proxy.service's ExecReload, the role's handler for a new
    configuration): a name taken off the list is refused from then on, a tunnel opened before goes on."""
    lab = plab
    held = subprocess.Popen(["ip", "netns", "exec", lab.cell_a, sys.executable, str(PROBE), "hold",
                             lab.slots[0]["gateway"], str(PORT), "allowed.test", "443"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "HTTP/1.1 200 Connection established"
        _data, narrower = lab.plan_proxy(egress_names={"": [e for e in ENTRIES if e != "allowed.test"]})
        lab.reconfigure_squid(narrower)
        assert lab.connect(lab.cell_a, "allowed.test")["proxy"].startswith("HTTP/1.1 403 ")   # off the list now
        assert lab.connect(lab.cell_a, "sub.wild.test")["body"] == "hello from 198.20.1.1:443"  # control: still on
        held.stdin.write("go\n")
        held.stdin.flush()
        assert held.stdout.readline().strip() == "hello from 198.20.1.1:443"                   # the open tunnel
    finally:
        held.kill()
        held.wait()
        lab.reconfigure_squid(lab.proxy)
    assert lab.connect(lab.cell_a, "allowed.test")["body"] == "hello from 198.20.1.1:443"
