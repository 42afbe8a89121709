"""Network-namespace lab for the cell_nat tests: a guest, an outside network and two cells.

Topology (every address lives only inside the namespaces created here)::

    outside ns                    guest ns                          cell ns a / b
    wan0 198.20.0.1/24  <---->  upA 198.20.0.2/24 (default route)
    lo: 198.20.1.1 198.20.1.200   chvh0 10.200.0.1/24  <---->  eth0 10.200.0.2/24
        198.20.2.1 198.20.3.1     chvh1 10.200.1.1/24  <---->  eth0 10.200.1.2/24
        169.254.169.254           (+ fd00:cafe:0::1/64, fd00:cafe:1::1/64 for the IPv6 checks)

The outside namespace has no route to 10.200.0.0/16: a cell reaches it
only through the guest's masquerade. The ruleset is rendered from the
role's own template with the same data the cell_nat_info module returns.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from ansible_collections.chv.fleet.plugins.module_utils import cell_nat

from testpaths import PROBES, ROOT

REPO = Path(ROOT)
TEMPLATE = REPO / "roles" / "cell_nat" / "templates" / "cell-nat.nft.j2"
STOP_FILE = REPO / "roles" / "cell_nat" / "files" / "cell-nat-stop.nft"
PROBE = Path(PROBES) / "cellnat_probe.py"
TIMEOUT = "0.6"


def lab_available():
    """None when the live tests can run, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("nft", "ip"):
        if not shutil.which(tool):
            return "%s is not installed" % tool
    probe = subprocess.run(["ip", "netns", "add", "cnt-probe-%d" % os.getpid()], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return "cannot create a network namespace: %s" % probe.stderr.strip()
    subprocess.run(["ip", "netns", "del", "cnt-probe-%d" % os.getpid()], check=False)
    return None


def render(data):
    """Render the role's template as Ansible does (trim_blocks, strict undefined)."""
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE.read_text()).render(__cell_nat_ruleset=data)


def make_slots(count, first_octet=0):
    return [{
        "name": "slot%d" % i, "index": i, "machine": "chv-slot%d" % i,
        "host_ifname": "chvh%d" % i, "cell_ifname": "eth0",
        "subnet": "10.200.%d.0/24" % (first_octet + i), "gateway": "10.200.%d.1" % (first_octet + i),
        "address": "10.200.%d.2" % (first_octet + i), "prefixlen": 24,
        "uid_base": 524288 + 65536 * i, "uid_size": 65536,
    } for i in range(count)]


def run(*argv, check=True, ns=None, timeout=30):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError("%s failed (%d): %s%s" % (" ".join(cmd), proc.returncode, proc.stdout, proc.stderr))
    return proc


def rule_count(ns, table="inet chv_cell"):
    family, name = table.split()
    items = json.loads(run("nft", "-j", "list", "table", family, name, ns=ns).stdout)["nftables"]
    return sum(1 for item in items if "rule" in item)


def table_json(ns, family="inet", name="chv_cell"):
    return json.loads(run("nft", "-j", "list", "table", family, name, ns=ns).stdout)["nftables"]


