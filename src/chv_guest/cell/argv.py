"""The one pure function that turns (policy, slot identity, command) into
the systemd-nspawn argument list, plus the path helpers it relies on.

Nothing in this module touches the file system or the process table: the
caller probes the host once (``probe_paths`` tells it which paths matter)
and passes the result in as ``HostFacts``.  ``chv-cell argv`` prints exactly
what ``chv-cell run`` executes.
"""

from __future__ import annotations

import os.path
from typing import TYPE_CHECKING, Container, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set, Tuple

from .policy import is_under

if TYPE_CHECKING:
    from .policy import Policy, Slot

# Inside the cell, the start gate FIFO is bound read-only here (the cell's
# own /run is a private tmpfs, so nothing of the host's /run is visible).
GATE_IN_CELL = "/run/chv-gate"


# The cell's pid 2 (nspawn --as-pid2) is this shell: it blocks on the start
# gate FIFO and execs the payload only after the launcher has written "go"
# (after the cell's network is configured), then the variables passed to
# this run as NAME=VALUE lines (taskenv.py: names the policy allows, never
# on a command line), then an empty line.  The FIFO is owned by host root
# with mode 0644: the cell (whose root is an unprivileged host uid) can
# open it for reading only, so nothing inside any cell can open a gate; and
# nothing else runs in the cell before the payload to read what passes.  If
# the launcher dies before the empty line, the read sees EOF and the
# payload never starts.  The FIFO is opened once, as fd 3, which the
# payload does not get.  The shell's own variables begin with chv_, which
# no passed name may (taskenv.RESERVED_PREFIX).
def gate_script(gate: str) -> str:
    """The in-cell start of a run, reading the gate FIFO at ``gate``."""
    return (
        '{ IFS= read -r chv_g <&3 && [ "$chv_g" = go ] && while IFS= read -r chv_v <&3; do '
        '[ -n "$chv_v" ] || { unset chv_g chv_v; exec "$@" 3<&-; }; export "$chv_v" || break; done; } 3<' + gate + '; '
        'echo "chv-cell: start gate closed; payload not started" >&2; exit 125'
    )


GATE_SCRIPT = gate_script(GATE_IN_CELL)

# Trees of the host visible in every cell: /usr (nspawn --volatile=yes mounts
# the host's /usr read-only on a tmpfs root) and /etc (bound read-only by the
# launcher so that --inaccessible= can hide paths inside it).
HOST_TREES = ("/usr", "/etc")


class HostFacts(NamedTuple):
    scope: str  # "systemd" (nspawn allocates a scope) or "standalone" (--keep-unit)
    existing: FrozenSet[str]  # host paths (from probe_paths) that exist
    shared_network: bool  # True only with the explicit --shared-network flag
    run_id: str = "0"  # unique per run (systemd scope: the transient unit's name suffix)


def cell_paths(policy: Policy, slot: Slot) -> Dict[str, str]:
    """Host-side paths belonging to one slot."""
    name = slot["name"]
    state = policy["state_dir"]
    return {
        "lock": os.path.join(state, "locks", name + ".lock"),
        "record": os.path.join(state, "cells", name + ".json"),
        "net_dir": os.path.join(state, "net", name),
        "resolv_conf": os.path.join(state, "net", name, "resolv.conf"),
        "hosts": os.path.join(state, "net", name, "hosts"),
        "gate": os.path.join(state, "gate", name),
        # where the slot's warm cell waits for a payload (chv-cell warm)
        "warm_socket": os.path.join(state, "warm", name + ".sock"),
        "workspace": os.path.join(policy["workspace_root"], name),
        "agent_state": os.path.join(policy["agent_state_root"], name),
    }


def scope_unit(slot: Slot, run_id: str) -> str:
    """Name of the transient scope of one run (systemd-run adds ".scope")."""
    return "chv-cell-%s-%s" % (slot["name"], run_id)


def _subst(path: str, slot: Slot) -> str:
    return path.replace("{slot}", slot["name"])


