"""Slot claiming with flock(2).

A slot is claimed by holding ``flock(LOCK_EX | LOCK_NB)`` on
``<state_dir>/locks/<slot>.lock``.  The kernel drops the lock when the
launcher dies, however it dies, so a crashed launcher's slot frees itself.

The lock file is unlinked on release so nothing is left behind; that opens a
classic race (A unlinks while B already opened the old inode and then locks
it).  Two rules close it:
  * the file is unlinked only while its lock is held;
  * after locking, the claimer checks that the path still names the inode it
    locked (fstat vs stat) and starts over otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Callable, Optional, Sequence, Tuple, TypeVar

K = TypeVar("K")


class SlotBusy(Exception):
    pass


class Claim:
    """A held slot lock."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: Optional[int] = fd

    def release(self) -> None:
        """Unlink (while still holding the lock) and close."""
        if self.fd is None:
            return
        try:
            st = os.fstat(self.fd)
            try:
                cur = os.stat(self.path)
            except FileNotFoundError:
                cur = None
            if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = None


def try_claim(path: str) -> Claim:
    """Return a Claim, or raise SlotBusy when another launcher holds it."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SlotBusy(path)
            raise
        st = os.fstat(fd)
        try:
            cur = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            cur = None
        if cur is None or (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
            # The previous holder unlinked it between our open and our lock.
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, b"%d\n" % os.getpid())
        return Claim(path, fd)


def claim_any(lock_paths: Sequence[Tuple[K, str]], timeout: float, poll: float = 0.05,
              sleep: Callable[[float], object] = time.sleep,
              clock: Callable[[], float] = time.monotonic, label: Callable[[K], str] = str) -> Tuple[K, Claim]:
    """Claim the first free lock among ``lock_paths`` (a list of (key, path)).

    Retries until ``timeout`` seconds have passed; returns (key, Claim) or
    raises SlotBusy naming (``label``) every key tried.
    """
    deadline = clock() + timeout
    delay = poll
    while True:
        for key, path in lock_paths:
            try:
                return key, try_claim(path)
            except SlotBusy:
                continue
        if clock() >= deadline:
            raise SlotBusy(", ".join(label(k) for k, dummy in lock_paths))
        sleep(min(delay, max(0.0, deadline - clock())))
        delay = min(delay * 1.5, 0.5)
