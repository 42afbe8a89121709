"""chv-browser's configuration: its defaults and its rules, in one place.

chv-browser checks its configuration with ``validate`` at start; the browser
role checks what it would render with the same function on the controller
before any change (chv.fleet.door_config_errors), and takes its variables'
defaults from ``DEFAULTS`` (chv.fleet.door_defaults): docs/services.md,
"Configuration".
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional

from ..wire import settings as s

DEFAULTS = {
    "socket": "/run/chv-browser/browser.sock",
    # the role's is chv_broker_group: run alone, the socket keeps chv-browser's own group
    "socket_group": "",
    "shots_dir": "/run/chv-shots",
    "shots_cell_dir": "/run/chv/shots",
    "shots_keep": 20,
    "shots_max_bytes": 8 * 1024 * 1024,
    # the role's default is the distribution's chromium (its platform variables)
    "executable_path": "/usr/bin/chromium",
    "chromium_sandbox": True,
    "chromium_args": ["--headless", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run",
                      "--disable-default-apps", "--disable-extensions", "--mute-audio"],
    "navigation_timeout": 30.0,
    "request_timeout": 60.0,
    "idle_timeout": 300.0,
    "max_lines": 200,
    "max_bytes": 65536,
    "viewport": {"width": 1280, "height": 800},
    "max_request_bytes": 65536,
    "read_timeout": 10.0,
    # the global backstop, raised to (slots + 1) * max_requests_per_slot (wire.global_cap)
    "max_connections": 8,
    # requests of one slot in flight at once (read, queued or running); more get "busy"
    "max_requests_per_slot": 2,
    # the host's slot count; 0: the slots of the cell policy, counted at start
    "slots": 0,
    "cell_policy": "/etc/chv-fleet/cell-policy.json",  # chv_guest.cell's DEFAULT_POLICY_PATH
    # empty: no check of the venv's Playwright (the role pins one)
    "playwright_version": "",
    # pages a slot's context may have open at once, its own included
    "pages_per_slot": 4,
}

# chromium arguments that would open chromium to the cells (a DevTools port) or drop its sandbox
FORBIDDEN_ARGS = ("--remote-debugging", "--no-sandbox")
CHROMIUM_ARGS_VAR = "chv_browser_chromium_args(_default, _group, _host)"


def _viewport(value: object) -> Optional[str]:
    good = isinstance(value, dict) and all(
        not isinstance(value.get(k), bool) and isinstance(value.get(k), int) and value[k] > 0
        for k in ("width", "height"))
    return None if good else s.must("a width and a height above 0", value)


def _chromium_args(value: object) -> Optional[str]:
    problem = s.strings()(value)
    if problem or not isinstance(value, list):
        return problem
    bad = [a for a in value if a.startswith(FORBIDDEN_ARGS)]
    return ("(has %s) must not hold --remote-debugging* or --no-sandbox (use chv_browser_chromium_sandbox)"
            % s.show(bad)) if bad else None


def _service(key: str, rule: s.Rule) -> s.Setting:
    """A key no role variable sets (named by itself)."""
    return s.Setting(key, key, rule, "")


SETTINGS = (
    s.Setting("socket", "chv_browser_socket_path", s.absolute_path),
    s.Setting("socket_group", "chv_browser_broker_group", s.text, ""),
    s.Setting("shots_dir", "chv_browser_shots_dir", s.absolute_path),
    s.Setting("shots_cell_dir", "chv_browser_shots_cell_dir", s.absolute_path),
    s.Setting("shots_keep", "chv_browser_shots_keep", s.integer(1)),
    s.Setting("shots_max_bytes", "chv_browser_shots_max_bytes", s.integer(1048576)),
    s.Setting("executable_path", "chv_browser_executable_path", s.text, ""),
    s.Setting("chromium_sandbox", "chv_browser_chromium_sandbox", s.boolean),
    s.Setting("chromium_args", CHROMIUM_ARGS_VAR, _chromium_args, "chv_browser_chromium_args_default"),
    s.Setting("navigation_timeout", "chv_browser_navigation_timeout", s.number()),
    s.Setting("request_timeout", "chv_browser_request_timeout", s.number()),
    s.Setting("idle_timeout", "chv_browser_idle_timeout", s.number()),
    s.Setting("max_lines", "chv_browser_snapshot_max_lines", s.integer(1)),
    s.Setting("max_bytes", "chv_browser_snapshot_max_bytes", s.integer(256)),
    s.Setting("viewport", "chv_browser_viewport", _viewport),
    _service("max_request_bytes", s.integer(1024)),
    _service("read_timeout", s.number()),
    s.Setting("max_connections", "chv_browser_max_connections", s.integer(1)),
    s.Setting("max_requests_per_slot", "chv_browser_max_requests_per_slot", s.integer(1)),
    _service("slots", s.integer(0)),
    _service("cell_policy", s.absolute_path),
    s.Setting("playwright_version", "chv_browser_playwright_version", s.text, ""),
    s.Setting("pages_per_slot", "chv_browser_pages_per_slot", s.integer(1)),
)
# the role's variables that are no configuration key
ROLE_SETTINGS = (
    s.Setting("", "chv_browser_user", s.not_root),
    s.Setting("", "chv_browser_install_dir", s.absolute_path),
    s.Setting("", "chv_browser_config_path", s.absolute_path),
    s.Setting("", "chv_browser_home", s.absolute_path),
    s.Setting("", "chv_browser_venv", s.absolute_path),
    s.Setting("", "chv_browser_state_dir", s.absolute_path),
)


def validate(config: Mapping[str, Any], role_vars: Optional[Mapping[str, Any]] = None,
             at_start: bool = False) -> List[str]:
    """Every problem of ``config`` (and of the role's other variables), each naming the role variable.

    A request deadline below the navigation timeout is an operator's mistake the role refuses; the
    service (``at_start``) runs with it, the deadline cutting first (its deadline tests need that)."""
    errors = s.problems(config, SETTINGS)
    navigation, request = config.get("navigation_timeout"), config.get("request_timeout")
    timeout = s.number()
    if not at_start and timeout(navigation) is None and timeout(request) is None \
            and request < navigation:  # type: ignore[operator]
        errors.append("chv_browser_request_timeout must be at least chv_browser_navigation_timeout (%s), not %s"
                      % (s.show(navigation), s.show(request)))
    return errors + s.problems(role_vars or {}, ROLE_SETTINGS, by_var=True)


def load_config(path: Optional[str]) -> Dict[str, Any]:
    """The configuration file (DEFAULTS where it says nothing, key by key); DEFAULTS without one."""
    cfg = dict(DEFAULTS)
    if path:
        with open(path, encoding="utf-8") as fh:
            cfg.update(json.load(fh))
    return cfg
