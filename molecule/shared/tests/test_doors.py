"""The doors fail closed: what chv-browser and sync fetch for a cell obeys the
cells' egress policy in the kernel, and chv-cell refuses to start a cell when
what it relies on is not in force. Through real cells on a converged guest.

Targets on the guest: one logging server (HTTP and a raw TLS port) bound to
every guest address, so that the guest's loopback, its uplink address, the
requesting cell's gateway and a metadata stand-in (169.254.169.254 on the
guest's loopback: no packet leaves the lab; this kernel has no dummy
interface driver, CONFIG_DUMMY is off) all reach it; a second cell
listening on its own address. Allowed target: a server on the lab host, bound
to the guest's gateway there (outside the guest). Every refusal is checked
beside that control in the same test, the servers' own logs show zero
requests, and a counter-proof removes the doors' rules (output chain) and
sees the same probes arrive.
"""

import contextlib
import json
import shlex
import socket
import threading
import time

import pytest

from conftest import OutsideHTTP, html, in_cell, lab_guest, only_in, run_roles

HTTP_PORT, TLS_PORT, CELL_PORT = 18800, 18443, 18802
OUT_HTTP, OUT_TLS, OUT_TLS_UNLISTED = 18801, 18444, 18445
META = "169.254.169.254"
NAME = "loopback.chv.test"
LOG = "/run/chv-molecule-doors.log"
MARKER = "/workspace/payload-ran"

# One script for the guest's target and the second cell's: log every request.
TARGET = r"""
import http.server, json, socket, sys, threading
log_path, http_port, tls_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def log(**kw):
    with open(log_path, "a") as fh:
        fh.write(json.dumps(kw) + "\n")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        log(kind="http", local=self.connection.getsockname()[0], path=self.path)
        self.send_response(200); self.send_header("Content-Type", "text/html"); self.end_headers()
        self.wfile.write(b"<!doctype html><title>guest service</title><h1>guest service</h1>")
    def log_message(self, *a):
        pass
def tls():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", tls_port)); s.listen(16)
    while True:
        c, a = s.accept(); c.settimeout(3)
        try:
            first = c.recv(3)
        except OSError:
            first = b""
        log(kind="tls", local=c.getsockname()[0], first=first.hex()); c.close()
if tls_port:
    threading.Thread(target=tls, daemon=True).start()
http.server.ThreadingHTTPServer(("0.0.0.0", http_port), H).serve_forever()
"""


