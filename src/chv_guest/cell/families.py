"""The socket family filter of a cell (policy ``socket_families``).

A cell may create sockets of the families the policy lists (default
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK) and no other: socket() and
socketpair() of any other family fail with EAFNOSUPPORT.  nspawn has no
RestrictAddressFamilies= and a scope unit takes no exec properties, so the
launcher installs a seccomp filter in its child just before that child
execs systemd-run / systemd-nspawn.  A seccomp filter is inherited across
fork and exec and cannot be removed, so it holds for nspawn and for every
process of the cell, stacked with nspawn's own filter (the kernel applies
the strictest verdict of all filters).  nspawn and systemd-run run under it
too: they need AF_UNIX (D-Bus, their own socket pairs) and AF_NETLINK (the
veth), which is why a policy's list must keep those two.

The filter is built with libseccomp (Debian's python3-seccomp binding), the
same way systemd builds RestrictAddressFamilies= (libseccomp allows one
comparison per argument and rule): deny below the lowest allowed family,
above the highest, and each family in between that is not allowed.  The
comparisons are on the full 64-bit register, so a family with high bits
set (which the kernel would truncate to an int) is denied, too.

Only the native architecture is in the filter.  A system call of another
ABI (i386 through int 0x80, including socketcall(), whose arguments a
filter cannot see; x32) ends the process (bad-architecture action
KILL_PROCESS; libseccomp's default would kill only the thread).  nspawn's
own filter admits every ABI the kernel runs (x86-64, i386, x32), so without
this one a 32-bit system call would be a way around a socket() rule.

``plan()`` is the pure part (unit-tested without libseccomp); ``build()``
turns it into a libseccomp filter; ``load_seccomp()`` finds the binding
even under ``python3 -IS`` (the launcher's interpreter flags), where
dist-packages is not on sys.path.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

if TYPE_CHECKING:
    from types import ModuleType

# Linux's address families (include/linux/socket.h), by name.
FAMILIES = {
    "AF_UNSPEC": 0, "AF_UNIX": 1, "AF_INET": 2, "AF_AX25": 3, "AF_IPX": 4, "AF_APPLETALK": 5,
    "AF_NETROM": 6, "AF_BRIDGE": 7, "AF_ATMPVC": 8, "AF_X25": 9, "AF_INET6": 10, "AF_ROSE": 11,
    "AF_DECnet": 12, "AF_NETBEUI": 13, "AF_SECURITY": 14, "AF_KEY": 15, "AF_NETLINK": 16,
    "AF_PACKET": 17, "AF_ASH": 18, "AF_ECONET": 19, "AF_ATMSVC": 20, "AF_RDS": 21, "AF_SNA": 22,
    "AF_IRDA": 23, "AF_PPPOX": 24, "AF_WANPIPE": 25, "AF_LLC": 26, "AF_IB": 27, "AF_MPLS": 28,
    "AF_CAN": 29, "AF_TIPC": 30, "AF_BLUETOOTH": 31, "AF_IUCV": 32, "AF_RXRPC": 33, "AF_ISDN": 34,
    "AF_PHONET": 35, "AF_IEEE802154": 36, "AF_CAIF": 37, "AF_ALG": 38, "AF_NFC": 39, "AF_VSOCK": 40,
    "AF_KCM": 41, "AF_QIPCRTR": 42, "AF_SMC": 43, "AF_XDP": 44, "AF_MCTP": 45,
}
DEFAULT_FAMILIES = ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK")
# What the launcher's own children need under the filter: systemd-run and
# nspawn talk D-Bus and use socket pairs (AF_UNIX); nspawn makes the veth
# over rtnetlink (AF_NETLINK).
REQUIRED_FAMILIES = frozenset(["AF_UNIX", "AF_NETLINK"])
# The policy value that turns the filter off (no filter is installed).
ANY = "any"
SYSCALLS = ("socket", "socketpair")
DENY_ERRNO = errno.EAFNOSUPPORT

# Where Debian's python3-seccomp puts the binding (bookworm and trixie).
SECCOMP_DIRS = ("/usr/lib/python3/dist-packages",)
PACKAGE = "python3-seccomp"


class FilterUnavailable(Exception):
    """The filter cannot be built here (binding missing or refused)."""


class SocketFilter(Protocol):
    """What build() and the launcher use of a libseccomp SyscallFilter (the binding has no type hints)."""

    def set_attr(self, attr: object, value: int) -> None: ...

    def add_rule_exactly(self, action: object, syscall: str, *args: object) -> None: ...

    def load(self) -> None: ...


def validate(value: object) -> List[str]:
    """Errors of a policy ``socket_families`` value (empty list: valid)."""
    if value == ANY:
        return []
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        return ["socket_families: must be %r or a non-empty list of address family names (AF_UNIX, ...)" % ANY]
    errors = ["socket_families: unknown address family %r (known: %s)" % (v, ", ".join(sorted(FAMILIES)))
              for v in value if v not in FAMILIES]
    if "AF_UNSPEC" in value:
        errors.append("socket_families: AF_UNSPEC is no family a socket can have")
    missing = REQUIRED_FAMILIES - set(value)
    if missing:
        errors.append("socket_families: must include %s (systemd-run and systemd-nspawn run under the filter "
                      "and need them), or be %r for no filter" % (", ".join(sorted(missing)), ANY))
    return errors


def numbers(value: Union[str, Iterable[str]]) -> Optional[List[int]]:
    """The sorted family numbers a policy value allows (None: any)."""
    if value == ANY:
        return None
    return sorted({FAMILIES[v] for v in value})


def plan(allowed: Iterable[int]) -> List[Tuple[str, int]]:
    """The deny rules for family numbers ``allowed`` (non-empty): a list of
    (op, value) comparisons on argument 0, each one denying on its own,
    applied to every syscall in SYSCALLS.  ``op`` is "lt", "gt" or "eq"."""
    allowed = sorted(set(allowed))
    if not allowed or allowed[0] < 0:
        raise ValueError("plan needs at least one family number >= 0")
    rules = [("lt", allowed[0])] if allowed[0] > 0 else []
    ok = set(allowed)
    rules += [("eq", n) for n in range(allowed[0] + 1, allowed[-1]) if n not in ok]
    rules.append(("gt", allowed[-1]))
    return rules


def denies(rules: Iterable[Tuple[str, int]], family: int) -> bool:
    """Whether ``rules`` (plan) deny the 64-bit argument value ``family``."""
    family &= (1 << 64) - 1
    for op, value in rules:
        if (op == "lt" and family < value) or (op == "gt" and family > value) or (op == "eq" and family == value):
            return True
    return False


def load_seccomp(dirs: Optional[Sequence[str]] = None) -> ModuleType:
    """The libseccomp binding module: the one already imported or on
    sys.path, else the one in ``dirs`` (default SECCOMP_DIRS, Debian's
    dist-packages), found there by name only: nothing else of that
    directory becomes importable."""
    dirs = SECCOMP_DIRS if dirs is None else dirs
    mod = sys.modules.get("seccomp")
    if mod is not None:
        return mod
    spec = importlib.machinery.PathFinder.find_spec("seccomp")
    if spec is None:
        spec = importlib.machinery.PathFinder.find_spec("seccomp", list(dirs))
    if spec is None or spec.loader is None:
        raise FilterUnavailable("the libseccomp Python binding is not installed (package %s; looked on sys.path "
                                "and in %s)" % (PACKAGE, ", ".join(dirs)))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as exc:
        raise FilterUnavailable("cannot load the libseccomp Python binding %s: %s" % (spec.origin, exc))
    sys.modules["seccomp"] = mod
    return mod


_OPS = {"lt": "LT", "gt": "GT", "eq": "EQ"}


def build(allowed: Iterable[int], seccomp: Optional[ModuleType] = None) -> SocketFilter:
    """A libseccomp SyscallFilter (not loaded yet) that denies socket() and
    socketpair() of every family outside ``allowed`` (numbers) with
    EAFNOSUPPORT, allows everything else, and kills the process on a system
    call of a non-native ABI.  It leaves no_new_privs alone (the launcher is
    root; the cell's payload gets no_new_privs from nspawn)."""
    sc = seccomp or load_seccomp()
    try:
        f: SocketFilter = sc.SyscallFilter(defaction=sc.ALLOW)
        f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
        f.set_attr(sc.Attr.CTL_NNP, 0)
        deny = sc.ERRNO(DENY_ERRNO)
        for name in SYSCALLS:
            for op, value in plan(allowed):
                f.add_rule_exactly(deny, name, sc.Arg(0, getattr(sc, _OPS[op]), value))
    except (RuntimeError, ValueError, OSError, AttributeError) as exc:
        raise FilterUnavailable("libseccomp refused the socket family filter: %s" % exc)
    return f


def describe(value: Union[str, Iterable[str]]) -> str:
    """One line for logs: what the filter allows."""
    if value == ANY:
        return "any socket family (no filter)"
    return "socket families " + ", ".join(sorted(set(value), key=FAMILIES.__getitem__))


def filter_for(value: Union[str, Iterable[str]], seccomp: Optional[ModuleType] = None) -> Optional[SocketFilter]:
    """The filter for a policy's ``socket_families`` (None for "any");
    raises FilterUnavailable."""
    allowed = numbers(value)
    return None if allowed is None else build(allowed, seccomp)


def refusal(cause: object) -> str:
    """The launcher's message when the filter cannot be put in force."""
    return ("cannot restrict the cell's socket families: %s; refusing to start the cell (policy socket_families, "
            "role variable chv_cell_socket_families; %r runs cells without the filter)" % (cause, ANY))