class Lab(object):
    def __init__(self):
        prefix = "cnt-%d-" % os.getpid()
        self.guest, self.outside = prefix + "guest", prefix + "out"
        self.cell_a, self.cell_b = prefix + "cella", prefix + "cellb"
        self.namespaces = [self.guest, self.outside, self.cell_a, self.cell_b]
        self.uplink = "upA"
        self.slots = make_slots(2)
        self.servers = []

    # ------------------------------------------------------------ setup
    def up(self):
        for ns in self.namespaces:
            run("ip", "netns", "add", ns)
            run("ip", "link", "set", "lo", "up", ns=ns)
            # No duplicate address detection: link-local addresses usable at once.
            run("sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0", "net.ipv6.conf.all.accept_dad=0", ns=ns)
        g, o = self.guest, self.outside
        run("ip", "link", "add", "upA", "netns", g, "type", "veth", "peer", "name", "wan0", "netns", o)
        run("ip", "addr", "add", "198.20.0.1/24", "dev", "wan0", ns=o)
        run("ip", "link", "set", "wan0", "up", ns=o)
        for addr in ("198.20.1.1/32", "198.20.1.200/32", "198.20.2.1/32", "198.20.3.1/32", "169.254.169.254/32"):
            run("ip", "addr", "add", addr, "dev", "lo", ns=o)
        run("ip", "addr", "add", "198.20.0.2/24", "dev", "upA", ns=g)
        run("ip", "link", "set", "upA", "up", ns=g)
        run("ip", "route", "add", "default", "via", "198.20.0.1", ns=g)
        run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=g)
        run("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1", ns=g)
        for slot, ns, v6 in ((self.slots[0], self.cell_a, "fd00:cafe:0"), (self.slots[1], self.cell_b, "fd00:cafe:1")):
            host_if = slot["host_ifname"]
            run("ip", "link", "add", host_if, "netns", g, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "addr", "add", "%s/24" % slot["gateway"], "dev", host_if, ns=g)
            run("ip", "addr", "add", "%s::1/64" % v6, "dev", host_if, "nodad", ns=g)
            run("ip", "link", "set", host_if, "up", ns=g)
            run("ip", "addr", "add", "%s/24" % slot["address"], "dev", "eth0", ns=ns)
            run("ip", "addr", "add", "%s::2/64" % v6, "dev", "eth0", "nodad", ns=ns)
            run("ip", "link", "set", "eth0", "up", ns=ns)
            run("ip", "route", "add", "default", "via", slot["gateway"], ns=ns)
            run("ip", "-6", "route", "add", "default", "via", "%s::1" % v6, ns=ns)
        self.serve(o, "tcp:0.0.0.0:8080", "tcp:0.0.0.0:8081", "udp:0.0.0.0:8053")
        self.serve(g, "tcp:[::]:2222", "udp:0.0.0.0:53")
        self.serve(self.cell_b, "tcp:[::]:7000")
        return self

    def serve(self, ns, *specs):
        specs = [s.replace("[", "").replace("]", "") for s in specs]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(PROBE), "serve"] + specs,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()
        if line != "READY":
            proc.kill()
            raise AssertionError("server in %s did not start: %s %s" % (ns, line, proc.stderr.read()))
        self.servers.append(proc)

    def down(self):
        for proc in self.servers:
            proc.kill()
            proc.wait()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    # ------------------------------------------------------------ ruleset
    def plan(self, **params):
        params.setdefault("slots", self.slots)
        route = run("ip", "-j", "-4", "route", "show", "default", ns=self.guest).stdout
        interfaces = set(run("ls", "/sys/class/net", ns=self.guest).stdout.split())
        return cell_nat.plan(params, interfaces, route)

    def apply(self, **params):
        """Render with the role's template, check with nft -c, load with nft -f; return the data."""
        data = self.plan(**params)
        self.load_text(render(data))
        return data

    def load_text(self, text, ns=None):
        path = Path("/tmp") / ("cnt-%d-ruleset.nft" % os.getpid())
        path.write_text(text)
        try:
            run("nft", "-c", "-f", path, ns=ns or self.guest)
            run("nft", "-f", path, ns=ns or self.guest)
        finally:
            path.unlink()

    def nft(self, script, ns=None):
        run("nft", script, ns=ns or self.guest)

    def remove_table(self):
        run("nft", "-f", STOP_FILE, ns=self.guest)

    def counters(self):
        out = run("nft", "-j", "list", "counters", "table", "inet", "chv_cell", ns=self.guest).stdout
        return {item["counter"]["name"]: item["counter"]["packets"]
                for item in json.loads(out)["nftables"] if "counter" in item}

    # ------------------------------------------------------------ traffic
    def probe(self, ns, host, port, proto="tcp", source=None):
        """The peer address the server saw, or None when nothing answered."""
        argv = [sys.executable, PROBE, "probe", proto, host, port, TIMEOUT] + ([source] if source else [])
        proc = run(*argv, ns=ns, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def lab():
    """A guest, an outside and two cell namespaces for one test module."""
    topology = Lab()
    try:
        yield topology.up()
    finally:
        topology.down()
