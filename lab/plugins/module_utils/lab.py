# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Planning and host plumbing for the local systemd-nspawn test lab.

Pure functions (validation, address plan, image cache keys, apt source
parsing) are unit-tested; the functions that touch the host (cgroups,
processes, links, mounts) are small and used by the lab modules only.
Standard library only.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import hashlib
import ipaddress
import json
import os
import re
import signal
import time

DISTROS = {
    "bookworm": {"suites": ["bookworm", "bookworm-updates"], "security": "bookworm-security", "systemd": 252},
    "trixie": {"suites": ["trixie", "trixie-updates"], "security": "trixie-security", "systemd": 257},
}

# What every lab guest needs to boot and be reached by Ansible over SSH.
BASE_PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "python3", "openssh-server", "sudo",
    "iproute2", "iputils-ping", "procps", "ca-certificates",
    # what Ansible's apt and package_facts modules need on Debian targets
    "python3-apt",
]

# Host-side veth is "ve-" + machine name and must fit IFNAMSIZ (15 bytes).
MAX_GUEST_NAME = 12
NAME_RE = re.compile(r"^[a-z][a-z0-9-]*[a-z0-9]$|^[a-z]$")
CGROUP_PARENT = "chv-lab"
PROPAGATE_DIR = "/run/systemd/nspawn/propagate"
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class LabError(Exception):
    """A bad lab parameter or a host condition that stops the lab."""


def validate_name(value, what):
    if not isinstance(value, str) or not NAME_RE.match(value) or "--" in value:
        raise LabError("%s %r is not a valid hostname label (lowercase letters, digits, inner '-')" % (what, value))
    if len(value) > MAX_GUEST_NAME:
        raise LabError(
            "%s %r is %d characters; at most %d fit the host-side veth name ve-<name> (IFNAMSIZ)"
            % (what, value, len(value), MAX_GUEST_NAME))
    return value


IFNAME_RE = re.compile(r"^[a-z][a-z0-9]{0,14}$")
GUEST_KEYS = ("name", "distro", "ifname")


def guest_specs(lab_name, count=None, names=None):
    """The guests of a lab as {name, distro, ifname} (distro and ifname None
    when the entry leaves them to the lab): explicit entries (a name, or a
    dict with a name and optionally its own distro and the guest-side name of
    its interface), or <lab_name><n> for n in 1..count."""
    validate_name(lab_name, "lab_name")
    if names:
        if not isinstance(names, list):
            raise LabError("lab_guests must be a list of names or {name, distro, ifname} entries, got %r" % (names,))
        specs = []
        for entry in names:
            spec = dict(entry) if isinstance(entry, dict) else {"name": entry}
            unknown = sorted(set(spec) - set(GUEST_KEYS))
            if unknown:
                raise LabError("lab_guests entry %r has unknown keys %s (known: %s)"
                               % (entry, ", ".join(unknown), ", ".join(GUEST_KEYS)))
            validate_name(spec.get("name"), "lab_guests entry")
            if spec.get("distro") is not None and spec["distro"] not in DISTROS:
                raise LabError("lab_guests entry %s: distro %r is not supported; choose one of %s"
                               % (spec["name"], spec["distro"], ", ".join(sorted(DISTROS))))
            if spec.get("ifname") is not None and not IFNAME_RE.match(str(spec["ifname"])):
                raise LabError("lab_guests entry %s: ifname %r is not an interface name (a lowercase letter, then "
                               "at most 14 lowercase letters or digits)" % (spec["name"], spec["ifname"]))
            specs.append({"name": spec["name"], "distro": spec.get("distro"), "ifname": spec.get("ifname")})
        names = [s["name"] for s in specs]
        if len(set(names)) != len(names):
            raise LabError("lab_guests has duplicate names: %r" % (names,))
        return specs
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise LabError("lab_count %r is invalid: an integer from 1 to 64 is required" % (count,))
    result = ["%s%d" % (lab_name, i) for i in range(1, count + 1)]
    for n in result:
        validate_name(n, "generated guest name")
    return [{"name": n, "distro": None, "ifname": None} for n in result]


DNS_NAME_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def resolver_names(names):
    """lab_resolver_names checked: {DNS name (lowercase, at least two labels): IPv4 address}, sorted."""
    if not isinstance(names, dict):
        raise LabError("lab_resolver_names must be a mapping of DNS names to IPv4 addresses, got %r" % (names,))
    out = {}
    for name, addr in names.items():
        if not isinstance(name, str) or not DNS_NAME_RE.match(name):
            raise LabError("lab_resolver_names: %r is not a DNS name (lowercase labels, at least two)" % (name,))
        try:
            out[name] = str(ipaddress.IPv4Address(str(addr)))
        except ValueError:
            raise LabError("lab_resolver_names: %s maps to %r, not an IPv4 address" % (name, addr))
    return dict(sorted(out.items()))


