"""Cell policy: defaults, loading and validation (standard library only).

The policy is the one file the launcher reads
(/etc/chv-fleet/cell-policy.json, rendered by the chv.fleet.cell_runtime
role).  ``validate(obj)`` returns a list of human-readable errors; an empty
list means the policy is usable.  The role runs ``chv-cell validate-policy``
on the rendered file before putting it in place, so everything the launcher
would refuse at run time is refused at deploy time.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import math
import re
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from . import disk as diskmod
from . import families as familiesmod
from . import limits as limitsmod
from . import taskenv as taskenvmod

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10: annotations only

# A merged policy and one of its slot records: JSON objects whose shape
# validate() checks (DEFAULTS and validate are the one home of that shape).
Policy = Dict[str, Any]
Slot = Dict[str, Any]

POLICY_VERSION = 1
DEFAULT_POLICY_PATH = "/etc/chv-fleet/cell-policy.json"

# Capabilities known to the kernel (capability.h, Linux 6.x).
# In Linux's numbering: CAP_NAMES[n] is capability n (chv-cell audit reads
# the effective and bounding sets by these bits).
CAP_NAMES = tuple(
    "CAP_" + n
    for n in (
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID "
        "SETPCAP LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN "
        "NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE "
        "SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME "
        "SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
        "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
        "PERFMON BPF CHECKPOINT_RESTORE"
    ).split()
)
KNOWN_CAPS = frozenset(CAP_NAMES)

# The floor: a policy may drop more, never less.
REQUIRED_DROPPED_CAPS = frozenset(
    [
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_SYS_MODULE",
        "CAP_SYS_RAWIO",
        "CAP_SYS_BOOT",
        "CAP_MKNOD",
    ]
)
# Cell root could raise its own user.max_user_namespaces (set to 0 by the
# launcher unless allow_user_namespaces) again with this capability.
USERNS_GUARD_CAP = "CAP_SYS_RESOURCE"
# Upper bound of runtime_max (seconds): a year.
RUNTIME_MAX_LIMIT = 366 * 86400
# Upper bound of task_ttl (seconds): a week.
TASK_TTL_LIMIT = 7 * 86400
REQUIRED_DENIED_SYSCALLS = frozenset(["io_uring_setup", "io_uring_enter", "io_uring_register"])

KNOWN_RLIMITS = frozenset(
    "CPU FSIZE DATA STACK CORE RSS NOFILE AS NPROC MEMLOCK LOCKS SIGPENDING "
    "MSGQUEUE NICE RTPRIO RTTIME".split()
)
# nspawn environment variables an operator may set for nspawn itself; every
# other variable is stripped from nspawn's environment (some, such as
# SYSTEMD_NSPAWN_API_VFS_WRITABLE, would weaken the cell).
ALLOWED_NSPAWN_ENV = frozenset(
    ["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "SYSTEMD_NSPAWN_USE_CGNS", "SYSTEMD_LOG_LEVEL"]
)

# The platforms a policy is for: "linux" (systemd-nspawn cells) or "darwin"
# (a slot user under sandbox-exec, chv_cell/darwin.py; docs/macos.md).
PLATFORMS = ("linux", "darwin")
# Programs only the Linux launcher runs (null in a darwin policy), and only
# the macOS one (null in a linux policy).
LINUX_PROGRAMS = ("nspawn", "systemd_run", "ip", "nsenter", "nft")
DARWIN_PROGRAMS = ("sandbox_exec", "pfctl")
# A darwin slot: its unprivileged user is the cell's identity (no veth, no subnet).
DARWIN_SLOT_FIELDS = {"name": str, "index": int, "user": str, "uid_base": int, "uid_size": int}
_PF_ANCHOR_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*\Z")

DEFAULTS = {
    "version": POLICY_VERSION,
    "platform": "linux",
    "sandbox_exec": None,
    "pfctl": None,
    # the pf anchor holding the slot users' egress rules (darwin)
    "pf_anchor": None,
    "nspawn": "/usr/bin/systemd-nspawn",
    "systemd_run": "/usr/bin/systemd-run",
    "ip": "/usr/bin/ip",
    "nsenter": "/usr/bin/nsenter",
    "nft": "/usr/sbin/nft",
    # the interpreter a warm cell's pid 2 runs (warm_receive): the host's,
    # under /usr, which every cell sees
    "python": "/usr/bin/python3",
    "state_dir": "/run/chv-fleet",
    "workspace_root": "/var/lib/chv-fleet/workspaces",
    "workspace_mount": "/workspace",
    "agent_state_root": "/var/lib/chv-fleet/agent-state",
    "agent_state_mount": "/root",
    # The agent's identity inside the cell (docs/cells.md "The agent's paths"):
    # HOME, USER and LOGNAME of the payload.  The payload still runs as cell
    # root (uid 0 of the slot's user namespace); these name the agent user
    # the executor logs in as.  The role renders agent_state_mount equal to
    # agent_home, so the slot's agent state dir is the agent's HOME.
    "agent_user": "chv",
    "agent_home": "/home/chv",
    # More cell paths where the slot's workspace appears (besides
    # workspace_mount), e.g. the agent's ~/workspace.
    "workspace_aliases": [],
    "scope": "auto",
    "register": False,
    "drop_capabilities": sorted(REQUIRED_DROPPED_CAPS | {USERNS_GUARD_CAP}),
    "no_new_privileges": True,
    "syscall_deny": sorted(REQUIRED_DENIED_SYSCALLS),
    "inaccessible": ["/etc/chv"],
    "readonly_binds": [],
    "writable_binds": [{"source": "/run/chv", "target": "/run/chv", "optional": False}],
    "tmpfs": ["/tmp"],
    "setenv": {},
    # Names of variables an executor may pass to a run or a task with
    # --env-fd (chv_cell/taskenv.py, docs/executor.md "Passing variables to
    # the agent"): a model credential, the task's settings.  Any other name
    # is refused (78).
    "env_allow": [],
    "properties": {},
    "rlimits": {},
    "nspawn_environment": {},
    "dns_servers": [],
    "dns_search": [],
    "claim_timeout": 30.0,
    "start_timeout": 20.0,
    "stop_grace": 3.0,
    # Fail closed (docs/cells.md "Fail closed"): each of these refuses a run
    # rather than starting a cell without the protection.
    "require_ruleset": True,
    "require_limits": True,
    "allow_user_namespaces": False,
    "allow_shared_network": False,
    # The socket families a cell may create (chv_cell/families.py): a list
    # of AF_* names, or "any" for no filter.
    "socket_families": list(familiesmod.DEFAULT_FAMILIES),
    "runtime_max": 0,
    # A task's time to live (seconds, docs/executor.md "Tasks"): a task whose
    # last turn ended longer ago than this is torn down (role variable
    # chv_cell_task_ttl); `chv-cell task start --ttl S` may only lower it.
    "task_ttl": 3600.0,
    # The per-slot disk quota (chv_cell/disk.py): null for none, or a size
    # such as "2G"; set, the launcher refuses a run unless the slot's
    # workspace and home are on the slot's own file system of at most this size.
    "disk_max": None,
    # chv-browser's socket: at the end of every run, before the slot's lock is
    # released, the launcher has chv-browser destroy the slot's browser state
    # (chv_cell/doors.py). The role renders the browser role's
    # chv_browser_socket_path; "" tells no browser.
    "browser_socket": "/run/chv-browser/browser.sock",
    # chv-broker's configuration (the broker role's chv_broker_config_path):
    # `chv-cell task start --repo` clones with its sync door's worker,
    # protocols, hosts and credential (chv_cell/clone.py); "": no clones.
    "broker_config": "/etc/chv-fleet/broker.json",
    # Slots whose cells are kept started, waiting for a payload
    # (chv-cell warm; docs/cells.md "Warm cells"): names of slots.
    "warm_slots": [],
    # The slot chv-cell health (the rollout's gate) runs its cell in, kept
    # free of other runs: chv-cell run without --slot never takes it. None:
    # the health cell takes any free slot (docs/operations.md "The health gate").
    "health_slot": None,
    # chv-cell read (chv_cell/slotfiles.py): the largest file it copies out of a slot
    "read_max_bytes": 64 * 1024 * 1024,
    # Egress by name (docs/network.md "Egress by name"): None, the cell's own
    # packets go out under the CIDR policy; {"port": N}, the guest's ruleset
    # lets a cell reach only the egress proxy on its own gateway, port N: the
    # cell gets the proxy variables (argv.cell_environment) and no resolver.
    # Role variables chv_cell_egress_mode and chv_cell_egress_proxy_port.
    "egress_proxy": None,
    "slots": [],
}
READ_MAX_BYTES_LIMIT = 1 << 40  # read_max_bytes: at most 1 TiB

SLOT_FIELDS = {
    "name": str,
    "index": int,
    "machine": str,
    "host_ifname": str,
    "cell_ifname": str,
    "subnet": str,
    "gateway": str,
    "address": str,
    "prefixlen": int,
    "uid_base": int,
    "uid_size": int,
}

_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}\Z")
_SLOT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}\Z")
_MACHINE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}\Z")
_CAP_RE = re.compile(r"^CAP_[A-Z_]+\Z")
_SYSCALL_RE = re.compile(r"^[a-z0-9_]+\Z")
_PROP_RE = re.compile(r"^[A-Z][A-Za-z0-9]+\Z")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_RLIMIT_VAL_RE = re.compile(r"^(infinity|[0-9]+)(:(infinity|[0-9]+))?\Z")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
_SEARCH_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?\Z")

# Cell trees that a mount target (agent_home, workspace_aliases) must not be
# in or replace: nspawn provides them, or they are read-only host trees.
SYSTEM_TREES = ("/etc", "/usr", "/proc", "/sys", "/dev", "/run")
# Environment variables a cell always gets from the policy's agent keys
# (setenv may not name them).
AGENT_ENV = ("HOME", "USER", "LOGNAME")

# Host paths that must never become visible (as a bind source) in a cell.
PROTECTED_PATHS = ("/run/chv-fleet", "/etc/chv", "/var/lib/chv-fleet/identities.json")


class PolicyError(Exception):
    """The policy file cannot be used; ``errors`` lists every problem."""

    def __init__(self, errors: Iterable[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = list(errors)


def _is_abs_clean(path: object) -> TypeGuard[str]:
    """An absolute, normalised path that nspawn's --bind syntax can carry."""
    if not isinstance(path, str) or not path.startswith("/"):
        return False
    if any(c in path for c in ":,\n\0") or "//" in path:
        return False
    parts = path.split("/")[1:]
    if path != "/" and (path.endswith("/") or any(p in ("", ".", "..") for p in parts)):
        return False
    return True


