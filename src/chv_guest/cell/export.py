"""A task's bounded export (``chv-cell task export ID [--max-bytes N]
PATH...``, docs/executor.md "Results out"): a tar of the regular files
named (or found beneath the directories named) on stdout, read the way
``chv-cell read`` reads one file (slotfiles.py), never further:

- each PATH is a cell path of the task's slot (its workspace or home) and
  is opened beneath the slot's directory without following a link or
  crossing a mount point; a PATH that is a link, a FIFO, a device or a
  socket, or that is missing, refuses the whole export before anything is
  written;
- a directory is walked by file descriptor (each one opened O_NOFOLLOW
  relative to its parent's fd, on the slot's file system only); inside it
  a symbolic link, FIFO, device or socket is skipped (one line on stderr),
  never opened;
- only regular files owned by a uid of the slot's range are exported (a
  hard link to a file of root or of another slot is skipped), each
  reopened through its own fd and checked to be the inode found in the
  walk, with the size the walk saw: a file that grew is cut there, one
  that shrank is padded with zeros (and both are said on stderr);
- the sizes found are added up first: more than ``--max-bytes`` (at most,
  and by default, the policy's ``read_max_bytes``) refuses the export
  before a byte is written (EXIT_TOO_BIG).

The export holds the slot's lock: no turn of the task runs meanwhile, and
its end waits for the export.  Standard library only."""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from typing import IO, Callable, List, NamedTuple, Optional, Sequence, Set, Tuple

from . import slotfiles
from .policy import Policy, Slot

EXIT_REFUSED = slotfiles.EXIT_REFUSED  # 65: a PATH is a link, not a file or directory, or not the slot's
EXIT_MISSING = slotfiles.EXIT_MISSING  # 66: a PATH does not exist
EXIT_TOO_BIG = 73  # the files hold more than --max-bytes: nothing written
MAX_ENTRIES = 100000  # files and directories one export walks at most
MAX_DEPTH = 64


class Entry(NamedTuple):
    name: str  # the member's name in the tar: "workspace/..." or "home/..."
    cell_path: str  # the file's cell path (what open_slot_file opens again)
    st: os.stat_result


def member_name(kind: str, parts: Sequence[str]) -> str:
    return "/".join([kind] + list(parts))


def _cell_path(policy: Policy, kind: str, parts: Sequence[str]) -> str:
    top = policy["workspace_mount"] if kind == "workspace" else policy["agent_state_mount"]
    return "/".join([top.rstrip("/")] + list(parts))


def _slot_owned(st: os.stat_result, slot: Slot) -> bool:
    return bool(slot["uid_base"] <= st.st_uid < slot["uid_base"] + slot["uid_size"])


def _locate(policy: Policy, slot: Slot, path: str) -> Tuple[str, str, List[str]]:
    """slotfiles.locate, and the slot's workspace or home itself (no components) for its top."""
    tops = {policy["workspace_mount"]: "workspace", policy["agent_state_mount"]: "home"}
    tops.update({a: "workspace" for a in policy.get("workspace_aliases") or []})
    kind = tops.get(path.rstrip("/") or "/") if path.startswith("/") else ("workspace" if path in (".", "./") else None)
    if kind is not None:
        return kind, os.path.join(policy["workspace_root" if kind == "workspace" else "agent_state_root"],
                                  slot["name"]), []
    return slotfiles.locate(policy, slot, path)


def collect(policy: Policy, slot: Slot, paths: Sequence[str], log: Callable[[str], object]) -> List[Entry]:
    """The regular files the export holds, in order, each once; raises
    slotfiles.Refused for a PATH that cannot be exported at all."""
    out: List[Entry] = []
    seen: Set[Tuple[int, int, str]] = set()
    count = 0
    for path in paths:
        kind, top, parts = _locate(policy, slot, path)
        what = "%s (slot %s, %s)" % (path, slot["name"], kind)
        try:
            base = slotfiles.open_dir(top)
        except OSError as exc:
            raise slotfiles.Refused(EXIT_MISSING if exc.errno in (errno.ENOENT, errno.ENOTDIR) else EXIT_REFUSED,
                                    "%s: the slot's %s cannot be opened: %s" % (what, kind, exc.strerror))
        try:
            try:
                leaf = slotfiles.open_beneath(base, parts)[0] if parts else os.dup(base)
            except OSError as exc:
                raise slotfiles.errno_refusal(exc, what)
            try:
                st = os.fstat(leaf)
                if stat.S_ISDIR(st.st_mode):
                    count = _walk_dir(policy, slot, leaf, kind, list(parts), out, seen, count, log)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise slotfiles.Refused(EXIT_REFUSED, "%s is %s: only regular files and directories are "
                                            "exported" % (what, slotfiles.kind_of(st.st_mode)))
                if not _slot_owned(st, slot):
                    raise slotfiles.Refused(EXIT_REFUSED, "%s is owned by uid %d, outside the slot's uids: not the "
                                            "slot's file" % (what, st.st_uid))
                key = (st.st_dev, st.st_ino, member_name(kind, parts))
                if key not in seen:
                    seen.add(key)
                    out.append(Entry(member_name(kind, parts), _cell_path(policy, kind, parts), st))
            finally:
                os.close(leaf)
        finally:
            os.close(base)
    return out


