"""The lab host's guard rail (lab/roles/lab/templates/nat.nft.j2), loaded into a
network namespace that stands in for the lab host.

Topology (every address lives only inside the namespaces made here)::

    guest ns                      labhost ns                        outside ns
    eth0 10.99.30.2/28  <---->  vg 10.99.30.1/28      uplnk 198.51.100.2/24 <--> wan 198.51.100.1/24 (default)
         203.0.113.99/32 (spoof)   (route 203.0.113.99 dev vg)              lo: 192.168.77.1 169.254.169.254
         fe80::/64 (link-local)    fe80::/64 (link-local)                       10.255.255.53 203.0.113.7
                                   listeners on [::] (v4 and v6):               (route 203.0.113.99 via labhost)
                                   tcp/udp in lab_listener_ports and outside

A probe that slips through a broken boundary in a guest must still not reach
link-local or private ranges outside the lab; the lab host's resolver stays
reachable for DNS only; a public address is the control. On the lab host
itself a guest reaches only the listener range, over IPv4 and over IPv6
link-local alike, and a packet whose source the guest forged (routed back to
the guest, so a reply would arrive) reaches nothing. Counter-proof: without
the table the same probes arrive.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import jinja2
import pytest
import yaml

import cellnat_lab
from cellnat_lab import run
from testpaths import LAB_ROLE

_SKIP = cellnat_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

TEMPLATE = pathlib.Path(LAB_ROLE) / "templates" / "nat.nft.j2"
LAB_NET = "10.99.30.0/28"
RESOLVER = "10.255.255.53"
GUEST, LABHOST = "10.99.30.2", "10.99.30.1"
SPOOF = "203.0.113.99"  # not the lab's: a source the guest's root forges


def listener_range():
    """The listener range as the role has it (its one home: defaults/main.yml)."""
    defaults = yaml.safe_load((pathlib.Path(LAB_ROLE) / "defaults" / "main.yml").read_text())
    return defaults["lab_listener_ports"]


LO, HI = (int(x) for x in listener_range().split("-"))
IN_RANGE = LO
BELOW, ABOVE = 2024, HI + 1  # 2024: a port this machine's own services listen on


def render(lab_egress):
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["bool"] = bool
    # the plan as lab_plan returns it: the lab host's end of the guest's veth is "vg" here
    return env.from_string(TEMPLATE.read_text()).render(
        lab_name="guard-test", lab_egress=lab_egress, __lab_plan={"network": LAB_NET, "guests": [
            {"name": "g", "host_ifname": "vg", "host_address": LABHOST, "address": GUEST}]},
        __lab_nameservers=[RESOLVER], lab_listener_ports=listener_range())


def link_local(ns, dev):
    """The link-local address of dev once duplicate address detection is done."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in json.loads(run("ip", "-j", "-6", "addr", "show", "dev", dev, "scope", "link", ns=ns).stdout):
            for a in entry.get("addr_info", []):
                if a.get("family") == "inet6" and not a.get("tentative"):
                    return a["local"]
        time.sleep(0.2)
    raise AssertionError("no link-local address on %s in %s" % (dev, ns))


