# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a host needs before chv.fleet changes it (the chv.fleet.preflight
module): the kernel features cells use, the ip tool, memory for every
slot's cell at its MemoryMax, and room for the slots' identities. Each
check reads files under a root (/ on a host; a directory tree in the unit
tests) and returns (ok, detail)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import gzip
import os
import re

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci

SIZE_RE = re.compile(r"^([0-9]+)([KMGT]?)$")
UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
# the kernel modules cells need: their veth pair and the ruleset's tables
MODULES = ("veth", "nf_tables")


def parse_size(text):
    """systemd's MemoryMax= in bytes (1024-based suffixes); None for
    infinity or a percentage, which set no absolute amount."""
    value = str(text).strip()
    if value == "infinity" or value.endswith("%"):
        return None
    match = SIZE_RE.match(value)
    if not match:
        raise ValueError("MemoryMax %r is not a size (bytes or K, M, G, T), a percentage or infinity" % text)
    return int(match.group(1)) * UNITS[match.group(2)]


def _read(root, path):
    with open(os.path.join(root, path.lstrip("/"))) as f:
        return f.read()


def _exists(root, path):
    return os.path.exists(os.path.join(root, path.lstrip("/")))


def check_cgroup2(root):
    ok = _exists(root, "/sys/fs/cgroup/cgroup.controllers")
    return ok, "unified cgroup hierarchy (cgroup2) mounted at /sys/fs/cgroup" if ok else \
        "/sys/fs/cgroup is not cgroup2 (no cgroup.controllers): nspawn cells need the unified hierarchy"


def check_user_namespaces(root):
    try:
        count = int(_read(root, "/proc/sys/user/max_user_namespaces").strip())
    except (OSError, ValueError):
        return False, "cannot read /proc/sys/user/max_user_namespaces: no user namespaces in this kernel"
    if count < 1:
        return False, "user.max_user_namespaces is %d: cells run in a user namespace of their own" % count
    return True, "user.max_user_namespaces is %d" % count


# the kernel's build option of each module, for its config file
CONFIG = {"veth": "CONFIG_VETH", "nf_tables": "CONFIG_NF_TABLES"}


def _kernel_config(root, release):
    """The running kernel's config text (/boot/config-<release> or
    /proc/config.gz), or None when the host has neither."""
    try:
        return _read(root, "/boot/config-%s" % release)
    except OSError:
        pass
    try:
        with gzip.open(os.path.join(root, "proc/config.gz"), "rt") as f:
            return f.read()
    except OSError:
        return None


def _kernel_has(root, module, release):
    """True when the module is loaded (/sys/module), built in or installed
    for the running kernel (modules.builtin, modules.dep) or set in its
    config; False when one of those lists exists and has it nowhere; None
    when the host has none of them (a kernel without module lists or
    config, as in some VMs and containers)."""
    if _exists(root, "/sys/module/" + module):
        return True
    seen = False
    pattern = re.compile(r"(^|/)%s\.ko(\.[a-z]+)?(:|$)" % re.escape(module), re.M)
    for name in ("modules.builtin", "modules.dep"):
        try:
            text = _read(root, "/lib/modules/%s/%s" % (release, name))
        except OSError:
            continue
        seen = True
        if pattern.search(text):
            return True
    config = _kernel_config(root, release)
    if config is not None:
        seen = True
        if re.search(r"^%s=[ym]$" % CONFIG[module], config, re.M):
            return True
    return False if seen else None


def check_modules(root, release, proven=()):
    """proven: the modules a live probe showed working (the module makes a
    veth pair in a network namespace of its own); the others are looked up."""
    found = dict((m, True if m in proven else _kernel_has(root, m, release)) for m in MODULES)
    missing = [m for m in MODULES if found[m] is False]
    if missing:
        return False, "kernel %s has no %s (loaded, built in, as a module or in its config)" % (
            release, ", ".join(missing))
    unknown = [m for m in MODULES if found[m] is None]
    if unknown:
        return True, ("kernel %s: %s not verifiable here (no module lists or config); the health gate's "
                      "real cell proves them after the roles" % (release, ", ".join(unknown)))
    return True, "kernel %s has %s" % (release, ", ".join(MODULES))


def check_ip(root, path="/usr/sbin:/usr/bin:/sbin:/bin"):
    for directory in path.split(":"):
        if os.access(os.path.join(root, directory.lstrip("/"), "ip"), os.X_OK):
            return True, "ip (iproute2) at %s/ip" % directory
    return False, "no ip command (iproute2) in %s: the roles and the launcher need it" % path


