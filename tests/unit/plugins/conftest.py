"""Fixtures shared by the plugin tests: a real process holding a slot lock
the way the chv-cell launcher does."""

import subprocess
import sys

import pytest

from testpaths import SRC

# Takes the lock (plain flock, or the launcher's own claim.try_claim), says
# "held <pid>", then keeps it until stdin closes.
_HOLDER = r'''
import fcntl, os, sys
path, how = sys.argv[1], sys.argv[2]
if how == 'launcher':
    sys.path.insert(0, sys.argv[3])
    from chv_guest.cell import claim
    held = claim.try_claim(path)
else:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
sys.stdout.write('held %d\n' % os.getpid())
sys.stdout.flush()
sys.stdin.read()
if how == 'launcher':
    held.release()
'''


class LockHolder:
    """A child process holding flock(LOCK_EX) on ``path`` until ``stop()``."""

    def __init__(self, path, how='flock'):
        self.path = str(path)
        self.proc = subprocess.Popen([sys.executable, '-c', _HOLDER, self.path, how, SRC],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     universal_newlines=True)
        line = self.proc.stdout.readline()
        assert line.startswith('held '), 'lock holder failed to start: %r' % line
        self.pid = int(line.split()[1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            assert self.proc.wait(timeout=30) == 0
        self.proc.stdout.close()


@pytest.fixture
def hold_lock():
    """hold_lock(path, how='flock') -> LockHolder; every holder is stopped
    at the end of the test."""
    holders = []

    def start(path, how='flock'):
        holder = LockHolder(path, how)
        holders.append(holder)
        return holder

    yield start
    for holder in holders:
        if holder.proc.poll() is None:
            holder.proc.kill()
            holder.proc.wait()
        holder.proc.stdout.close()
        if holder.proc.stdin and not holder.proc.stdin.closed:
            holder.proc.stdin.close()
