"""chv.fleet.door_config, door_config_errors and door_default: the door services' own
configuration validators and defaults (chv_guest.broker.config, chv_guest.browser.config)
on the controller (docs/services.md, "Configuration"). Each refusal beside its control."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter import door_config

from chv_guest.broker import config as broker_config, server as broker_server
from chv_guest.browser import config as browser_config


def test_filters_are_registered():
    assert set(door_config.FilterModule().filters()) == {"door_config", "door_config_errors", "door_default"}


@pytest.mark.parametrize("service", ["broker", "browser"])
def test_the_defaults_pass(service):
    assert door_config.door_config_errors({}, service) == []


@pytest.mark.parametrize("service,config,role_vars,message", [
    ("broker", {"max_request_bytes": 10}, {}, "chv_broker_max_request_bytes must be at least 1024, not 10"),
    ("broker", {"max_connections_per_slot": True}, {},
     "chv_broker_max_connections_per_slot must be an integer of at least 1, not true"),
    ("broker", {"read_timeout": 0.0}, {}, "chv_broker_read_timeout must be a number above 0, not 0.0"),
    ("broker", {"sync": {"user": "root"}}, {}, 'chv_broker_sync_user must be a user other than root, not "root"'),
    ("broker", {"sync": {"isolation": "chroot"}}, {},
     'chv_broker_sync_isolation must be one of unit, child, not "chroot"'),
    ("broker", {"sync": {"protocols": ["https", "file"]}}, {},
     'chv_broker_sync_protocols must be a list of strings among https, http, ssh, git, not ["https", "file"]'),
    ("broker", {"browser": {"socket": "run/b.sock"}}, {},
     'chv_broker_browser_socket must be an absolute path, not "run/b.sock"'),
    ("broker", {"sync": {"mounts": ["BindPaths=/etc"]}}, {},
     "chv_broker_sync_mounts (with _default) is refused: BindPaths= is chv-broker's own (the slot's workspace)"),
    ("broker", {}, {"chv_broker_install_dir": "usr/lib"},
     'chv_broker_install_dir must be an absolute path, not "usr/lib"'),
    ("browser", {"shots_keep": 0}, {}, "chv_browser_shots_keep must be at least 1, not 0"),
    ("browser", {"viewport": {"width": 0, "height": 800}}, {},
     'chv_browser_viewport must be a width and a height above 0, not {"height": 800, "width": 0}'),
    ("browser", {"chromium_args": ["--headless", "--remote-debugging-port=9222"]}, {},
     'chv_browser_chromium_args(_default, _group, _host) (has ["--remote-debugging-port=9222"]) must not hold '
     '--remote-debugging* or --no-sandbox (use chv_browser_chromium_sandbox)'),
    ("browser", {"request_timeout": 10.0}, {},
     "chv_browser_request_timeout must be at least chv_browser_navigation_timeout (30.0), not 10.0"),
    ("browser", {}, {"chv_browser_user": "root"}, 'chv_browser_user must be a user other than root, not "root"'),
])
def test_a_bad_value_is_named_by_its_variable(service, config, role_vars, message):
    assert door_config.door_config_errors(config, service, role_vars) == [message]
    if config:  # door_config renders the configuration alone
        with pytest.raises(AnsibleFilterError, match="chv-%s would refuse its configuration" % service):
            door_config.door_config(config, service)
    # the service refuses the same at start, in the same words (but a request deadline below the
    # navigation timeout, which it runs with: the deadline cuts first)
    module = {"broker": broker_config, "browser": browser_config}[service]
    assert module.validate(broker_config.merge(module.DEFAULTS, config), role_vars) == [message]
    at_start = browser_config.validate(broker_config.merge(module.DEFAULTS, config), role_vars, at_start=True) \
        if service == "browser" else [message]
    assert at_start == ([] if "request_timeout must be" in message else [message])


def test_every_problem_is_named_at_once():
    errors = door_config.door_config_errors({"max_request_bytes": 10, "sync": {"hosts": ["h:0"]}}, "broker")
    assert [e.split(" ")[0] for e in errors] == ["chv_broker_max_request_bytes", "chv_broker_sync_hosts"]
    with pytest.raises(ValueError, match="chv_broker_max_request_bytes.*; chv_broker_sync_hosts"):
        broker_server.Broker(broker_config.merge(broker_config.DEFAULTS, {"max_request_bytes": 10,
                                                                          "sync": {"hosts": ["h:0"]}}))


def test_the_config_renders_as_given():
    config = {"max_request_bytes": 2048, "sync": {"hosts": ["git.example.org:443"]}}
    assert door_config.door_config(config, "broker") == config


@pytest.mark.parametrize("call", [
    lambda: door_config.door_config_errors({}, "cells"),
    lambda: door_config.door_config_errors([], "broker"),
    lambda: door_config.door_default("chv_broker_max_request_bytes", "cells"),
])
def test_wrong_use_is_refused(call):
    with pytest.raises(AnsibleFilterError):
        call()


def test_a_default_is_a_copy():
    mounts = door_config.door_default("chv_broker_sync_mounts_default", "broker")
    mounts.append("PrivateTmp=no")
    assert door_config.door_default("chv_broker_sync_mounts_default", "broker") == \
        list(broker_config.SYNC_MOUNTS_DEFAULT)


def test_the_timeouts_pair_is_checked_beside_other_problems():
    errors = door_config.door_config_errors({"request_timeout": 10.0, "shots_keep": 0}, "browser")
    assert [e.split(" ")[0] for e in errors] == ["chv_browser_shots_keep", "chv_browser_request_timeout"]
    assert door_config.door_config_errors({"request_timeout": 30.0}, "browser") == []  # control: equal is fine
