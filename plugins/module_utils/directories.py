# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Directories with their mode, owner and group, several in one module run
(the chv.fleet.directories module): what ansible.builtin.file with
state=directory does for one path, for a list, so that a role's directories
cost one module run on the host instead of one per directory.

plan() compares the wanted entries with the host and returns the changes,
changing nothing; apply() makes them. Both take the lookups they need as
arguments, so that the unit tests run them without root."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import grp
import os
import pwd
import re
import stat

MODE_RE = re.compile(r"^0?[0-7]{3,4}$")


class DirectoryError(Exception):
    """A bad entry or a path that cannot be a directory: nothing was changed."""


class Wanted(object):
    """One directory as the role wants it; uid and gid are None for a name
    that does not exist yet (check mode only: an earlier task creates it)."""

    def __init__(self, path, mode, owner, group, uid, gid):
        self.path, self.mode, self.owner, self.group, self.uid, self.gid = path, mode, owner, group, uid, gid


class Change(object):
    """What differs for one path: created (it is missing; parents lists the
    missing directories above it, made 0755 and root's as the file module
    does), or its mode, uid or gid (before, after)."""

    def __init__(self, wanted, created, parents=(), mode=None, uid=None, gid=None):
        self.wanted, self.created, self.parents = wanted, created, list(parents)
        self.mode, self.uid, self.gid = mode, uid, gid

    @property
    def path(self):
        return self.wanted.path


def _resolve(value, kind, lookup, allow_unknown, error):
    text = str(value)
    if text.isdigit():
        return int(text)
    try:
        return lookup(text)
    except KeyError:
        if allow_unknown:
            return None
        raise error("%s %r does not exist on this host" % (kind, text))


def check_path(path, where, error=None):
    """An entry's path: absolute and normalized, or error (DirectoryError
    unless another class is given) naming the entry."""
    if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path:
        raise (error or DirectoryError)("%s: path must be an absolute, normalized path, got %r" % (where, path))
    return path


def check_owner(entry, where, path, owner, group, allow_unknown=False, error=None,
                uid_of=lambda name: pwd.getpwnam(name).pw_uid,
                gid_of=lambda name: grp.getgrnam(name).gr_gid):
    """An entry's mode (an octal string), owner and group (names or numbers;
    the entry's own or the module's default) as (mode, owner, group, uid,
    gid); uid and gid are None for a name the host does not have when
    allow_unknown (check mode). Shared by chv.fleet.directories and
    chv.fleet.files."""
    error = error or DirectoryError
    mode = str(entry.get("mode", ""))
    if not MODE_RE.match(mode):
        raise error("%s (%s): mode must be an octal string such as \"0755\", got %r" % (where, path, entry.get("mode")))
    own = entry.get("owner") if entry.get("owner") is not None else owner
    grp_ = entry.get("group") if entry.get("group") is not None else group
    return (int(mode, 8), str(own), str(grp_),
            _resolve(own, "%s (%s): owner" % (where, path), uid_of, allow_unknown, error),
            _resolve(grp_, "%s (%s): group" % (where, path), gid_of, allow_unknown, error))


def wanted_entries(paths, owner, group, allow_unknown=False,
                   uid_of=lambda name: pwd.getpwnam(name).pw_uid,
                   gid_of=lambda name: grp.getgrnam(name).gr_gid):
    """Check and resolve the module's entries: absolute normalized paths,
    octal modes, existing owners and groups (names or numbers; the entry's
    own or the module's default). A path twice must be the same entry."""
    out, seen = [], {}
    for index, entry in enumerate(paths):
        where = "paths[%d]" % index
        path = check_path(entry.get("path"), where)
        wanted = Wanted(path, *check_owner(entry, where, path, owner, group, allow_unknown,
                                           uid_of=uid_of, gid_of=gid_of))
        key = (wanted.mode, wanted.owner, wanted.group)
        if path in seen and seen[path] != key:
            raise DirectoryError("%s: %s is listed twice with different settings" % (where, path))
        if path not in seen:
            seen[path] = key
            out.append(wanted)
    return out


def _lookup(path, stat_fn):
    try:
        return stat_fn(path)
    except FileNotFoundError:
        return None


def plan(entries, stat_fn=os.stat):
    """The changes that make every entry true, in the entries' order; none
    when the host already matches. A path that exists and is not a directory
    (a symlink to a directory counts as one, as with the file module) is an
    error, raised before any change."""
    changes, made = [], set()
    for wanted in entries:
        st = _lookup(wanted.path, stat_fn)
        if st is None:
            parents, parent = [], os.path.dirname(wanted.path)
            while parent not in made and _lookup(parent, stat_fn) is None:
                parents.insert(0, parent)
                parent = os.path.dirname(parent)
            made.update(parents + [wanted.path])
            changes.append(Change(wanted, True, parents, mode=(None, wanted.mode), uid=(None, wanted.uid),
                                  gid=(None, wanted.gid)))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise DirectoryError("%s exists and is not a directory" % wanted.path)
        mode = stat.S_IMODE(st.st_mode)
        diff = dict(
            mode=(mode, wanted.mode) if mode != wanted.mode else None,
            uid=(st.st_uid, wanted.uid) if st.st_uid != wanted.uid else None,
            gid=(st.st_gid, wanted.gid) if st.st_gid != wanted.gid else None)
        if any(diff.values()):
            changes.append(Change(wanted, False, **diff))
    return changes


def apply(changes, makedirs=os.makedirs, chown=os.chown, chmod=os.chmod):
    """Make the planned changes: missing parents (0755, root's), the
    directory (0700 until its owner and mode are set; it may be the parent
    of an entry before it), then owner and group, then the mode (chown may
    clear the set-id bits a mode sets)."""
    for change in changes:
        for parent in change.parents:
            makedirs(parent, 0o755, exist_ok=True)
        if change.created:
            makedirs(change.path, 0o700, exist_ok=True)
        if change.uid or change.gid:
            chown(change.path, change.wanted.uid, change.wanted.gid)
        chmod(change.path, change.wanted.mode)


def _describe(wanted, mode, uid, gid):
    return "%s mode=%s uid=%s gid=%s" % (wanted.path, "%04o" % mode if mode is not None else "-",
                                         uid if uid is not None else wanted.owner,
                                         gid if gid is not None else wanted.group)


def diff(changes):
    """Ansible's before/after diff: one line per changed path."""
    before, after = [], []
    for c in changes:
        if c.created:
            before.append("%s absent" % c.path)
        else:
            before.append(_describe(c.wanted, (c.mode or (c.wanted.mode,))[0], (c.uid or (c.wanted.uid,))[0],
                                    (c.gid or (c.wanted.gid,))[0]))
        after.append(_describe(c.wanted, c.wanted.mode, c.wanted.uid, c.wanted.gid))
    return {"before": "\n".join(before) + "\n", "after": "\n".join(after) + "\n"}
