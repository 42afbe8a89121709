"""The launcher tells chv-browser that a run ended (chv_guest/cell/doors.py), on real Unix sockets."""
import errno
import json
import os
import socket
import subprocess
import threading

import pytest

from cellrt import BASE_POLICY  # noqa: F401  (makes chv_cell importable)
from chv_guest.broker import client
from chv_guest.cell import doors
from chv_guest.cell import errors
from chv_guest.cell import exits
from chv_guest.cell import policy as policymod
from chv_guest.cell import host, runner


class FakeBrowser:
    """A Unix socket answering each request line with the next of ``replies`` (None: no answer)."""

    def __init__(self, path, replies):
        self.path = path
        self.replies = list(replies)
        self.requests = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.replies:
            try:
                conn, dummy = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(json.loads(client.read_line(conn)))
                reply = self.replies.pop(0)
                if reply is None:
                    conn.recv(1)  # hold the connection without answering until the client gives up
                    continue
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self):
        self.sock.close()


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "browser.sock")


def test_ended_when_chv_browser_confirms(sock_path):
    b = FakeBrowser(sock_path, [{"ok": True, "result": {"context_closed": True, "shots_removed": 2}}])
    outcome, detail = doors.end_browser_slot(sock_path, "slot3")
    b.close()
    assert outcome == "ended" and '"shots_removed": 2' in detail
    assert b.requests == [{"action": "end", "slot": "slot3"}]


def test_busy_is_retried_until_confirmed(sock_path):
    busy = {"ok": False, "error": "busy: chv-browser serves at most 8 connections at once (max_connections)"}
    b = FakeBrowser(sock_path, [busy, busy, {"ok": True, "result": {}}])
    naps = []
    assert doors.end_browser_slot(sock_path, "slot0", sleep=naps.append)[0] == "ended"
    b.close()
    assert len(b.requests) == 3 and len(naps) == 2


def test_a_refusal_fails_at_once(sock_path):
    b = FakeBrowser(sock_path, [{"ok": False, "error": "only root outside every cell may end a slot's browser state"}])
    outcome, detail = doors.end_browser_slot(sock_path, "slot0", sleep=lambda s: pytest.fail("retried"))
    b.close()
    assert outcome == "failed" and "only root" in detail


def test_no_answer_fails_within_the_timeout(sock_path):
    b = FakeBrowser(sock_path, [None] * 50)
    outcome, detail = doors.end_browser_slot(sock_path, "slot0", timeout=0.5)
    b.close()
    assert outcome == "failed" and "gave up after 0.5s" in detail


def test_nothing_listening_means_no_browser_state(sock_path, tmp_path):
    assert doors.end_browser_slot(sock_path, "slot0")[0] == "no-browser"  # no such path
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock_path)  # a socket file nobody accepts on (a dead chv-browser's)
    s.close()
    assert doors.end_browser_slot(sock_path, "slot0")[0] == "no-browser"
    assert doors.end_browser_slot("", "slot0")[0] == "no-browser"


def test_policy_browser_socket_default_and_validation(raw_policy):
    assert policymod.merged(raw_policy)["browser_socket"] == "/run/chv-browser/browser.sock"
    for ok in ("", "/run/x/browser.sock"):
        assert policymod.validate(dict(raw_policy, browser_socket=ok)) == []
    for bad in ("relative.sock", "/run/../x.sock", "/", 5, None):
        errors = policymod.validate(dict(raw_policy, browser_socket=bad))
        assert any(e.startswith("browser_socket:") for e in errors), (bad, errors)


def test_the_end_of_a_run_tells_the_browser_and_a_failure_is_loud(policy, monkeypatch, capsys, sock_path):
    calls = []
    launcher = runner.Launcher(dict(policy, browser_socket=sock_path))
    slot = policy["slots"][0]
    monkeypatch.setattr(doors, "end_browser_slot", lambda path, name: calls.append((path, name)) or ("ended", "{}"))
    launcher.end_doors(slot)
    assert calls == [(sock_path, slot["name"])]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(doors, "end_browser_slot", lambda path, name: ("failed", "TimeoutError: timed out"))
    launcher.end_doors(slot)
    err = capsys.readouterr().err
    assert "chv-cell: slot %s: ERROR: chv-browser did not confirm the end of this run" % slot["name"] in err


def test_run_claimed_ends_the_browser_state_before_it_returns_even_when_setup_fails(policy, monkeypatch, sock_path):
    """run_claimed (cold runs, and warm cells: WarmCell.serve calls it too) tells the browser in its
    finally block, whatever happened, while the caller still holds the slot's lock."""
    order = []
    launcher = runner.Launcher(dict(policy, browser_socket=sock_path))
    slot = policy["slots"][0]

    def reap(s, scope):
        order.append("reap")
        raise errors.SetupError("stop here")

    monkeypatch.setattr(launcher, "reap", reap)
    monkeypatch.setattr(launcher, "_wait_ifname_gone", lambda s: None)
    monkeypatch.setattr(launcher, "_remove_runtime_files", lambda s: order.append("cleanup"))
    monkeypatch.setattr(launcher, "end_doors", lambda s: order.append(("end", s["name"])))
    launcher.scope = "standalone"
    assert launcher.run_claimed(slot, ["true"], False, 0) == exits.EXIT_SETUP
    assert order == ["reap", "cleanup", ("end", slot["name"])]
    from chv_guest.cell import warm

    assert warm.WarmCell.run_claimed is runner.Launcher.run_claimed and "end_doors" not in vars(warm.WarmCell)
    assert os.path.basename(doors.__file__) == "doors.py"


def test_run_claimed_stops_nspawn_and_ends_the_browser_state_when_pidfd_open_fails(policy, monkeypatch, sock_path):
    """pidfd_open can fail (EMFILE) once nspawn runs: the finally block still stops nspawn, without a
    pidfd to wait on, and reaches end_doors (stop() used to raise TypeError there, skipping both)."""
    order = []
    procs = []
    launcher = runner.Launcher(dict(policy, browser_socket=sock_path))
    slot = policy["slots"][0]
    gate_r, gate_w = os.pipe()
    os.close(gate_r)

    def spawn(argv, cgroups):
        procs.append(subprocess.Popen(["sleep", "60"]))
        return procs[-1]

    def pidfd_open(pid):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(launcher, "reap", lambda s, scope: None)
    monkeypatch.setattr(launcher, "prepare", lambda s, shared_network: gate_w)
    monkeypatch.setattr(host, "ensure_inaccessible_nodes", lambda: None)
    monkeypatch.setattr(launcher, "spawn", spawn)
    monkeypatch.setattr(os, "pidfd_open", pidfd_open)
    monkeypatch.setattr(launcher, "_wait_ifname_gone", lambda s: None)
    monkeypatch.setattr(launcher, "_remove_runtime_files", lambda s: order.append("cleanup"))
    monkeypatch.setattr(launcher, "end_doors", lambda s: order.append(("end", s["name"])))
    try:
        launcher.scope = "systemd"
        assert launcher.run_claimed(slot, ["true"], False, 0) == exits.EXIT_SETUP
        assert procs[0].poll() == -15  # SIGTERM'd and reaped, not left running
        assert order == ["cleanup", ("end", slot["name"])]
    finally:
        for p in procs:
            p.kill()
            p.wait()