def bind_table(policy: Policy, slot: Slot) -> List[Tuple[str, str, str, bool]]:
    """All binds of the cell as (flag, source, target, optional), in order.

    nspawn mounts them in this order, so a parent comes before what is
    mounted inside it: /etc, the readonly and writable binds, the slot's
    workspace at workspace_mount, its agent state dir at agent_state_mount,
    then the workspace again at each workspace alias (an alias may lie inside
    the agent_state_mount, e.g. /home/chv/workspace under /home/chv; the
    validator refuses any other nesting).
    """
    paths = cell_paths(policy, slot)
    table = [("--bind-ro", "/etc", "/etc", False)]
    for b in policy["readonly_binds"]:
        src = _subst(b["source"], slot)
        table.append(("--bind-ro", src, _subst(b.get("target", b["source"]), slot), b.get("optional", False)))
    for b in policy["writable_binds"]:
        src = _subst(b["source"], slot)
        table.append(("--bind", src, _subst(b.get("target", b["source"]), slot), b.get("optional", False)))
    table.append(("--bind", paths["workspace"], policy["workspace_mount"], False))
    table.append(("--bind", paths["agent_state"], policy["agent_state_mount"], False))
    for alias in policy["workspace_aliases"]:
        table.append(("--bind", paths["workspace"], alias, False))
    return table


def alias_mountpoints(policy: Policy) -> List[List[str]]:
    """Workspace aliases inside the agent_state_mount, as path components
    relative to it (["workspace"] for /home/chv/workspace under /home/chv).
    Their mount points live in the slot's agent state dir on the host; the
    launcher creates them there, owned by the slot's cell root."""
    mount = policy["agent_state_mount"]
    out = []
    for alias in policy["workspace_aliases"]:
        if alias != mount and is_under(alias, mount):
            out.append(alias[len(mount.rstrip("/")) + 1:].split("/"))
    return out


def probe_paths(policy: Policy, slot: Slot) -> Set[str]:
    """Host paths whose existence build_argv needs to know."""
    out = set()
    for _flag, src, _tgt, optional in bind_table(policy, slot):
        if optional:
            out.add(src)
    for p in policy["inaccessible"]:
        host = host_path_of(_subst(p, slot), policy, slot)
        if host is not None:
            out.add(host)
    return out


def host_path_of(cell_path: str, policy: Policy, slot: Slot,
                 existing: Optional[Container[str]] = None) -> Optional[str]:
    """Which host path a cell path shows, or None if the cell cannot see it.

    The deepest bind whose target contains the path wins; /usr and /etc
    show the host's own trees.  ``existing`` (when given) drops optional
    binds that will not be mounted.
    """
    best = None
    candidates = [("host", t, t, False) for t in HOST_TREES] + bind_table(policy, slot)
    for flag, src, tgt, optional in candidates:
        if optional and existing is not None and src not in existing:
            continue
        if is_under(cell_path, tgt) and (best is None or len(tgt) >= len(best[1])):
            best = (src, tgt)
    if best is None:
        return None
    src, tgt = best
    return src + cell_path[len(tgt):]


# What never goes through the egress proxy: the cell's own loopback.
NO_PROXY = "localhost,127.0.0.1,::1"


def proxy_url(policy: Policy, slot: Slot) -> Optional[str]:
    """The slot's egress proxy, ``http://<the slot's gateway>:<port>``, with
    the policy's egress_proxy; None without it. The one place the URL is
    made: the cell's proxy variables and its record's ``egress_proxy`` (which
    chv-broker hands to the doors acting for the slot: chv-browser's context,
    the sync worker's git) are this string. A door's connection to it comes
    from the gateway address itself, inside the slot's subnet, so squid's
    per-source ACL applies the slot's list to the door as to the cell."""
    proxy = policy.get("egress_proxy")
    if not proxy:
        return None
    return "http://%s:%d" % (slot["gateway"], proxy["port"])


def proxy_environment(policy: Policy, slot: Slot) -> Dict[str, str]:
    """With the policy's egress_proxy, the variables git, pip, npm, curl and
    the model clients read to use a proxy (both cases: curl reads only the
    lower-case http_proxy), pointing at the proxy on the slot's own gateway
    (proxy_url); without it, none. A client that ignores them finds no route
    (the guest drops every other packet of the cell) and no resolver."""
    url = proxy_url(policy, slot)
    if url is None:
        return {}
    env = {}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = url
    env["NO_PROXY"] = env["no_proxy"] = NO_PROXY
    return env


