"""Egress by name on a real bookworm guest (issue 33, docs/network.md
"The catalog in proxy mode"): a lab of one guest (baked image; squid comes
from the Debian mirror, lab_egress) with the lab's resolver stand-in,
converged by site.yml in proxy mode. chv-cell audit judges the catalog with
the EGR cases (and the doors through the proxy), and the EGR counter-proofs
(the proxy's list widened for one slot, the kernel's DNS and direct drops
loosened) fail exactly their cases. The sync door through the proxy: a
task's clone and a cell's pull from an allowed git host (a real git server
on the lab host) work, and both to a denied name are refused before any
byte reaches its listener, each with its line in the proxy's log. The
names resolve only at the stand-in, to the lab host's listeners; nothing
leaves the lab (tests/helpers/proxy_guests.py). The same audit on trixie,
and a full converge in proxy mode that changes nothing but what a test
broke, run on the trixie scenario's guest, which its last converges put in
proxy mode (molecule/shared/tests/test_faults.py and test_proxy_mode.py):
a guest and two converges fewer for make test than a trixie guest here."""

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

import gitserver
import proxy_guests
from chv_guest.cell import audit, egresslog
from test_lab import playbook
from testpaths import ROOT

LAB = "lproxy"
NETWORK = "10.99.38.0/28"
HOST = "10.99.38.1"          # the lab host, the guest's side: the listeners
GUEST, ADDRESS = "lproxy1", "10.99.38.2"
DENY_PORT, GIT_PORT = proxy_guests.DENY_PORT, 18772
NAMES = dict(proxy_guests.resolver_names(HOST), **{"git.chv-lab.test": HOST})
# the lab host's git server (tests/helpers/gitserver.py), by its name; its account's password is this run's
GIT_URL = "http://git.chv-lab.test:%d/git/proj.git" % GIT_PORT
DENIED_GIT_URL = "http://%s:%d/git/proj.git" % (proxy_guests.DENIED, DENY_PORT)
GIT_PASSWORD = base64.b32encode(os.urandom(15)).decode().lower()
LAB_VARS = ["lab_name=" + LAB, "lab_network=" + NETWORK, json.dumps({
    "lab_guests": [{"name": GUEST, "distro": "bookworm"}], "lab_egress": True, "lab_resolver_names": NAMES})]
SITE_VARS = dict(proxy_guests.site_vars([{"name": "git.chv-lab.test", "port": GIT_PORT}]), **{
    # the sync door: both git hosts pass chv-broker's own list, so that the proxy is what refuses
    "chv_broker_sync_protocols": ["http", "https"],
    "chv_broker_sync_hosts": ["git.chv-lab.test:%d" % GIT_PORT, "%s:%d" % (proxy_guests.DENIED, DENY_PORT)],
    "chv_broker_sync_credentials": "http://executor:%s@git.chv-lab.test:%d\n" % (GIT_PASSWORD, GIT_PORT),
    # the lab host (the plain layer replaces the inventory's per-guest one)
    "cell_nat_egress_allow": [{"cidr": HOST + "/32", "comment": "the lab host"}]})
DIR = "/var/lib/chv-fleet-lab/" + LAB
CLIENT = "/usr/lib/chv-fleet/chv_guest/broker/client.py"