def is_under(path: str, root: str) -> bool:
    """True when ``path`` equals ``root`` or lies beneath it."""
    if root == "/":
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")


def merged(obj: Mapping[str, Any]) -> Policy:
    """Policy with defaults filled in for absent keys (deep copy)."""
    out = copy.deepcopy(DEFAULTS)
    for key, value in obj.items():
        out[key] = copy.deepcopy(value)
    return out


def _check_binds(name: str, binds: object, errors: List[str], state_dir: object) -> None:
    if not isinstance(binds, list):
        errors.append("%s: must be a list" % name)
        return
    for i, b in enumerate(binds):
        where = "%s[%d]" % (name, i)
        if not isinstance(b, dict):
            errors.append("%s: must be a mapping with source/target/optional" % where)
            continue
        extra = set(b) - {"source", "target", "optional"}
        if extra:
            errors.append("%s: unknown keys %s" % (where, ", ".join(sorted(extra))))
        src = b.get("source")
        tgt = b.get("target", src)
        src_check = src.replace("{slot}", "slot") if isinstance(src, str) else src
        tgt_check = tgt.replace("{slot}", "slot") if isinstance(tgt, str) else tgt
        if not _is_abs_clean(src_check):
            errors.append("%s: source %r must be an absolute normalised path without ':' or ','" % (where, src))
            continue
        if not _is_abs_clean(tgt_check) or tgt_check == "/":
            errors.append("%s: target %r must be an absolute normalised path other than /" % (where, tgt))
            continue
        if not isinstance(b.get("optional", False), bool):
            errors.append("%s: optional must be a boolean" % where)
        # a state_dir that is not a clean absolute path is reported on its own (validate)
        for protected in PROTECTED_PATHS + ((state_dir,) if _is_abs_clean(state_dir) else ()):
            if is_under(protected, src_check) or is_under(src_check, protected):
                errors.append("%s: source %s would expose %s inside the cell" % (where, src, protected))
        if tgt_check in ("/etc", "/usr", "/proc", "/sys", "/dev", "/run"):
            errors.append("%s: target %s would replace a system tree of the cell" % (where, tgt))


