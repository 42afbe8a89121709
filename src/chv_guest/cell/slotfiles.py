"""Reading a slot's files for someone else (``chv-cell read``).

The executor's results and the audit are read outside every cell, as
root, from directories the cell writes.  Everything below a slot's
workspace or home is the cell's to arrange: a symlink to another slot's
file or to /etc/shadow, a FIFO that blocks a reader forever, a file of
many gigabytes.  This module opens such a file the way the cell itself
would see it, never further:

- the path is a cell path (``/workspace/...``, a workspace alias, the
  agent's home) or one relative to the workspace; it is mapped to the
  slot's directory on the guest, and ``..`` is refused;
- the slot's directory is opened with O_NOFOLLOW|O_DIRECTORY (its name lies
  in a root-owned directory, so the cell cannot swap it), and the path
  beneath it with openat2(2) and RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
  RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV, or, where openat2 is not
  available (ENOSYS, or a seccomp filter's EPERM), with a walk of one
  O_NOFOLLOW|O_DIRECTORY open per component from the directory's fd; the
  last component is opened O_PATH|O_NOFOLLOW, so a symlink, FIFO or device
  is never opened for reading (no blocking, no side effect of a device's
  open);
- only a regular file is then reopened for reading (through its own fd,
  O_NONBLOCK, checked to be the same inode), and only when the cell could
  read it too (owned by a uid of the slot's range, or world-readable: a
  hard link to a file of root or of another slot is refused);
- at most ``read_max_bytes`` (policy; role variable
  ``chv_cell_read_max_bytes``) are copied: a larger file is refused before
  a byte is written, one that grows past the limit while it is copied is
  cut there and the exit code says so.

Exit codes (``chv-cell read``): 0 the file's bytes are on stdout;
EXIT_REFUSED (65) the file was refused (a symlink or a mount point on the
way, not a regular file, not the slot's); EXIT_MISSING (66) no such file;
EXIT_TOO_BIG (67) larger than read_max_bytes; 78 (EXIT_CONFIG) the request
itself is refused (no such slot, a path outside the slot's workspace and
home, ``..``).  Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

from .exits import EXIT_CONFIG  # the request is refused

if TYPE_CHECKING:
    from .policy import Policy, Slot

EXIT_REFUSED = 65  # EX_DATAERR: the file is refused (link, not regular, not the slot's)
EXIT_MISSING = 66  # EX_NOINPUT: no such file
EXIT_TOO_BIG = 67  # larger than read_max_bytes

PATH_MAX = 4096

# openat2(2): the same number on every architecture Debian ships (asm-generic
# and x86 alike; only alpha differs).
SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_FLAGS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

O_PATH = getattr(os, "O_PATH", 0)
_DIR_FLAGS = (O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The last component: O_PATH where there is one (nothing is opened for
# reading yet), otherwise a non-blocking read-only open.
_LEAF_FLAGS = (O_PATH or (os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)) | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CHUNK = 1 << 16


class Refused(Exception):
    """A request or a file the reader refuses: ``code`` (an exit code of
    this module) and ``str()`` (the message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: Optional[ctypes.CDLL] = None


def _syscall() -> Callable[..., int]:
    global _libc  # pylint: disable=global-statement
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2) of ``path`` (str) relative to ``dirfd``; the new fd.
    Raises OSError with the kernel's errno (ENOSYS where there is none)."""
    how = _OpenHow(flags, 0, resolve)
    fd = _syscall()(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                    ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


# ---------------------------------------------------------------- the path
def split_relative(rel: str) -> List[str]:
    """The components of a relative path: empty and ``.`` ones dropped;
    ``..``, a NUL or an empty result refused (EXIT_CONFIG)."""
    if "\0" in rel:
        raise Refused(EXIT_CONFIG, "the path contains a NUL byte")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(EXIT_CONFIG, "the path %r contains '..': name the file beneath the slot's workspace or home"
                      % rel)
    if not parts:
        raise Refused(EXIT_CONFIG, "the path %r names the slot's directory itself, not a file in it" % rel)
    return parts


def _beneath(path: str, top: str) -> Optional[str]:
    """The rest of ``path`` below ``top`` ('' for ``top`` itself), or None."""
    top = top.rstrip("/") or "/"
    if path == top:
        return ""
    prefix = top if top.endswith("/") else top + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def locate(policy: Policy, slot: Slot, path: str) -> Tuple[str, str, List[str]]:
    """Map a path of the slot's cell to (kind, host directory, components).

    ``path`` relative: beneath the workspace (the cell's working directory).
    Absolute: beneath ``workspace_mount``, a ``workspace_aliases`` entry
    (the workspace) or ``agent_state_mount`` (the home), the longest that
    matches.  Anything else is refused (EXIT_CONFIG): the reader never reads
    outside the slot's two directories."""
    if len(path) > PATH_MAX or not path:
        raise Refused(EXIT_CONFIG, "the path must be 1 to %d characters" % PATH_MAX)
    dirs = {"workspace": os.path.join(policy["workspace_root"], slot["name"]),
            "home": os.path.join(policy["agent_state_root"], slot["name"])}
    if not path.startswith("/"):
        return "workspace", dirs["workspace"], split_relative(path)
    tops = [(policy["workspace_mount"], "workspace"), (policy["agent_state_mount"], "home")]
    tops += [(a, "workspace") for a in policy.get("workspace_aliases") or []]
    best = None
    for top, kind in tops:
        rest = _beneath(path, top)
        if rest is not None and (best is None or len(top) > len(best[0])):
            best = (top, kind, rest)
    if best is None:
        raise Refused(EXIT_CONFIG, "%s is outside the slot's workspace (%s) and home (%s)"
                      % (path, ", ".join([policy["workspace_mount"]] + list(policy.get("workspace_aliases") or [])),
                         policy["agent_state_mount"]))
    dummy, kind, rest = best
    return kind, dirs[kind], split_relative(rest)


# ---------------------------------------------------------------- opening
def errno_refusal(exc: OSError, what: str) -> Refused:
    """A Refused for an OSError of opening ``what``."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return Refused(EXIT_MISSING, "%s: no such file" % what)
    if exc.errno == errno.ELOOP:
        return Refused(EXIT_REFUSED, "%s: a symbolic link on the way (never followed)" % what)
    if exc.errno == errno.EXDEV:
        return Refused(EXIT_REFUSED, "%s: leaves the slot's directory or crosses a mount point" % what)
    return Refused(EXIT_REFUSED, "%s: cannot open: %s" % (what, exc.strerror))


def open_dir(path: str) -> int:
    """An fd of the slot's directory ``path`` (its last component not followed)."""
    parent, name = os.path.split(path)
    pfd = os.open(parent, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the operator's own path (root's)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=pfd)
    finally:
        os.close(pfd)


