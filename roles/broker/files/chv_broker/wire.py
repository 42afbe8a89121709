"""Line-delimited JSON framing shared by chv-broker and chv-browser.

One request is one JSON object on one line (terminated by b"\n"), at most
``max_bytes`` long including the newline, read within ``timeout`` seconds
in total.  One reply is one JSON object on one line.
"""
import json
import os
import socket
import threading
import time


class WireError(Exception):
    """The peer sent something that is not a valid request line."""


def read_line(conn, max_bytes, timeout):
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


def parse_object(line):
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


def encode(obj):
    """One reply line."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8") + b"\n"


def ok(result):
    return {"ok": True, "result": result}


def err(message):
    return {"ok": False, "error": str(message)}


def call(path, request, timeout, max_reply_bytes=4 * 1024 * 1024):
    """Client side: send ``request`` to the Unix socket at ``path``, return the reply dict.

    Raises OSError when the socket cannot be reached and WireError when the
    server closes the connection or answers garbage.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(encode(request))
        return parse_object(read_line(s, max_reply_bytes, timeout))


def send_quietly(conn, obj, timeout=5):
    """Send one reply line; a peer that went away is not an error."""
    try:
        conn.settimeout(timeout)
        conn.sendall(encode(obj))
    except OSError:
        pass


def serve_connections(listener, stop, max_connections, handle, busy_message, on_busy=None):
    """Accept connections until ``stop`` is set, each handled in a thread of its own.

    At most ``max_connections`` run at once; one more gets ``busy_message``
    as an error reply and is closed (``on_busy`` is then called, e.g. to
    audit it). The 0.25 s accept timeout is how quickly ``stop`` is noticed.
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
        if not slots.acquire(blocking=False):
            with conn:
                send_quietly(conn, err(busy_message))
            if on_busy:
                on_busy()
            continue

        def run(c=conn):
            try:
                handle(c)
            finally:
                slots.release()
        threading.Thread(target=run, daemon=True).start()


def listener_from_env(environ):
    """The socket systemd passed (LISTEN_FDS, fd 3), or None."""
    if environ.get("LISTEN_PID") != str(os.getpid()) or int(environ.get("LISTEN_FDS", "0")) < 1:
        return None
    return socket.socket(fileno=3)
