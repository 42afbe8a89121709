"""Line-delimited JSON framing shared by chv-broker and chv-browser.

One request is one JSON object on one line (terminated by b"\n"), at most
``max_bytes`` long including the newline, read within ``timeout`` seconds
in total.  One reply is one JSON object on one line.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Generic, Mapping, Optional, TypeVar, overload

# A request or reply as JSON decodes it: the values are whatever the peer sent.
JSONObject = Dict[str, Any]
_T = TypeVar("_T")


class WireError(Exception):
    """The peer sent something that is not a valid request line."""


def read_line(conn: socket.socket, max_bytes: int, timeout: float) -> bytes:
    """Read one newline-terminated line from ``conn``.

    Raises WireError on timeout, oversize input, EOF before the newline.
    The overall deadline is enforced across partial reads, so a peer that
    trickles bytes cannot hold a worker past ``timeout``.
    """
    deadline = time.monotonic() + timeout
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError("read timeout")
        conn.settimeout(left)
        try:
            chunk = conn.recv(min(65536, max_bytes + 1 - len(buf)))
        except socket.timeout:
            raise WireError("read timeout") from None
        if not chunk:
            raise WireError("connection closed before end of request")
        nl = chunk.find(b"\n")
        if nl >= 0:
            buf += chunk[:nl]
            if len(buf) + 1 > max_bytes:
                raise WireError("request too large")
            return bytes(buf)
        buf += chunk
        if len(buf) >= max_bytes:
            raise WireError("request too large")


def parse_object(line: bytes) -> JSONObject:
    """Decode one request line into a dict, or raise WireError."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("request is not UTF-8") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise WireError("request is not valid JSON") from None
    if not isinstance(obj, dict):
        raise WireError("request must be a JSON object")
    return obj


def encode(obj: Mapping[str, object]) -> bytes:
    """One reply line."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8") + b"\n"


def ok(result: object) -> JSONObject:
    return {"ok": True, "result": result}


def err(message: object) -> JSONObject:
    return {"ok": False, "error": str(message)}


def call(path: str, request: Mapping[str, object], timeout: float,
         max_reply_bytes: int = 4 * 1024 * 1024) -> JSONObject:
    """Client side: send ``request`` to the Unix socket at ``path``, return the reply dict.

    Raises OSError when the socket cannot be reached and WireError when the
    server closes the connection or answers garbage.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(encode(request))
        return parse_object(read_line(s, max_reply_bytes, timeout))


def send_quietly(conn: socket.socket, obj: Mapping[str, object], timeout: float = 5) -> None:
    """Send one reply line; a peer that went away is not an error."""
    try:
        conn.settimeout(timeout)
        conn.sendall(encode(obj))
    except OSError:
        pass


class Busy(Exception):
    """A connection or request refused for capacity; ``str()`` is the reply's error.

    ``quota`` names the limit (a configuration key, e.g.
    ``max_connections_per_slot``), ``slot`` the slot it was counted
    against (None: the global cap), ``limit`` its value.
    """

    def __init__(self, message: str, quota: str, limit: int, slot: Optional[str] = None) -> None:
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.slot = slot


