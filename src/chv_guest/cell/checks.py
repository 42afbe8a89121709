"""The fail-closed checks of a Linux cell before its gate opens: resource
limits (its own cgroup, or its systemd scope), no user namespaces in the
cell, and the cell_nat ruleset covering its veth.  Each raises SetupError
to refuse the cell."""

from __future__ import annotations

import ctypes
import os
import subprocess
from typing import Callable, List, Optional, Tuple

from . import cgroups
from . import limits as limitsmod
from . import policy as policymod
from . import ruleset as rulesetmod
from .errors import SetupError
from .fsutil import read_text
from .log import log

USERNS_SYSCTL = "/proc/sys/user/max_user_namespaces"
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C", "LC_ALL": "C"}


def _limits_verdict(policy: policymod.Policy, slot: policymod.Slot, problems: List[str]) -> None:
    if not problems:
        return
    if policy["require_limits"]:
        raise SetupError(
            "resource limits cannot be enforced: %s; refusing to start the cell (policy require_limits)"
            % "; ".join(problems)
        )
    log("slot %s: WARNING: resource limits NOT enforced: %s (policy require_limits is false)"
        % (slot["name"], "; ".join(problems)))


def apply_standalone_limits(policy: policymod.Policy, slot: policymod.Slot, cg2: Optional[str],
                            debug: Callable[[str], None] = lambda msg: None) -> None:
    """Write the policy's properties into the cell's own cgroup2
    directory (before nspawn is in it)."""
    props = policy["properties"]
    if not props:
        return
    mem_total, tasks = cgroups.host_facts_for_limits()
    limits, problems = limitsmod.plan(props, mem_total, tasks)
    if cg2 is None:
        bad = [(lim, "no cgroup2 hierarchy on this host") for lim in limits]
    else:
        parent = os.path.dirname(cg2)
        try:
            enabled = set(read_text(os.path.join(parent, "cgroup.subtree_control")).split())
        except OSError:
            enabled = set()
        bad = limitsmod.unavailable(limits, enabled, set(os.listdir(cg2)))
        bad = [(lim, r + " (not in %s/cgroup.subtree_control)" % parent if r.startswith("controller") else r)
               for lim, r in bad]
    problems += [limitsmod.describe([b]) for b in bad]
    _limits_verdict(policy, slot, problems)
    skipped = {lim for lim, dummy in bad}
    for lim in limits:
        if lim in skipped:
            continue
        assert cg2 is not None  # without it every limit is skipped
        path = os.path.join(cg2, lim.file)
        try:
            with open(path, "w") as fh:
                fh.write(lim.value + "\n")
            got = read_text(path)
        except OSError as exc:
            raise SetupError("cannot write %s=%s to %s: %s" % (lim.prop, lim.value, path, exc.strerror))
        if not limitsmod.matches(lim, got, os.sysconf("SC_PAGE_SIZE")):
            raise SetupError("%s reads %r after writing %s (%s)" % (path, got.strip(), lim.value, lim.prop))
        debug("slot %s: %s = %s" % (slot["name"], path, lim.value))


def check_scope_limits(policy: policymod.Policy, slot: policymod.Slot, leader: int, unit: str) -> None:
    """systemd scope: the scope's cgroup must carry the limits asked."""
    props = policy["properties"]
    if not props:
        return
    mem_total, tasks = cgroups.host_facts_for_limits()
    limits, problems = limitsmod.plan(props, mem_total, tasks)
    mount = cgroups.mounts().get("")
    try:
        cg = cgroups.dirs_of(leader).get("")
    except OSError:
        cg = None
    scope = None
    if mount is not None and cg is not None:
        scope = limitsmod.scope_dir(cg[len(mount[1]):], unit)
    if scope is None:
        problems += ["%s (%s): the cell's cgroup2 scope %s was not found" % (lim.prop, lim.file, unit)
                     for lim in limits]
    else:
        assert mount is not None  # a scope is found only in it
        problems += cgroups.scope_limit_problems(limits, mount[1] + scope)
    _limits_verdict(policy, slot, problems)


