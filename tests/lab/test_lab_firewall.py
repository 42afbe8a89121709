"""The lab host's input filter (lab/roles/lab/templates/nat.nft.j2, chain
input_from_guest, for what arrives on the lab's veths): a guest reaches a
listener of the lab host inside the recorded test listener range (lab.json
listener_ports, role default lab_listener_ports) and not one outside it
(refused: TCP reset, ICMP port unreachable), in the same run, over IPv4 and
over the IPv6 link-local addresses of its veth alike. On the shared lab
of tests/lab/conftest.py (its second guest)."""

import json
import os
import re
import socket
import subprocess
import threading

import pytest


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/systemd-nspawn"),
                                reason="the lab needs root and systemd-nspawn")


# Runs on the guest: connect to each (host, port), read up to 5 bytes.
CONNECT = r'''
import json, socket, sys
out = {}
for host, port in json.loads(sys.argv[1]):
    try:
        s = socket.create_connection((host, port), timeout=4)
        out[str(port)] = s.recv(5).decode() or "empty"
        s.close()
    except OSError as exc:
        out[str(port)] = type(exc).__name__
print(json.dumps(out))
'''


def sockaddr(address, port):
    """(family, the address to bind or connect): IPv4, or IPv6 with a scope (fe80::...%ve-x)."""
    fam, dummy_t, dummy_p, dummy_c, addr = socket.getaddrinfo(address, port, 0, socket.SOCK_STREAM)[0]
    return fam, addr


def listen(address, port):
    """A TCP listener on (address, port) answering every connection with b"hello"."""
    fam, addr = sockaddr(address, port)
    srv = socket.socket(fam)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(addr)
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, dummy = srv.accept()
            except OSError:
                return
            conn.sendall(b"hello")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def free_port(address, lo, hi):
    for port in range(lo, hi + 1):
        fam, addr = sockaddr(address, port)
        s = socket.socket(fam)
        try:
            s.bind(addr)
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise AssertionError("no free port in %d-%d" % (lo, hi))


@pytest.fixture(scope="module")
def lab(site_lab):
    """The shared lab (tests/lab/conftest.py); its second guest, never converged, is the one used here."""
    return site_lab


def on_guest(lab, guest, *argv):
    cmd = ["ssh", "-i", lab["key"], "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
           "-o", "LogLevel=ERROR", "root@" + guest["address"]] + [" ".join("'%s'" % a.replace("'", "'\\''")
                                                                         for a in argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_a_guest_reaches_the_lab_host_only_in_the_listener_range(lab):
    guest = lab["guests"][-1]
    host = guest["host_address"]
    lo, hi = (int(x) for x in lab["listener_ports"].split("-"))
    inside_port = free_port(host, lo, hi)
    outside_port = free_port(host, hi + 1, hi + 1000)
    low_port = free_port(host, 1024, lo - 1)  # below the range, too
    servers = [listen(host, p) for p in (inside_port, outside_port, low_port)]
    try:
        r = on_guest(lab, guest, "python3", "-I", "-c", CONNECT,
                     json.dumps([[host, inside_port], [host, outside_port], [host, low_port]]))
        # the lab host itself reaches all three (the listeners work)
        local = {p: socket.create_connection((host, p), timeout=4).recv(5) for p in (inside_port, outside_port)}
    finally:
        for s in servers:
            s.close()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got[str(inside_port)] == "hello"  # control: in the range (and SSH replies came back)
    # refused by the lab host's input chain (a listener is there: see local)
    assert got[str(outside_port)] == "ConnectionRefusedError" and got[str(low_port)] == "ConnectionRefusedError", got
    assert local == {inside_port: b"hello", outside_port: b"hello"}
    # the drop is the lab table's input chain
    table = "chv_lab_" + lab["lab"]
    listing = subprocess.run(["nft", "list", "chain", "inet", table, "input_from_guest"], capture_output=True,
                             text=True, check=True).stdout
    assert "th dport %s accept" % lab["listener_ports"] in listing
    assert re.search(r"meta l4proto tcp counter packets [1-9][0-9]* bytes [0-9]+ reject with tcp reset", listing), listing


def link_local(ifname):
    """The IPv6 link-local address of one of the lab host's interfaces."""
    out = subprocess.run(["ip", "-j", "-6", "addr", "show", "dev", ifname, "scope", "link"], capture_output=True,
                         text=True, check=True).stdout
    return [a["local"] for e in json.loads(out) for a in e.get("addr_info", []) if a.get("family") == "inet6"][0]


def test_a_guest_reaches_the_lab_host_over_ipv6_link_local_only_in_the_listener_range(lab):
    """The guest's veth has an IPv6 link-local address at both ends although
    the lab is IPv4: the same range, the same refusal, over IPv6."""
    guest = lab["guests"][-1]
    host_ll = link_local(guest["host_ifname"])
    here = "%s%%%s" % (host_ll, guest["host_ifname"])    # the lab host's view of its own end
    there = "%s%%%s" % (host_ll, guest["ifname"])        # the guest's view: its interface as the scope
    lo, hi = (int(x) for x in lab["listener_ports"].split("-"))
    inside_port = free_port(here, lo, hi)
    outside_port = free_port(here, hi + 1, hi + 1000)
    low_port = free_port(here, 1024, lo - 1)
    servers = [listen(here, p) for p in (inside_port, outside_port, low_port)]
    try:
        r = on_guest(lab, guest, "python3", "-I", "-c", CONNECT,
                     json.dumps([[there, inside_port], [there, outside_port], [there, low_port]]))
        local = {}
        for p in (inside_port, outside_port, low_port):
            fam, addr = sockaddr(here, p)
            with socket.socket(fam) as c:
                c.settimeout(4)
                c.connect(addr)
                local[p] = c.recv(5)
    finally:
        for s in servers:
            s.close()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got[str(inside_port)] == "hello", got  # control: in the range (neighbour discovery works)
    assert got[str(outside_port)] == "ConnectionRefusedError" and got[str(low_port)] == "ConnectionRefusedError", got
    assert local == {inside_port: b"hello", outside_port: b"hello", low_port: b"hello"}
