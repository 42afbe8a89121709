"""One lock for this machine's account and sudo databases while make test's
lanes run at once. The executor's-path tests (tests/integration/cells,
host lane) add a group, two users and sudoers drop-ins for a while; the
macOS check-mode walk (tests/integration/playbooks, lab lane) proves that
its run changed none of them, by a snapshot before and after. Without the
lock the walk saw the cells tests' drop-in appear (a CI run at 7cc6018).

``changing()`` is held (shared: such tests do not wait for each other) for
as long as a test's changes exist; ``unchanged()`` is held (exclusive) from
the walk's first snapshot to its second. Standard library only."""

import contextlib
import fcntl
import os

LOCK = "/tmp/chv-fleet-test-host-accounts.lock"


@contextlib.contextmanager
def _held(mode):
    # read-only: flock needs no write access, and a walk run as another user than root (it may) opens the
    # file root created under its umask
    fd = os.open(LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def changing():
    """Held while this test's accounts or sudoers drop-ins exist on the machine."""
    return _held(fcntl.LOCK_SH)


def unchanged():
    """Held while a test proves that nothing changed the accounts or sudoers drop-ins."""
    return _held(fcntl.LOCK_EX)
