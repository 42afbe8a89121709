"""The lab host's guard rail (lab/roles/lab/templates/nat.nft.j2), loaded into a
network namespace that stands in for the lab host.

Topology (every address lives only inside the namespaces made here)::

    guest ns                      labhost ns                        outside ns
    eth0 10.99.30.2/28  <---->  vg 10.99.30.1/28      uplnk 198.51.100.2/24 <--> wan 198.51.100.1/24 (default)
                                                                            lo: 192.168.77.1 169.254.169.254
                                                                                10.255.255.53 203.0.113.7

A probe that slips through a broken boundary in a guest must still not reach
link-local or private ranges outside the lab; the lab host's resolver stays
reachable for DNS only; a public address is the control. Counter-proof:
without the table the same probes arrive.
"""

import os
import pathlib
import subprocess
import sys

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


def render(lab_egress):
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["bool"] = bool
    # the listener range as the role has it (its one home: defaults/main.yml)
    defaults = yaml.safe_load((pathlib.Path(LAB_ROLE) / "defaults" / "main.yml").read_text())
    return env.from_string(TEMPLATE.read_text()).render(
        lab_name="guard-test", lab_egress=lab_egress, __lab_plan={"network": LAB_NET}, __lab_nameservers=[RESOLVER],
        lab_listener_ports=defaults["lab_listener_ports"])


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
        proc = subprocess.Popen(["ip", "netns", "exec", outside, sys.executable, str(cellnat_lab.PROBE), "serve",
                                 "tcp:0.0.0.0:8080", "udp:%s:53" % RESOLVER],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        servers.append(proc)
        assert proc.stdout.readline().strip() == "READY"
        yield {"guest": guest, "labhost": labhost}
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        for ns in (guest, labhost, outside):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def probe(topo, host, port, proto="tcp"):
    proc = run(sys.executable, cellnat_lab.PROBE, "probe", proto, host, port, cellnat_lab.TIMEOUT,
               ns=topo["guest"], check=False)
    return proc.returncode == 0


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
        run("nft", "delete", "table", "ip", "chv_lab_guard_test", ns=topo["labhost"], check=False)
    # counter-proof: without the lab's table, every one of them arrives
    for host, port, proto in GUARDED:
        assert probe(topo, host, port, proto), host
