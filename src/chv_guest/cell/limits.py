"""systemd unit properties as cgroup v2 files (standard library only).

The policy's ``properties`` (MemoryMax, TasksMax, CPUQuota, ...) are the
cell's resource limits.  With a systemd scope, systemd writes them into the
scope's cgroup; in ``scope: standalone`` the launcher writes them itself
into the cgroup it creates for the cell.  Either way the launcher checks
that they are in force before the start gate opens (policy
``require_limits``), because systemd accepts MemoryMax= silently where the
memory controller is not delegated.

Pure: ``convert`` maps one property to (controller, file, value) and
``matches`` compares what a cgroup file reads with what was asked.
"""

from __future__ import annotations

import re
from typing import Container, Iterable, List, Mapping, NamedTuple, Optional, Tuple

# Property -> (controller, cgroup v2 file, kind of value).
MAPPING = {
    "MemoryMax": ("memory", "memory.max", "bytes"),
    "MemoryHigh": ("memory", "memory.high", "bytes"),
    "MemorySwapMax": ("memory", "memory.swap.max", "bytes"),
    "TasksMax": ("pids", "pids.max", "tasks"),
    "CPUQuota": ("cpu", "cpu.max", "quota"),
    "CPUWeight": ("cpu", "cpu.weight", "weight"),
}
# systemd's default CPUQuotaPeriodSec= (100 ms), in microseconds.
CPU_PERIOD_US = 100000
# systemd never writes a quota below 1 ms per period.
CPU_QUOTA_MIN_US = 1000
# Host facts used when a policy is validated without a host (percentages
# are only checked for syntax then).
NOMINAL_MEM_TOTAL = 1 << 30
NOMINAL_TASKS = 4096

# systemd's parse_size(): base 1024, optional fraction, optional B.
_SIZE_RE = re.compile(r"^([0-9]+)(?:\.([0-9]+))?\s*([KMGTPE]?)B?$")
_SIZE_FACTORS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}
_PERCENT_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)%$")
_INT_RE = re.compile(r"^[0-9]+$")


class Limit(NamedTuple):
    """One property as the cgroup v2 ``file`` of ``controller`` holding ``value``."""

    prop: str
    controller: str
    file: str
    value: str


class LimitError(ValueError):
    """A property the launcher cannot map to a cgroup file."""


def _size(text: str) -> Optional[int]:
    m = _SIZE_RE.match(text)
    if not m:
        return None
    whole, frac, unit = m.groups()
    factor = _SIZE_FACTORS[unit]
    n = int(whole) * factor
    if frac:
        n += int(frac) * factor // (10 ** len(frac))
    return n


def _percent(text: str) -> Optional[float]:
    m = _PERCENT_RE.match(text)
    return float(m.group(1)) if m else None


def convert(prop: str, value: object, mem_total: Optional[int] = None, tasks_total: Optional[int] = None) -> Limit:
    """The Limit for one unit property; raises LimitError when it cannot be
    mapped.  ``mem_total`` (bytes of RAM) and ``tasks_total`` (the system's
    task limit) are needed only for percentages, as systemd defines them."""
    if prop not in MAPPING:
        raise LimitError(
            "%s is not a property the launcher can map to a cgroup file (it knows %s)"
            % (prop, ", ".join(sorted(MAPPING)))
        )
    controller, fname, kind = MAPPING[prop]
    text = str(value).strip()

    def bad(what: str) -> LimitError:
        return LimitError("%s=%s: %s" % (prop, value, what))

    if isinstance(value, bool):
        raise bad("not a value")
    if kind in ("bytes", "tasks") and text == "infinity":
        return Limit(prop, controller, fname, "max")

    def share(total: Optional[int], of_what: str) -> Optional[int]:
        """``text`` as a percentage of ``total`` (None when it is no percentage)."""
        pct = _percent(text)
        if pct is None:
            return None
        if pct > 100:
            raise bad("percentages above 100% are not valid")
        if total is None:
            raise bad("a percentage needs " + of_what)
        return int(total * pct / 100)

    if kind == "bytes":
        n = share(mem_total, "the host's memory size")
        if n is not None:
            return Limit(prop, controller, fname, str(n))
        n = _size(text)
        if n is None:
            raise bad("expected bytes with an optional K, M, G, T, P or E suffix, a percentage or infinity")
        return Limit(prop, controller, fname, str(n))
    if kind == "tasks":
        n = share(tasks_total, "the system's task limit")
        if n is None:
            if not _INT_RE.match(text):
                raise bad("expected a number of tasks, a percentage or infinity")
            n = int(text)
        if n < 1:
            raise bad("must allow at least one task")
        return Limit(prop, controller, fname, str(n))
    if kind == "quota":
        pct = _percent(text)
        if pct is None or pct <= 0:
            raise bad("expected a percentage above 0 (100% is one CPU)")
        quota = max(CPU_QUOTA_MIN_US, int(round(pct * CPU_PERIOD_US / 100)))
        return Limit(prop, controller, fname, "%d %d" % (quota, CPU_PERIOD_US))
    # weight
    if not _INT_RE.match(text) or not 1 <= int(text) <= 10000:
        raise bad("expected a weight between 1 and 10000")
    return Limit(prop, controller, fname, str(int(text)))


def plan(properties: Mapping[str, object], mem_total: Optional[int] = None,
         tasks_total: Optional[int] = None) -> Tuple[List[Limit], List[str]]:
    """(limits, errors): every property converted, or the reason it cannot be."""
    limits, errors = [], []
    for prop, value in sorted(properties.items()):
        try:
            limits.append(convert(prop, value, mem_total, tasks_total))
        except LimitError as exc:
            errors.append(str(exc))
    return limits, errors


def matches(limit: Limit, text: str, page_size: int = 4096) -> bool:
    """Does ``text`` (what the cgroup file reads) enforce ``limit``?

    Memory files are kept in pages (the kernel rounds down); cpu.max is
    compared as a ratio (systemd may choose another period)."""
    text = text.strip()
    if limit.value == "max" or text == "max":
        return text == limit.value
    if limit.file == "cpu.max":
        try:
            q, per = (int(x) for x in text.split())
            wq, wper = (int(x) for x in limit.value.split())
        except ValueError:
            return False
        return abs(q / per - wq / wper) <= 0.01 * (wq / wper)
    try:
        got = int(text)
    except ValueError:
        return False
    want = int(limit.value)
    if limit.controller == "memory":
        return got == want // page_size * page_size
    return got == want


def unavailable(limits: Iterable[Limit], enabled_controllers: Container[str],
                present_files: Container[str]) -> List[Tuple[Limit, str]]:
    """Limits that cannot be enforced in a cgroup whose parent enables
    ``enabled_controllers`` and which has the files ``present_files``:
    a list of (limit, reason)."""
    out = []
    for lim in limits:
        if lim.controller not in enabled_controllers:
            out.append((lim, "controller %s is not available" % lim.controller))
        elif lim.file not in present_files:
            out.append((lim, "%s is absent" % lim.file))
    return out


def scope_dir(cgroup_path: str, unit: str) -> Optional[str]:
    """The ancestor of ``cgroup_path`` (a cgroup2 path as /proc/PID/cgroup
    shows it) named ``unit``, or None."""
    parts = [p for p in cgroup_path.split("/") if p]
    while parts:
        if parts[-1] == unit:
            return "/" + "/".join(parts)
        parts.pop()
    return None


def describe(items: Iterable[Tuple[Limit, str]]) -> str:
    """One human-readable list of (Limit, reason) pairs."""
    return "; ".join("%s (%s): %s" % (lim.prop, lim.file, reason) for lim, reason in items)
