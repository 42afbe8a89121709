#!/usr/bin/python3 -I
"""Minimal chv-broker client for use inside a cell (standard library only).

The broker role installs this file as /usr/lib/chv-fleet/chv_guest/broker/client.py
(no command on PATH); run it with one request as its only argument:

    python3 /usr/lib/chv-fleet/chv_guest/broker/client.py '{"op": "ping"}'
    python3 /usr/lib/chv-fleet/chv_guest/broker/client.py '{"op": "sync", "action": "status", "repo": "myrepo"}'

Prints the reply line; exits 0 when the reply has "ok": true, 1 when the
broker refused, 2 when the broker could not be reached or hung up, and 2
after printing this text when not given exactly one argument.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from typing import List

SOCKET = os.environ.get("CHV_BROKER_SOCKET", "/run/chv/broker.sock")


def read_line(s: socket.socket) -> bytes:
    """What the peer sends up to its first newline; all it sent when it hangs up before one."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def request(line: str, path: str = SOCKET, timeout: float = 180.0) -> bytes:
    """Send one request line to the broker at ``path``; its reply line (see read_line)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        try:
            s.sendall(line.encode("utf-8").replace(b"\n", b" ") + b"\n")
        except BrokenPipeError:
            pass  # a rejected peer is answered before its request is read: read that answer
        buf = read_line(s)
        wait_for_close(s)
        return buf


def wait_for_close(s: socket.socket, timeout: float = 5.0) -> None:
    """Wait (at most ``timeout`` seconds) for the broker to close the connection after its reply.

    The broker gives the slot's connection back before it closes the socket, so
    a request sent after this is never refused for the one before it
    (max_connections_per_slot), however loaded the guest is."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    try:
        buf = request(argv[1], SOCKET, float(os.environ.get("CHV_BROKER_TIMEOUT", "180")))
    except OSError as exc:
        sys.stderr.write("chv_guest/broker/client.py: %s\n" % exc)
        return 2
    if not buf.endswith(b"\n"):
        sys.stderr.write("chv_guest/broker/client.py: broker closed the connection without a reply\n")
        return 2
    sys.stdout.write(buf.decode("utf-8", "replace"))
    try:
        return 0 if json.loads(buf).get("ok") is True else 1
    except ValueError:
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
