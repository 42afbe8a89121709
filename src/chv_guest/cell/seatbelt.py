"""macOS cells: the Seatbelt (sandbox-exec) profile of a slot, generated
from the cell policy (standard library only, pure: no file system access).

``profile(policy, slot)`` is the one generator: the cell_runtime role
renders it into /etc/chv-fleet/seatbelt/<slot>.sb (through the
chv.fleet.seatbelt_profile filter, which imports this module), and the
macOS launcher (chv_cell/darwin.py) refuses a run unless that file holds
exactly what this function returns for the installed policy.

What the profile says, from the policy's keys:
  * ``(deny default)`` first: nothing is allowed unless a rule below says so.
  * read: the system trees a payload needs (SYSTEM_READ below: the macOS
    counterpart of the host's /usr that nspawn shows read-only), the
    readonly and writable bind sources, the slot's own directories;
  * write: only the slot's workspace, its agent state directory (HOME, as
    on Linux), its temp directory (the counterpart of the cell's tmpfs),
    the writable bind sources (/run/chv: the broker socket) and the
    character devices every program writes (/dev/null, the tty);
  * the ``inaccessible`` paths denied for reading and writing explicitly,
    after every allow (in SBPL a later rule wins over an earlier one);
  * network: Unix sockets only under the writable bind sources (the
    broker's socket) and the system resolver's socket; IP out to any
    address and port but localhost, nothing inbound, no listening. Seatbelt matches IP destinations
    only as "*" or "localhost", so the egress policy (addresses and ports,
    cell_nat_egress_*) is the pf anchor's (chv.fleet.cell_nat on macOS),
    which matches the slot users; the launcher refuses a run while that
    anchor is not loaded (require_ruleset).

Seatbelt sees resolved paths: /etc, /tmp and /var are /private/... on
macOS and /run is mapped to /private/var/run by the role (synthetic.conf),
so every path is written in its resolved form (``resolved``), and a denied
path in both forms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping

if TYPE_CHECKING:
    from .policy import Policy, Slot

# The first-level symlinks of macOS (and /run, which the cell_runtime role
# adds through /etc/synthetic.conf): Seatbelt matches the resolved path.
ROOT_LINKS = (
    ("/etc", "/private/etc"),
    ("/tmp", "/private/tmp"),
    ("/var", "/private/var"),
    ("/run", "/private/var/run"),
)

# System trees a payload reads (the macOS counterpart of the host's /usr,
# which every Linux cell sees read-only): programs, libraries, frameworks,
# the dyld cache, time zones and certificates. /private/etc is in it for
# the resolver, passwd and TLS configuration; the policy's inaccessible
# paths (/etc/chv among them) are denied after it.
SYSTEM_READ = (
    "/System",
    "/usr",
    "/bin",
    "/sbin",
    "/Library/Apple",
    "/Library/Frameworks",
    "/Library/Preferences/SystemConfiguration",
    "/private/etc",
    "/private/var/db/timezone",
    "/private/var/db/dyld",
    "/dev",
    "/opt/homebrew",
    "/usr/local",
)

# Character devices a payload writes.
DEVICE_WRITE = ("/dev/null", "/dev/zero", "/dev/tty", "/dev/dtracehelper")

# The system resolver (mDNSResponder): macOS programs resolve names through
# it, not by sending DNS packets themselves.
RESOLVER_SOCKET = "/private/var/run/mDNSResponder"
RESOLVER_SERVICES = ("com.apple.dnssd.service", "com.apple.system.opendirectoryd.libinfo",
                     "com.apple.system.notification_center", "com.apple.SystemConfiguration.configd",
                     "com.apple.trustd", "com.apple.trustd.agent")

# Where each slot's temp directory lives (TMPDIR of the payload; emptied by
# the launcher before and after each run).
TMP_ROOT = "/private/var/tmp/chv-fleet"


def resolved(path: str) -> str:
    """``path`` as Seatbelt sees it (first-level macOS symlinks resolved)."""
    for link, target in ROOT_LINKS:
        if path == link or path.startswith(link + "/"):
            return target + path[len(link):]
    return path


def _forms(path: str) -> List[str]:
    """The path and its resolved form, each once."""
    out = [path]
    if resolved(path) != path:
        out.append(resolved(path))
    return out


def quote(text: str) -> str:
    """An SBPL string literal."""
    if "\n" in text or "\0" in text:
        raise ValueError("path %r cannot be written into a Seatbelt profile" % text)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def slot_dirs(policy: Policy, slot: Slot) -> Dict[str, str]:
    """The slot's own directories on the host: workspace, agent state (its
    HOME) and temp directory."""
    name = slot["name"]
    return {
        "workspace": policy["workspace_root"].rstrip("/") + "/" + name,
        "agent_state": policy["agent_state_root"].rstrip("/") + "/" + name,
        "tmp": TMP_ROOT + "/" + name,
    }


def _bind_source(bind: Mapping[str, Any], slot: Slot) -> str:
    source: str = bind["source"]
    return source.replace("{slot}", slot["name"])


def profile(policy: Policy, slot: Slot) -> str:
    """The Seatbelt profile (SBPL text) of ``slot`` under ``policy``."""
    dirs = slot_dirs(policy, slot)
    readonly = [_bind_source(b, slot) for b in policy.get("readonly_binds") or []]
    writable = [_bind_source(b, slot) for b in policy.get("writable_binds") or []]
    own = [dirs["workspace"], dirs["agent_state"], dirs["tmp"]]

    def subpaths(paths: List[str]) -> str:
        seen: List[str] = []
        for p in paths:
            for form in _forms(p):
                if form not in seen:
                    seen.append(form)
        return " ".join("(subpath %s)" % quote(p) for p in seen)

    lines = [
        ";; chv.fleet cell %s (user %s): generated from the cell policy by chv_cell.seatbelt"
        % (slot["name"], slot.get("user", "?")),
        "(version 1)",
        "(deny default)",
        ";; processes: the payload and its children, signals among them",
        "(allow process-fork)",
        "(allow process-exec)",
        "(allow signal (target same-sandbox))",
        "(allow process-info* (target same-sandbox))",
        "(allow sysctl-read)",
        "(allow ipc-posix-sem)",
        "(allow ipc-posix-shm)",
        "(allow pseudo-tty)",
        "(allow file-ioctl (literal \"/dev/tty\") (regex #\"^/dev/ttys[0-9]+$\"))",
        ";; read: system trees, the bind sources, the slot's own directories",
        "(allow file-read-metadata)",
        "(allow file-read* %s)" % subpaths(list(SYSTEM_READ) + readonly + writable + own),
        ";; write: the slot's workspace, agent state and temp directory, the writable binds",
        "(allow file-write* %s)" % subpaths(own + writable),
        "(allow file-write-data %s)" % " ".join("(literal %s)" % quote(d) for d in DEVICE_WRITE),
        "(allow file-write* (regex #\"^/dev/ttys[0-9]+$\"))",
        ";; Unix sockets: the writable bind sources (the broker's socket) and the resolver",
        "(allow network-outbound %s)" % " ".join(
            ["(literal %s)" % quote(RESOLVER_SOCKET)]
            + ["(subpath %s)" % quote(p) for p in _dedup(resolved(w) for w in writable)]),
        "(allow mach-lookup %s)" % " ".join("(global-name %s)" % quote(s) for s in RESOLVER_SERVICES),
    ]
    lines += [
        ";; IP: out only, never to localhost; which addresses and ports: the pf anchor (slot users)",
        '(allow network-outbound (remote ip "*:*"))',
        '(deny network-outbound (remote ip "localhost:*"))',
        "(deny network-inbound)",
        "(deny network-bind (local ip))",
        ";; never: the policy's inaccessible paths (after every allow: the last match wins)",
    ]
    for path in policy.get("inaccessible") or []:
        for form in _forms(path):
            lines.append("(deny file-read* file-write* (subpath %s))" % quote(form))
    return "\n".join(lines) + "\n"


def _dedup(items: Iterable[str]) -> List[str]:
    out: List[str] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
