"""What chv-broker's and chv-browser's test builds share (broker/testbuild.py,
browser/testbuild.py): the guard that keeps them to `chv-cell audit
--counter-proof`.

A test build is the installed server with exactly one check replaced by a
permissive one, started by the counter-proof (chv_guest/cell/doorbuild.py)
for the run of one loosening, on a socket in a directory of its own, and
stopped and removed after it. It refuses to start (``refusal``) unless

- it runs as root (it drops to the service's user itself where the service
  does not run as root);
- its run directory is a directory named ``RUN_DIR_PREFIX...`` directly
  under ``RUN_DIR_PARENT``, owned by root, writable by no one else (not a
  link);
- that directory's ``OWNER_FILE`` names its parent process: the
  counter-proof writes its own pid there before it starts the build, so a
  build started by anything else (systemd, a shell, a cell) finds another
  pid, or none;
- every path it listens on lies inside that directory.

Nothing here is used by the services themselves: the production entry
points (chv-broker, chv-browser) never import a test build."""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading
import time
from typing import Callable, Iterable, Optional, Sequence

# where the counter-proof makes a test build's directory (cell/doorbuild.py has the same values)
RUN_DIR_PARENT = "/run"
RUN_DIR_PREFIX = "chv-audit-build."
OWNER_FILE = "owner"
# the exit status of a refused start
EXIT_REFUSED = 77


def refusal(run_dir: str, paths: Sequence[str], euid: int, ppid: int) -> Optional[str]:
    """Why a test build may not start with ``run_dir`` and the ``paths`` it
    would listen on, as ``euid`` with parent ``ppid``; None when it may."""
    if euid != 0:
        return "runs as root only (started by chv-cell audit --counter-proof)"
    real = os.path.abspath(run_dir)
    if os.path.dirname(real) != RUN_DIR_PARENT or not os.path.basename(real).startswith(RUN_DIR_PREFIX):
        return "%s is not a counter-proof's directory (%s/%s*)" % (run_dir, RUN_DIR_PARENT, RUN_DIR_PREFIX)
    try:
        st = os.lstat(real)
    except OSError as exc:
        return "%s: %s" % (run_dir, exc.strerror)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return "%s is not a directory of root's that only root may write" % run_dir
    try:
        with open(os.path.join(real, OWNER_FILE), encoding="ascii") as fh:
            owner = fh.read().strip()
    except OSError:
        owner = ""
    if owner != str(ppid):
        return "not started by the counter-proof that made %s (its %s names %r, the parent is %d)" % (
            run_dir, OWNER_FILE, owner, ppid)
    for path in paths:
        if not os.path.abspath(path).startswith(real + "/"):
            return "%s lies outside %s" % (path, run_dir)
    return None


def guard(run_dir: str, paths: Sequence[str]) -> int:
    """The parent's pid when this process may run as a test build; exits with
    EXIT_REFUSED, saying why, when not."""
    ppid = os.getppid()
    why = refusal(run_dir, paths, os.geteuid(), ppid)
    if why:
        sys.stderr.write("chv-audit test build refused: %s\n" % why)
        sys.exit(EXIT_REFUSED)
    return ppid


def stop_with_parent(ppid: int, stop: Callable[[], None], every: float = 0.5) -> threading.Thread:
    """Call ``stop()`` once this process's parent (the counter-proof) is gone: a killed
    audit leaves no test build serving."""
    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(every)
        stop()
    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def parser(prog: str, variants: Iterable[str]) -> argparse.ArgumentParser:
    """A test build's command line: --run-dir, --variant (one of ``variants``), --config."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--variant", required=True, choices=sorted(variants))
    ap.add_argument("--config", required=True)
    return ap


def enter(run_dir: str, paths: Sequence[str]) -> None:
    """The guard (exits when refused), then a SIGTERM to this process, the
    servers' own shutdown, once the counter-proof that started it is gone."""
    ppid = guard(run_dir, paths)
    stop_with_parent(ppid, lambda: os.kill(os.getpid(), signal.SIGTERM))