def _typed_slots(slots: object, fields: Mapping[str, type], errors: List[str]) -> List[Tuple[int, Slot]]:
    """(index, record) of each slot record that has every field of ``fields``
    with its type; one error for each other record, or for a slot list that
    is no non-empty list."""
    if not isinstance(slots, list) or not slots:
        errors.append("slots: must be a non-empty list of slot identities")
        return []
    out = []
    for i, s in enumerate(slots):
        where = "slots[%d]" % i
        if not isinstance(s, dict):
            errors.append("%s: must be a mapping" % where)
            continue
        missing = [k for k in fields if k not in s]
        if missing:
            errors.append("%s: missing %s" % (where, ", ".join(missing)))
            continue
        bad = [k for k, t in fields.items() if not isinstance(s[k], t) or isinstance(s[k], bool)]
        if bad:
            errors.append("%s: wrong type for %s" % (where, ", ".join(bad)))
            continue
        out.append((i, s))
    return out


def _named_slots(slots: object, fields: Mapping[str, type], errors: List[str]) -> Iterable[Tuple[int, Slot, str]]:
    """(index, slot, where) of each well-typed slot, its name checked; ``where`` names it in errors."""
    for i, s in _typed_slots(slots, fields, errors):
        where = "slots[%d] (%s)" % (i, s["name"])
        if not _SLOT_RE.match(s["name"]):
            errors.append("%s: name must match %s" % (where, _SLOT_RE.pattern))
        yield i, s, where