def ssh(address, command, timeout=900):
    return subprocess.run(["ssh", "-i", DIR + "/id_ed25519", "-o", "StrictHostKeyChecking=no", "-o",
                           "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "root@" + address, command],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def proxy_lab(tmp_path_factory):
    """The lab up and converged in proxy mode; down afterwards."""
    playbook("lab_down.yml", *LAB_VARS)
    rc, dummy, out = playbook("lab_up.yml", *LAB_VARS)
    assert rc == 0, out[-3000:]
    extra = tmp_path_factory.mktemp("proxy") / "vars.json"
    extra.write_text(json.dumps(SITE_VARS))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1")
    site = subprocess.run(_site_argv(extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
                          check=False)
    try:
        assert site.returncode == 0, site.stdout[-4000:]
        yield extra
    finally:
        playbook("lab_down.yml", *LAB_VARS)


def _site_argv(extra):
    return [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "site.yml", "-i",
            DIR + "/inventory.yml", "-e", "@%s" % extra]


def _audit(extra=""):
    """The guest's audit report (tests/helpers/proxy_guests.py) and the peers the denied name's listener saw."""
    return proxy_guests.audit_guest(lambda cmd: ssh(ADDRESS, cmd), ADDRESS, HOST, extra)


def test_a_proxy_mode_guest_passes_the_egr_cases_and_the_doors_through_the_proxy(proxy_lab):
    """Every case of proxy mode passes beside its control, the EGR ones
    among them, and the browser door's refusals are the proxy's; the denied
    name's listener sees the guest's own control connection only
    (proxy_guests.check_report)."""
    rep, seen = _audit()
    proxy_guests.check_report(rep, "bookworm", ADDRESS, seen)


def test_the_egr_counter_proofs_fail_exactly_their_cases(proxy_lab):
    """Widening the proxy's list for cell A's slot fails EGR-02 and EGR-03
    only; accepting the cell's DNS fails EGR-05 only, its direct connection
    EGR-06 only; the runs before and after pass, and the proxy is back on
    its own configuration."""
    rep = _audit(" --counter-proof --case EGR-02 --case EGR-05 --case EGR-06")[0]
    got = dict((r["name"], (r["verdict"], r["failed"])) for r in rep["loosenings"])
    assert got == {"EGR-02": ("proven", ["EGR-02", "EGR-03"]), "EGR-05": ("proven", ["EGR-05"]),
                   "EGR-06": ("proven", ["EGR-06"])}, rep["loosenings"]
    assert rep["verdict"] == "proven", rep
    conf = ssh(ADDRESS, "ls /etc/chv-fleet/egress-proxy/").stdout
    assert "chv-audit-orig" not in conf, conf


def _log_lines(address, since):
    """The proxy's log lines after line ``since`` (egresslog's fields), and the count now."""
    text = ssh(address, "cat %s" % egresslog.DEFAULT_LOG).stdout.splitlines()
    return [egresslog.parse_line(line) for line in text[since:]], len(text)


def test_the_sync_door_goes_through_the_proxy_with_the_slots_list(proxy_lab):
    """A task's clone (before the task's first cell: the slot's
    gateway is on the guest's loopback for the clone) and a cell's pull
    through chv-broker's sync reach the allowed git host through the proxy;
    the same two to a denied name (allowed by chv-broker's own host list, so
    that the proxy is what refuses) get the proxy's 403, and the denied
    name's listener sees nothing. The proxy's log has a line for each
    attempt, of the task's slot, from its gateway, with its verdict."""
    address = ADDRESS
    server = gitserver.GitServer(address=HOST, port=GIT_PORT, password=GIT_PASSWORD).start()
    try:
        with audit.Listener(HOST, DENY_PORT) as deny:
            before = _log_lines(address, 0)[1]
            started = ssh(address, "chv-cell task start --repo " + GIT_URL)
            assert started.returncode == 0, started.stderr
            task = json.loads(started.stdout)
            assert task["repo"]["head"] == server.commits[-1], task           # control: cloned through the proxy
            try:
                pull = json.dumps({"op": "sync", "action": "pull"})
                script = ("python3 {c} '{p}'; echo; git remote set-url origin {d}; python3 {c} '{p}'; echo; "
                          "test -z \"$(ip -4 route show default)\" || ip -4 route show default"
                          .format(c=CLIENT, p=pull, d=DENIED_GIT_URL))
                turn = ssh(address, "chv-cell run --task %s -- sh -c %s" % (task["task"], shlex.quote(script)))
                assert turn.returncode == 0, (turn.stdout, turn.stderr)
                replies = [json.loads(line) for line in turn.stdout.splitlines() if line.startswith("{")]
                assert len(replies) == 2, turn.stdout
                assert replies[0]["ok"] and replies[0]["result"]["returncode"] == 0, replies[0]
                assert replies[1]["result"]["returncode"] != 0 and "403" in json.dumps(replies[1]), replies[1]
            finally:
                ended = ssh(address, "chv-cell task end " + task["task"])
                assert ended.returncode == 0, ended.stderr
            refused = ssh(address, "chv-cell task start --repo " + DENIED_GIT_URL)
            assert refused.returncode == 76 and "403" in refused.stderr, (refused.returncode, refused.stderr)
            time.sleep(1)
            assert deny.seen == [], deny.seen                                  # not a byte reached it
        lines, _n = _log_lines(address, before)
        slot = task["slot"]
        gateway = ssh(address, "python3 -c 'import json; print([s[\"gateway\"] for s in json.load(open("
                               "\"/etc/chv-fleet/cell-policy.json\"))[\"slots\"] if s[\"name\"] == \"%s\"][0])'"
                      % slot).stdout.strip()
        # git's requests over plain HTTP are a line each (its first, without the credential, gets the server's
        # 401: failed); the denied name's attempts stop at their first request
        got = [(r["slot"], r["src"], r["host"], r["verdict"]) for r in lines if r]
        assert len(got) == len(lines) and set(g[:2] for g in got) == {(slot, gateway)}, lines
        allowed = [g[3] for g in got if g[2] == "git.chv-lab.test"]
        assert allowed.count("allowed") >= 4 and "denied" not in allowed, got      # the clone's and the pull's
        assert [g[3] for g in got if g[2] == "denied.chv-lab.test"] == ["denied", "denied"], got
        assert set(g[2] for g in got) == {"git.chv-lab.test", "denied.chv-lab.test"}, got
        # the clone's address on the loopback is gone again
        assert not re.search(r"\b%s/32\b" % re.escape(gateway), ssh(address, "ip -4 -o addr show dev lo").stdout)
    finally:
        server.stop()