def cell_environment(policy: Policy, slot: Slot) -> Dict[str, str]:
    """The variables every cell gets, which the policy's setenv cannot change:
    CHV_CELL=1, CHV_SLOT, the agent's HOME (agent_home), USER and LOGNAME
    (agent_user), and with an egress proxy the proxy variables
    (proxy_environment)."""
    env = {
        "CHV_CELL": "1",
        "CHV_SLOT": slot["name"],
        "HOME": policy["agent_home"],
        "USER": policy["agent_user"],
        "LOGNAME": policy["agent_user"],
    }
    env.update(proxy_environment(policy, slot))
    return env


def build_argv(policy: Policy, slot: Slot, command: Sequence[str], facts: HostFacts) -> List[str]:
    """The complete systemd-nspawn argv for running ``command`` in ``slot``."""
    if not command:
        raise ValueError("no command given")
    paths = cell_paths(policy, slot)
    register = bool(policy["register"]) and facts.scope == "systemd"
    argv = []
    if facts.scope == "systemd":
        # A transient scope per run, with a unique name (no clash with a
        # previous run's scope still being collected) and the policy's unit
        # properties; nspawn then keeps that unit (--keep-unit).
        argv += [
            policy["systemd_run"],
            "--scope",
            "--quiet",
            "--collect",
            "--unit=" + scope_unit(slot, facts.run_id),
            "--description=chv cell %s" % slot["name"],
            # nspawn manages the cgroups below its unit, as in its own scopes
            "--property=Delegate=yes",
        ]
        argv += ["--property=%s=%s" % (k, v) for k, v in sorted(policy["properties"].items())]
        argv.append("--")
    argv += [
        policy["nspawn"],
        "--quiet",
        "--directory=/",
        "--volatile=yes",
        "--as-pid2",
        "--pipe",
        "--machine=" + slot["machine"],
        "--register=" + ("yes" if register else "no"),
        "--keep-unit",

        "--private-users=%d:%d" % (slot["uid_base"], slot["uid_size"]),
        "--private-users-ownership=off",
        "--drop-capability=" + ",".join(sorted(set(policy["drop_capabilities"]))),
        "--no-new-privileges=yes",
        "--system-call-filter=~" + " ".join(sorted(set(policy["syscall_deny"]))),
        "--link-journal=no",
        "--resolv-conf=off",
        "--timezone=off",
    ]
    existing = facts.existing
    for flag, src, tgt, optional in bind_table(policy, slot):
        if optional and src not in existing:
            continue
        argv.append("%s=%s" % (flag, src if src == tgt else src + ":" + tgt))
    if not facts.shared_network:
        argv.append("--bind-ro=%s:/etc/resolv.conf" % paths["resolv_conf"])
        argv.append("--bind-ro=%s:/etc/hosts" % paths["hosts"])
    argv.append("--bind-ro=%s:%s" % (paths["gate"], GATE_IN_CELL))
    # --inaccessible= fails when the path does not exist inside the cell, so
    # only paths the cell can actually see (and that exist) are listed; a
    # path outside /usr, /etc and the binds is not in the cell at all.
    hidden = []
    for p in policy["inaccessible"]:
        cp = _subst(p, slot)
        host = host_path_of(cp, policy, slot, existing)
        if host is not None and host in existing and cp not in hidden:
            hidden.append(cp)
    argv += ["--inaccessible=" + p for p in hidden]
    argv += ["--tmpfs=%s:mode=1777" % t for t in policy["tmpfs"]]
    env = cell_environment(policy, slot)
    for k, v in policy["setenv"].items():
        if k not in env:
            env[k] = str(v)
    argv += ["--setenv=%s=%s" % (k, env[k]) for k in env]
    for k, v in sorted(policy["rlimits"].items()):
        name = k if k.startswith("RLIMIT_") else "RLIMIT_" + k
        argv.append("--rlimit=%s=%s" % (name, v))
    if not facts.shared_network:
        argv += ["--private-network", "--network-veth-extra=%s:%s" % (slot["host_ifname"], slot["cell_ifname"])]
    argv.append("--chdir=" + policy["workspace_mount"])
    argv += ["--", "/bin/sh", "-c", GATE_SCRIPT, "chv-gate"]
    argv += list(command)
    return argv


def nspawn_environment(policy: Policy) -> Dict[str, str]:
    """The environment nspawn runs with: nothing from the caller leaks in."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    env.update({k: str(v) for k, v in policy["nspawn_environment"].items()})
    return env
