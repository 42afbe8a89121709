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
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cellnat_lab
import egress_lab
from cellnat_lab import run
from egress_lab import ENTRIES, PORT, PROBE, RESOLVER

from chv_guest.broker import server as brokerserver
from chv_guest.cell import argv as argvmod
from chv_guest.cell import egresslog
from chv_guest.cell import ruleset

_SKIP = egress_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def plab():
    with egress_lab.running_lab() as lab:
        yield lab


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


# ------------------------------------------------------------ the doors (chv-browser, the sync worker's git)

SYNCRUN = Path(__file__).resolve().parents[3] / "src" / "chv_guest" / "broker" / "syncrun.py"


def _as_uid(lab, uid, *argv, **kw):
    """argv in the guest as ``uid``."""
    return subprocess.run(["ip", "netns", "exec", lab.guest, "setpriv", "--reuid=%d" % uid, "--regid=%d" % uid,
                           "--clear-groups"] + [str(a) for a in argv], capture_output=True, text=True, timeout=60,
                          check=False, **kw)


def _as_door(lab, index, *argv, **kw):
    """argv in the guest as slot ``index``'s UID (a sync worker's; a door_uids member)."""
    return _as_uid(lab, lab.slots[index]["uid_base"], *argv, **kw)


def _sync(lab, index, remote):
    """chv-broker's sync worker (syncrun.py, the spec as Broker.op_sync makes it: worker_spec with the
    record's egress_proxy) fetching from ``remote`` into a fresh workspace of slot ``index``; its result."""
    uid = lab.slots[index]["uid_base"]
    ws = lab.work / ("ws-%d-%d" % (index, len(list(lab.work.glob("ws-*")))))
    env = dict(os.environ, GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", "init", "-q", "-b", "main", str(ws)], env=env, check=True)
    subprocess.run(["git", "-C", str(ws), "remote", "add", "origin", remote], env=env, check=True)
    subprocess.run(["chown", "-R", "%d:%d" % (uid, uid), str(ws)], check=True)
    scfg = {"protocols": ["http", "https"], "hosts": [], "python": sys.executable,
            "rlimit_as": 0, "rlimit_cpu": 0}
    spec = brokerserver.worker_spec(scfg, str(ws), ".", ["git", "fetch", "-q", "origin"], b"", lab.door_url(index))
    proc = _as_door(lab, index, sys.executable, "-I", SYNCRUN, json.dumps(spec), stdin=subprocess.DEVNULL)
    head = subprocess.run(["git", "-C", str(ws), "rev-parse", "--verify", "-q", "origin/main"],
                          env=dict(env, GIT_DIR=str(ws / ".git")), capture_output=True, text=True, check=False)
    return proc, head.stdout.strip()


def test_the_sync_doors_git_fetches_from_an_allowed_host_and_a_denied_one_gets_no_byte(plab):
    lab = plab
    logged = len(lab.log_lines())
    proc, head = _sync(lab, 0, "http://git.test/repo.git")
    assert proc.returncode == 0, proc.stderr
    assert len(head) == 40                                                     # control: fetched, through the proxy
    assert lab.reached(egress_lab.GIT_ADDR + ":80")
    proc, head = _sync(lab, 0, "http://denied.test/repo.git")
    assert proc.returncode != 0 and head == ""
    assert "403" in proc.stderr
    assert lab.reached("198.20.2.1:80") == []                                   # not a byte reached it
    assert lab.queried("denied.test") == []
    # the door cannot go around the proxy: its direct connection is refused by the kernel (drop_door_direct)
    lab.probe(lab.guest, "198.20.2.1", 80)
    assert len(lab.reached("198.20.2.1:80")) == 1                              # control: the guest's root reaches it
    direct = _as_door(lab, 0, sys.executable, cellnat_lab.PROBE, "probe", "tcp", "198.20.2.1", 80, 2)
    assert direct.returncode != 0
    assert len(lab.reached("198.20.2.1:80")) == 1
    counter = json.loads(run("nft", "-j", "list", "counter", "inet", "chv_cell", "drop_door_direct",
                             ns=lab.guest).stdout)["nftables"][1]["counter"]
    assert counter["packets"] >= 1
    got = [(r["slot"], r["src"], r["host"], r["verdict"]) for r in lab.log_lines()[logged:]]
    gateway = lab.slots[0]["gateway"]
    assert ("slot0", gateway, "git.test", "allowed") in got                    # the door's lines: the slot's,
    assert ("slot0", gateway, "denied.test", "denied") in got                  # from its gateway address
    assert all(r[1] == gateway for r in got)


def test_a_door_gets_the_list_of_the_slot_it_acts_for(plab):
    """group.test is slot1's only (slot_group second): the door through slot1's proxy URL reaches it,
    through slot0's it is refused; a cell of slot1 is the control that the name works for slot1."""
    lab = plab
    logged = len(lab.log_lines())
    assert lab.connect(lab.cell_b, "group.test")["body"] == "hello from 198.20.1.1:443"     # control: a cell
    for index, expect in ((1, "HTTP/1.1 200 Connection established"), (0, "HTTP/1.1 403 Forbidden")):
        host, port = lab.door_url(index)[len("http://"):].split(":")
        out = _as_door(lab, index, sys.executable, PROBE, "connect", host, port, "group.test", 443)
        assert json.loads(out.stdout)["proxy"] == expect, out.stderr
    got = [(r["slot"], r["host"], r["verdict"]) for r in lab.log_lines()[logged:]]
    assert got == [("slot1", "group.test", "allowed"), ("slot1", "group.test", "allowed"),
                   ("slot0", "group.test", "denied")]


def test_no_other_process_of_the_guest_reaches_the_proxy_on_a_slots_gateway(plab):
    """squid takes a connection from a slot's gateway for that slot's (its list, its log): only the doors
    make one. A process of the guest that is no door (uid 65533) gets no connection and drop_proxy_outside
    counts it, nor a line in the proxy's log; the control: slot0's door, the same command, is answered."""
    lab = plab
    before, logged = lab.counters(), len(lab.log_lines())
    host, port = lab.door_url(0)[len("http://"):].split(":")
    probe = (sys.executable, PROBE, "connect", host, port, "allowed.test", 443)
    door = _as_door(lab, 0, *probe)
    assert json.loads(door.stdout)["proxy"] == "HTTP/1.1 200 Connection established", door.stderr
    other = _as_uid(lab, 65533, *probe)
    assert json.loads(other.stdout)["proxy"].startswith("ERROR"), (other.stdout, other.stderr)
    assert lab.counters()["drop_proxy_outside"] - before["drop_proxy_outside"] >= 1
    assert [(r["slot"], r["host"]) for r in lab.log_lines()[logged:]] == [("slot0", "allowed.test")]

