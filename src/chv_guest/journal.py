"""Structured entries in systemd's journal, by its native protocol (one
datagram of ``FIELD=value`` lines to /run/systemd/journal/socket; no
library needed, https://systemd.io/JOURNAL_NATIVE_PROTOCOL/).

The launcher, chv-broker and chv-browser send one entry per event with
their fields as ``CHV_*`` journal fields, so that ``journalctl
CHV_SLOT=slot3`` or ``journalctl CHV_EVENT=chv-cell.run CHV_VERDICT=busy``
finds them (docs/observability.md "Logs"), and the metrics collector
counts them (chv_guest/metrics/events.py). At the package's top: every role installs it. A process whose standard error
already goes to the journal (a service: systemd sets JOURNAL_STREAM to its
device and inode) sends the entry instead of the line, as systemd asks of
such programs; elsewhere the line is written as before and the entry sent
besides (when a journal listens)."""

from __future__ import annotations

import os
import re
import socket
import struct
from typing import IO, Any, Dict, Mapping, Optional

SOCKET = "/run/systemd/journal/socket"
PREFIX = "CHV_"
# a journal field name: upper case letters, digits and underscores, not starting with one (journald's rule)
FIELD_RE = re.compile(r"[A-Z0-9][A-Z0-9_]{0,63}\Z")
# a value longer than this is cut (a reason quoting a whole error is still one entry)
VALUE_MAX = 2048
PRIORITY_INFO = 6


def field_name(key: str) -> Optional[str]:
    """``CHV_<KEY>`` for an event field's key (pure), None when it makes no journal field name."""
    name = PREFIX + re.sub(r"[^A-Za-z0-9]", "_", key).upper()
    return name if FIELD_RE.match(name) else None


def value_text(value: object) -> str:
    """A field's value as journal text (pure): JSON-free scalars as they print, None as ''."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)[:VALUE_MAX]


def entry(message: str, identifier: str, event: str, fields: Mapping[str, Any]) -> Dict[str, str]:
    """The journal fields of one event (pure): MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, CHV_EVENT and one
    ``CHV_<KEY>`` per scalar field (lists and dicts stay in MESSAGE only)."""
    out = {"MESSAGE": message, "PRIORITY": str(PRIORITY_INFO), "SYSLOG_IDENTIFIER": identifier,
           PREFIX + "EVENT": event}
    for key, value in fields.items():
        name = field_name(key)
        if name is not None and name not in out and (value is None or isinstance(value, (str, int, float, bool))):
            out[name] = value_text(value)
    return out


def encode(fields: Mapping[str, str]) -> bytes:
    """The native protocol's datagram (pure): ``NAME=value`` lines, a value
    with a newline as the name, a newline, its length (64-bit little endian)
    and the value."""
    out = []
    for name, value in fields.items():
        if not FIELD_RE.match(name):
            raise ValueError("not a journal field name: %r" % name)
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out.append(name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n")
        else:
            out.append(name.encode() + b"=" + data + b"\n")
    return b"".join(out)


def send(fields: Mapping[str, str], path: Optional[str] = None) -> bool:
    """Send one entry (to SOCKET unless ``path``); False when no journal
    took it (none listens here, or the datagram was refused)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(encode(fields), path or SOCKET)
        return True
    except OSError:
        return False


def is_journal_stream(stream: IO[str], environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``stream`` is the journal stream systemd connected this
    service's standard error to (JOURNAL_STREAM's device:inode)."""
    expected = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return False
    return expected == "%d:%d" % (st.st_dev, st.st_ino)
