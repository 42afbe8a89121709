"""chv-broker's configuration: its defaults and its rules, in one place.

chv-broker checks its configuration with ``validate`` at start; the broker
role checks what it would render with the same function on the controller
before any change (chv.fleet.door_config_errors), and takes its variables'
defaults from ``DEFAULTS`` (chv.fleet.door_defaults): docs/services.md,
"Configuration".
"""
from __future__ import annotations

import json
from typing import Any, List, Mapping, Optional

from ..wire import settings as s
from ..wire.protocol import SYNC_ACTIONS
from .syncrun import jail_plan, parse_host_entry

# what a cell sees of the guest is /usr, /etc (without /etc/chv), its own
# workspace and agent state, /run/chv: the sync worker sees no more
SYNC_MOUNTS_DEFAULT = (
    "TemporaryFileSystem=/var:ro",
    "PrivateTmp=yes",
    "ProtectHome=yes",
    "InaccessiblePaths=-/run/chv-fleet -/run/chv-shots -/run/chv-browser -/etc/chv -/opt -/srv -/mnt -/media"
    " -/usr/lib/chv-fleet/chv_guest/browser -/usr/lib/chv-fleet/chv-browser",
)
SYNC_ISOLATION = ("unit", "child")
SYNC_PROTOCOLS = ("https", "http", "ssh", "git")

DEFAULTS = {
    "cells_dir": "/run/chv-fleet/cells",
    "workspaces_dir": "/var/lib/chv-fleet/workspaces",
    "max_request_bytes": 65536,
    "read_timeout": 10.0,
    # the global backstop, raised to (slots + 1) * max_connections_per_slot (wire.global_cap)
    "max_connections": 16,
    # per slot (wire.SlotQuota): connections open, idle ones included, and requests being carried out
    "max_connections_per_slot": 4,
    "max_requests_per_slot": 2,
    # the host's slot count; 0: the slots of the cell policy, counted at start
    "slots": 0,
    "cell_policy": "/etc/chv-fleet/cell-policy.json",  # chv_guest.cell's DEFAULT_POLICY_PATH
    "sync": {
        "enabled": True,
        "commands": {
            "status": ["git", "status", "--porcelain=v1", "-b"],
            "pull": ["git", "pull", "--ff-only"],
            "push": ["git", "push"],
        },
        "timeout": 120.0,
        "user": "",
        "shared_user": "",
        "credentials_file": "/etc/chv/broker/git-credentials",
        "protocols": ["https"],
        # empty: no host check in chv-broker (only the kernel egress policy)
        "hosts": [],
        "max_output_bytes": 65536,
        # setrlimit of the worker and git, in both isolation modes
        "rlimit_as": 4294967296,
        "rlimit_cpu": 300,
        # freezes the cell's scope where chv-broker's cgroup fs is read-only (freeze.py)
        "systemctl": "/usr/bin/systemctl",
        "python": "/usr/bin/python3",
        # "unit": a transient service per sync (chv-broker needs no network, no setuid); "child": its own child
        "isolation": "unit",
        "systemd_run": "/usr/bin/systemd-run",
        "setpriv": "/usr/bin/setpriv",
        # the transient service's properties (the role has a default list of its own)
        "unit_properties": [],
        # the worker's mount namespace, in both isolation modes; chv-broker adds the slot's workspace
        "mounts": list(SYNC_MOUNTS_DEFAULT),
    },
    "browser": {
        "enabled": True,
        "socket": "/run/chv-browser/browser.sock",
        "timeout": 60.0,
        "reap_interval": 15.0,
    },
}

HOST_ENTRY = ("a host name or IP address, optionally with :port (1-65535; IPv6 as 2001:db8::1, "
              "[2001:db8::1] or [2001:db8::1]:22)")


def _hosts(value: object) -> Optional[str]:
    if not isinstance(value, list):
        return s.must("a list of host names or IP addresses", value)
    for entry in value:
        try:
            parse_host_entry(entry)
        except ValueError as exc:
            return "entry %s is not %s: %s" % (s.show(entry), HOST_ENTRY, exc)
    return None


def _commands(value: object) -> Optional[str]:
    good = isinstance(value, dict) and all(
        k in SYNC_ACTIONS and isinstance(v, list) and v and all(isinstance(a, str) for a in v)
        for k, v in value.items())
    return None if good else s.must("actions among %s, each a non-empty argument list"
                                    % ", ".join(SYNC_ACTIONS), value)


def _mounts(value: object) -> Optional[str]:
    if not isinstance(value, list):
        return s.must("a list of mount properties", value)
    try:
        if any(str(p).startswith("BindPaths=") for p in value):
            raise ValueError("BindPaths= is chv-broker's own (the slot's workspace)")
        jail_plan(value)
    except ValueError as exc:
        return "is refused: %s" % exc
    return None