class OutsideTLS(object):
    """A TCP listener on the lab host that records the first bytes of each connection."""

    def __init__(self, address, port):
        self.seen = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        with contextlib.suppress(OSError):  # accept() fails once close() shut the socket down
            while True:
                self._record(self.sock.accept()[0])

    def _record(self, conn):
        with conn:
            conn.settimeout(3)
            try:
                self.seen.append(conn.recv(3).hex())
            except OSError:
                self.seen.append("")

    def close(self):
        # shutdown wakes the thread blocked in accept(); close alone would keep
        # the listening socket alive (and its port bound) until that returns
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def guest_log(host, path=LOG):
    out = host.run("cat %s 2>/dev/null", path).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wait_for(predicate, seconds=5.0):
    """Whether ``predicate()`` came true within ``seconds`` (asked every 0.2 s, and once more at the end)."""
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def doors(host, policy_slots, slots):
    guest = lab_guest(host)
    s0, s1 = policy_slots[slots[0]], policy_slots[slots[1]]
    gw = guest["host_address"]
    embed = html("Embedding page", "<h1>embeds</h1>"
                 '<img src="http://%s:%d/img">' % (guest["address"], HTTP_PORT)
                 + '<iframe src="http://%s:%d/iframe"></iframe>' % (s1["address"], CELL_PORT)
                 + '<script>fetch("http://%s:%d/fetch", {mode: "no-cors"})</script>' % (META, HTTP_PORT))
    outside = OutsideHTTP(gw, OUT_HTTP, {
        "/": (200, {}, html("Outside page", "<h1>allowed outside page</h1>"), 0),
        "/redirect": (302, {"Location": "http://127.0.0.1:%d/redirected" % HTTP_PORT}, b"", 0),
        "/embed": (200, {}, embed, 0),
    })
    tls_ok, tls_unlisted = OutsideTLS(gw, OUT_TLS), OutsideTLS(gw, OUT_TLS_UNLISTED)
    with host.sudo():
        host.run("systemctl stop chv-molecule-target chv-molecule-cell1 2>/dev/null; rm -f %s", LOG)
        host.run("ip addr del %s/32 dev lo", META)
        host.run_expect([0], "ip addr add %s/32 dev lo", META)
        host.run_expect([0], "cp /etc/hosts /etc/hosts.chv-molecule && echo '127.0.0.1 %s' >> /etc/hosts", NAME)
        host.run_expect([0], "systemd-run --unit=chv-molecule-target --collect python3 -c %s %s %s %s",
                             TARGET, LOG, str(HTTP_PORT), str(TLS_PORT))
        cell_log = "/var/lib/chv-fleet/workspaces/%s/doors.log" % s1["name"]
        host.run("rm -f %s", cell_log)
        host.run_expect([0], "systemd-run --unit=chv-molecule-cell1 --collect chv-cell run --slot %s -- "
                             "python3 -c %s /workspace/doors.log %s 0", s1["name"], TARGET, str(CELL_PORT))
        # controls: every target answers the guest itself (root, not a door UID)
        for url in ("http://127.0.0.1:%d/ready" % HTTP_PORT, "http://%s:%d/ready" % (META, HTTP_PORT),
                    "http://%s:%d/ready" % (s1["address"], CELL_PORT)):
            host.run_expect([0], "for i in $(seq 100); do python3 -c %s && exit 0; sleep 0.1; done; exit 1",
                                 "import urllib.request; urllib.request.urlopen('%s', timeout=2)" % url)
        host.run("rm -f %s %s", LOG, cell_log)
    try:
        yield {"guest": guest, "s0": s0, "s1": s1, "outside": outside, "tls_ok": tls_ok,
               "tls_unlisted": tls_unlisted, "cell_log": cell_log}
    finally:
        with host.sudo():
            host.run("systemctl stop chv-molecule-target chv-molecule-cell1")
            host.run("ip addr del %s/32 dev lo", META)
            host.run("mv /etc/hosts.chv-molecule /etc/hosts")
            host.run("systemctl reload chv-cell-nat.service")
        for server in (outside, tls_ok, tls_unlisted):
            server.close()


def _browser_probes(d):
    """(what, url) opened from a cell of slot0; every one must be refused."""
    s0, s1, guest = d["s0"], d["s1"], d["guest"]
    return [
        ("guest loopback", "http://127.0.0.1:%d/lo" % HTTP_PORT),
        ("guest uplink address", "http://%s:%d/uplink" % (guest["address"], HTTP_PORT)),
        ("the cell's own gateway", "http://%s:%d/gateway" % (s0["gateway"], HTTP_PORT)),
        ("metadata stand-in", "http://%s:%d/meta" % (META, HTTP_PORT)),
        ("a name resolving to loopback", "http://%s:%d/name" % (NAME, HTTP_PORT)),
        ("a second cell", "http://%s:%d/cell" % (s1["address"], CELL_PORT)),
        ("a redirect to loopback", d["outside"].url + "/redirect"),
    ]


def _open(from_cell, slot, url):
    return from_cell(slot, {"op": "browser", "action": "open", "url": url})


def _arrived(host, d):
    """Paths that reached the guest's target and the second cell."""
    return sorted(e["path"] for e in guest_log(host) + guest_log(host, d["cell_log"]) if e.get("kind") == "http")


