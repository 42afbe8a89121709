"""Warm cells: the messages, the checks at hand-over, the receiver's parsing,
the slot states, and one hand-over over a real socketpair with real fds
(no cell: tests/integration and Molecule run real warm cells)."""

import array
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from chv_guest.cell import actions, argv as argvmod, claim as claimmod, handover, policy as policymod, records, warm
from chv_guest.cell import warm_receive


def test_the_policy_names_only_its_own_slots_as_warm(raw_policy):
    raw_policy["warm_slots"] = ["slot1"]
    assert policymod.validate(raw_policy) == []
    raw_policy["warm_slots"] = ["slot9", "slot1", "slot1"]
    errors = policymod.validate(raw_policy)
    assert "warm_slots: 'slot9' is not a slot of this policy" in errors
    assert "warm_slots: a slot is named twice" in errors
    raw_policy["warm_slots"] = "slot1"
    assert policymod.validate(raw_policy) == ["warm_slots: must be a list of slot names"]


def test_a_request_carries_a_real_argv_and_at_most_the_policy_runtime():
    assert warm.check_request({"argv": ["sh", "-c", "x"], "runtime_max": 0}, 0) == (["sh", "-c", "x"], 0)
    assert warm.check_request({"argv": ["true"], "runtime_max": 5}, 10) == (["true"], 5)
    assert warm.check_request({"argv": ["true"], "runtime_max": None}, 10) == (["true"], 10)
    for bad in (None, {}, {"argv": []}, {"argv": [""]}, {"argv": "true"}, {"argv": ["a\0b"]}, {"argv": [1]}):
        with pytest.raises(ValueError):
            warm.check_request(bad, 0)
    with pytest.raises(ValueError, match="exceeds the policy's runtime_max"):
        warm.check_request({"argv": ["true"], "runtime_max": 20}, 10)


def test_the_receiver_takes_the_start_environment_and_exactly_three_fds():
    raw = b"PATH=/usr/bin:/bin\0CHV_CELL=1\0EMPTY=\0A=b=c\0junk\0\0"
    assert warm_receive.parse_environ(raw) == {"PATH": "/usr/bin:/bin", "CHV_CELL": "1", "EMPTY": "", "A": "b=c"}
    msg = json.dumps({"argv": ["echo", "hi"]}).encode()
    assert warm_receive.parse_request(msg, [5, 6, 7], False) == ["echo", "hi"]
    for args in ((msg, [5, 6], False), (msg, [5, 6, 7], True), (b"{", [5, 6, 7], False),
                 (b'{"argv": []}', [5, 6, 7], False), (b"\xff", [5, 6, 7], False)):
        with pytest.raises(ValueError):
            warm_receive.parse_request(*args)


def test_the_digest_follows_the_policy_content(policy):
    other = dict(policy, stop_grace=policy["stop_grace"] + 1)
    assert handover.policy_digest(policy) == handover.policy_digest(dict(policy))
    assert handover.policy_digest(policy) != handover.policy_digest(other)


def test_a_replaced_file_changes_the_stamp(tmp_path):
    f = tmp_path / "policy.json"
    f.write_text("{}")
    before = warm.files_stamp([str(f)])
    assert warm.files_stamp([str(f)]) == before
    (tmp_path / "new").write_text("{}")
    os.replace(tmp_path / "new", f)  # what the role's copy does
    assert warm.files_stamp([str(f)]) != before
    f.unlink()
    assert warm.files_stamp([str(f)]) == ((str(f), None, None, None),)


def _record(policy, slot, rec):
    path = argvmod.cell_paths(policy, slot)["record"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rec, fh)


@pytest.fixture
def warm_policy(policy, tmp_path):
    return dict(policy, state_dir=str(tmp_path / "state"), warm_slots=[policy["slots"][1]["name"]])


def test_a_waiting_warm_cell_is_idle_and_a_payload_in_it_runs(warm_policy, capsys):
    pol = warm_policy
    cold, hot = pol["slots"][0], pol["slots"][1]
    me = os.getpid()
    assert not records.payload_running(pol, hot) and records.read_record(pol, hot) is None
    _record(pol, hot, {"pid": me, "warm": True})  # starting: no socket yet
    assert not records.payload_running(pol, hot) and not records.warm_waiting(pol, hot)
    sock = argvmod.cell_paths(pol, hot)["warm_socket"]
    os.makedirs(os.path.dirname(sock))
    open(sock, "w").close()
    assert records.warm_waiting(pol, hot) and not records.payload_running(pol, hot)
    _record(pol, cold, {"pid": me})
    assert records.payload_running(pol, cold)
    actions.print_status(pol)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("running pid=%d" % me)
    assert lines[1].endswith("idle (warm cell ready, pid %d)" % me)
    _record(pol, hot, {"pid": me, "warm": True, "payload": 1.0})  # handed over
    assert records.payload_running(pol, hot) and not records.warm_waiting(pol, hot)
    actions.print_status(pol)
    assert capsys.readouterr().out.splitlines()[1].endswith("running pid=%d" % me)


class _Caller(object):
    """The parts of a Launcher that handover.handover uses."""

    def __init__(self, policy):
        self.policy = policy
        self.caller = None
        self.stop_signal = self.stop_reason = None
        self.said = []

    def debug(self, msg):
        self.said.append(msg)

    def mark_payload_started(self):
        self.payload_started = True

    def sleep(self, seconds, fds):
        return fds