def _workspaces(value: object) -> Optional[str]:
    problem = s.absolute_path(value)
    if problem is None:
        try:  # chv-broker binds <it>/<slot> into the sync worker's namespace
            jail_plan(["BindPaths=%s/slot" % str(value).rstrip("/")])
        except ValueError:
            problem = s.must("a plain absolute path (letters, digits, ._@+-)", value)
    return problem


def _credentials(value: object) -> Optional[str]:
    return None if value == "" or s.absolute_path(value) is None else s.must("an absolute path or empty", value)


def _properties(value: object) -> Optional[str]:
    good = isinstance(value, list) and all(isinstance(p, str) and "=" in p for p in value)
    return None if good else s.must("a list of systemd properties (Name=value)", value)


def _service(key: str, rule: s.Rule) -> s.Setting:
    """A key no role variable sets (named by itself)."""
    return s.Setting(key, key, rule, "")


SETTINGS = (
    s.Setting("cells_dir", "chv_broker_cells_dir", s.absolute_path),
    s.Setting("workspaces_dir", "chv_broker_workspaces_dir", _workspaces),
    s.Setting("max_request_bytes", "chv_broker_max_request_bytes", s.integer(1024)),
    s.Setting("read_timeout", "chv_broker_read_timeout", s.number()),
    s.Setting("max_connections", "chv_broker_max_connections", s.integer(1)),
    s.Setting("max_connections_per_slot", "chv_broker_max_connections_per_slot", s.integer(1)),
    s.Setting("max_requests_per_slot", "chv_broker_max_requests_per_slot", s.integer(1)),
    _service("slots", s.integer(0)),
    _service("cell_policy", s.absolute_path),
    s.Setting("sync.enabled", "chv_broker_sync_enabled", s.boolean),
    s.Setting("sync.commands", "chv_broker_sync_commands (with _default, _group and _host, combined)", _commands,
              "chv_broker_sync_commands_default"),
    s.Setting("sync.timeout", "chv_broker_sync_timeout", s.number()),
    s.Setting("sync.user", "chv_broker_sync_user", s.not_root),
    s.Setting("sync.shared_user", "chv_broker_sync_shared_user", s.not_root),
    s.Setting("sync.credentials_file", "chv_broker_sync_credentials_file", _credentials),
    s.Setting("sync.protocols", "chv_broker_sync_protocols", s.strings(SYNC_PROTOCOLS)),
    s.Setting("sync.hosts", "chv_broker_sync_hosts", _hosts),
    _service("sync.max_output_bytes", s.integer(1)),
    _service("sync.rlimit_as", s.integer(1)),
    _service("sync.rlimit_cpu", s.integer(1)),
    _service("sync.systemctl", s.absolute_path),
    _service("sync.python", s.absolute_path),
    s.Setting("sync.isolation", "chv_broker_sync_isolation", s.one_of(*SYNC_ISOLATION)),
    _service("sync.systemd_run", s.absolute_path),
    _service("sync.setpriv", s.absolute_path),
    s.Setting("sync.unit_properties", "chv_broker_sync_unit_properties (with _default)", _properties, ""),
    s.Setting("sync.mounts", "chv_broker_sync_mounts (with _default)", _mounts, "chv_broker_sync_mounts_default"),
    s.Setting("browser.enabled", "chv_broker_browser_enabled", s.boolean),
    s.Setting("browser.socket", "chv_broker_browser_socket", s.absolute_path),
    s.Setting("browser.timeout", "chv_broker_browser_timeout", s.number()),
    s.Setting("browser.reap_interval", "chv_broker_browser_reap_interval", s.number(strict=False)),
)
# the role's variables that are no configuration key
ROLE_SETTINGS = (
    s.Setting("", "chv_broker_install_dir", s.absolute_path),
    s.Setting("", "chv_broker_config_path", s.absolute_path),
    s.Setting("", "chv_broker_socket_path", s.absolute_path),
)


def validate(config: Mapping[str, Any], role_vars: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Every problem of ``config`` (and of the role's other variables), each naming the role variable."""
    return s.problems(config, SETTINGS) + s.problems(role_vars or {}, ROLE_SETTINGS, by_var=True)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    return s.merge(base, over)


def load_config(path: Optional[str]) -> dict[str, Any]:
    """The configuration file (DEFAULTS where it says nothing); DEFAULTS without one."""
    if not path:
        return merge(DEFAULTS, {})
    with open(path, encoding="utf-8") as fh:
        return merge(DEFAULTS, json.load(fh))
