# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Several files, symlinks and removals in one module run (the
chv.fleet.files module): what ansible.builtin.copy with content, the file
module with state=link or state=absent do for one path each, for a list.
A copy or template task costs two module runs on the host even when
nothing changes (a stat, then the file module for the attributes); a
role's files through chv.fleet.files cost one.

plan() compares the wanted entries with the host and returns the changes,
changing nothing. apply() makes them in two passes: every new content is
written to a temporary file beside its destination, given its owner and
mode and checked by the entry's validate command; only when all of them
passed are they renamed into place (one rename each) and the links and
removals made. A failed check leaves every destination as it was. Both
take the lookups they need as arguments, so that the unit tests run them
without root."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import grp
import os
import pwd
import shlex
import stat
import tempfile

from ansible_collections.chv.fleet.plugins.module_utils.directories import check_owner, check_path

STATES = ("file", "link", "absent")
DIFF_MAX = 64 * 1024  # bytes of content shown in a diff, per side


class FilesError(Exception):
    """A bad entry, or a destination that cannot be made what the entry
    says: nothing was changed."""


class Wanted(object):
    """One entry as the role wants it. state file: content (bytes), mode,
    owner, group (uid and gid None for a name the host does not have yet:
    check mode only), validate (a command with %s, or None), force (False:
    an existing file is left as it is). state link: src, the link's
    target. state absent: nothing else."""

    def __init__(self, dest, state, content=None, mode=None, owner=None, group=None, uid=None, gid=None,
                 validate=None, force=True, src=None):
        self.dest, self.state, self.content, self.src = dest, state, content, src
        self.mode, self.owner, self.group, self.uid, self.gid = mode, owner, group, uid, gid
        self.validate, self.force = validate, force


class Change(object):
    """What differs for one destination. kind: "create" (missing), "content"
    (a file whose bytes differ; its owner and mode may differ too), "attrs"
    (mode, uid or gid only), "link" (a missing link or one to another
    target), "remove". before: the current content (bytes) of a file, or
    the current link target, for the diff; attrs: (mode, uid, gid) now."""

    def __init__(self, wanted, kind, before=None, attrs=None):
        self.wanted, self.kind, self.before, self.attrs = wanted, kind, before, attrs

    @property
    def dest(self):
        return self.wanted.dest


def wanted_entries(files, owner, group, allow_unknown=False,
                   uid_of=lambda name: pwd.getpwnam(name).pw_uid,
                   gid_of=lambda name: grp.getgrnam(name).gr_gid):
    """Check and resolve the module's entries; the first bad one raises
    FilesError naming it (files[i] and its dest). A destination may be
    listed once."""
    out, seen = [], set()
    for index, entry in enumerate(files):
        where = "files[%d]" % index
        dest = check_path(entry.get("dest"), where, FilesError)
        if dest in seen:
            raise FilesError("%s: %s is listed twice" % (where, dest))
        seen.add(dest)
        state = entry.get("state") or "file"
        if state not in STATES:
            raise FilesError("%s (%s): state must be one of %s, got %r" % (where, dest, ", ".join(STATES), state))
        if state == "absent":
            out.append(Wanted(dest, state))
        elif state == "link":
            src = entry.get("src")
            if not isinstance(src, str) or not src or "\0" in src:
                raise FilesError("%s (%s): a link needs src, the path it points to (no NUL byte), got %r"
                                 % (where, dest, src))
            out.append(Wanted(dest, state, src=src))
        else:
            content = entry.get("content")
            if content is None:
                raise FilesError("%s (%s): a file needs content" % (where, dest))
            validate = entry.get("validate")
            if validate is not None and "%s" not in validate:
                raise FilesError("%s (%s): validate must contain %%s (the file to check), got %r"
                                 % (where, dest, validate))
            mode, own, grp_, uid, gid = check_owner(entry, where, dest, owner, group, allow_unknown, FilesError,
                                                    uid_of=uid_of, gid_of=gid_of)
            data = content.encode("utf-8") if not isinstance(content, bytes) else content
            out.append(Wanted(dest, state, data, mode, own, grp_, uid, gid, validate,
                              entry.get("force", True) is not False))
    return out


