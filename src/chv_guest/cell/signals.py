"""Hang-up detection: without a tty, sshd sends no SIGHUP when the
connection drops, but the session's pipes or sockets lose their peer."""

from __future__ import annotations

import os
import select
from typing import Iterable, List, Optional

# POLLHUP: the other end of a socket or tty closed; POLLERR: a pipe with no
# reader left.  A regular file or /dev/null reports neither.
HANGUP_EVENTS = select.POLLHUP | select.POLLERR


def hangup_watch_fds(fds: Iterable[int] = (1, 2)) -> List[int]:
    """The fds among ``fds`` (stdout, stderr) that are open and so can be
    watched for a disconnected peer."""
    out = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        out.append(fd)
    return out


def hangup_reason(fd: int, events: int) -> Optional[str]:
    """Why a poll() result of a watched fd means the peer went away (None if
    it does not).  POLLNVAL (fd not open) is not a hangup."""
    if not events & HANGUP_EVENTS:
        return None
    what = {1: "stdout", 2: "stderr"}.get(fd, "fd %d" % fd)
    kind = "closed (POLLHUP)" if events & select.POLLHUP else "has no reader (POLLERR)"
    return "the peer of %s %s: the caller is gone" % (what, kind)
