"""The launcher's one log line format, on fd 2."""

from __future__ import annotations

import os
import sys


def log(msg: str) -> None:
    """Write one ``chv-cell: msg`` line to fd 2, unbuffered.

    Errors are ignored: after a disconnect stderr may be a pipe or socket
    without a reader, and nothing may be left in a Python buffer that would
    fail again (and change the exit status to 120) at interpreter exit.  When
    sys.stderr has been replaced by something that is not fd 2 (a test's
    capture), the line goes there instead."""
    line = "chv-cell: %s\n" % msg
    stream = sys.stderr
    try:
        direct = stream is None or stream.fileno() == 2
    except (AttributeError, ValueError, OSError):
        direct = False  # a replaced sys.stderr (a test's capture): write to it
    try:
        if not direct:
            stream.write(line)
            stream.flush()
            return
        data = line.encode("utf-8", "replace")
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass
