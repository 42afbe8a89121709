# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the last converge left on a host, and whether it still holds (the
chv.fleet.converge_state module; site.yml's fast path, docs/operations.md
"A run that changes nothing").

After a converge whose health gate passed, record() writes a stamp: the
digest of the run's inputs (the collection, the host's variables, the facts
and guest reads the roles use; computed on the controller by the filter
chv.fleet.converge_digest) and a manifest of what the roles own (their
``owned`` declarations, the one home of what a role puts on a host): every
path under them with its type, mode, owner, inode, size and change time
(ctime: a write, chmod, chown or replacement changes it, and no user but root
with the clock can set it back), each unit's enablement and activity, the
accounts, the nftables tables, the sysctl values and the packages the roles
install.

verify() compares the host with the stamp. The next run takes the fast path
(its roles skip their tasks) only when the digest is the same and nothing of
the manifest differs: a changed, removed or added file, a stopped or disabled
unit, a missing table, account or package. Anything else runs the roles in
full, which repairs it. Both take the readers they need as arguments, so the
unit tests run them without root."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os
import stat
import tempfile

STAMP_VERSION = 1
SKIP_PREFIXES = ("/run/", "/proc/", "/sys/")
SKIP_NAMES = ("__pycache__",)
DIFF_MAX = 10  # differences reported, of any number found


def _skipped(path):
    return path.startswith(SKIP_PREFIXES) or os.path.basename(path) in SKIP_NAMES


def entry(path, lstat=os.lstat, readlink=os.readlink):
    """One path as the manifest records it (None: the path does not exist)."""
    try:
        st = lstat(path)
    except (IOError, OSError):
        return None
    if stat.S_ISDIR(st.st_mode):
        kind = "d"
    elif stat.S_ISREG(st.st_mode):
        kind = "f"
    elif stat.S_ISLNK(st.st_mode):
        kind = "l"
    else:
        kind = "o"
    rec = {"type": kind, "mode": "%04o" % stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
           "ino": st.st_ino, "ctime_ns": getattr(st, "st_ctime_ns", int(st.st_ctime * 1e9))}
    if kind == "f":
        rec["size"] = st.st_size
    if kind == "l":
        rec["target"] = readlink(path)
    return rec


# What a runtime path keeps in the manifest: its contents, inode and change time are its service's
RUNTIME_KEYS = ("type", "mode", "uid", "gid", "target")


def walk(roots, tops=(), runtime=(), lstat=os.lstat, readlink=os.readlink, listdir=os.listdir):
    """{path: entry} for every root and, below a root that is a directory, every path in it (links are
    recorded, never followed); for each of ``tops`` the path alone (a directory whose contents are the
    host's, not the role's); for each of ``runtime`` (what a role's service rewrites as it runs) the path
    alone with its type, mode, owner and link target only. Paths under /run (made at boot) and __pycache__
    are left out."""
    out = {}
    for top in tops:
        if not _skipped(top):
            out[top] = entry(top, lstat, readlink)
    for path in runtime:
        if not _skipped(path):
            rec = entry(path, lstat, readlink)
            out[path] = None if rec is None else dict((k, v) for k, v in rec.items() if k in RUNTIME_KEYS)
    pending = sorted(set(r for r in roots if not _skipped(r)), reverse=True)
    while pending:
        path = pending.pop()
        rec = entry(path, lstat, readlink)
        out[path] = rec
        if rec is not None and rec["type"] == "d":
            try:
                names = listdir(path)
            except (IOError, OSError):
                continue
            pending.extend(sorted((os.path.join(path, n) for n in names
                                   if not _skipped(os.path.join(path, n))), reverse=True))
    return out


def parse_units(text):
    """systemctl show -p Id,UnitFileState,ActiveState output: {unit: {"file": ..., "active": ...}}."""
    units, cur = {}, {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if cur.get("Id"):
                units[cur["Id"]] = {"file": cur.get("UnitFileState", ""), "active": cur.get("ActiveState", "")}
            cur = {}
            continue
        key, value = line.split("=", 1) if "=" in line else (line, "")
        cur[key] = value
    return units


def activity_watched(unit, units):
    """Whether a unit's activity must hold between runs: not a service that a socket or timer of the same
    name starts (it comes and goes with its clients), and no template instance."""
    if unit.endswith(".service"):
        stem = unit[:-len(".service")]
        if stem + ".socket" in units or stem + ".timer" in units:
            return False
    return "@." not in unit


def parse_dpkg_status(text):
    """The packages dpkg's status file lists as installed."""
    installed, name = set(), None
    for line in text.splitlines():
        if line.startswith("Package: "):
            name = line[len("Package: "):].strip()
        elif line.startswith("Status: ") and name and line.split()[-1] == "installed":
            installed.add(name)
    return installed


def parse_nft_tables(text):
    """`nft list tables` output: {"inet chv_cell", ...}."""
    return set(" ".join(line.split()[1:3]) for line in text.splitlines() if line.startswith("table "))


def snapshot(want, read):
    """The host's state of everything ``want`` names (the module's arguments: paths, tops, runtime, units,
    users, groups, nft_tables, sysctls, packages); ``read`` gives the host's readers (see the module)."""
    units = sorted(set(want.get("units") or []))
    shown = read["units"](units) if units else {}
    installed = read["packages"]() if want.get("packages") else set()
    tables = read["nft_tables"]() if want.get("nft_tables") else set()
    return {
        "paths": walk(want.get("paths") or [], want.get("tops") or (), want.get("runtime") or (), read["lstat"],
                      read["readlink"], read["listdir"]),
        "units": dict((u, shown.get(u, {"file": "", "active": ""})) for u in units),
        "users": dict((u, read["user"](u)) for u in sorted(set(want.get("users") or []))),
        "groups": dict((g, read["group"](g)) for g in sorted(set(want.get("groups") or []))),
        "nft_tables": dict((t, t in tables) for t in sorted(set(want.get("nft_tables") or []))),
        "sysctls": dict((k, read["sysctl"](k)) for k in sorted(set(want.get("sysctls") or []))),
        "packages": dict((p, p in installed) for p in sorted(set(want.get("packages") or []))),
    }


def differences(recorded, now):
    """What differs between a recorded snapshot and the host's now, one line each (empty: nothing)."""
    out = []
    before, after = recorded.get("paths", {}), now.get("paths", {})
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        if a is None:
            out.append("%s: new" % path)
        elif b is None:
            out.append("%s: gone" % path)
        else:
            keys = [k for k in ("type", "mode", "uid", "gid", "target", "size", "ino", "ctime_ns") if a.get(k) != b.get(k)]
            out.append("%s: %s changed" % (path, ", ".join(keys)))
    units_before, units_after = recorded.get("units", {}), now.get("units", {})
    for unit in sorted(set(units_before) | set(units_after)):
        a, b = units_before.get(unit, {}), units_after.get(unit, {})
        if a.get("file") != b.get("file"):
            out.append("unit %s: %s, was %s" % (unit, b.get("file") or "unknown", a.get("file") or "unknown"))
        elif activity_watched(unit, units_before) and a.get("active") != b.get("active"):
            out.append("unit %s: %s, was %s" % (unit, b.get("active") or "unknown", a.get("active") or "unknown"))
    for key, what in (("users", "user"), ("groups", "group"), ("nft_tables", "nft table"), ("sysctls", "sysctl"),
                      ("packages", "package")):
        a, b = recorded.get(key, {}), now.get(key, {})
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                out.append("%s %s: %s, was %s" % (what, name, json.dumps(b.get(name)), json.dumps(a.get(name))))
    return out


def rollout_cordon(text):
    """Whether a cordon marker's text (None: no marker) is a rollout's (chv-cell cordon --rollout), which
    only a rollout's passed gate lifts."""
    if text is None:
        return False
    try:
        rec = json.loads(text)
    except ValueError:
        return False
    return isinstance(rec, dict) and rec.get("rollout") is True


def verify(stamp, want, digest, now_epoch, read, cordon_text=None):
    """The fast path's verdict: {"fresh": bool, "reasons": [...], "gate_age": seconds or None}. Fresh: a
    stamp of this version, the same digest, the same things wanted, no rollout's cordon left on the host
    (``cordon_text``: the marker's text, None without one) and no difference on the host."""
    if stamp is None:
        return {"fresh": False, "reasons": ["no stamp of an earlier converge"], "gate_age": None}
    gate = stamp.get("gate") or {}
    age = round(now_epoch - gate["at"], 1) if isinstance(gate.get("at"), (int, float)) else None
    if rollout_cordon(cordon_text):
        reasons = ["a rollout's cordon is on the host (a run that stopped before its gate)"]
    elif stamp.get("version") != STAMP_VERSION:
        reasons = ["the stamp is of another version (%r)" % stamp.get("version")]
    elif stamp.get("digest") != digest:
        reasons = ["the run's inputs differ from the last converge's (collection, variables or facts)"]
    elif stamp.get("want") != want:
        reasons = ["the roles own other things than at the last converge"]
    else:
        found = differences(stamp.get("state") or {}, snapshot(want, read))
        reasons = found[:DIFF_MAX] + (["and %d more" % (len(found) - DIFF_MAX)] if len(found) > DIFF_MAX else [])
    return {"fresh": not reasons, "reasons": reasons, "gate_age": age}


def stamp(want, digest, gate_summary, now_epoch, read):
    """The stamp record() writes."""
    return {"version": STAMP_VERSION, "digest": digest, "want": want, "gate": {"at": now_epoch, "summary": gate_summary},
            "state": snapshot(want, read)}


def load(path):
    """The stamp at path, or None (none there, or not one this module wrote)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (IOError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save(path, data):
    """Write the stamp atomically, root's, 0600 (it names what the host runs, nothing secret)."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".converge-", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
