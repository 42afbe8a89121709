"""chv.fleet.broker on a converged guest, through real cells (chv-cell run).

Every refusal is checked beside a request that succeeds: from a cell vs. a
guest process outside any cell, the slot's own repository vs. another
slot's, the sync worker reading the credentials vs. the cell reading them.
"""

import json
import shlex
import time

import pytest

from conftest import CLIENT, Reply, in_cell, kill_mid_request, unit_value

CREDENTIALS = "/etc/chv/broker/git-credentials"
SECRET = "molecule-s3cret-token"
GIT_INIT = ("git init -q -b main repo && cd repo && "
            "git -c user.name=cell -c user.email=cell@invalid commit -q --allow-empty -m init && "
            "git remote add origin https://git.example.invalid/agent/repo.git")


@pytest.fixture(scope="module")
def repos(host, slots):
    """A git repository made by each of the first two slots in its own workspace."""
    for slot in slots[:2]:
        r = in_cell(host, slot, ["sh", "-c", "cd /workspace && rm -rf repo && " + GIT_INIT])
        assert r.rc == 0, r.stderr
    saved = CREDENTIALS + ".molecule-test-broker"  # the converge's own file (the fleet's vault), put back after
    with host.sudo():
        host.run_expect([0], "test ! -e {0} || cp -p {0} {1}".format(CREDENTIALS, saved))
        host.run_expect([0], "install -m 0600 -o root -g root /dev/null %s && printf '%%s\\n' %s > %s",
                             CREDENTIALS, shlex.quote("https://agent:%s@git.example.invalid" % SECRET), CREDENTIALS)
    yield slots[:2]
    with host.sudo():
        host.run("if test -e {1}; then mv -f {1} {0}; else rm -f {0}; fi".format(CREDENTIALS, saved))


def _audit(host, since, count):
    """chv-broker's audit lines in the journal since ``since``, once there are ``count`` of them (journald
    stores a line after the reply that the client already has: CI read the journal a line short), or after
    10 s, what there is."""
    deadline = time.monotonic() + 10
    while True:
        out = host.check_output("journalctl -u chv-broker.service -o cat --since=@%s" % since)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        audit = [a for a in lines if a.get("event") == "chv-broker.audit"]
        if len(audit) >= count or time.monotonic() > deadline:
            return audit
        time.sleep(0.2)


@pytest.fixture
def live_cell(host, slots):
    """A cell of the first slot that stays up (its uid range is then a live one)."""
    host.run("systemctl stop chv-molecule-cell.service 2>/dev/null; systemctl reset-failed chv-molecule-cell.service 2>/dev/null")
    host.run_expect([0], "systemd-run --unit=chv-molecule-cell chv-cell run --slot %s -- sleep 120", slots[0])
    host.run_expect([0], "for i in $(seq 100); do test -s /run/chv-fleet/cells/%s.json && exit 0; sleep 0.1; done; exit 1", slots[0])
    yield slots[0]
    host.run("systemctl stop chv-molecule-cell.service")


def test_units_enabled_and_socket_for_cells(host):
    assert host.service("chv-broker.socket").is_enabled
    assert host.service("chv-broker.socket").is_running
    sock = host.file("/run/chv/broker.sock")
    assert sock.is_socket and sock.mode == 0o666 and sock.user == "root"


def test_ping_from_a_cell_and_rejected_from_the_guest(host, slots, live_cell, from_cell, from_guest, policy_slots):
    since = host.check_output("date +%s")
    ok = from_cell(slots[1], {"op": "ping"})
    assert ok.ok, ok
    assert ok.result == {"pong": True, "slot": slots[1]}
    # the same request from guest processes outside any cell, while a cell
    # of slot0 is live: as root, and as slot0's cell root uid
    as_root = from_guest({"op": "ping"})
    assert as_root.rc == 1 and "not a process of a live chv cell" in as_root.error, as_root
    cell_uid = policy_slots[live_cell]["uid_base"]
    as_cell_uid = from_guest({"op": "ping"}, user=cell_uid)
    assert as_cell_uid.rc == 1 and "not a process of a live chv cell" in as_cell_uid.error, as_cell_uid
    audit = [(a["slot"], a["verdict"], a.get("peer_uid"), a.get("reason")) for a in _audit(host, since, 3)]
    assert (slots[1], "ok", None, None) in audit, audit
    assert (None, "rejected", 0, "uid outside every live cell's range") in audit, audit
    assert (None, "rejected", cell_uid, "pid namespace is not a live cell's") in audit, audit