def test_a_warm_launcher_waits_out_a_cold_run_and_runs_its_cell_holding_the_slot(warm_policy, monkeypatch,
                                                                                tmp_path):
    """serve() claims through the base launcher's claim_and_run: it waits
    while a cold run holds the slot's lock, runs the cell with the lock
    held, releases it after and restores the signal handlers."""
    pol = dict(warm_policy, require_ruleset=False)
    slot = pol["slots"][1]
    lock = argvmod.cell_paths(pol, slot)["lock"]
    cold = claimmod.try_claim(lock)
    cell = warm.WarmCell(pol, str(tmp_path / "policy.json"), slot)
    seen = []

    def sleep(seconds, fds=()):
        seen.append(("sleep", seconds))
        cold.release()  # the cold run ends
        return []

    def run_claimed(s, command, shared_network, runtime_max):
        seen.append(("run", s is slot, command, os.path.exists(lock), cell.scope in ("systemd", "standalone")))
        cell.handed_over = True
        return 0

    monkeypatch.setattr(cell, "sleep", sleep)
    monkeypatch.setattr(cell, "run_claimed", run_claimed)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert cell.serve() == 0
    finally:
        cell._ours.close()
        os.close(cell.spawn_stdin)
    assert seen == [("sleep", 0.5), ("run", True, ["warm"], True, True)]
    assert not os.path.exists(lock) and signal.getsignal(signal.SIGTERM) is handler
    other = warm.WarmCell(pol, str(tmp_path / "policy.json"), pol["slots"][0])  # not a warm slot
    try:
        assert other.serve() == warm.EXIT_NOT_WARM
    finally:
        other._ours.close()
        os.close(other.spawn_stdin)


def test_no_ready_warm_cell_means_a_cold_start(warm_policy):
    caller = _Caller(warm_policy)
    req = handover.request(caller, ["true"], 0)
    assert req is not None and handover.handover(caller, [warm_policy["slots"][1]], req, 0.0) is None
    assert handover.request(caller, ["x" * warm_receive.REQUEST_MAX], 0) is None
    assert "too long for a warm cell" in caller.said[-1]


def test_a_hand_over_passes_argv_and_the_callers_stdio_and_returns_the_exit_code(warm_policy, tmp_path):
    """A stand-in warm launcher on the slot's socket: it receives the request
    with three fds that are the caller's own stdio, answers started and the
    exit code; a second stand-in answers retry for another policy."""
    pol = warm_policy
    slot = pol["slots"][1]
    path = handover.socket_path(pol, slot)
    os.makedirs(os.path.dirname(path))
    server = subprocess.Popen([sys.executable, "-c", """
import array, json, os, socket, sys
sys.path.insert(0, sys.argv[2])
from chv_guest.cell import handover
lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
lst.bind(sys.argv[1]); lst.listen(1)
print("ready", flush=True)
conn, dummy = lst.accept()
req, fds = handover.recv(conn)
os.write(fds[1], b"through the caller's stdout\\n")
conn.send(handover.encode({"started": True}))
conn.send(handover.encode({"exit": 7}))
print(json.dumps([req["argv"], req["policy"], len(fds)]), flush=True)
""", path, os.path.dirname(os.path.dirname(os.path.dirname(warm.__file__)))], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline() == "ready\n"
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    saved = os.dup(1)
    os.dup2(fd, 1)
    try:
        caller = _Caller(pol)
        rc = handover.handover(caller, [slot], handover.request(caller, ["echo", "hi"], 0), 0.0)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)
    argv, digest, nfds = json.loads(server.stdout.readline())
    server.wait(10)
    assert rc == 7 and argv == ["echo", "hi"] and digest == handover.policy_digest(pol) and nfds == 3
    assert out.read_text() == "through the caller's stdout\n"


def test_the_receiver_runs_the_payload_on_the_fds_it_was_given(tmp_path):
    """warm_receive as a warm cell's pid 2 runs it (python3 -I -S -c
    BOOTSTRAP, fd 0 a socketpair, this file's text its first message): the
    payload gets the sent fds as 0/1/2, the start environment, and cannot
    reach the socketpair; EOF starts nothing (125)."""
    with open(warm_receive.__file__, "rb") as fh:
        source = fh.read()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {"PATH": "/usr/bin:/bin", "CHV_CELL": "1"}
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", warm_receive.BOOTSTRAP], stdin=theirs, env=env)
    theirs.close()
    ours.send(source)
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    payload = 'echo "$CHV_CELL $LC_CTYPE"; ls -l /proc/self/fd/0 | grep -c socket; exit 3'
    ours.sendmsg([json.dumps({"argv": ["sh", "-c", payload]}).encode()],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [os.open(os.devnull, os.O_RDONLY), fd, fd]))])
    assert proc.wait(10) == 3
    assert out.read_text() == "1 \n0\n"
    ours.close()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", warm_receive.BOOTSTRAP], stdin=theirs,
                            stderr=subprocess.PIPE)
    theirs.close()
    ours.send(source)
    ours.close()
    assert proc.wait(10) == 125 and b"nothing started" in proc.stderr.read()