def _check_unique(seen: Dict[str, Dict[object, int]], i: int, s: Slot, where: str, errors: List[str]) -> None:
    """Each key of ``seen`` a value no earlier slot has; records slot ``i``'s."""
    for key in seen:
        if s[key] in seen[key]:
            errors.append("%s: %s %r also used by slots[%d]" % (where, key, s[key], seen[key][s[key]]))
        seen[key][s[key]] = i


def _check_slots(slots: object, errors: List[str]) -> None:
    seen: Dict[str, Dict[object, int]] = {k: {} for k in ("name", "index", "machine", "host_ifname")}
    nets: List[Tuple[int, ipaddress.IPv4Network]] = []
    ranges = []
    for i, s, where in _named_slots(slots, SLOT_FIELDS, errors):
        if not _MACHINE_RE.match(s["machine"]):
            errors.append("%s: machine %r is not a valid machine name" % (where, s["machine"]))
        for key in ("host_ifname", "cell_ifname"):
            if not _IFNAME_RE.match(s[key]) or s[key] in (".", ".."):
                errors.append("%s: %s %r must be 1-15 characters [A-Za-z0-9_.-]" % (where, key, s[key]))
        if s["cell_ifname"] == "lo":
            errors.append("%s: cell_ifname must not be lo" % where)
        _check_unique(seen, i, s, where, errors)
        try:
            net = ipaddress.IPv4Network(s["subnet"])
            gw = ipaddress.IPv4Address(s["gateway"])
            addr = ipaddress.IPv4Address(s["address"])
        except ValueError as exc:
            errors.append("%s: %s" % (where, exc))
        else:
            if net.prefixlen != s["prefixlen"]:
                errors.append("%s: prefixlen %d does not match subnet %s" % (where, s["prefixlen"], net))
            if net.prefixlen > 30:
                errors.append("%s: subnet %s leaves no room for gateway and cell" % (where, net))
            hosts = set(net.hosts())
            for key, ip in (("gateway", gw), ("address", addr)):
                if ip not in hosts:
                    errors.append("%s: %s %s is not a host address of %s" % (where, key, ip, net))
            if gw == addr:
                errors.append("%s: gateway and address are both %s" % (where, gw))
            if net.is_loopback or net.is_multicast or net.is_link_local:
                errors.append("%s: subnet %s is not usable for a cell" % (where, net))
            for j, other in nets:
                if net.overlaps(other):
                    errors.append("%s: subnet %s overlaps slots[%d] (%s)" % (where, net, j, other))
            nets.append((i, net))
        base, size = s["uid_base"], s["uid_size"]
        if base <= 0:
            errors.append("%s: uid_base must be > 0 (cell root must never be host root)" % where)
        if size < 1 or base + size > 2**32 - 1:
            errors.append("%s: uid range %d+%d is out of bounds" % (where, base, size))
        ranges.append((i, base, size))
    # Per-slot ranges must be disjoint; identical ranges are the shared mode.
    for a in range(len(ranges)):
        for b in range(a + 1, len(ranges)):
            ia, ba, sa = ranges[a]
            ib, bb, sb = ranges[b]
            if (ba, sa) != (bb, sb) and ba < bb + sb and bb < ba + sa:
                errors.append(
                    "slots[%d]/slots[%d]: uid ranges %d+%d and %d+%d overlap partially" % (ia, ib, ba, sa, bb, sb)
                )