def test_unknown_and_malformed_requests_refused_broker_survives(host, slots, from_cell):
    unknown = from_cell(slots[0], {"op": "shell", "cmd": "id"})
    assert unknown.rc == 1 and unknown.error, unknown
    bad = Reply(in_cell(host, slots[0], ["python3", CLIENT, "{not json"]))
    assert bad.rc == 1 and bad.error, bad
    after = from_cell(slots[0], {"op": "ping"})
    assert after.ok, after


def test_sync_status_works_while_the_cell_cannot_read_the_credentials(host, repos, from_cell):
    since = host.check_output("date +%s")
    status = from_cell(repos[0], {"op": "sync", "action": "status", "repo": "repo"})
    assert status.ok, status
    assert status.result["returncode"] == 0 and status.result["stdout"].startswith("## main"), status
    # it ran in a transient service of its own (chv_broker_sync_isolation: unit), not in chv-broker
    started = host.check_output("journalctl -o cat --since=@%s -u 'chv-broker-sync-%s-*'", since, repos[0])
    assert "Started chv-broker-sync-%s-" % repos[0] in started, started
    # control: the credentials exist and root outside the cell reads them
    with host.sudo():
        assert SECRET in host.file(CREDENTIALS).content_string
    direct = in_cell(host, repos[0], ["cat", CREDENTIALS])
    assert direct.rc != 0 and SECRET not in direct.stdout, direct.stdout
    listing = in_cell(host, repos[0], ["ls", "/etc/chv"])
    assert listing.rc != 0 and "Permission denied" in listing.stderr, listing.stderr


def test_another_slots_repository_is_refused(host, repos, from_cell):
    mine, theirs = repos
    own = from_cell(theirs, {"op": "sync", "action": "status", "repo": "repo"})
    assert own.ok and own.result["returncode"] == 0, own
    # the worker runs as the slot's own uid: another slot's 0700 workspace does
    # not even resolve for it (and would be outside this slot's workspace)
    for repo in ("../%s/repo" % theirs, "/var/lib/chv-fleet/workspaces/%s/repo" % theirs):
        refused = from_cell(mine, {"op": "sync", "action": "status", "repo": repo})
        assert refused.rc == 1 and refused.error.startswith("sync rejected: "), (repo, refused)
    # paths that resolve (the worker may read them) but lie outside the workspace
    for repo in ("..", "/etc"):
        refused = from_cell(mine, {"op": "sync", "action": "status", "repo": repo})
        assert refused.rc == 1 and "outside the slot's workspace" in refused.error, (repo, refused)
    # a symlink the cell plants in its own workspace, pointing at the other slot
    link = in_cell(host, mine, ["ln", "-sfn", "/var/lib/chv-fleet/workspaces/%s/repo" % theirs, "/workspace/evil"])
    assert link.rc == 0, link.stderr
    refused = from_cell(mine, {"op": "sync", "action": "status", "repo": "evil"})
    assert refused.rc == 1, refused


def test_killed_broker_fails_the_request_then_serves_the_next(host, slots, from_cell):
    # A cell connects and sends half a request; chv-broker is SIGKILLed while
    # it waits for the rest. The client sees the connection drop (exit 2),
    # systemd restarts the service, and the next request is served.
    half = ("import socket\n"
            "s = socket.socket(socket.AF_UNIX); s.connect('/run/chv/broker.sock')\n"
            "s.sendall(b'{\"op\": \"pi'); s.settimeout(30)\n"
            "print('sent', flush=True)\n"
            "print('reply=%r' % s.recv(4096))\n")
    killed, before, out = kill_mid_request(host, "chv-broker.service", slots[0], ["python3", "-c", half],
                                           "grep -q sent $OUT")
    assert killed > 0 and "reply=b''" in out, out
    after = from_cell(slots[0], {"op": "ping"})
    assert after.ok, after
    assert host.service("chv-broker.service").is_running
    now = int(unit_value(host, "chv-broker.service", "MainPID"))
    restarts = int(unit_value(host, "chv-broker.service", "NRestarts"))
    assert now not in (0, killed) and restarts == before + 1, (killed, now, before, restarts)
