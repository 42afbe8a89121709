"""The verdict channel, ``chv-cell run --status-fd N``: one JSON line on fd
N, which only the caller holds (close-on-exec, and nspawn starts with
close_fds; a warm cell gets only fds 0-2), so the payload cannot write it."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional, TypedDict

from .exits import EXIT_RUNTIME
from .log import log

VERDICTS = ("ran", "runtime", "signal", "setup", "busy", "config", "cordoned", "unknown")


if TYPE_CHECKING:  # a TypedDict compiles its annotations at import (about 1 ms): for the checker only
    class StatusRecord(TypedDict):
        verdict: str  # one of VERDICTS
        exit: int
        slot: Optional[str]
        payload_started: bool
        payload_exit: Optional[int]


def status_record(rc: int, stage: Optional[str], slot: Optional[str] = None, payload_started: bool = False,
                  payload_exit: Optional[int] = None) -> StatusRecord:
    """The verdict of a run that ended with ``rc`` (pure; the verdicts:
    docs/executor.md).  ``stage``, how far the run got: "config", "setup",
    "busy", "signal" or "cordoned" (before a cell ran: the verdict), "claimed" (a cold
    cell in ``slot``, or a warm one whose launcher said how the payload
    ended) or "warm" (one that did not)."""
    if stage == "claimed":
        if payload_exit is not None and rc == payload_exit:
            verdict = "ran"
        elif payload_started and payload_exit is None and rc == EXIT_RUNTIME:
            verdict = "runtime"
        elif payload_exit is None and rc > 128:
            verdict = "signal"
        else:
            verdict = "setup"  # the payload did not start, or the teardown failed after it
    elif stage == "warm":
        verdict = "unknown"  # a warm launcher that did not say how the payload ended
    elif stage in ("config", "setup", "busy", "signal", "cordoned"):
        verdict = stage
    else:
        raise ValueError("unknown stage %r" % (stage,))
    return {"verdict": verdict, "exit": rc, "slot": slot, "payload_started": bool(payload_started),
            "payload_exit": payload_exit}


def status_fd_problem(fd: object) -> Optional[str]:
    """None when ``fd`` can carry the verdict: a number above 2 (0-2 are the
    payload's streams) open for writing.  Otherwise what is wrong with it."""
    import fcntl  # noqa: PLC0415

    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 3:
        return "--status-fd %r: must be a file descriptor number of 3 or more (0-2 are the payload's streams)" % (fd,)
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return "--status-fd %d: that file descriptor is not open (through sudo it needs the sudoers option " \
               "closefrom_override and sudo -C, which chv-cell does itself)" % fd
    if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
        return "--status-fd %d: that file descriptor is not open for writing" % fd
    return None


def write_status(fd: int, record: StatusRecord) -> None:
    """Write ``record`` as one JSON line to ``fd`` and close it; a reader
    that went away is ignored (the exit code still reaches the caller)."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as exc:
        log("cannot write the verdict to --status-fd %d: %s" % (fd, exc.strerror))
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
