#!/usr/bin/python3 -I
"""git credential helper of chv-broker (standard library only).

chv-broker reads the credential file (git-credential-store format, one
``https://user:token@host`` per line) as root from a path cells cannot see
and writes its content to the sync worker's stdin; the worker keeps it in
an unnamed memfd that git and this helper inherit (its number is in
CHV_BROKER_CRED_FD).  This helper answers git's ``get``
with the first entry whose protocol and host match; ``store`` and ``erase``
are ignored (the file is managed by the operator, not by git).
"""
from __future__ import annotations

import os
import sys
from typing import IO, Iterable, Iterator, List, Mapping, Optional, Tuple
from urllib.parse import unquote, urlsplit


def entries(text: str) -> Iterator[Tuple[str, str, str, str]]:
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            u = urlsplit(line)
            host = u.hostname or ""
            if u.port:
                host = "%s:%d" % (host, u.port)
        except ValueError:
            continue
        if u.scheme and host and u.username is not None:
            yield u.scheme, host.lower(), unquote(u.username), unquote(u.password or "")


def lookup(text: str, protocol: str, host: str) -> Optional[Tuple[str, str]]:
    for scheme, h, user, password in entries(text):
        if scheme == protocol and h == host.lower():
            return user, password
    return None


def read_fd(fd: int) -> str:
    chunks: List[bytes]
    chunks, off = [], 0
    while True:
        b = os.pread(fd, 65536, off)
        if not b:
            return b"".join(chunks).decode("utf-8", "replace")
        chunks.append(b)
        off += len(b)


def main(argv: List[str], stdin: Iterable[str], stdout: IO[str], environ: Mapping[str, str]) -> int:
    if len(argv) < 2 or argv[1] != "get":
        return 0
    attrs: dict[str, str] = {}
    for line in stdin:
        line = line.rstrip("\n")
        if not line:
            break
        k, dummy, v = line.partition("=")
        attrs[k] = v
    fd = environ.get("CHV_BROKER_CRED_FD")
    if not fd or "protocol" not in attrs or "host" not in attrs:
        return 0
    try:
        found = lookup(read_fd(int(fd)), attrs["protocol"], attrs["host"])
    except (OSError, ValueError):
        return 0
    if found:
        stdout.write("username=%s\npassword=%s\n" % found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv, sys.stdin, sys.stdout, os.environ))