def _lstat(path, lstat_fn):
    try:
        return lstat_fn(path)
    except FileNotFoundError:
        return None


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def plan(entries, lstat_fn=os.lstat, read=_read, readlink=os.readlink, exists=os.path.isdir, check_mode=False):
    """The changes that make every entry true, in the entries' order; none
    when the host already matches. Raised before any change: a destination
    that is a directory (or, for a link, a file that is not a link), a
    destination whose directory is missing (in check mode that is reported
    as a create: an earlier task of the same run makes the directory)."""
    changes = []
    for wanted in entries:
        st = _lstat(wanted.dest, lstat_fn)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise FilesError("%s exists and is a directory" % wanted.dest)
        if wanted.state == "absent":
            if st is not None:
                changes.append(Change(wanted, "remove", before=_before(wanted.dest, st, read, readlink)))
            continue
        if st is None and not exists(os.path.dirname(wanted.dest)) and not check_mode:
            raise FilesError("%s: its directory %s does not exist" % (wanted.dest, os.path.dirname(wanted.dest)))
        if wanted.state == "link":
            if st is None:
                changes.append(Change(wanted, "link"))
            elif not stat.S_ISLNK(st.st_mode):
                raise FilesError("%s exists and is not a symlink; it is left as it is" % wanted.dest)
            elif readlink(wanted.dest) != wanted.src:
                changes.append(Change(wanted, "link", before=readlink(wanted.dest)))
            continue
        if st is None:
            changes.append(Change(wanted, "create"))
            continue
        if not stat.S_ISREG(st.st_mode):
            raise FilesError("%s exists and is not a regular file" % wanted.dest)
        if not wanted.force:
            continue
        attrs = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        current = read(wanted.dest)
        if current != wanted.content:
            changes.append(Change(wanted, "content", before=current, attrs=attrs))
        elif attrs != (wanted.mode, wanted.uid, wanted.gid):
            changes.append(Change(wanted, "attrs", attrs=attrs))
    return changes


def _before(path, st, read, readlink):
    if stat.S_ISLNK(st.st_mode):
        return readlink(path)
    return read(path) if stat.S_ISREG(st.st_mode) else None


def _write_temp(wanted, run, chown, chmod):
    """The new content in a temporary file beside the destination, with its
    owner and mode, checked by the entry's validate command."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(wanted.dest), prefix=".%s." % os.path.basename(wanted.dest))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(wanted.content)
        chown(tmp, wanted.uid, wanted.gid)
        chmod(tmp, wanted.mode)
        if wanted.validate:
            argv = [tmp if word == "%s" else word.replace("%s", tmp) for word in shlex.split(wanted.validate)]
            rc, out, err = run(argv)
            if rc != 0:
                raise FilesError("%s: validate (%s) failed with %d, nothing was changed: %s"
                                 % (wanted.dest, wanted.validate, rc, (err or out).strip()))
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def apply(changes, run, chown=os.chown, chmod=os.chmod, rename=os.rename, unlink=os.unlink, symlink=os.symlink):
    """Make the planned changes: first every new content into a checked
    temporary file (a failure removes them all and changes nothing), then
    the renames, attribute changes, links and removals in order. run(argv)
    returns (rc, stdout, stderr)."""
    temps = {}
    try:
        for change in changes:
            if change.kind in ("create", "content"):
                temps[change.dest] = _write_temp(change.wanted, run, chown, chmod)
    except BaseException:
        for tmp in temps.values():
            unlink(tmp)
        raise
    for change in changes:
        wanted = change.wanted
        if change.kind in ("create", "content"):
            rename(temps[change.dest], change.dest)
        elif change.kind == "attrs":
            # owner first: chown may clear set-id bits the mode sets
            chown(change.dest, wanted.uid, wanted.gid)
            chmod(change.dest, wanted.mode)
        elif change.kind == "link":
            if change.before is not None:
                unlink(change.dest)
            symlink(wanted.src, change.dest)
        else:
            unlink(change.dest)


def _text(data):
    if data is None:
        return ""
    if isinstance(data, str):
        return data + "\n"
    if len(data) > DIFF_MAX or b"\0" in data:
        return "(%d bytes, not shown)\n" % len(data)
    return data.decode("utf-8", "replace")


def _attrs_line(mode, uid, gid):
    return "mode=%04o uid=%s gid=%s\n" % (mode, uid, gid)


def diff(changes):
    """Ansible's diffs, one per changed destination: the content before and
    after (a link's target; a line of mode, uid and gid when only those
    change)."""
    out = []
    for c in changes:
        w = c.wanted
        entry = dict(before_header=c.dest, after_header=c.dest)
        if c.kind == "remove":
            entry.update(before=_text(c.before), after="")
            entry["after_header"] = "%s (absent)" % c.dest
        elif c.kind == "link":
            entry.update(before=_text(c.before), after=_text(w.src))
        elif c.kind == "attrs":
            uid = w.uid if w.uid is not None else w.owner
            gid = w.gid if w.gid is not None else w.group
            entry.update(before=_attrs_line(*c.attrs), after=_attrs_line(w.mode, uid, gid))
        else:
            entry.update(before=_text(c.before), after=_text(w.content))
            if c.kind == "create":
                entry["before_header"] = "%s (absent)" % c.dest
        out.append(entry)
    return out