def test_browser_reaches_only_what_a_cell_may(host, doors, from_cell):
    slot = doors["s0"]["name"]
    control = _open(from_cell, slot, doors["outside"].url + "/")
    assert control.ok and 'heading "allowed outside page"' in control.result["aria_snapshot"], control
    for what, url in _browser_probes(doors):
        reply = _open(from_cell, slot, url)
        assert not reply.ok and reply.rc == 1, (what, reply)
        assert "ERR_CONNECTION_REFUSED" in reply.error or "ERR_" in reply.error, (what, reply)
    assert "/redirect" in doors["outside"].requests  # the allowed server was asked, the redirect's target never
    embed = _open(from_cell, slot, doors["outside"].url + "/embed")
    assert embed.ok and 'heading "embeds"' in embed.result["aria_snapshot"], embed
    time.sleep(2)  # give the page's fetch() time to be sent, were it allowed
    assert _arrived(host, doors) == [], "a door reached a denied target"
    with host.sudo():
        counters = json.loads(host.check_output("nft -j list counters table inet chv_cell"))["nftables"]
    dropped = {c["counter"]["name"]: c["counter"]["packets"] for c in counters if "counter" in c}
    assert dropped["drop_door_to_guest"] > 0 and dropped["drop_door_to_cell"] > 0 and dropped["accept_door"] > 0


def test_counter_proof_without_the_door_rules_the_probes_arrive(host, doors, from_cell):
    slot = doors["s0"]["name"]
    with host.sudo():
        host.run_expect([0], "nft flush chain inet chv_cell output")
    try:
        for what, url in _browser_probes(doors):
            _open(from_cell, slot, url)
        _open(from_cell, slot, doors["outside"].url + "/embed")
        expected = {"/lo", "/uplink", "/gateway", "/meta", "/name", "/cell", "/redirected", "/img", "/iframe",
                    "/fetch"}
        assert wait_for(lambda: expected <= set(_arrived(host, doors))), _arrived(host, doors)
    finally:
        with host.sudo():
            host.run_expect([0], "systemctl reload chv-cell-nat.service")
            host.run("rm -f %s %s", LOG, doors["cell_log"])
    with host.sudo():
        assert "jump door_out" in host.check_output("nft list chain inet chv_cell output")


def _sync_pull(host, from_cell, slot, remote):
    setup = ("cd /workspace && rm -rf door-repo && git init -q -b main door-repo && "
             "git -C door-repo remote add origin %s" % shlex.quote(remote))
    r = in_cell(host, slot, ["sh", "-c", setup])
    assert r.rc == 0, r.stderr
    return from_cell(slot, {"op": "sync", "action": "pull", "repo": "door-repo"})


def test_sync_reaches_only_what_a_cell_may(host, doors, from_cell):
    slot, guest = doors["s0"]["name"], doors["guest"]
    control = _sync_pull(host, from_cell, slot, "https://%s:%d/r.git" % (guest["host_address"], OUT_TLS))
    assert wait_for(lambda: doors["tls_ok"].seen), control
    assert doors["tls_ok"].seen[0].startswith("1603"), doors["tls_ok"].seen  # a TLS ClientHello
    for what, host_part in (("guest loopback", "127.0.0.1"), ("guest uplink address", guest["address"]),
                            ("metadata stand-in", META)):
        reply = _sync_pull(host, from_cell, slot, "https://%s:%d/r.git" % (host_part, TLS_PORT))
        assert reply.body is not None and reply.rc != 125, (what, reply)   # the cell ran and the broker answered
        assert not reply.ok or reply.result.get("returncode") != 0, (what, reply)
    time.sleep(1)
    assert [e for e in guest_log(host) if e.get("kind") == "tls"] == [], "sync reached a denied target"
    # chv_broker_sync_hosts (set by the scenario's converge) names only OUT_TLS on the lab host: another
    # port there is refused before git runs, and its listener sees nothing
    unlisted = _sync_pull(host, from_cell, slot, "https://%s:%d/r.git" % (guest["host_address"], OUT_TLS_UNLISTED))
    assert "not in chv_broker_sync_hosts" in json.dumps(unlisted.body), unlisted
    time.sleep(1)
    assert doors["tls_unlisted"].seen == []


@pytest.fixture
def marker_path(policy_slots, slots):
    path = "/var/lib/chv-fleet/workspaces/%s/payload-ran" % slots[0]
    return path


