"""Tasks' records and the pure parts of their lifecycle (tasks.py has the
side of it that starts and stops things; docs/executor.md "Tasks").

A task owns one slot from ``chv-cell task start`` to ``chv-cell task end``
(or its expiry).  Its record, ``<state_dir>/tasks/<id>.json`` (root's,
0600, in a 0700 directory), is the slot's reservation: while it exists no
plain run and no other task claims the slot (the launcher checks it while
holding the slot's lock, runner.Launcher._claim).  The id is 128 random
bits in hex: unguessable, and the only name of the task."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from typing import Any, Dict, List, Optional

from . import policy as policymod
from .fsutil import write_atomic

TASK_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
SHOTS_DIR = "/run/chv-shots"  # chv-browser's screenshots, a directory per slot (browser/config.py shots_dir)


class WipeError(Exception):
    """A directory could not be emptied without following a link or leaving its file system."""


def new_id() -> str:
    """A new task id: 128 random bits, 32 lower-case hex digits."""
    import secrets  # noqa: PLC0415 (not on a plain run's path: docs/performance.md)

    return secrets.token_hex(16)


def valid_id(task_id: str) -> bool:
    return bool(TASK_ID_RE.match(task_id))


def tasks_dir(policy: policymod.Policy) -> str:
    return os.path.join(policy["state_dir"], "tasks")


def record_path(policy: policymod.Policy, task_id: str) -> str:
    if not valid_id(task_id):
        raise ValueError("%r is not a task id" % task_id)
    return os.path.join(tasks_dir(policy), task_id + ".json")


def new_record(task_id: str, slot: str, owner: int, ttl: float, now: float) -> Dict[str, Any]:
    return {"task": task_id, "slot": slot, "owner": owner, "created": round(now, 3), "ttl": ttl,
            "last_used": round(now, 3)}


def expires(rec: Dict[str, Any]) -> float:
    """When the task expires unless a turn uses it: its last use plus its TTL."""
    return float(rec["last_used"]) + float(rec["ttl"])


def expired(rec: Dict[str, Any], now: float) -> bool:
    """The task is to be torn down: its TTL has passed since its last use,
    its end began and did not finish (``ending``), or its start did not
    (``starting``: a start holds its slot's lock throughout, so one whose
    lock is free died).  Whether a turn or the start runs is the caller's
    to check (the slot's lock)."""
    return bool(rec.get("ending") or rec.get("starting")) or now > expires(rec)


def may_use(rec: Dict[str, Any], uid: int) -> bool:
    """Only the uid that started the task (and root) may run in it, end it or list it."""
    return uid == 0 or rec.get("owner") == uid


def public(rec: Dict[str, Any], policy: policymod.Policy) -> Dict[str, Any]:
    """What ``task start`` and ``task list`` print of a task (``repo``: the clone's url, head and branch)."""
    return {"task": rec["task"], "slot": rec["slot"], "owner": rec["owner"], "home": policy["agent_state_mount"],
            "workspace": policy["workspace_mount"], "created": rec["created"], "ttl": rec["ttl"],
            "last_used": rec["last_used"], "expires": round(expires(rec), 3),
            **({"repo": rec["repo"]} if isinstance(rec.get("repo"), dict) else {})}


def _valid_record(rec: object, task_id: str) -> bool:
    if not isinstance(rec, dict) or rec.get("task") != task_id or not isinstance(rec.get("slot"), str):
        return False
    try:
        int(rec["owner"])
        float(rec["last_used"])
        float(rec["ttl"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def read(policy: policymod.Policy, task_id: str) -> Optional[Dict[str, Any]]:
    """The task's record, or None when there is no such task (or its record is unreadable)."""
    try:
        fd = os.open(record_path(policy, task_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        with os.fdopen(fd) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if _valid_record(rec, task_id) else None


def write(policy: policymod.Policy, rec: Dict[str, Any]) -> None:
    d = tasks_dir(policy)
    os.makedirs(d, mode=0o700, exist_ok=True)
    write_atomic(record_path(policy, rec["task"]), json.dumps(rec, sort_keys=True) + "\n", 0o600)


def remove(policy: policymod.Policy, task_id: str) -> None:
    try:
        os.unlink(record_path(policy, task_id))
    except FileNotFoundError:
        pass


def all_records(policy: policymod.Policy) -> List[Dict[str, Any]]:
    """Every task's record (oldest first)."""
    try:
        names = os.listdir(tasks_dir(policy))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.endswith(".json") and valid_id(n[:-5]):
            rec = read(policy, n[:-5])
            if rec is not None:
                out.append(rec)
    return sorted(out, key=lambda r: (float(r.get("created", 0)), r["task"]))


TOMBSTONE_KEEP = 86400.0  # how long an expired task's owner is told "expired" rather than "no such task"


def tombstone_path(policy: policymod.Policy, task_id: str) -> str:
    if not valid_id(task_id):
        raise ValueError("%r is not a task id" % task_id)
    return os.path.join(tasks_dir(policy), "expired", task_id)


def write_tombstone(policy: policymod.Policy, rec: Dict[str, Any]) -> None:
    """Remember for TOMBSTONE_KEEP seconds that the task expired (its owner's uid only)."""
    os.makedirs(os.path.dirname(tombstone_path(policy, rec["task"])), mode=0o700, exist_ok=True)
    write_atomic(tombstone_path(policy, rec["task"]), "%d\n" % int(rec["owner"]), 0o600)


def expired_owner(policy: policymod.Policy, task_id: str) -> Optional[int]:
    """The owner of a task that expired (within TOMBSTONE_KEEP), or None."""
    try:
        fd = os.open(tombstone_path(policy, task_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as fh:
            return int(fh.read(32).strip())
    except (OSError, ValueError):
        return None


def prune_tombstones(policy: policymod.Policy, now: float) -> None:
    d = os.path.join(tasks_dir(policy), "expired")
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return
    for n in names:
        try:
            if valid_id(n) and now - os.lstat(os.path.join(d, n)).st_mtime > TOMBSTONE_KEEP:
                os.unlink(os.path.join(d, n))
        except FileNotFoundError:
            pass


def touch(policy: policymod.Policy, task_id: str) -> None:
    """A turn of the task ended (its slot's lock still held): its last use is now."""
    rec = read(policy, task_id)
    if rec is not None and not rec.get("ending"):
        rec["last_used"] = round(time.time(), 3)
        write(policy, rec)


def reserved_by(policy: policymod.Policy, slot_name: str) -> Optional[str]:
    """The id of the task that owns the slot, or None."""
    for rec in all_records(policy):
        if rec["slot"] == slot_name:
            return str(rec["task"])
    return None


# ---------------------------------------------------------------- wiping
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def wipe_contents(path: str) -> int:
    """Remove everything inside the directory ``path`` (which stays); the
    number of entries removed.  Never follows a link: every directory is
    opened O_NOFOLLOW relative to its parent's fd, everything else is
    unlinked (a symlink, FIFO, socket, device or hard link is removed as a
    name, never opened).  One fd at a time (no recursion, any depth): a
    directory emptied is left through its ``..``, checked to be the
    directory it came from.  Refuses (WipeError) a directory on another
    file system (a mount point) and a ``path`` that is a symlink; a missing
    ``path`` is empty."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise WipeError("cannot open %s (a symlink or not a directory?): %s" % (path, exc.strerror))
    removed = 0
    try:
        top = os.fstat(fd)
        dev = top.st_dev
        names: List[str] = []
        ids = [(top.st_dev, top.st_ino)]
        while True:
            sub = None
            with os.scandir(fd) as it:
                for e in it:
                    st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        if st.st_dev != dev:
                            raise WipeError("%s is on another file system (a mount point): not removed"
                                            % os.path.join(path, *names, e.name))
                        sub = e.name
                        break
                    os.unlink(e.name, dir_fd=fd)
                    removed += 1
            if sub is not None:
                nfd = os.open(sub, _DIR_FLAGS, dir_fd=fd)
                st = os.fstat(nfd)
                if st.st_dev != dev:
                    os.close(nfd)
                    raise WipeError("%s is on another file system (a mount point): not removed"
                                    % os.path.join(path, *names, sub))
                os.close(fd)
                fd = nfd
                names.append(sub)
                ids.append((st.st_dev, st.st_ino))
                continue
            if not names:
                return removed
            pfd = os.open("..", _DIR_FLAGS, dir_fd=fd)
            pst = os.fstat(pfd)
            os.close(fd)
            fd = pfd
            ids.pop()
            if (pst.st_dev, pst.st_ino) != ids[-1]:
                raise WipeError("%s moved while it was emptied" % os.path.join(path, *names))
            os.rmdir(names.pop(), dir_fd=fd)
            removed += 1
    finally:
        os.close(fd)