def _check_darwin_slots(slots: object, errors: List[str]) -> None:
    """A darwin policy's slots: each an unprivileged user of its own."""
    seen: Dict[str, Dict[object, int]] = {k: {} for k in ("name", "index", "user", "uid_base")}
    for i, s, where in _named_slots(slots, DARWIN_SLOT_FIELDS, errors):
        if not _USER_RE.match(s["user"]):
            errors.append("%s: user %r is not a user name" % (where, s["user"]))
        if s["uid_base"] < 500 or s["uid_base"] > 2**31 - 1:
            errors.append("%s: uid_base %d must be an unprivileged uid (500 .. 2^31-1)" % (where, s["uid_base"]))
        if s["uid_size"] != 1:
            errors.append("%s: uid_size must be 1 (the slot user is the cell's only uid)" % where)
        _check_unique(seen, i, s, where, errors)


def _bind_targets(binds: object) -> List[str]:
    """Targets of a readonly_binds/writable_binds list as checkable paths
    (``{slot}`` replaced by a sample name; malformed entries skipped)."""
    out = []
    if isinstance(binds, list):
        for b in binds:
            if isinstance(b, dict):
                tgt = b.get("target", b.get("source"))
                if isinstance(tgt, str):
                    out.append(tgt.replace("{slot}", "slot"))
    return out


def _check_agent(p: Policy, errors: List[str]) -> None:
    """agent_user, agent_home, workspace_aliases and the agent's environment.

    agent_user is a plain user name; agent_home an absolute path outside the
    system trees.  Each workspace alias is an absolute path that is neither
    inside a system tree nor equal to, inside or around the workspace_mount,
    a bind target, a tmpfs or another alias, and that does not contain the
    agent_state_mount (an alias inside the agent_state_mount is allowed: it is
    bound after it).  setenv may not name HOME, USER or LOGNAME.
    """
    if not isinstance(p["agent_user"], str) or not _USER_RE.match(p["agent_user"]):
        errors.append("agent_user: %r must be a user name matching %s" % (p["agent_user"], _USER_RE.pattern))
    home = p["agent_home"]
    if not _is_abs_clean(home) or home == "/" or any(is_under(home, t) for t in SYSTEM_TREES):
        errors.append("agent_home: %r must be an absolute normalised path outside %s" % (home, ", ".join(SYSTEM_TREES)))
    aliases = p["workspace_aliases"]
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        errors.append("workspace_aliases: must be a list of absolute paths")
        return
    others = [("bind target", t) for t in _bind_targets(p["readonly_binds"]) + _bind_targets(p["writable_binds"])]
    if isinstance(p["tmpfs"], list):
        others += [("tmpfs", t) for t in p["tmpfs"] if isinstance(t, str)]
    if isinstance(p["workspace_mount"], str):
        others.append(("workspace_mount", p["workspace_mount"]))
    for i, a in enumerate(aliases):
        where = "workspace_aliases[%d]" % i
        if not _is_abs_clean(a) or a == "/":
            errors.append("%s: %r must be an absolute normalised path other than /" % (where, a))
            continue
        trees = [t for t in SYSTEM_TREES if is_under(a, t)]
        if trees:
            errors.append("%s: %s is inside the system tree %s of the cell" % (where, a, trees[0]))
        for what, t in others + [("workspace_aliases[%d]" % j, b) for j, b in enumerate(aliases[:i])]:
            if _is_abs_clean(t) and (is_under(a, t) or is_under(t, a)):
                errors.append("%s: %s collides with %s %s" % (where, a, what, t))
        st = p["agent_state_mount"]
        if isinstance(st, str) and is_under(st, a):
            errors.append("%s: %s would hide the agent_state_mount %s (an alias may lie inside it, not around it)"
                          % (where, a, st))
    if isinstance(p["setenv"], dict):
        for k in AGENT_ENV:
            if k in p["setenv"]:
                errors.append("setenv: %s is set from agent_user/agent_home and cannot be overridden" % k)