def plan(lab_name, distro, network, count=None, names=None, resolver=None):
    """Validate the parameters and return the lab plan: one /30 per guest,
    each guest with its distro (the lab's unless its entry names one) and
    the guest-side name of its interface (host0 unless its entry names one),
    and the resolver stand-in's names (resolver_names)."""
    if distro not in DISTROS:
        raise LabError("lab_distro %r is not supported; choose one of %s" % (distro, ", ".join(sorted(DISTROS))))
    try:
        net = ipaddress.IPv4Network(network, strict=True)
    except (ValueError, TypeError) as exc:
        raise LabError("lab_network %r is not an IPv4 network: %s" % (network, exc))
    if net.prefixlen > 30:
        raise LabError("lab_network %r is smaller than one /30" % (network,))
    guests = guest_specs(lab_name, count, names)
    slices = list(net.subnets(new_prefix=30)) if net.prefixlen < 30 else [net]
    if len(guests) > len(slices):
        raise LabError("lab_network %s holds %d /30 links, %d guests requested" % (net, len(slices), len(guests)))
    result = []
    for spec, sub in zip(guests, slices):
        hosts = list(sub.hosts())
        result.append({
            "name": spec["name"], "distro": spec["distro"] or distro, "ifname": spec["ifname"] or "host0",
            "link": str(sub), "host_ifname": "ve-" + spec["name"],
            "host_address": str(hosts[0]), "address": str(hosts[1]), "prefixlen": 30,
        })
    return {"lab": lab_name, "network": str(net), "distro": distro, "guests": result,
            "distros": sorted(set(g["distro"] for g in result)), "resolver_names": resolver_names(resolver or {})}


def overlapping_routes(network, routes, own_ifnames):
    """Routes (``ip -j route show table all``) overlapping ``network`` that are not the lab's own."""
    net = ipaddress.IPv4Network(network)
    found = []
    for r in routes:
        dst = r.get("dst")
        if not dst or dst == "default" or ":" in dst or r.get("dev") in own_ifnames:
            continue
        try:
            rnet = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            continue
        if rnet.overlaps(net):
            found.append("%s dev %s" % (dst, r.get("dev", "?")))
    return found


def parse_apt_sources(deb822_texts, list_texts):
    """Return the Debian archive and security mirror URIs the host's apt uses."""
    archive = security = None
    for text in deb822_texts:
        for stanza in re.split(r"\n\s*\n", text):
            fields = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
                continue
            uris, suites = fields.get("uris", "").split(), fields.get("suites", "").split()
            if not uris:
                continue
            if any(s.endswith("-security") for s in suites):
                security = security or uris[0]
            elif any(s in DISTROS or s.split("-")[0] in DISTROS for s in suites):
                archive = archive or uris[0]
    for text in list_texts:
        for line in text.splitlines():
            # options: one bracketed block, which may hold several space-separated options
            parts = re.sub(r"\[[^\]]*\]", " ", line).split() if line.startswith("deb ") else []
            if len(parts) < 3:
                continue
            if parts[2].endswith("-security"):
                security = security or parts[1]
            elif parts[2].split("-")[0] in DISTROS:
                archive = archive or parts[1]
    return archive, security


def image_sources(distro, archive, security):
    """mmdebstrap source lines for a distro from the host's mirrors."""
    d = DISTROS[distro]
    lines = ["deb %s %s main" % (archive, " ".join(d["suites"]))]
    if security:
        lines.append("deb %s %s main" % (security, d["security"]))
    return lines


def image_key(distro, packages, sources):
    """Cache key: distro + sorted package list + sources (a changed list is a new image)."""
    blob = json.dumps({"v": 1, "distro": distro, "packages": sorted(set(packages)), "sources": sources},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- host plumbing

def cgroup_roots():
    """Writable cgroup hierarchies a guest gets its own directory in (v1 name=systemd + v2)."""
    roots = []
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        roots.append("/sys/fs/cgroup")  # pure unified hierarchy
    else:
        for sub in ("systemd", "unified"):
            if os.path.isdir(os.path.join("/sys/fs/cgroup", sub)):
                roots.append(os.path.join("/sys/fs/cgroup", sub))
    return roots


def guest_cgroups(lab, name):
    return [os.path.join(root, CGROUP_PARENT, "%s-%s" % (lab, name)) for root in cgroup_roots()]


def enter_cgroups(paths):
    """Move the calling process into each cgroup (used as a pre-exec step)."""
    for path in paths:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0\n")


def cgroup_pids(path):
    pids = set()
    for dirpath, _dirs, files in os.walk(path):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(dirpath, "cgroup.procs")) as f:
                    pids.update(int(x) for x in f.read().split())
            except OSError:
                pass
    return pids


def remove_cgroup_tree(path):
    """rmdir a cgroup and its children depth-first; returns the directories left."""
    if not os.path.isdir(path):
        return []
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda t: -t[0].count("/")):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    return [path] if os.path.isdir(path) else []


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_pids(pids, term_timeout=10.0):
    """SIGTERM (orderly poweroff for an nspawn -b guest), then SIGKILL what is left."""
    pids = [p for p in pids if pid_alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + term_timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def mounts_under(path):
    """Mount points at or below ``path`` (deepest first)."""
    path = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path.rstrip("/") + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda m: -m.count("/"))


def tail(path, lines=40):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = ANSI_RE.sub("", f.read().decode("utf-8", "replace"))
        return [line for line in text.splitlines() if line.strip()][-lines:]
    except OSError:
        return []