def _walk_dir(policy: Policy, slot: Slot, dir_fd: int, kind: str, parts: List[str], out: List[Entry],
              seen: Set[Tuple[int, int, str]], count: int, log: Callable[[str], object]) -> int:
    """Add the regular files beneath the directory ``dir_fd`` (an O_PATH fd
    of ``parts``); the running count of entries walked."""
    dev = os.fstat(dir_fd).st_dev
    # (fd, parts) of the directories still to read: each opened O_NOFOLLOW from its parent's fd
    todo: List[Tuple[int, List[str]]] = [(os.open("/proc/self/fd/%d" % dir_fd, os.O_RDONLY | os.O_DIRECTORY
                                                  | os.O_CLOEXEC), parts)]
    try:
        while todo:
            fd, here = todo.pop()
            try:
                names = sorted(os.listdir(fd))
                subdirs = []
                for name in names:
                    count += 1
                    if count > MAX_ENTRIES:
                        raise slotfiles.Refused(EXIT_TOO_BIG, "more than %d entries beneath %s" % (
                            MAX_ENTRIES, member_name(kind, parts)))
                    rel = here + [name]
                    shown = member_name(kind, rel)
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        if st.st_dev != dev:
                            log("export: skipped %s: a mount point" % shown)
                        elif len(rel) - len(parts) >= MAX_DEPTH:
                            log("export: skipped %s: deeper than %d directories" % (shown, MAX_DEPTH))
                        else:
                            subdirs.append(name)
                    elif not stat.S_ISREG(st.st_mode):
                        log("export: skipped %s: %s (never followed or opened)" % (shown, slotfiles.kind_of(st.st_mode)))
                    elif not _slot_owned(st, slot):
                        log("export: skipped %s: owned by uid %d, outside the slot's uids (a hard link to a file "
                            "that is not the slot's?)" % (shown, st.st_uid))
                    elif (st.st_dev, st.st_ino, shown) not in seen:
                        seen.add((st.st_dev, st.st_ino, shown))
                        out.append(Entry(shown, _cell_path(policy, kind, rel), st))
                for name in reversed(subdirs):
                    try:
                        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    except OSError as exc:  # swapped for a link meanwhile: ELOOP/ENOTDIR
                        log("export: skipped %s: %s" % (member_name(kind, here + [name]), exc.strerror))
                        continue
                    if os.fstat(nfd).st_dev != dev:
                        os.close(nfd)
                        log("export: skipped %s: a mount point" % member_name(kind, here + [name]))
                        continue
                    todo.append((nfd, here + [name]))
            finally:
                os.close(fd)
    finally:
        for fd, dummy in todo:
            os.close(fd)
    return count


class _Bounded:
    """A file object of exactly ``size`` bytes read from ``fd``: cut when
    the file grew, padded with zeros when it shrank (``changed`` says so)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.left, self.changed = fd, size, False

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        if n <= 0:
            return b""
        data = os.read(self.fd, n)
        if not data:
            self.changed = True
            data = b"\0" * n
        self.left -= len(data)
        return data


def write_tar(policy: Policy, slot: Slot, entries: Sequence[Entry], out: IO[bytes],
              log: Callable[[str], object]) -> int:
    """The tar of ``entries`` on ``out`` (a stream: POSIX format, root's
    0644 files with the walk's mtimes); the number of files written."""
    written = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            try:
                fd, st = slotfiles.open_slot_file(policy, slot, e.cell_path, 1 << 62)[:2]
            except slotfiles.Refused as exc:
                log("export: skipped %s: %s" % (e.name, exc))
                continue
            try:
                if (st.st_dev, st.st_ino) != (e.st.st_dev, e.st.st_ino) or not _slot_owned(st, slot):
                    log("export: skipped %s: replaced while the export ran" % e.name)
                    continue
                info = tarfile.TarInfo(e.name)
                info.size, info.mtime, info.mode = e.st.st_size, int(e.st.st_mtime), 0o644
                body = _Bounded(fd, e.st.st_size)
                tar.addfile(info, body)
                if body.changed or os.read(fd, 1):
                    log("export: %s changed while it was read: written with its size at the walk, %d bytes"
                        % (e.name, e.st.st_size))
                written += 1
            finally:
                os.close(fd)
    return written


def export(policy: Policy, slot: Slot, paths: Sequence[str], max_bytes: int, out: IO[bytes],
           log: Callable[[str], object]) -> int:
    """The export of ``paths`` of ``slot`` to ``out``; its exit code."""
    try:
        entries = collect(policy, slot, paths, log)
    except slotfiles.Refused as exc:
        log("export: %s" % exc)
        return exc.code
    total = sum(e.st.st_size for e in entries)
    if total > max_bytes:
        log("export: the files named hold %d bytes, more than --max-bytes %d: nothing written" % (total, max_bytes))
        return EXIT_TOO_BIG
    write_tar(policy, slot, entries, out, log)
    out.flush()
    return 0


def effective_max(policy: Policy, asked: Optional[int]) -> int:
    """--max-bytes: at most (and by default) the policy's read_max_bytes; ValueError otherwise."""
    limit = int(policy["read_max_bytes"])
    if asked is None:
        return limit
    if not 0 < asked <= limit:
        raise ValueError("--max-bytes %d must be above 0 and at most the policy's read_max_bytes %d (role variable "
                         "chv_cell_read_max_bytes)" % (asked, limit))
    return asked
