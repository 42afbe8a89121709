"""chv-browser's dispatch on the shared table of browser actions (no Playwright needed).

The Engine is real but never started: its ``submit`` is replaced by a
recorder, so these tests see which handler a request reaches and with
which checked arguments. Refusal messages are compared to the letter.
"""
import os

import pytest

from browser_helpers import Recorder
from testpaths import ROOT, SRC
from chv_guest.browser import policy, server
from chv_guest.wire import protocol


@pytest.fixture
def srv():
    engine = Recorder()
    yield server.Server(server.DEFAULTS, engine)
    engine.loop.close()


def refusal(s, req):
    with pytest.raises(policy.Refused) as exc:
        s.dispatch(req)
    return str(exc.value)


def test_every_action_has_its_handler_and_every_field_its_check(srv):
    assert set(srv.actions) == set(protocol.BROWSER_ACTIONS) == {"open", "snapshot", "screenshot", "close"}
    for action, handler in srv.actions.items():
        assert handler == getattr(srv.engine, "op_" + action)
    fields = {f for fs in protocol.BROWSER_ACTIONS.values() for f in fs}
    assert fields == set(policy.FIELD_CHECKS) == {"url", "name"}


def test_an_engine_without_a_handler_stops_the_start():
    class Partial:
        async def op_open(self, slot, url):
            pass

    with pytest.raises(TypeError, match="Partial has no op_ method for snapshot, screenshot, close"):
        server.Server(server.DEFAULTS, Partial())


@pytest.mark.parametrize("req, call", [
    ({"action": "open", "url": " https://example.org/a "}, ("open", "slot3", "https://example.org/a")),
    ({"action": "snapshot", "url": "ignored"}, ("snapshot", "slot3")),
    ({"action": "screenshot", "name": "front.v2"}, ("screenshot", "slot3", "front.v2")),
    ({"action": "close"}, ("close", "slot3")),
])
def test_each_action_reaches_its_handler_with_checked_fields(srv, req, call):
    assert srv.dispatch(dict(req, slot="slot3")) == "submitted"
    (op, *rest), = srv.engine.calls
    assert op == getattr(srv.engine, "op_" + call[0]) and tuple(rest) == call[1:]


@pytest.mark.parametrize("action", ["evaluate", "content", "cdp", "goto", "pdf", "", "Open", "op_open",
                                    None, 1, ["open"], {"open": 1}])
def test_unknown_actions_are_refused(srv, action):
    req = {"slot": "slot0", "url": "http://x/"}
    if action is not None:
        req["action"] = action
    assert refusal(srv, req) == "action must be one of open, snapshot, screenshot, close"
    assert srv.engine.calls == []


@pytest.mark.parametrize("req, message", [
    ({"slot": "../x", "action": "open", "url": "http://x/"}, "invalid slot"),
    ({"action": "evaluate"}, "invalid slot"),  # the slot is checked first
    ({"slot": "s", "action": "open"}, "url must be a non-empty string of at most 8192 characters"),
    ({"slot": "s", "action": "open", "url": "file:///etc/passwd"}, "only http and https URLs with a host may be opened"),
    ({"slot": "s", "action": "open", "url": "http:///x"}, "only http and https URLs with a host may be opened"),
    ({"slot": "s", "action": "screenshot", "name": "../x"},
     "screenshot name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63} without '..'"),
    ({"slot": "s", "action": "screenshot"}, "screenshot name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63} without '..'"),
])
def test_bad_requests_are_refused_before_the_engine(srv, req, message):
    assert refusal(srv, req) == message
    assert srv.engine.calls == []


def test_shared_modules_are_the_brokers():
    """Both services use the framing and the tables from one source, chv_guest.wire:
    no copy of them beside either service, and both import that one."""
    from chv_guest.broker import server as broker_server  # pylint: disable=import-outside-toplevel
    from chv_guest.wire import wire  # pylint: disable=import-outside-toplevel

    for service in ("broker", "browser"):
        for name in ("wire.py", "protocol.py"):
            assert not os.path.lexists(os.path.join(SRC, "chv_guest", service, name))
    assert server.wire is broker_server.wire is wire
    assert server.BROWSER_ACTIONS is broker_server.BROWSER_ACTIONS is protocol.BROWSER_ACTIONS


def test_a_playwright_other_than_the_configured_one_stops_the_start(tmp_path, capsys):
    """The role writes the version it installed into browser.json: a venv it has not
    finished upgrading (or downgraded by hand) must not serve; unpinned, no check."""
    import importlib.metadata
    assert server.playwright_mismatch("", installed=lambda: "0.0") is None
    assert server.playwright_mismatch("1.65.2", installed=lambda: "1.65.2") is None  # the control
    assert server.playwright_mismatch("1.65.2", installed=lambda: "1.60.0") == \
        "Playwright 1.60.0 is installed, the configuration expects 1.65.2"

    def missing():
        raise importlib.metadata.PackageNotFoundError("playwright")
    assert server.playwright_mismatch("1.65.2", installed=missing) == \
        "Playwright (none) is installed, the configuration expects 1.65.2"
    # main() refuses before it binds or starts anything (this venv has no Playwright 0.0.1)
    config = tmp_path / "browser.json"
    config.write_text('{"playwright_version": "0.0.1", "socket": "%s"}' % (tmp_path / "never.sock"))
    assert server.main(["--config", str(config)]) == 1
    assert '"verdict": "refused-start"' in capsys.readouterr().err
    assert not (tmp_path / "never.sock").exists()
