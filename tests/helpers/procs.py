"""The host's processes, for the tests: their command lines; stopping one the test started."""

import os
import subprocess


def cmdlines():
    """(pid, argv as a list of bytes) of each process whose command line can be read."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as fh:
                    argv = fh.read().split(b"\0")
            except OSError:
                continue  # gone meanwhile, or not ours to read
            yield pid, argv


def stop(proc, grace, end=None):
    """End ``proc`` (a Popen) with ``end()`` (default: terminate it); kill it when it is still there
    after ``grace`` seconds."""
    (end or proc.terminate)()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