def test_launcher_refuses_without_the_table_and_runs_once_it_is_back(host, slots, marker_path):
    run = "chv-cell run --slot %s -- sh -c %s" % (slots[0], shlex.quote("touch %s" % MARKER))
    with host.sudo():
        host.run("rm -f %s", marker_path)
        host.run_expect([0], "nft delete table inet chv_cell")
        try:
            refused = host.run(run)
            assert refused.rc == 125 and "table inet chv_cell" in refused.stderr, refused
            assert not host.file(marker_path).exists
        finally:
            host.run_expect([0], "systemctl reload chv-cell-nat.service")
        ran = host.run(run)
        assert ran.rc == 0, ran.stderr
        assert host.file(marker_path).exists
        host.run("rm -f %s", marker_path)


USERNS_PROBE = ("import ctypes, os\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "r = libc.unshare(0x10000000)\n"
                "print('unshare', 'ok' if r == 0 else os.strerror(ctypes.get_errno()))\n")


VARIANT = ("import json, sys\n"
           "policy = json.load(open('/etc/chv-fleet/cell-policy.json'))\n"
           "policy.update(json.loads(sys.argv[2]))\n"
           "json.dump(policy, open(sys.argv[1], 'w'))\n")


@pytest.fixture
def policy_variant(host):
    """Make a copy of the guest's cell policy with some keys changed (root
    may pick a policy); the copies go again after the test."""
    made = []

    def make(name, **changes):
        path = "/etc/chv-fleet/molecule-%s.json" % name
        with host.sudo():
            host.run_expect([0], "python3 -c %s %s %s", VARIANT, path, json.dumps(changes))
        made.append(path)
        return path
    yield make
    with host.sudo():
        host.run("rm -f %s", " ".join(made))


def test_no_nested_user_namespaces_unless_the_policy_allows_them(host, slots, policy_variant):
    with host.sudo():
        # control: on the guest, outside any cell, both succeed
        assert host.run("unshare -U true").rc == 0
        assert host.check_output("python3 -c %s", USERNS_PROBE) == "unshare ok"
        cell = in_cell(host, slots[0], ["sh", "-c", "unshare -U true; echo rc=$?; python3 -c %s"
                                        % shlex.quote(USERNS_PROBE)])
        assert cell.rc == 0, cell.stderr
        assert "rc=0" not in cell.stdout and "unshare ok" not in cell.stdout, cell.stdout
        allowed = policy_variant("userns", allow_user_namespaces=True)
        r = host.run("chv-cell --policy %s run --slot %s -- python3 -c %s", allowed, slots[0], USERNS_PROBE)
        assert r.rc == 0 and r.stdout.strip() == "unshare ok", r


def test_runtime_max_stops_the_cell_with_exit_124(host, slots):
    with host.sudo():
        control = host.run("chv-cell run --slot %s --runtime-max 30 -- sh -c 'exit 3'", slots[0])
        assert control.rc == 3, control
        r = host.run("chv-cell run --slot %s --runtime-max 1 -- sleep 60", slots[0])
        assert r.rc == 124, r
        assert "idle" in host.check_output("chv-cell status | grep '^%s '", slots[0])


def test_shared_network_refused_unless_the_policy_allows_it(host, slots, policy_variant):
    with host.sudo():
        refused = host.run("chv-cell run --slot %s --shared-network -- true", slots[0])
        assert refused.rc == 78 and "chv_cell_allow_shared_network" in refused.stderr, refused
        allowed = policy_variant("shared", allow_shared_network=True)
        assert host.run("chv-cell --policy %s run --slot %s --shared-network -- true", allowed, slots[0]).rc == 0


def test_limits_the_guest_cannot_enforce_refuse_the_cell(host, slots, marker_path, policy_variant):
    with host.sudo():
        controllers = host.file("/sys/fs/cgroup/cgroup.controllers").content_string.split()
        strict = policy_variant("limits", require_limits=True)
        host.run("rm -f %s", marker_path)
        r = host.run("chv-cell --policy %s run --slot %s -- sh -c %s", strict, slots[0], "touch " + MARKER)
        if {"memory", "pids", "cpu"} <= set(controllers):
            pytest.skip("this guest delegates memory, pids and cpu: the limits are enforced, not refused")
        assert r.rc == 125 and "require_limits" in r.stderr, r
        assert not host.file(marker_path).exists
        # control: the scenario's policy (require_limits false in the lab) runs the same cell, with a warning
        ran = host.run("chv-cell run --slot %s -- sh -c %s", slots[0], "touch " + MARKER)
        assert ran.rc == 0 and "not enforced" in ran.stderr.lower(), ran
        assert host.file(marker_path).exists
        host.run("rm -f %s", marker_path)