def check_memory(root, slots, memory_max):
    limit = parse_size(memory_max)
    if limit is None:
        return True, "MemoryMax %s sets no absolute amount per cell" % memory_max
    match = re.search(r"^MemTotal:\s+([0-9]+) kB$", _read(root, "/proc/meminfo"), re.M)
    total = int(match.group(1)) * 1024
    need = slots * limit
    if need > total:
        return False, ("%d slots x MemoryMax %s = %d MiB, more than this host's %d MiB of memory"
                       % (slots, memory_max, need // 2 ** 20, total // 2 ** 20))
    return True, "%d slots x MemoryMax %s = %d MiB of %d MiB" % (slots, memory_max, need // 2 ** 20, total // 2 ** 20)


# cell_identity's option -> the cell_runtime role's variable (after var_prefix)
IDENTITY_VARS = {"force": "identity_force"}


def identity_label(param, message, var_prefix="chv_cell_"):
    """An allocator message naming the role variable instead of the module
    option: "pool 10.0.0.0/8 is ..." -> "chv_cell_pool 10.0.0.0/8 is ..."."""
    var = var_prefix + IDENTITY_VARS.get(param, param)
    if message.startswith(param + " "):
        return var + message[len(param):]
    return "%s: %s" % (var, message)


def agent_uid(root, user, fallback):
    """The uid of ``user`` in <root>/etc/passwd, else ``fallback`` (the uid
    the role gives the agent user when it creates it)."""
    try:
        uid = ci.passwd_id(_read(root, "/etc/passwd"), user)
    except OSError:
        return fallback
    return fallback if uid is None else uid


def check_identities(root, run, identity, var_prefix="chv_cell_"):
    """The slots' identities as chv.fleet.cell_identity would allocate them
    (``identity``: its options slots, pool, prefix, uid_mode, shared_uid,
    ifname_prefix, cell_ifname, machine_prefix, ledger, reassign, force,
    state_dir; shared_uid None is the uid of agent_user, else agent_uid),
    in check mode: the ledger read, nothing written. Fails on whatever the
    allocation would refuse (a pool the host's routes leave too small, a
    shared UID range holding accounts, interface names, running cells...),
    each message naming the role variable. ``run(argv)`` runs ``ip``."""
    p = dict(identity)
    try:
        names = ci.normalize_slot_names(p["slots"])
        shared_uid = p.get("shared_uid")
        if shared_uid is None:
            fallback = p.get("agent_uid")
            shared_uid = agent_uid(root, p.get("agent_user"), ci.DEFAULT_SHARED_UID if fallback is None else fallback)
        settings = ci.Settings(pool=p["pool"], prefix=p["prefix"], uid_mode=p["uid_mode"], shared_uid=shared_uid,
                               ifname_prefix=p["ifname_prefix"], cell_ifname=p["cell_ifname"],
                               machine_prefix=p["machine_prefix"])
    except ci.AllocationError as exc:
        return False, identity_label(exc.param, str(exc), var_prefix)
    if len(names) > settings.subnet_count:
        count = isinstance(p["slots"], int) and not isinstance(p["slots"], bool)
        given = str(p["slots"]) if count else "%r (%d slots)" % (p["slots"], len(names))
        return False, ("%sslots %s is more than %spool %s holds: %d /%d subnets (%sprefix %d)"
                       % (var_prefix, given, var_prefix, settings.pool, settings.subnet_count, settings.prefix,
                          var_prefix, settings.prefix))
    ledger = os.path.join(root, p["ledger"].lstrip("/"))
    probe = ci.CellProbe(os.path.join(root, p["state_dir"].lstrip("/")), os.path.join(root, "sys/class/net"))
    try:
        host = ci.gather_host_facts(run, root)
    except (OSError, ValueError) as exc:
        return False, "cannot read the host's addresses and routes: %s" % exc
    try:
        result = ci.update_ledger(ledger, names, settings, host, reassign=p["reassign"], check_mode=True,
                                  force=p["force"], probe=probe)
    except ci.RunningCellError as exc:
        return False, str(exc)
    except ci.AllocationError as exc:
        return False, identity_label(exc.param, str(exc), var_prefix)
    except (ci.CellIdentityError, OSError, ValueError) as exc:
        return False, "%sledger %s: %s" % (var_prefix, p["ledger"], exc)
    slots = result["identities"]
    detail = "%d slots: %d new, %d kept" % (len(slots), len(result["added"]), len(slots) - len(result["added"]))
    if slots:
        detail += " (%s ... %s, %s ... %s)" % (slots[0]["host_ifname"], slots[-1]["host_ifname"],
                                               slots[0]["subnet"], slots[-1]["subnet"])
    return True, detail


def run_checks(root, release, slots, memory_max, proven=(), identity=None, run=None, var_prefix="chv_cell_"):
    """Every check, in order: [(name, ok, detail)]. ``slots`` is a count
    or a list of slot names; ``identity`` (cell_identity's options, see
    check_identities) adds the identities check, with ``run``."""
    try:
        count = len(ci.normalize_slot_names(slots))
    except ci.AllocationError as exc:
        raise ValueError(identity_label(exc.param, str(exc), var_prefix))
    checks = [
        ("cgroup2",) + check_cgroup2(root),
        ("user namespaces",) + check_user_namespaces(root),
        ("kernel modules",) + check_modules(root, release, proven),
        ("iproute2",) + check_ip(root),
        ("memory",) + check_memory(root, count, memory_max),
    ]
    if identity is not None and run is None:
        checks.append(("identities", False, "not checked: no ip command to read the host's addresses and routes"))
    elif identity is not None:
        checks.append(("identities",) + check_identities(root, run, dict(identity, slots=slots), var_prefix))
    return checks