def _walk(base_fd: int, parts: Sequence[str]) -> int:
    """The fallback of openat2: one O_NOFOLLOW open per component from
    ``base_fd``; a directory on another device is a mount point (refused,
    as RESOLVE_NO_XDEV).  The last component's fd (_LEAF_FLAGS)."""
    dev = os.fstat(base_fd).st_dev
    fd = os.dup(base_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, _LEAF_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                # O_NOFOLLOW|O_DIRECTORY on a symlink: ELOOP or ENOTDIR; say which
                try:
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        exc = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                except OSError:
                    pass
                raise exc
            os.close(fd)
            fd = nfd
            if not last and os.fstat(fd).st_dev != dev:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_beneath(base_fd: int, parts: Sequence[str], use_openat2: bool = True) -> Tuple[int, str]:
    """The fd of ``parts`` beneath ``base_fd`` opened with _LEAF_FLAGS,
    never following a symlink nor leaving ``base_fd``: openat2 when
    ``use_openat2`` and the kernel has it, else the walk.  Returns (fd,
    "openat2" | "walk"); raises OSError."""
    if use_openat2:
        try:
            return openat2(base_fd, "/".join(parts), _LEAF_FLAGS, RESOLVE_FLAGS), "openat2"
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
    return _walk(base_fd, parts), "walk"


def cell_could_read(st: os.stat_result, slot: Slot) -> bool:
    """The slot's cell could read this inode: owned by a uid of its range, or world-readable."""
    return slot["uid_base"] <= st.st_uid < slot["uid_base"] + slot["uid_size"] or bool(st.st_mode & stat.S_IROTH)


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_slot_file(policy: Policy, slot: Slot, path: str, max_bytes: int,
                   use_openat2: bool = True) -> Tuple[int, os.stat_result, str]:
    """Open the cell path ``path`` of ``slot`` for reading as described in
    the module's docstring.  Returns (fd, st, how); raises Refused."""
    kind, top, parts = locate(policy, slot, path)
    what = "%s (slot %s, %s)" % (path, slot["name"], kind)
    try:
        base = open_dir(top)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise Refused(EXIT_MISSING, "%s: the slot's %s %s does not exist" % (what, kind, top))
        raise errno_refusal(exc, what)
    leaf: Optional[int]  # None once the fd is returned or closed
    try:
        try:
            leaf, how = open_beneath(base, parts, use_openat2)
        except OSError as exc:
            raise errno_refusal(exc, what)
    finally:
        os.close(base)
    try:
        st = os.fstat(leaf)
        if stat.S_ISLNK(st.st_mode):
            raise Refused(EXIT_REFUSED, "%s is a symbolic link (never followed)" % what)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(EXIT_REFUSED, "%s is %s: only regular files are read" % (what, kind_of(st.st_mode)))
        if not cell_could_read(st, slot):
            raise Refused(EXIT_REFUSED, "%s is owned by uid %d, outside the slot's uids %d+%d, and not world-readable: "
                          "not the slot's file" % (what, st.st_uid, slot["uid_base"], slot["uid_size"]))
        if st.st_size > max_bytes:
            raise Refused(EXIT_TOO_BIG, "%s is %d bytes, more than read_max_bytes %d (role variable "
                          "chv_cell_read_max_bytes)" % (what, st.st_size, max_bytes))
        if O_PATH:
            fd = os.open("/proc/self/fd/%d" % leaf, _READ_FLAGS)
            again = os.fstat(fd)
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(again.st_mode):
                os.close(fd)
                raise Refused(EXIT_REFUSED, "%s changed while it was opened" % what)
            os.close(leaf)
            leaf = None
        else:
            fd, leaf = leaf, None
        return fd, st, how
    finally:
        if leaf is not None:
            os.close(leaf)


def copy_bounded(fd: int, out_fd: int, max_bytes: int) -> Tuple[int, bool]:
    """Copy ``fd`` to ``out_fd`` up to ``max_bytes``; (bytes copied, more
    left), where more left means the file grew past the limit."""
    done = 0
    while done < max_bytes:
        chunk = os.read(fd, min(CHUNK, max_bytes - done))
        if not chunk:
            return done, False
        view = memoryview(chunk)
        while view:
            view = view[os.write(out_fd, view):]
        done += len(chunk)
    return done, bool(os.read(fd, 1))


def read_file(policy: Policy, slot_name: str, path: str, out_fd: int = 1,
              log: Optional[Callable[[str], object]] = None, use_openat2: bool = True,
              allowed: Optional[Callable[[], Optional[int]]] = None) -> int:
    """``chv-cell read --slot SLOT PATH``: the file's bytes to ``out_fd``;
    the exit code (one ``log`` line for every refusal).  ``allowed`` (the
    caller's check of who may read the slot) runs again once the file is
    open, before a byte is copied: a refusal code from it (it logs why)
    ends the read, so a task that took the slot between the caller's first
    check and the open is never read by another user."""
    log = log or (lambda msg: sys.stderr.write("chv-cell: %s\n" % msg))
    slot = next((s for s in policy["slots"] if s["name"] == slot_name), None)
    if slot is None:
        log("read: no slot named %r in the policy (have: %s)" % (slot_name, ", ".join(s["name"] for s in policy["slots"])))
        return EXIT_CONFIG
    max_bytes = policy["read_max_bytes"]
    try:
        fd = open_slot_file(policy, slot, path, max_bytes, use_openat2)[0]
    except Refused as exc:
        log("read: %s" % exc)
        return exc.code
    try:
        refused = allowed() if allowed is not None else None
        if refused is not None:
            return refused
        done, more = copy_bounded(fd, out_fd, max_bytes)
    except OSError as exc:
        log("read: %s: %s" % (path, exc.strerror))
        return EXIT_REFUSED
    finally:
        os.close(fd)
    if more:
        log("read: %s grew past read_max_bytes %d while it was read; output cut at %d bytes" % (path, max_bytes, done))
        return EXIT_TOO_BIG
    return 0
