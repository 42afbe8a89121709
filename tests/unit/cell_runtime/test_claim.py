import fcntl
import os
import signal
import time

import pytest

from chv_guest.cell import claim as claimmod


def test_claim_and_release_removes_lock(tmp_path):
    path = str(tmp_path / "locks" / "slot0.lock")
    c = claimmod.try_claim(path)
    assert os.path.exists(path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    assert open(path).read().strip() == str(os.getpid())
    c.release()
    assert not os.path.exists(path)
    c.release()  # idempotent


def test_second_claim_is_busy(tmp_path):
    path = str(tmp_path / "slot0.lock")
    c = claimmod.try_claim(path)
    with pytest.raises(claimmod.SlotBusy):
        claimmod.try_claim(path)
    c.release()
    claimmod.try_claim(path).release()


def test_lock_fd_not_inherited(tmp_path):
    c = claimmod.try_claim(str(tmp_path / "s.lock"))
    assert not os.get_inheritable(c.fd)
    c.release()


def test_dead_holder_frees_slot(tmp_path):
    """A launcher killed with SIGKILL leaves a slot the next run can claim."""
    path = str(tmp_path / "slot0.lock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: claim and hang
        os.close(r)
        claimmod.try_claim(path)
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    with pytest.raises(claimmod.SlotBusy):
        claimmod.try_claim(path)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert os.path.exists(path)  # the file survives a SIGKILL ...
    claimmod.try_claim(path).release()  # ... but its lock does not
    assert not os.path.exists(path)


def test_claim_retries_when_file_was_replaced(tmp_path, monkeypatch):
    """If the holder unlinks between our open and our flock, we must not
    keep a lock on an orphaned inode."""
    path = str(tmp_path / "slot0.lock")
    real_flock = fcntl.flock
    calls = []

    def racing_flock(fd, op):
        if not calls:
            # the previous holder releases: unlink, and a third party creates anew
            os.unlink(path)
            open(path, "w").close()
        calls.append(fd)
        return real_flock(fd, op)

    open(path, "w").close()
    monkeypatch.setattr(claimmod.fcntl, "flock", racing_flock)
    c = claimmod.try_claim(path)
    assert len(calls) == 2
    st, cur = os.fstat(c.fd), os.stat(path)
    assert (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)
    c.release()


def test_release_does_not_unlink_someone_elses_file(tmp_path):
    path = str(tmp_path / "slot0.lock")
    c = claimmod.try_claim(path)
    os.unlink(path)
    open(path, "w").close()  # a different inode now has the name
    c.release()
    assert os.path.exists(path)


def test_claim_any_picks_first_free(tmp_path):
    paths = [("slot0", str(tmp_path / "0.lock")), ("slot1", str(tmp_path / "1.lock"))]
    held = claimmod.try_claim(paths[0][1])
    key, c = claimmod.claim_any(paths, timeout=0)
    assert key == "slot1"
    with pytest.raises(claimmod.SlotBusy) as e:
        claimmod.claim_any(paths, timeout=0)
    assert "slot0, slot1" in str(e.value)
    c.release()
    held.release()


def test_claim_any_waits_then_gives_up(tmp_path):
    paths = [("slot0", str(tmp_path / "0.lock"))]
    held = claimmod.try_claim(paths[0][1])
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    with pytest.raises(claimmod.SlotBusy):
        claimmod.claim_any(paths, timeout=5, sleep=sleep, clock=lambda: now[0])
    assert 4.9 <= now[0] <= 5.6
    assert len(sleeps) > 3 and max(sleeps) <= 0.5
    held.release()


def test_claim_any_succeeds_when_slot_frees_while_waiting(tmp_path):
    paths = [("slot0", str(tmp_path / "0.lock"))]
    held = [claimmod.try_claim(paths[0][1])]
    now = [0.0]

    def sleep(s):
        now[0] += s
        if now[0] > 1 and held:
            held.pop().release()

    key, c = claimmod.claim_any(paths, timeout=30, sleep=sleep, clock=lambda: now[0])
    assert key == "slot0" and now[0] < 2
    c.release()