def _check_names(errors: List[str], key: str, values: object, what: str, is_valid: Callable[[str], object],
                 invalid_message: str, required: AbstractSet[str]) -> None:
    """A list of names: strings only, each valid, and every required one present."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        errors.append("%s: must be a list of %s" % (key, what))
        return
    errors.extend(invalid_message % v for v in values if not is_valid(v))
    missing = required - set(values)
    if missing:
        errors.append("%s: must include %s" % (key, ", ".join(sorted(missing))))


def validate(obj: object) -> List[str]:
    """Return a list of errors (empty when the policy is valid)."""
    errors = []
    if not isinstance(obj, dict):
        return ["policy must be a JSON object"]
    unknown = set(obj) - set(DEFAULTS)
    if unknown:
        errors.append("unknown keys: %s" % ", ".join(sorted(unknown)))
    if obj.get("version") != POLICY_VERSION:
        errors.append("version: must be %d" % POLICY_VERSION)
    if "slots" not in obj:
        errors.append("slots: missing")
    p = merged(obj)

    platform = p["platform"] if p["platform"] in PLATFORMS else None
    if platform is None:
        errors.append("platform: must be one of %s" % ", ".join(PLATFORMS))
    programs = {"linux": LINUX_PROGRAMS, "darwin": DARWIN_PROGRAMS}.get(platform or "", ())
    for key in programs + ("python", "state_dir", "workspace_root", "agent_state_root"):
        if not _is_abs_clean(p[key]) or p[key] == "/":
            errors.append("%s: %r must be an absolute normalised path" % (key, p[key]))
    for key in {"linux": DARWIN_PROGRAMS + ("pf_anchor",), "darwin": LINUX_PROGRAMS}.get(platform or "", ()):
        if p[key] is not None:
            errors.append("%s: must be null in a %s policy" % (key, platform))
    if platform == "darwin" and not (isinstance(p["pf_anchor"], str) and _PF_ANCHOR_RE.match(p["pf_anchor"])):
        errors.append("pf_anchor: %r must be a pf anchor name (a/b/c)" % (p["pf_anchor"],))
    for key in ("workspace_mount", "agent_state_mount"):
        if not _is_abs_clean(p[key]) or p[key] in ("/", "/etc", "/usr", "/run", "/proc", "/sys", "/dev", "/tmp"):
            errors.append("%s: %r must be an absolute path that is not a system tree" % (key, p[key]))
    if _is_abs_clean(p["state_dir"]):
        for key in ("workspace_root", "agent_state_root"):
            if _is_abs_clean(p[key]) and (is_under(p[key], p["state_dir"]) or is_under(p["state_dir"], p[key])):
                errors.append("%s: must not overlap state_dir %s" % (key, p["state_dir"]))
    if p["scope"] not in ("auto", "systemd", "standalone"):
        errors.append("scope: must be auto, systemd or standalone")
    for key in ("register", "no_new_privileges", "require_ruleset", "require_limits", "allow_user_namespaces",
                "allow_shared_network"):
        if not isinstance(p[key], bool):
            errors.append("%s: must be a boolean" % key)
    if p["no_new_privileges"] is False:
        errors.append("no_new_privileges: cells always run with no_new_privileges")

    _check_names(errors, "drop_capabilities", p["drop_capabilities"], "capability names",
                 lambda c: _CAP_RE.match(c) and c in KNOWN_CAPS,
                 "drop_capabilities: unknown capability %r", REQUIRED_DROPPED_CAPS)
    if (
        p["allow_user_namespaces"] is False
        and isinstance(p["drop_capabilities"], list)
        and USERNS_GUARD_CAP not in p["drop_capabilities"]
    ):
        errors.append(
            "drop_capabilities: must include %s while allow_user_namespaces is false (cell root could "
            "raise user.max_user_namespaces again)" % USERNS_GUARD_CAP
        )
    _check_names(errors, "syscall_deny", p["syscall_deny"], "syscall names", _SYSCALL_RE.match,
                 "syscall_deny: %r is not a syscall name (groups only widen nspawn's filter)",
                 REQUIRED_DENIED_SYSCALLS)

    inacc = p["inaccessible"]
    if not isinstance(inacc, list) or not all(isinstance(x, str) for x in inacc):
        errors.append("inaccessible: must be a list of absolute paths")
    else:
        for x in inacc:
            if not _is_abs_clean(x.replace("{slot}", "slot")) or x == "/":
                errors.append("inaccessible: %r must be an absolute normalised path" % x)

    _check_binds("readonly_binds", p["readonly_binds"], errors, p["state_dir"])
    _check_binds("writable_binds", p["writable_binds"], errors, p["state_dir"])
    if isinstance(p["writable_binds"], list):
        for i, b in enumerate(p["writable_binds"]):
            if isinstance(b, dict) and isinstance(b.get("source"), str):
                if b["source"] in ("/", "/etc", "/usr", "/var", "/home", "/root", "/boot", "/run"):
                    errors.append("writable_binds[%d]: %s must not be writable in a cell" % (i, b["source"]))

    tmpfs = p["tmpfs"]
    if not isinstance(tmpfs, list) or not all(isinstance(t, str) and _is_abs_clean(t) and t != "/" for t in tmpfs):
        errors.append("tmpfs: must be a list of absolute paths other than /")

    for key, pattern, what in (
        ("setenv", _ENV_RE, "environment variable"),
        ("properties", _PROP_RE, "unit property"),
        ("nspawn_environment", _ENV_RE, "environment variable"),
    ):
        d = p[key]
        if not isinstance(d, dict):
            errors.append("%s: must be a mapping" % key)
            continue
        for k, v in d.items():
            if not pattern.match(k):
                errors.append("%s: %r is not a valid %s name" % (key, k, what))
            if not isinstance(v, (str, int)) or isinstance(v, bool) or "\n" in str(v) or "\0" in str(v):
                errors.append("%s: value of %s must be a single-line string or number" % (key, k))
    if isinstance(p["properties"], dict) and p["require_limits"] is True:
        for k, v in sorted(p["properties"].items()):
            if not _PROP_RE.match(k) or not isinstance(v, (str, int)) or isinstance(v, bool):
                continue
            try:
                limitsmod.convert(k, v, mem_total=limitsmod.NOMINAL_MEM_TOTAL, tasks_total=limitsmod.NOMINAL_TASKS)
            except limitsmod.LimitError as exc:
                errors.append(
                    "properties: %s (require_limits refuses every property the launcher cannot check; "
                    "set require_limits to false to pass it unchecked)" % exc
                )
    errors.extend(taskenvmod.validate_allow(p["env_allow"], p["setenv"]))
    if isinstance(p["setenv"], dict) and str(p["setenv"].get("CHV_CELL", "1")) != "1":
        errors.append("setenv: CHV_CELL is always 1 in a cell")
    if isinstance(p["nspawn_environment"], dict):
        for k in p["nspawn_environment"]:
            if k not in ALLOWED_NSPAWN_ENV:
                errors.append("nspawn_environment: %s is not allowed (allowed: %s)" % (k, ", ".join(sorted(ALLOWED_NSPAWN_ENV))))

    rl = p["rlimits"]
    if not isinstance(rl, dict):
        errors.append("rlimits: must be a mapping")
    else:
        for k, v in rl.items():
            name = k[7:] if k.startswith("RLIMIT_") else k
            if name not in KNOWN_RLIMITS:
                errors.append("rlimits: unknown limit %r" % k)
            if not _RLIMIT_VAL_RE.match(str(v)) or isinstance(v, bool):
                errors.append("rlimits: %s value %r must be N, infinity or SOFT:HARD" % (k, v))

    dns = p["dns_servers"]
    if not isinstance(dns, list):
        errors.append("dns_servers: must be a list")
    else:
        for d in dns:
            try:
                ip = ipaddress.ip_address(d)
            except (ValueError, TypeError):
                errors.append("dns_servers: %r is not an IP address" % (d,))
                continue
            if ip.is_loopback or ip.is_unspecified:
                errors.append("dns_servers: %s is not reachable from a cell" % ip)
    search = p["dns_search"]
    if not isinstance(search, list) or not all(isinstance(s, str) and _SEARCH_RE.match(s) for s in search):
        errors.append("dns_search: must be a list of domain names")

    for key, lo, hi in (("claim_timeout", 0, 86400), ("start_timeout", 1, 600), ("stop_grace", 0, 600)):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            errors.append("%s: must be a number between %s and %s" % (key, lo, hi))

    v = p["runtime_max"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= RUNTIME_MAX_LIMIT:
        errors.append("runtime_max: must be a number of seconds between 0 (no limit) and %d" % RUNTIME_MAX_LIMIT)

    v = p["task_ttl"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= TASK_TTL_LIMIT:
        errors.append("task_ttl: must be a number of seconds between 1 and %d (role variable chv_cell_task_ttl)"
                      % TASK_TTL_LIMIT)

    errors.extend(familiesmod.validate(p["socket_families"]))
    bsock = p["browser_socket"]
    if not isinstance(bsock, str) or (bsock and (not _is_abs_clean(bsock) or bsock == "/")):
        errors.append("browser_socket: %r must be an absolute normalised path, or empty (no chv-browser)" % (bsock,))
    bcfg = p["broker_config"]
    if not isinstance(bcfg, str) or (bcfg and (not _is_abs_clean(bcfg) or bcfg == "/")):
        errors.append("broker_config: %r must be an absolute normalised path, or empty (no clones)" % (bcfg,))
    v = p["read_max_bytes"]
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= READ_MAX_BYTES_LIMIT:
        errors.append("read_max_bytes: must be a whole number of bytes between 1 and %d (role variable "
                      "chv_cell_read_max_bytes)" % READ_MAX_BYTES_LIMIT)

    _check_egress_proxy(p, platform, errors)
    _check_disk(p, platform, errors)
    _check_agent(p, errors)
    if platform == "darwin":
        _check_darwin_slots(p["slots"], errors)
    else:
        _check_slots(p["slots"], errors)
    _check_warm(p, errors)
    _check_health_slot(p, errors)
    return errors


def _check_egress_proxy(p: Policy, platform: Optional[str], errors: List[str]) -> None:
    """egress_proxy: None, or {"port": 1-65535} on Linux."""
    v = p["egress_proxy"]
    if v is None:
        return
    port = v.get("port") if isinstance(v, dict) else None
    if not isinstance(v, dict) or set(v) != {"port"} or isinstance(port, bool) or not isinstance(port, int) \
            or not 1 <= port <= 65535:
        errors.append("egress_proxy: %r must be null or {\"port\": 1-65535} (role variables chv_cell_egress_mode, "
                      "chv_cell_egress_proxy_port)" % (v,))
    elif platform == "darwin":
        errors.append("egress_proxy: the proxy mode is not implemented on macOS (role variable chv_cell_egress_mode)")


def _check_disk(p: Policy, platform: Optional[str], errors: List[str]) -> None:
    """disk_max: null, or a size string (a linux policy only)."""
    v = p["disk_max"]
    if v is None:
        return
    if platform == "darwin":
        errors.append("disk_max: must be null in a darwin policy (no per-slot disk quota on macOS; role variable "
                      "chv_cell_disk_max)")
        return
    try:
        diskmod.parse_size(v)
    except ValueError as exc:
        errors.append("disk_max: %s" % exc)


def _check_warm(p: Policy, errors: List[str]) -> None:
    """warm_slots: distinct names of the policy's slots."""
    warm = p["warm_slots"]
    if not isinstance(warm, list) or not all(isinstance(w, str) for w in warm):
        errors.append("warm_slots: must be a list of slot names")
        return
    names = [s.get("name") for s in p["slots"] if isinstance(s, dict)] if isinstance(p["slots"], list) else []
    for w in sorted(set(warm)):
        if w not in names:
            errors.append("warm_slots: %r is not a slot of this policy" % w)
    if len(set(warm)) != len(warm):
        errors.append("warm_slots: a slot is named twice")


