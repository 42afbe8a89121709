"""What the launcher tells the doors when a run ends (stdlib only; the
launcher never imports the browser's package).

A run of a slot's cell has ended and the launcher still holds the slot's
lock: before the lock is released (and so before the slot can be claimed
again), chv-browser is told to destroy the slot's browser state (its
context: pages, cookies, storage, cache; and its screenshots).  The request
is one JSON line on chv-browser's socket, ``{"action": "end", "slot": S}``;
chv-browser accepts it only from root of the guest's user namespace (its
SO_PEERCRED check, chv_browser/policy.py admin_peer_problem), never from a
cell, and chv-broker never forwards it (it is not a cell's browser action).

Outcomes (end_browser_slot):
  * "ended": chv-browser confirmed;
  * "no-browser": nothing listens on the socket (no such path, or nobody
    accepts on it): no chv-browser runs, and a browser context lives only
    in chv-browser's chromium, which does not outlive it;
  * "failed": chv-browser did not confirm within ``timeout`` seconds
    (retried while it answers busy or the connection fails on the way).
    The launcher logs it loudly; chv-browser still never serves that
    context to a later run whose requests name their cell (chv-browser's
    cell binding) and queued requests of the ended run are refused.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable, Dict, Tuple

END_TIMEOUT = 12.0  # chv-browser's own bound on closing a context is 10 s (CLOSE_TIMEOUT)
REPLY_MAX = 65536


class DoorError(Exception):
    pass


def _call(path: str, request: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """One request line, one reply line (a dict)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        s.connect(path)
        s.sendall(json.dumps(request, sort_keys=True).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DoorError("no reply within %gs" % timeout)
            s.settimeout(left)
            chunk = s.recv(4096)
            if not chunk:
                raise DoorError("connection closed before a reply")
            buf += chunk
            if len(buf) > REPLY_MAX:
                raise DoorError("reply too large")
    try:
        reply = json.loads(buf.split(b"\n", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise DoorError("reply is not JSON") from None
    if not isinstance(reply, dict):
        raise DoorError("reply is not a JSON object")
    return reply


def end_browser_slot(path: str, slot: str, timeout: float = END_TIMEOUT, sleep: Callable[[float], object] = time.sleep,
                     call: Callable[[str, Dict[str, str], float], Dict[str, Any]] = _call) -> Tuple[str, str]:
    """Tell chv-browser at ``path`` that the run of ``slot`` ended.

    Returns (outcome, detail): outcome "ended", "no-browser" or "failed"
    (module doc); detail says what chv-browser answered or what went wrong.
    A refusal by chv-browser (it does not know the operation, or does not
    accept the launcher as its peer) is "failed" at once: retrying cannot
    change it."""
    if not path:
        return "no-browser", "no chv-browser socket in the policy (browser_socket is empty)"
    deadline = time.monotonic() + timeout
    delay = 0.05
    last = "not tried"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "failed", "%s (gave up after %gs)" % (last, timeout)
        try:
            reply = call(path, {"action": "end", "slot": slot}, left)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            return "no-browser", "nothing listens on %s (%s)" % (path, exc.strerror or type(exc).__name__)
        except (OSError, DoorError) as exc:
            last = "%s: %s" % (type(exc).__name__, exc)
        else:
            if reply.get("ok") is True:
                return "ended", json.dumps(reply.get("result"), sort_keys=True)
            error = str(reply.get("error", "no error given"))[:300]
            if "busy" not in error:
                return "failed", "chv-browser refused: %s" % error
            last = "chv-browser busy: %s" % error
        sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)
