"""server.run_worker: the sync worker never outlives the caller's watch of
it. Real processes: a worker (and a child of its own, as git's are) that
would run for a minute."""

import os
import signal
import sys
import time

import pytest

from chv_guest.broker import server

# a worker whose child writes its pid, then both sleep
WORKER = ("import os, subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(60)\n")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a reaped group is gone for this purpose
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid, within=5.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


class Stop(Exception):
    pass


def test_a_caller_stopped_by_a_signal_takes_the_worker_and_its_children_with_it():
    """task start's SIGTERM (tasks.stop_signals raises in the caller): the worker's group is killed."""
    def stop(_signum, _frame):
        raise Stop()

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    pids = []
    real_read = os.read

    def read(fd, n):  # the worker's output as it arrives: its child's pid
        data = real_read(fd, n)
        pids.extend(int(x) for x in data.split() if x.isdigit())
        return data

    began = time.monotonic()
    try:
        os.read = read
        with pytest.raises(Stop):
            server.run_worker([sys.executable, "-c", WORKER], dict(os.environ), None, 4096, 30)
        # at once, not after the worker's 30 s timeout: the start's slot is emptied right after
        assert time.monotonic() - began < 10
    finally:
        os.read = real_read
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert pids and _gone(pids[0]), "the worker's child outlived its stopped caller"


def test_a_worker_that_ends_by_itself_is_waited_for_and_its_output_kept():
    """Control: the normal end (nothing killed) returns the worker's output and exit code."""
    res = server.run_worker([sys.executable, "-c", "print('done'); raise SystemExit(3)"], dict(os.environ), None,
                            4096, 30)
    assert res["returncode"] == 3 and res["stdout"] == b"done\n" and res["ended"] is None