def start_userns_restriction(libc: ctypes.CDLL, leader: int) -> Tuple[int, int]:
    """Start a child that writes 0 to user.max_user_namespaces in the
    cell's user namespace (user.* sysctls resolve against the writer's, so
    it joins the cell's); on a read-only /proc/sys (a guest that is itself
    a container) it remounts it in a private mount namespace first."""
    own, cell = (os.stat("/proc/%s/ns/user" % x).st_ino for x in ("self", leader))
    if own == cell:
        raise SetupError("the cell has no user namespace of its own")
    fd = os.open("/proc/%d/ns/user" % leader, os.O_RDONLY | os.O_CLOEXEC)
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        code, msg = 1, "no answer"
        try:
            os.close(r)
            _writable_proc_sys(libc)
            if libc.setns(fd, CLONE_NEWUSER) != 0:
                e = ctypes.get_errno()
                raise OSError(e, "setns(CLONE_NEWUSER): " + os.strerror(e))
            with open(USERNS_SYSCTL, "w") as fh:
                fh.write("0\n")
            with open(USERNS_SYSCTL) as fh:
                msg = "value " + fh.read().strip()
            code = 0
        except BaseException as exc:  # noqa: B036 (report everything, then exit)
            msg = "error %s" % exc
        try:
            os.write(w, msg.encode()[:2000])
        finally:
            os._exit(code)
    os.close(w)
    os.close(fd)
    return pid, r


def userns_verdict(started: Tuple[int, int]) -> None:
    """Wait for the child of start_userns_restriction; SetupError unless
    it read 0 back."""
    pid, r = started
    chunks = []
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    answer = b"".join(chunks).decode(errors="replace") or "no answer"
    if answer != "value 0":
        raise SetupError(
            "cannot set user.max_user_namespaces to 0 in the cell (%s); refusing to start the cell "
            "(policy allow_user_namespaces is false)" % answer
        )


def list_ruleset(policy: policymod.Policy) -> Optional[subprocess.Popen[bytes]]:
    """Start ``nft -j list table`` for check_ruleset (the listing is read
    there; the run starts it before it configures the veth, so that the
    two overlap).  None when nft cannot be started (check_ruleset then
    reports why)."""
    try:
        return subprocess.Popen(rulesetmod.list_command(policy["nft"]), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=TOOL_ENV)
    except OSError:
        return None


def check_ruleset(policy: policymod.Policy, slot: policymod.Slot, listing_proc: Optional[subprocess.Popen[bytes]] = None) -> None:
    """The cell_nat table must be loaded and cover this slot's veth
    (``listing_proc``: a list_ruleset() started earlier, or None)."""
    cmd = rulesetmod.list_command(policy["nft"])
    tail = "; refusing to start the cell (policy require_ruleset)"
    try:
        r = listing_proc or subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, env=TOOL_ENV)
        out, err = r.communicate(timeout=20)
    except OSError as exc:
        raise SetupError("cannot run %s: %s%s" % (cmd[0], exc.strerror, tail))
    except subprocess.TimeoutExpired:
        r.kill()
        r.wait()
        raise SetupError("%s did not answer within 20s%s" % (" ".join(cmd), tail))
    listing: Optional[str] = out.decode(errors="replace")
    if r.returncode != 0:
        message = err.decode(errors="replace").strip()
        if "No such file or directory" not in message:
            raise SetupError("%s failed (exit %d): %s%s" % (" ".join(cmd), r.returncode, message, tail))
        listing = None
    try:
        items = rulesetmod.missing(listing, slot["host_ifname"], proxy=bool(policy["egress_proxy"]))
    except rulesetmod.RulesetError as exc:
        raise SetupError("%s%s" % (exc, tail))
    if items:
        raise SetupError(rulesetmod.refusal(items))


def _writable_proc_sys(libc: ctypes.CDLL, path: str = "/proc/sys") -> None:
    """In a forked child only: when ``path`` is a read-only mount, move to a
    private mount namespace and remount it read-write there (the flags
    nosuid/nodev/noexec are kept).  Nothing changes for other processes."""
    st = os.statvfs(path)
    if not st.f_flag & os.ST_RDONLY:
        return
    keep = st.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)  # same bits as MS_NOSUID|MS_NODEV|MS_NOEXEC
    if libc.unshare(CLONE_NEWNS) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "unshare(CLONE_NEWNS): " + os.strerror(e))
    for target, flags, what in (
        (b"/", _MS_REC | _MS_PRIVATE, "make / private"),
        (path.encode(), _MS_REMOUNT | _MS_BIND | keep, "remount %s read-write" % path),
    ):
        if libc.mount(None, target, None, flags, None) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "%s: %s" % (what, os.strerror(e)))