class Hold(Generic[_T]):
    """One unit of a slot's quota, given back once (``release()`` or the end of a ``with`` block)."""

    def __init__(self, quota: SlotQuota, slot: str, data: _T) -> None:
        self._quota = quota
        self.slot = slot
        self.data = data  # what the caller admitted (e.g. the peer's cell record)
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._quota.release(self.slot)

    def __enter__(self) -> Hold[_T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SlotQuota:
    """What each slot holds of one resource (connections, requests in flight), at most ``limit`` each.

    Keyed by the slot the caller decided (chv-broker: its peer check;
    chv-browser: the slot chv-broker wrote into the request). ``acquire``
    never waits: at the limit it raises Busy naming ``name`` and the slot,
    so one slot's load is refused to that slot alone. Thread-safe.
    """

    def __init__(self, name: str, limit: int, what: str) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError("%s must be an integer of at least 1, not %r" % (name, limit))
        self.name = name
        self.limit = limit
        self.what = what  # e.g. "connections open", for the message
        self._held: Dict[str, int] = {}
        self._lock = threading.Lock()

    # the caller's data comes back typed from Hold.data (chv-broker: the peer's cell record)
    @overload
    def acquire(self, slot: str) -> Hold[None]: ...
    @overload
    def acquire(self, slot: str, data: _T) -> Hold[_T]: ...

    def acquire(self, slot: str, data: object = None) -> Hold[Any]:
        with self._lock:
            n = self._held.get(slot, 0)
            if n >= self.limit:
                raise Busy("busy: slot %s is at its quota of %d %s (%s); retry when one has ended"
                           % (slot, self.limit, self.what, self.name), self.name, self.limit, slot)
            self._held[slot] = n + 1
        return Hold(self, slot, data)

    def release(self, slot: str) -> None:
        with self._lock:
            n = self._held.get(slot, 0) - 1
            if n > 0:
                self._held[slot] = n
            else:
                self._held.pop(slot, None)

    def held(self, slot: str) -> int:
        with self._lock:
            return self._held.get(slot, 0)

    def total(self) -> int:
        with self._lock:
            return sum(self._held.values())


def policy_slots(path: str) -> int:
    """How many slots the cell policy at ``path`` names (0 when it cannot be read: no floor).
    The doors count them at start, so that their configuration does not depend on what a
    play knew of the slot identities (a run of one role, a tagged run)."""
    try:
        with open(path, "rb") as fh:
            slots = json.loads(fh.read(4 << 20)).get("slots")
    except (OSError, ValueError, AttributeError):
        return 0
    return len(slots) if isinstance(slots, list) else 0


def global_cap(configured: int, slots: int, per_slot: int) -> int:
    """The global connection cap a door runs with: ``configured``, raised to
    (slots + 1) * per_slot when that is more, so that every slot at its
    quota at once still leaves room for one more slot's worth (connections
    not yet counted against a slot: being read or refused). ``slots`` is the
    host's slot count (0: unknown, no floor)."""
    return max(int(configured), (int(slots) + 1) * int(per_slot) if slots else 0)


def refuse(conn: socket.socket, message: str) -> None:
    """Answer ``message`` as an error and close, without waiting for the peer (from the accept loop)."""
    with conn:
        try:
            conn.setblocking(False)  # a fresh socket's buffer takes one short line; never wait for a reader
            conn.sendall(encode(err(message)))
        except OSError:
            pass


def serve_connections(listener: socket.socket, stop: threading.Event, max_connections: int,
                      handle: Callable[..., None], busy_message: str,
                      on_busy: Optional[Callable[[Busy], None]] = None,
                      admit: Optional[Callable[[socket.socket], object]] = None) -> None:
    """Accept connections until ``stop`` is set, each handled in a thread of its own.

    ``admit(conn)``, when given, runs in the accept loop before any thread
    is started, and must not wait for the peer (chv-broker's peer check and
    per-slot count read only kernel state and root-owned records). It
    returns what ``handle(conn, admitted)`` gets (released with
    ``admitted.release()`` after ``handle`` returns, when it has one), or
    raises Busy: the connection gets Busy's message and is closed at once.
    Without ``admit``, ``handle(conn)`` is called.

    At most ``max_connections`` run at once; one more gets ``busy_message``
    and is closed. ``on_busy(exc)`` (a Busy) is called for every refused
    connection, e.g. to audit it. Refusals are sent without blocking, so the
    accept loop never waits for any peer. The 0.25 s accept timeout is how
    quickly ``stop`` is noticed.
    """
    slots = threading.BoundedSemaphore(max_connections)
    listener.settimeout(0.25)
    while not stop.is_set():
        try:
            conn, dummy = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            if stop.is_set():
                break
            raise
        admitted: object = None
        try:
            if admit is not None:
                admitted = admit(conn)
            if not slots.acquire(blocking=False):
                raise Busy(busy_message, "max_connections", max_connections)
        except Busy as exc:
            if admitted is not None and hasattr(admitted, "release"):
                admitted.release()
            if on_busy:  # audited before the peer can see the refusal
                on_busy(exc)
            refuse(conn, str(exc))
            continue

        def run(c: socket.socket = conn, a: object = admitted) -> None:
            try:
                if admit is None:
                    handle(c)
                else:
                    handle(c, a)
            finally:
                if a is not None and hasattr(a, "release"):
                    a.release()
                slots.release()
        try:
            threading.Thread(target=run, daemon=True).start()
        except RuntimeError:  # no thread to be had: refuse this one, keep accepting
            if admitted is not None and hasattr(admitted, "release"):
                admitted.release()
            slots.release()
            if on_busy:
                on_busy(Busy(busy_message, "max_connections", max_connections))
            refuse(conn, busy_message)


def listener_from_env(environ: Mapping[str, str]) -> Optional[socket.socket]:
    """The socket systemd passed (LISTEN_FDS, fd 3), or None."""
    if environ.get("LISTEN_PID") != str(os.getpid()) or int(environ.get("LISTEN_FDS", "0")) < 1:
        return None
    return socket.socket(fileno=3)
