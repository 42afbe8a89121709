"""Handing a payload to a warm cell: the messages both sides exchange
(docs/cells.md "Warm cells") and the caller's side, which ``chv-cell run``
tries before it starts a cold cell (warm.py is the warm cell's side).

Messages are JSON over SOCK_SEQPACKET.  Caller -> warm: {"argv": [...],
"runtime_max": S or null, "caller": text or null, "policy": policy_digest}
with three fds, then {"signal": N} at most once.  Warm -> caller:
{"started": true}, {"retry": why} (try another cell, or a cold start) or
{"exit": N, "payload_exit": N or null, "error": text} (the run's end;
payload_exit is the payload's own exit code when it ended by itself)."""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from . import argv as argvmod
from . import launcher as launchermod
from . import policy as policymod
from . import warm_receive
from .errors import Interrupted
from .exits import EXIT_SETUP
from .log import log

MESSAGE_MAX = warm_receive.REQUEST_MAX + 4096


def socket_path(policy: policymod.Policy, slot: policymod.Slot) -> str:
    return argvmod.cell_paths(policy, slot)["warm_socket"]


def policy_digest(policy: policymod.Policy) -> str:
    """The policy's content (merged with the defaults) as one digest: a warm
    cell takes only payloads of callers with the very same policy (a run
    with --policy FILE, e.g. chv-cell audit's loosened copies, starts cold)."""
    return hashlib.sha256(json.dumps(policy, sort_keys=True).encode()).hexdigest()


def encode(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def decode(data: bytes) -> Optional[Dict[str, Any]]:
    """A message as a dict, or None (EOF, or not a JSON object)."""
    if not data:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def recv(sock: socket.socket) -> Tuple[Optional[Dict[str, Any]], List[int]]:
    """One message with any fds attached: (dict or None, [fds])."""
    data, fds, truncated = warm_receive.receive(sock, MESSAGE_MAX)
    if truncated:
        for fd in fds:
            os.close(fd)
        return None, []
    return decode(data), fds


def send(sock: socket.socket, obj: object) -> bool:
    try:
        sock.send(encode(obj))
        return True
    except OSError:
        return False


def request(launcher: launchermod.Launcher, command: Sequence[str], runtime_max: float) -> Optional[bytes]:
    """A caller's request for handover (built once per run), or None when
    the argv is too long for one message (a cold cell then)."""
    req = encode({"argv": list(command), "runtime_max": runtime_max, "caller": launcher.caller,
                  "policy": policy_digest(launcher.policy)})
    if len(req) > warm_receive.REQUEST_MAX:
        launcher.debug("the command line is too long for a warm cell (%d bytes); starting a cold one" % len(req))
        return None
    return req


def handover(launcher: launchermod.Launcher, slots: Iterable[policymod.Slot], req: bytes, t0: float) -> Optional[int]:
    """The caller's side: offer the request ``req`` (request()) to the ready
    warm cells of ``slots`` in turn.  Returns the run's exit code,
    or None when no warm cell took it (none ready, or all taken meanwhile):
    the caller then starts a cold cell."""
    p = launcher.policy
    stdio = _stdio_fds()
    try:
        for slot in slots:
            name = slot["name"]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(socket_path(p, slot))
                sock.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", stdio))])
            except OSError:
                sock.close()
                continue
            reply, dummy = recv(sock)
            if reply is None or "retry" in reply:
                if reply is not None:
                    launcher.debug("slot %s: warm cell not used: %s" % (name, reply["retry"]))
                sock.close()
                continue
            if not reply.get("started"):
                sock.close()
                if reply.get("error"):
                    log("slot %s: %s" % (name, reply["error"]))
                return _exit_code(reply)
            launcher.debug("slot %s: warm cell took the payload %.3fs after start" % (name, time.monotonic() - t0))
            launcher.claimed_slot = name
            launcher.mark_payload_started()
            return _wait(launcher, sock, name)
    finally:
        for fd in stdio:
            if fd > 2:
                os.close(fd)
    return None


def _exit_code(reply: Dict[str, Any]) -> int:
    rc = reply.get("exit")
    return rc if isinstance(rc, int) and not isinstance(rc, bool) and 0 <= rc <= 255 else EXIT_SETUP


def _stdio_fds() -> List[int]:
    """fds 0, 1 and 2 as the caller has them; /dev/null for any that is closed."""
    out = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            out.append(fd)
        except OSError:
            out.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
    return out


def _wait(launcher: launchermod.Launcher, sock: socket.socket, name: str) -> int:
    """Wait for the warm cell's exit code; forward a stop signal once."""
    forwarded = False
    try:
        while True:
            try:
                ready = launcher.sleep(3600, [sock.fileno()])
            except Interrupted as exc:
                launcher.stop_signal = launcher.stop_reason = None
                if exc.reason:
                    log("slot %s: %s; stopping the cell (exit %d, as on SIGHUP)" % (name, exc.reason, 128 + exc.signum))
                if forwarded:
                    continue
                forwarded = True
                if not send(sock, {"signal": exc.signum}):
                    return 128 + exc.signum
                continue
            if sock.fileno() in ready:
                reply, dummy = recv(sock)
                if reply is None:
                    log("slot %s: the warm cell's launcher went away; the payload's exit code is unknown" % name)
                    return EXIT_SETUP
                if reply.get("error"):
                    log("slot %s: %s" % (name, reply["error"]))
                if "payload_exit" in reply:
                    pe = reply["payload_exit"]
                    launcher.payload_exit = pe if isinstance(pe, int) and not isinstance(pe, bool) else None
                    launcher.warm_reported = True
                return _exit_code(reply)
    finally:
        sock.close()
