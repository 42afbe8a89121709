"""chv-browser's door capacity (requests in flight per slot) and the limits of its unit.

The unit is rendered from roles/browser/templates/chv-browser.service.j2 as
Ansible renders it (trim_blocks, strict undefined) with the role's defaults;
its [Service] section must carry MemoryMax=, MemorySwapMax=, TasksMax= and
CPUQuota= with the documented defaults, take overrides, and leave a limit
out when its variable is "".
"""
import os
import threading

import jinja2
import pytest
import yaml

from browser_helpers import Recorder
from testpaths import ROOT
from chv_guest.browser import server
from chv_guest.wire import wire

LIMITS = {"MemoryMax": "chv_browser_memory_max", "MemorySwapMax": "chv_browser_memory_swap_max",
          "TasksMax": "chv_browser_tasks_max", "CPUQuota": "chv_browser_cpu_quota"}


def _yaml(*parts):
    with open(os.path.join(ROOT, "roles", "browser", *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def render_unit(**over):
    variables = dict(_yaml("defaults", "main.yml"), chv_browser_nat_unit="chv-cell-nat.service",
                     __browser_restart_marker="/run/chv-fleet/chv-browser.restart", ansible_managed="managed")
    variables.update(over)
    with open(os.path.join(ROOT, "roles", "browser", "templates", "chv-browser.service.j2"), encoding="utf-8") as fh:
        env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
        env.filters["basename"] = os.path.basename
        return env.from_string(fh.read()).render(**variables)


def service_settings(unit):
    """[(key, value)] of the unit's [Service] section, in order."""
    out, section = [], None
    for line in unit.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.append((key, value))
    return out


def test_the_unit_limits_chromium_with_the_documented_defaults():
    defaults = _yaml("defaults", "main.yml")
    specs = _yaml("meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    settings = service_settings(render_unit())
    limits = {k: v for k, v in settings if k in LIMITS}
    assert limits == {"MemoryMax": "2G", "MemorySwapMax": "0", "TasksMax": "1024", "CPUQuota": "100%"}
    assert [k for k, dummy in settings].count("MemoryMax") == 1
    for key, var in LIMITS.items():  # the role's default, its argument spec and the unit agree
        assert str(defaults[var]) == str(specs[var]["default"]) == limits[key], var
        assert specs[var]["type"] == "str" and specs[var]["description"]


def test_an_override_reaches_the_unit_and_an_empty_value_leaves_the_limit_out():
    settings = dict(service_settings(render_unit(chv_browser_memory_max="1536M", chv_browser_tasks_max="256",
                                                 chv_browser_cpu_quota="", chv_browser_memory_swap_max="")))
    assert (settings["MemoryMax"], settings["TasksMax"]) == ("1536M", "256")
    assert "CPUQuota" not in settings and "MemorySwapMax" not in settings
    assert settings["ExecStart"].endswith("--config /etc/chv-fleet/browser.json")  # the rest is intact


# ------------------------------------------------------------------ requests in flight per slot

class Blocking(Recorder):
    """submit blocks until released, as a slow page open does."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def submit(self, op, slot, *args, **kw):
        self.entered.release()
        self.release.wait(30)
        return super().submit(op, slot, *args)


def _call(srv, req):
    out = []
    t = threading.Thread(target=lambda: out.append(_dispatch(srv, req)), daemon=True)
    t.start()
    return t, out


def _dispatch(srv, req):
    try:
        return srv.dispatch(req)
    except wire.Busy as exc:
        return exc


def test_a_slot_over_its_requests_in_flight_is_refused_and_another_is_not():
    engine = Blocking()
    srv = server.Server(dict(server.DEFAULTS), engine)
    assert srv.requests.limit == server.DEFAULTS["max_requests_per_slot"] == 2
    running = [_call(srv, {"slot": "slot0", "action": "open", "url": "https://example.org/"}) for dummy in range(2)]
    for dummy in running:
        assert engine.entered.acquire(timeout=30)
    refused = _dispatch(srv, {"slot": "slot0", "action": "snapshot"})
    assert isinstance(refused, wire.Busy) and (refused.quota, refused.slot) == ("max_requests_per_slot", "slot0")
    assert str(refused).startswith("busy: slot slot0 is at its quota of 2 requests in flight (max_requests_per_slot)")
    other = _call(srv, {"slot": "slot1", "action": "snapshot"})  # control: slot1 is admitted
    assert engine.entered.acquire(timeout=30)
    close = _call(srv, {"slot": "slot0", "action": "close"})  # a teardown is never refused for capacity
    assert engine.entered.acquire(timeout=30)
    engine.release.set()
    for t, out in running + [other, close]:
        t.join(30)
        assert out == ["submitted"]
    assert srv.requests.total() == 0
    assert _dispatch(srv, {"slot": "slot0", "action": "snapshot"}) == "submitted"  # slot0 again


@pytest.mark.parametrize("slots,expected", [(0, 8), (2, 8), (3, 8), (4, 10), (16, 34)])
def test_the_global_cap_fits_every_slot_at_its_quota(slots, expected):
    assert server.Server(dict(server.DEFAULTS, slots=slots), Recorder()).max_connections == expected


def test_a_quota_below_one_is_refused():
    with pytest.raises(ValueError, match="max_requests_per_slot must be an integer of at least 1, not 0"):
        server.Server(dict(server.DEFAULTS, max_requests_per_slot=0), Recorder())


def test_the_service_refuses_to_start_with_a_quota_below_one():
    assert server.config_problem(dict(server.DEFAULTS)) is None  # control
    assert server.config_problem(dict(server.DEFAULTS, max_requests_per_slot=0)) == \
        "chv_browser_max_requests_per_slot must be at least 1, not 0"
