"""Egress by name on the trixie guest (issue 33, docs/network.md "The
catalog in proxy mode"): test_faults.py's last converges put the guest in
proxy mode (tests/helpers/proxy_guests.py's variables; the scenario's lab
resolver stand-in answers the test names, molecule/trixie/molecule.yml).
chv-cell audit judges the catalog with the EGR cases and the doors through
the proxy; the EGR counter-proofs (the proxy's list widened for one slot,
the kernel's DNS and direct drops loosened) fail exactly their cases; the
sync door through the proxy: a task's clone and a cell's pull from an
allowed git host (a real git server on the lab host) work, and both to a
denied name are refused before any byte reaches its listener, each with its
line in the proxy's log. After test_faults.py, before nothing: the guest
stays in proxy mode until destroy. On bookworm, Debian 12's squid with the
role's configuration is proven in network namespaces
(tests/integration/netns/test_egress_proxy_netns.py)."""

import json
import re
import shlex
import time

import pytest

import gitserver
import proxy_guests
from chv_guest.cell import audit, egresslog
from conftest import CLIENT, lab_guest, lab_record, only_in

pytestmark = [only_in("trixie"), pytest.mark.ends_the_guest(order=0)]


def sudo_run(host, cmd):
    with host.sudo():
        return host.run(cmd)


def _audit(host, extra=""):
    """The guest's audit report (proxy_guests.audit_guest) and the peers the denied name's listener saw."""
    guest = lab_guest(host)
    return proxy_guests.audit_guest(lambda cmd: sudo_run(host, cmd), guest["address"], guest["host_address"], extra)


def test_in_proxy_mode_the_egr_cases_and_the_doors_pass(host):
    """Every case of proxy mode passes beside its control, the EGR ones
    among them, the browser door's refusals are the proxy's, and the denied
    name's listener sees the guest's own control connection only
    (proxy_guests.check_report)."""
    guest = lab_guest(host)
    # molecule/trixie/molecule.yml names the stand-in's names itself (YAML): they must be these
    assert lab_record()["resolver_names"] == proxy_guests.resolver_names(guest["host_address"])
    rep, seen = _audit(host)
    proxy_guests.check_report(rep, "trixie", guest["address"], seen)


def test_the_egr_counter_proofs_fail_exactly_their_cases(host):
    """Widening the proxy's list for cell A's slot fails EGR-02 and EGR-03
    only; accepting the cell's DNS fails EGR-05 only, its direct connection
    EGR-06 only; the runs before and after pass, and the proxy is back on
    its own configuration."""
    rep = _audit(host, " --counter-proof --case EGR-02 --case EGR-05 --case EGR-06")[0]
    got = dict((r["name"], (r["verdict"], r["failed"])) for r in rep["loosenings"])
    assert got == {"EGR-02": ("proven", ["EGR-02", "EGR-03"]), "EGR-05": ("proven", ["EGR-05"]),
                   "EGR-06": ("proven", ["EGR-06"])}, rep["loosenings"]
    assert rep["verdict"] == "proven", rep
    conf = sudo_run(host, "ls /etc/chv-fleet/egress-proxy/").stdout
    assert "chv-audit-orig" not in conf, conf


def _log_lines(host, since):
    """The proxy's log lines after line ``since`` (egresslog's fields), and the count now."""
    text = sudo_run(host, "cat %s" % egresslog.DEFAULT_LOG).stdout.splitlines()
    return [egresslog.parse_line(line) for line in text[since:]], len(text)


def test_the_sync_door_goes_through_the_proxy_with_the_slots_list(host, policy_slots):
    """A task's clone (before the task's first cell: the slot's
    gateway is on the guest's loopback for the clone) and a cell's pull
    through chv-broker's sync reach the allowed git host through the proxy;
    the same two to a denied name (allowed by chv-broker's own host list, so
    that the proxy is what refuses) get the proxy's 403, and the denied
    name's listener sees nothing. The proxy's log has a line for each
    attempt, of the task's slot, from its gateway, with its verdict."""
    why = gitserver.available()
    if why:
        pytest.skip(why)
    lab_host = lab_guest(host)["host_address"]
    git_url = "http://%s:%d/git/proj.git" % (proxy_guests.GIT, proxy_guests.GIT_PORT)
    denied_url = "http://%s:%d/git/proj.git" % (proxy_guests.DENIED, proxy_guests.DENY_PORT)
    # the account test_faults.py's converge gave the guest (chv_broker_sync_credentials, proxy_guests.site_vars)
    server = gitserver.GitServer(user=proxy_guests.GIT_USER, password=proxy_guests.GIT_PASSWORD, address=lab_host,
                                 port=proxy_guests.GIT_PORT).start()
    try:
        with audit.Listener(lab_host, proxy_guests.DENY_PORT) as deny:
            before = _log_lines(host, 0)[1]
            started = sudo_run(host, "chv-cell task start --repo " + git_url)
            assert started.rc == 0, started.stderr
            task = json.loads(started.stdout)
            assert task["repo"]["head"] == server.commits[-1], task           # control: cloned through the proxy
            try:
                pull = json.dumps({"op": "sync", "action": "pull"})
                script = ("python3 {c} '{p}'; echo; git remote set-url origin {d}; python3 {c} '{p}'; echo; "
                          "test -z \"$(ip -4 route show default)\" || ip -4 route show default"
                          .format(c=CLIENT, p=pull, d=denied_url))
                turn = sudo_run(host, "chv-cell run --task %s -- sh -c %s" % (task["task"], shlex.quote(script)))
                assert turn.rc == 0, (turn.stdout, turn.stderr)
                replies = [json.loads(out) for out in turn.stdout.splitlines() if out.startswith("{")]
                assert len(replies) == 2, turn.stdout
                assert replies[0]["ok"] and replies[0]["result"]["returncode"] == 0, replies[0]
                assert replies[1]["result"]["returncode"] != 0 and "403" in json.dumps(replies[1]), replies[1]
            finally:
                ended = sudo_run(host, "chv-cell task end " + task["task"])
                assert ended.rc == 0, ended.stderr
            refused = sudo_run(host, "chv-cell task start --repo " + denied_url)
            assert refused.rc == 76 and "403" in refused.stderr, (refused.rc, refused.stderr)
            time.sleep(1)
            assert deny.seen == [], deny.seen                                  # not a byte reached it
        lines, _n = _log_lines(host, before)
        slot = task["slot"]
        gateway = policy_slots[slot]["gateway"]
        # git's requests over plain HTTP are a line each (its first, without the credential, gets the server's
        # 401: failed); the denied name's attempts stop at their first request
        got = [(r["slot"], r["src"], r["host"], r["verdict"]) for r in lines if r]
        assert len(got) == len(lines) and set(g[:2] for g in got) == {(slot, gateway)}, lines
        allowed = [g[3] for g in got if g[2] == proxy_guests.GIT]
        assert allowed.count("allowed") >= 4 and "denied" not in allowed, got      # the clone's and the pull's
        assert [g[3] for g in got if g[2] == proxy_guests.DENIED] == ["denied", "denied"], got
        assert set(g[2] for g in got) == {proxy_guests.GIT, proxy_guests.DENIED}, got
        # the clone's address on the loopback is gone again
        assert not re.search(r"\b%s/32\b" % re.escape(gateway), sudo_run(host, "ip -4 -o addr show dev lo").stdout)
    finally:
        server.stop()
