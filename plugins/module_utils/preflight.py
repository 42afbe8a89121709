# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a host needs before chv.fleet changes it (the chv.fleet.preflight
module): the kernel features cells use, the ip tool, and memory for every
slot's cell at its MemoryMax. Each check reads files under a root (/ on a
host; a directory tree in the unit tests) and returns (ok, detail)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import gzip
import os
import re

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


def run_checks(root, release, slots, memory_max, proven=()):
    """Every check, in order: [(name, ok, detail)]."""
    return [
        ("cgroup2",) + check_cgroup2(root),
        ("user namespaces",) + check_user_namespaces(root),
        ("kernel modules",) + check_modules(root, release, proven),
        ("iproute2",) + check_ip(root),
        ("memory",) + check_memory(root, slots, memory_max),
    ]