# fleet only: the release is the roles' and the ruleset's, not the distribution's, and the trixie guest
# ends in proxy mode (test_faults.py, test_proxy_mode.py), where a cell reaches no outside page directly
@only_in("fleet")
@pytest.mark.ends_the_guest
def test_a_live_slot_is_not_released_and_a_forced_release_cuts_its_cell_off(host, doors, policy_slots, slots):
    s1 = policy_slots[slots[1]]
    out = "http://%s:%d/" % (doors["guest"]["host_address"], OUT_HTTP)
    # A cell of slot1 that probes the outside page each time the guest drops a numbered trigger in its workspace.
    loop = ("import os, sys, time, urllib.request\n"
            "n = 0\n"
            "while True:\n"
            "    t = '/workspace/probe-%d' % n\n"
            "    if os.path.exists(t):\n"
            "        try:\n"
            "            urllib.request.urlopen(sys.argv[1], timeout=3); r = 'ok'\n"
            "        except OSError as e:\n"
            "            r = 'fail %s' % e\n"
            "        open(t + '.out', 'w').write(r); n += 1\n"
            "    time.sleep(0.1)\n")
    ws = "/var/lib/chv-fleet/workspaces/%s" % s1["name"]
    view = {}

    def probe(n):
        # through the cell's own root: a forced release unmounts the slot's disk on the guest side
        # (its workspace path there is a plain directory again), while the live cell keeps its mounts
        trigger = "/proc/%d/root/workspace/probe-%d" % (view["pid"], n)
        host.run_expect([0], "touch %s", trigger)
        host.run_expect([0], "for i in $(seq 100); do test -s %s.out && exit 0; sleep 0.1; done; exit 1", trigger)
        return host.check_output("cat %s.out", trigger)

    with host.sudo():
        host.run("systemctl stop chv-molecule-cell1 chv-molecule-live 2>/dev/null; rm -f %s/probe-*", ws)
        host.run_expect([0], "systemd-run --unit=chv-molecule-live --collect chv-cell run --slot %s -- python3 -c %s %s",
                             s1["name"], loop, out)
        host.run_expect([0], "for i in $(seq 100); do test -s /run/chv-fleet/cells/%s.json && exit 0; sleep 0.1; done; "
                             "exit 1", s1["name"])
        pid = json.loads(host.file("/run/chv-fleet/cells/%s.json" % s1["name"]).content_string)["pid"]
        view["pid"] = pid
        try:
            assert probe(0) == "ok"  # control: the live cell reaches the outside
            refused = run_roles(["chv.fleet.cell_runtime", "chv.fleet.cell_nat"], {"chv_cell_slots": 1},
                                expect_ok=False)
            assert refused.returncode != 0
            # Molecule turns on display_failed_stderr (its ansible.cfg, inherited here): a failed task goes to stderr.
            said = refused.stdout + refused.stderr
            assert "slot %s has a running cell (pid %d" % (s1["name"], pid) in said, said[-3000:]
            assert s1["host_ifname"] in host.check_output("nft list set inet chv_cell cell_ifs")
            run_roles(["chv.fleet.cell_runtime", "chv.fleet.cell_nat"],
                      {"chv_cell_slots": 1, "chv_cell_identity_force": True})
            assert s1["host_ifname"] not in host.check_output("nft list set inet chv_cell cell_ifs")
            assert probe(1).startswith("fail"), "a cell of a released slot still reaches the outside"
        finally:
            host.run("systemctl stop chv-molecule-live")
            host.run("rm -f %s/probe-*", ws)
        # the guest keeps one slot (ends_the_guest): the released one is gone, the other still runs cells
        assert host.run("chv-cell run --slot %s -- true", s1["name"]).rc == 78
        assert host.run("chv-cell run --slot %s -- true", slots[0]).rc == 0