def _check_health_slot(p: Policy, errors: List[str]) -> None:
    """health_slot: None, or a slot of the policy that is no warm slot (with
    more slots than it, else no run could start)."""
    h = p["health_slot"]
    if h is None:
        return
    names = [s.get("name") for s in p["slots"] if isinstance(s, dict)] if isinstance(p["slots"], list) else []
    if not isinstance(h, str) or h not in names:
        errors.append("health_slot: %r is not a slot of this policy" % (h,))
    elif isinstance(p["warm_slots"], list) and h in p["warm_slots"]:
        errors.append("health_slot: %r is a warm slot too" % h)
    elif len(names) < 2:
        errors.append("health_slot: %r is the only slot: no run could start" % h)


def effective_runtime_max(policy_max: float, requested: Optional[float]) -> float:
    """The wall-clock limit of one run (seconds, 0 = none).

    ``requested`` (``chv-cell run --runtime-max``, None when not given) may
    only lower the policy's ``runtime_max``; with a policy of 0 any positive
    value is allowed.  Raises ValueError with the message to show.
    """
    if requested is None:
        return policy_max
    if isinstance(requested, bool) or not isinstance(requested, (int, float)) or math.isnan(requested):
        raise ValueError("--runtime-max must be a number of seconds")
    if requested <= 0:
        if policy_max:
            raise ValueError(
                "--runtime-max must be > 0: the policy limits every run to %gs (runtime_max, role variable "
                "chv_cell_runtime_max) and a run may only lower that" % policy_max
            )
        raise ValueError("--runtime-max must be > 0 seconds")
    if policy_max and requested > policy_max:
        raise ValueError(
            "--runtime-max %gs exceeds the policy's runtime_max of %gs (role variable chv_cell_runtime_max); "
            "a run may only lower it" % (requested, policy_max)
        )
    return requested


def load(path: str = DEFAULT_POLICY_PATH) -> Policy:
    """Read, validate and return the merged policy; raise PolicyError."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            obj = json.load(fh)
    except OSError as exc:
        raise PolicyError(["cannot read %s: %s" % (path, exc.strerror)])
    except ValueError as exc:
        raise PolicyError(["%s is not valid JSON: %s" % (path, exc)])
    errors = validate(obj)
    if errors:
        raise PolicyError(errors)
    return merged(obj)


def slot_by_name(policy: Policy, name: str) -> Slot:
    s: Slot
    for s in policy["slots"]:
        if s["name"] == name:
            return s
    raise KeyError(name)