@pytest.fixture(scope="module")
def topo():
    prefix = "cgr-%d-" % os.getpid()
    guest, labhost, outside = prefix + "g", prefix + "h", prefix + "o"
    servers = []
    try:
        for ns in (guest, labhost, outside):
            run("ip", "netns", "add", ns)
            run("ip", "link", "set", "lo", "up", ns=ns)
        run("ip", "link", "add", "eth0", "netns", guest, "type", "veth", "peer", "name", "vg", "netns", labhost)
        run("ip", "link", "add", "uplnk", "netns", labhost, "type", "veth", "peer", "name", "wan", "netns", outside)
        for ns, dev, addr in ((guest, "eth0", "10.99.30.2/28"), (labhost, "vg", "10.99.30.1/28"),
                              (labhost, "uplnk", "198.51.100.2/24"), (outside, "wan", "198.51.100.1/24")):
            run("ip", "addr", "add", addr, "dev", dev, ns=ns)
            run("ip", "link", "set", dev, "up", ns=ns)
        for addr in ("192.168.77.1/32", "169.254.169.254/32", RESOLVER + "/32", "203.0.113.7/32"):
            run("ip", "addr", "add", addr, "dev", "lo", ns=outside)
        run("ip", "route", "add", "default", "via", "10.99.30.1", ns=guest)
        run("ip", "route", "add", "default", "via", "198.51.100.1", ns=labhost)
        run("ip", "route", "add", LAB_NET, "via", "198.51.100.2", ns=outside)
        run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=labhost)
        # the guest's root forges a source; the lab host (and the outside)
        # would route a reply to it back to the guest
        run("ip", "addr", "add", SPOOF + "/32", "dev", "eth0", ns=guest)
        run("ip", "route", "add", SPOOF + "/32", "dev", "vg", ns=labhost)
        run("ip", "route", "add", SPOOF + "/32", "via", "198.51.100.2", ns=outside)
        proc = subprocess.Popen(["ip", "netns", "exec", outside, sys.executable, str(cellnat_lab.PROBE), "serve",
                                 "tcp:0.0.0.0:8080", "udp:%s:53" % RESOLVER],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        servers.append(proc)
        assert proc.stdout.readline().strip() == "READY"
        # the lab host's own listeners, dual stack (IPv4 and IPv6 on [::])
        proc = subprocess.Popen(["ip", "netns", "exec", labhost, sys.executable, str(cellnat_lab.PROBE), "serve"]
                                + ["%s::::%d" % (proto, port) for port in (IN_RANGE, BELOW, ABOVE)
                                   for proto in ("tcp", "udp")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        servers.append(proc)
        assert proc.stdout.readline().strip() == "READY"
        yield {"guest": guest, "labhost": labhost, "labhost_ll": link_local(labhost, "vg") + "%eth0",
               "guest_ll": link_local(guest, "eth0")}
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        for ns in (guest, labhost, outside):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def probe(topo, host, port, proto="tcp", source=None):
    return send(topo, host, port, proto, source)[0] == 0


# The shared probe (cellnat_probe.py) takes no scope id: a link-local peer
# (fe80::...%eth0) goes through getaddrinfo here, the same exchange otherwise.
SCOPED = r"""
import socket, sys
proto, host, port, timeout = sys.argv[1:5]
kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
fam, _t, _p, _c, addr = socket.getaddrinfo(host, int(port), socket.AF_INET6, kind)[0]
sock = socket.socket(fam, kind)
sock.settimeout(float(timeout))
try:
    if proto == "tcp":
        sock.connect(addr)
        data = sock.recv(200)
    else:
        sock.sendto(b"q", addr)
        data = sock.recvfrom(200)[0]
except socket.timeout:
    sys.exit(print("TIMEOUT") or 1)
except ConnectionRefusedError:
    sys.exit(print("REFUSED") or 1)
print(data.decode().strip().split("%")[0])
"""


def send(topo, host, port, proto="tcp", source=None):
    """(exit status, what came back: the peer address the server saw, REFUSED, TIMEOUT, ...)."""
    if "%" in host:
        # tcp waits for the SYN's retransmission: the lab refuses IPv6 with
        # ICMPv6 port unreachable, which the guest's kernel (Linux >= 6.0)
        # takes as a soft error on the first SYN and reports at its
        # retransmission, about 1 s later
        timeout = "2.5" if proto == "tcp" else cellnat_lab.TIMEOUT
        proc = run(sys.executable, "-c", SCOPED, proto, host, port, timeout, ns=topo["guest"], check=False)
    else:
        proc = run(sys.executable, cellnat_lab.PROBE, "probe", proto, host, port, cellnat_lab.TIMEOUT,
                   *([source] if source else []), ns=topo["guest"], check=False)
    return proc.returncode, proc.stdout.strip()


def load(topo, text):
    path = "/tmp/cgr-%d.nft" % os.getpid()
    with open(path, "w") as fh:
        fh.write(text)
    try:
        run("nft", "-f", path, ns=topo["labhost"])
    finally:
        os.unlink(path)


GUARDED = [("192.168.77.1", 8080, "tcp"), ("169.254.169.254", 8080, "tcp"), (RESOLVER, 8080, "tcp")]


@pytest.mark.parametrize("lab_egress", [False, True])
def test_guard_rail_drops_private_and_link_local_keeps_dns_and_public(topo, lab_egress):
    load(topo, render(lab_egress))
    try:
        assert probe(topo, "203.0.113.7", 8080)                       # control: a public address
        assert probe(topo, RESOLVER, 53, "udp")                       # the lab host's resolver, DNS only
        for host, port, proto in GUARDED:
            assert not probe(topo, host, port, proto), host
    finally:
        run("nft", "delete", "table", "inet", "chv_lab_guard_test", ns=topo["labhost"], check=False)
    # counter-proof: without the lab's table, every one of them arrives
    for host, port, proto in GUARDED:
        assert probe(topo, host, port, proto), host


def test_the_lab_host_takes_from_a_guest_only_the_listener_range_v4_v6_and_no_forged_source(topo):
    ll = topo["labhost_ll"]
    load(topo, render(lab_egress=True))  # the masquerade too: a forged source is not masqueraded out
    try:
        # controls: in the range, over IPv4 and over IPv6 link-local (which
        # needs neighbour discovery both ways), tcp and udp
        assert send(topo, LABHOST, IN_RANGE, "tcp", GUEST) == (0, GUEST)
        assert send(topo, LABHOST, IN_RANGE, "udp", GUEST) == (0, GUEST)
        assert send(topo, ll, IN_RANGE, "tcp") == (0, topo["guest_ll"])
        assert send(topo, ll, IN_RANGE, "udp") == (0, topo["guest_ll"])
        for port in (BELOW, ABOVE):
            # refused (TCP reset) over IPv4 and IPv6 alike; udp gets nothing back
            assert send(topo, LABHOST, port, "tcp", GUEST) == (1, "REFUSED"), port
            assert send(topo, ll, port, "tcp") == (1, "REFUSED"), port
            assert not probe(topo, LABHOST, port, "udp", GUEST), port
            assert not probe(topo, ll, port, "udp"), port
        # a forged source reaches nothing: not the listener range, not another
        # port, not forwarded (beside the genuine ones above and the public
        # address, reached from the guest's own address)
        for port in (IN_RANGE, BELOW):
            for proto in ("tcp", "udp"):
                assert not probe(topo, LABHOST, port, proto, SPOOF), (port, proto)
        assert send(topo, "203.0.113.7", 8080, "tcp", GUEST) == (0, "198.51.100.2")  # masqueraded
        assert not probe(topo, "203.0.113.7", 8080, "tcp", SPOOF)
        counters = run("nft", "list", "chain", "inet", "chv_lab_guard_test", "input_from_guest",
                       ns=topo["labhost"]).stdout
        # the forged packets were dropped by the lab's rule for them (counted)
        assert re.search(r"ip saddr != %s counter packets [1-9][0-9]* " % re.escape(LAB_NET), counters), counters
    finally:
        run("nft", "delete", "table", "inet", "chv_lab_guard_test", ns=topo["labhost"], check=False)
    # counter-proof: without the lab's table, every one of them arrives
    for port in (BELOW, ABOVE):
        assert send(topo, LABHOST, port, "tcp", GUEST) == (0, GUEST), port
        assert send(topo, ll, port, "tcp") == (0, topo["guest_ll"]), port
    assert send(topo, LABHOST, IN_RANGE, "tcp", SPOOF) == (0, SPOOF)
    assert send(topo, LABHOST, BELOW, "udp", SPOOF) == (0, SPOOF)
    assert send(topo, "203.0.113.7", 8080, "tcp", SPOOF) == (0, SPOOF)
