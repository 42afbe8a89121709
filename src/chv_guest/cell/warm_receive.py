"""Inside a warm cell: the payload's stand-in, waiting for the payload.

A warm cell (``chv-cell warm``, docs/cells.md "Warm cells") is started,
configured and checked like any cell, and its start gate opened; its pid 2
is ``python3 -I -S -c BOOTSTRAP``, which reads this file's text as the
first message on fd 0 and runs it (no file of the launcher needs to be
visible in the cell, and ``ps`` shows a short command line).  It blocks on fd 0,
one end of a socketpair the warm launcher created before the cell started
(no other process, in any cell or on the guest, holds the other end), until
the launcher sends one message: the payload's argv as JSON with the
caller's stdin, stdout and stderr attached (SCM_RIGHTS).  It puts those on
fds 0, 1 and 2 (which closes the socketpair: the payload cannot talk to the
launcher) and execs the payload with the environment the cell started with
(read from /proc/self/environ, as nspawn set it: Python's own locale
coercion does not leak).  Anything else, and EOF (the launcher died),
ends the cell with 125: no payload runs.

Standard library only; ``parse_environ`` and ``parse_request`` are pure.
"""

from __future__ import annotations

import array
import errno
import json
import os
import socket
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10: annotations only

REQUEST_MAX = 131072  # bytes of JSON; a longer argv goes to a cold cell
# pid 2 of a warm cell: runs the program the launcher sends first on fd 0
# (this file) as __main__
BOOTSTRAP = ("import socket; sock = socket.socket(fileno=0); source = sock.recv(1 << 20); sock.detach(); "
             "exec(compile(source, 'chv-cell-warm-receive', 'exec'), {'__name__': '__main__'})")
STDIO_FDS = 3
EXIT_NOT_STARTED = 125


def parse_environ(raw: bytes) -> Dict[str, str]:
    """The variables of a NUL-separated ``K=V`` block (/proc/self/environ)."""
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def valid_argv(argv: object) -> TypeGuard[List[str]]:
    """A payload's argv: a non-empty list of strings without NUL, the first
    non-empty (the warm launcher checks a caller's request with it too)."""
    return isinstance(argv, list) and bool(argv) and all(isinstance(a, str) and "\0" not in a for a in argv) \
        and bool(argv[0])


def parse_request(msg: bytes, fds: Sequence[int], truncated: bool) -> List[str]:
    """The payload's argv from the launcher's message, or ValueError: JSON
    ``{"argv": [str, ...]}`` with a non-empty first word and exactly three
    file descriptors."""
    if truncated:
        raise ValueError("the payload message was truncated")
    if len(fds) != STDIO_FDS:
        raise ValueError("%d file descriptors arrived, not %d" % (len(fds), STDIO_FDS))
    try:
        req = json.loads(msg.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError("the payload message is not JSON: %s" % exc)
    argv = req.get("argv") if isinstance(req, dict) else None
    if not valid_argv(argv):
        raise ValueError("the payload message has no argv")
    return argv


def _say(text: str) -> None:
    try:
        os.write(2, ("chv-cell: warm cell: %s\n" % text).encode("utf-8", "replace"))
    except OSError:
        pass


def receive(sock: socket.socket, size: int = REQUEST_MAX) -> Tuple[bytes, List[int], bool]:
    """(msg, fds, truncated) of one message on ``sock`` (at most ``size``
    bytes and STDIO_FDS file descriptors); msg is b"" at EOF or on an error.
    The warm launcher receives its callers' requests with it too."""
    fds = array.array("i")
    try:
        msg, anc, flags, dummy = sock.recvmsg(size, socket.CMSG_SPACE(STDIO_FDS * fds.itemsize))
    except OSError:
        return b"", [], False
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds), bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))


def main() -> None:
    with open("/proc/self/environ", "rb") as fh:
        env = parse_environ(fh.read())
    sock = socket.socket(fileno=0)
    msg, fds, truncated = receive(sock)
    if not msg:
        _say("the launcher closed the cell before a payload arrived; nothing started")
        os._exit(EXIT_NOT_STARTED)
    try:
        argv = parse_request(msg, fds, truncated)
    except ValueError as exc:
        _say("%s; nothing started" % exc)
        os._exit(EXIT_NOT_STARTED)
    sock.detach()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)  # onto fd 0 this closes the socketpair's end
    for fd in fds:
        if fd > 2:
            os.close(fd)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        _say("cannot run %s: %s" % (argv[0], exc.strerror))
        os._exit(127 if exc.errno == errno.ENOENT else 126)


if __name__ == "__main__":
    main()
