"""File helpers of the launchers: directories created without following a
link, atomic writes, quiet unlinks."""

from __future__ import annotations

import os
import stat
from typing import Iterable, Optional

from .errors import SetupError

SLOT_DIR_MODE = 0o700  # a slot's workspace and agent state directory (its cell root's uid and gid)


def write_atomic(path: str, data: str, mode: int) -> None:
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, data.encode())
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def ensure_dir(path: str, mode: int, uid: Optional[int] = None) -> None:
    """Create path (and parents, root-only) if missing; never follow a symlink at the leaf."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755)
        os.mkdir(path, mode)
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, uid)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError("%s exists and is not a directory" % path)


def ensure_slot_dir(path: str, uid: int) -> None:
    """A slot's workspace or agent state directory, left owned by the slot's
    cell root (uid and gid ``uid``, no group shared between slots), mode
    0700.  An existing one is corrected through an O_NOFOLLOW fd (older
    releases used a setgid group; a cell may chmod it)."""
    ensure_dir(path, SLOT_DIR_MODE, uid=uid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SetupError("cannot open the slot directory %s: %s" % (path, exc.strerror))
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, uid):
            os.fchown(fd, uid, uid)
        if stat.S_IMODE(st.st_mode) != SLOT_DIR_MODE:
            os.fchmod(fd, SLOT_DIR_MODE)
    finally:
        os.close(fd)


def ensure_dir_beneath(base: str, parts: Iterable[str], mode: int, uid: int) -> None:
    """Create base/parts[0]/parts[1]/... where missing (new ones owned by
    ``uid``), each component opened O_NOFOLLOW relative to the previous:
    ``base`` is writable by the cell, so a symlink there is refused, not
    followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    path = base
    try:
        fd = os.open(base, flags)
    except OSError as exc:
        raise SetupError("cannot open %s: %s" % (base, exc.strerror))
    try:
        for part in parts:
            path = os.path.join(path, part)
            try:
                os.mkdir(part, mode, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                raise SetupError("%s (mount point of a workspace alias) is a symlink or not a directory (%s); move it away"
                                 % (path, exc.strerror))
            os.close(fd)
            fd = nfd
            if created:
                os.fchown(fd, uid, uid)
                os.fchmod(fd, mode)
    finally:
        os.close(fd)
