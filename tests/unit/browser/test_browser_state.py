"""A slot's browser state lasts one run; a slot's pages are capped (no chromium needed).

The Engine below is real and started (its asyncio loop thread runs), with
Playwright's context and pages replaced by small fakes that record what
was closed: the lifecycle code under test (end, the cell binding, the
epoch of queued requests, the popup cap) is chv-browser's own.
"""
import asyncio
import os
import socket
import struct

import pytest

from browser_helpers import Recorder
from chv_guest.browser import policy, server

IDENTITY_MAP = "         0          0 4294967295\n"


# ---------------------------------------------------------------- pure checks
def test_only_root_of_the_initial_user_namespace_may_end_a_slot():
    assert policy.admin_peer_problem(0, IDENTITY_MAP) is None
    assert "peer uid 3000000" in policy.admin_peer_problem(3000000, IDENTITY_MAP)
    assert "peer uid 65534" in policy.admin_peer_problem(65534, IDENTITY_MAP)
    # chv-browser in a user namespace of its own: a uid 0 there could be anybody's
    assert "initial user namespace" in policy.admin_peer_problem(0, "0 100000 65536\n")


def test_end_is_no_cell_action_so_the_broker_never_forwards_it():
    from chv_guest.wire import protocol

    assert set(policy.ADMIN_ACTIONS).isdisjoint(protocol.BROWSER_ACTIONS)
    assert not any(op.get("actions") and set(policy.ADMIN_ACTIONS) & set(op["actions"]) for op in protocol.OPS.values())


def test_cell_identity_and_pages_per_slot_checks():
    assert policy.check_cell(None) is None
    assert policy.check_cell("4242.4026532301") == "4242.4026532301"
    for bad in ("", "../x", "a b", 7, "x" * 129):
        with pytest.raises(policy.Refused):
            policy.check_cell(bad)
    # proxy mode: the egress proxy chv-broker forwards from the cell record, and only that form
    assert policy.check_proxy(None) is None
    assert policy.check_proxy("http://10.200.0.1:3128") == "http://10.200.0.1:3128"
    assert server.cell_of({"cell": "7", "proxy": "http://10.200.0.1:3128"}) == {
        "cell": "7", "proxy": "http://10.200.0.1:3128"}
    for bad in ("", "socks5://10.0.0.1:1", "http://proxy.example:3128", "http://10.0.0.1:3128/x", 3128):
        with pytest.raises(policy.Refused):
            policy.check_proxy(bad)
    assert server.config_problem(dict(server.DEFAULTS, pages_per_slot=1)) is None
    for bad in (0, -1, True, "4", 2.5):
        assert server.config_problem(dict(server.DEFAULTS, pages_per_slot=bad)).startswith(
            "chv_browser_pages_per_slot must be ")
    assert server.config_problem(dict(server.DEFAULTS)) is None


def test_admit_page():
    assert policy.admit_page(1, 4, True) and policy.admit_page(3, 4, True)
    assert not policy.admit_page(4, 4, True)
    assert not policy.admit_page(1, 4, False)  # no request of the slot runs: never needed


# ---------------------------------------------------------------- the peer check of end
class EndRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.ended = []
        self.kwargs = []

    def end(self, slot):
        self.ended.append(slot)
        return {"context_closed": True, "shots_removed": 0}

    def submit(self, op, slot, *args, **kwargs):
        self.kwargs.append(kwargs)
        return super().submit(op, slot, *args)


class Conn:
    """What getsockopt(SO_PEERCRED) reports for a peer of ``uid``."""

    def __init__(self, uid):
        self.uid = uid

    def getsockopt(self, level, name, size):
        assert (level, name, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return struct.pack("3i", 1234, self.uid, self.uid)


@pytest.fixture
def srv(tmp_path):
    engine = EndRecorder()
    s = server.Server(server.DEFAULTS, engine)
    uid_map = tmp_path / "uid_map"
    uid_map.write_text(IDENTITY_MAP)
    s.uid_map = str(uid_map)
    yield s
    engine.loop.close()


def end(s, conn):
    orig = server.Server.check_admin_peer
    try:
        server.Server.check_admin_peer = staticmethod(lambda c: orig(c, s.uid_map))
        return s.dispatch({"action": "end", "slot": "slot0"}, conn)
    finally:
        server.Server.check_admin_peer = staticmethod(orig)


def test_end_from_root_reaches_the_engine_and_from_a_cell_uid_never(srv):
    assert end(srv, Conn(0)) == {"context_closed": True, "shots_removed": 0}  # control
    assert srv.engine.ended == ["slot0"]
    for uid in (3000000, 65534):
        with pytest.raises(policy.Refused, match="only root outside every cell"):
            end(srv, Conn(uid))
    with pytest.raises(policy.Refused, match="peer can be checked"):
        end(srv, None)
    assert srv.engine.ended == ["slot0"]


def test_end_over_a_real_socket_uses_the_kernels_peer_credentials(srv):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        if os.geteuid() == 0:
            assert end(srv, b)["context_closed"] is True
        else:
            with pytest.raises(policy.Refused, match="peer uid %d" % os.geteuid()):
                end(srv, b)


def test_the_cell_identity_a_request_names_reaches_the_engine(srv):
    srv.dispatch({"action": "snapshot", "slot": "slot0", "cell": "42.4026531836"})
    srv.dispatch({"action": "snapshot", "slot": "slot0"})
    assert srv.engine.kwargs == [{"cell": "42.4026531836"}, {}]
    with pytest.raises(policy.Refused, match="cell must match"):
        srv.dispatch({"action": "snapshot", "slot": "slot0", "cell": "no spaces"})


# ---------------------------------------------------------------- the engine's lifecycle
class FakePage:
    def __init__(self, ctx, url="about:blank"):
        self.ctx = ctx
        self.url = url
        self.closed = False
        self._on_close = []

    def on(self, event, cb):
        assert event == "close"
        self._on_close.append(cb)

    async def close(self):
        if not self.closed:
            self.closed = True
            for cb in self._on_close:
                cb(self)


class FakeContext:
    made = []

    def __init__(self):
        self.closed = False
        self.handlers = []
        self.pages = []
        FakeContext.made.append(self)

    def on(self, event, cb):
        assert event == "page"
        self.handlers.append(cb)

    def set_default_navigation_timeout(self, ms):
        pass

    set_default_timeout = set_default_navigation_timeout

    async def new_page(self):
        page = FakePage(self)
        self.pages.append(page)
        return page

    def popup(self):
        """The slot's page opened another page: chromium reports it to the context's handlers."""
        page = FakePage(self)
        self.pages.append(page)
        for cb in self.handlers:
            cb(page)
        return page

    async def close(self):
        self.closed = True
        for page in self.pages:
            await page.close()


class FakeBrowser:
    def is_connected(self):
        return True

    async def new_context(self, **kwargs):
        return FakeContext()


@pytest.fixture
def engine(tmp_path):
    FakeContext.made = []
    e = server.Engine(dict(server.DEFAULTS, shots_dir=str(tmp_path / "shots"), pages_per_slot=4))
    e._browser = FakeBrowser()
    e.start()
    yield e
    e.stop()


def on_loop(engine, coro):
    return asyncio.run_coroutine_threadsafe(coro, engine.loop).result(10)


def test_end_closes_the_slots_context_and_screenshots_and_nothing_of_another_slot(engine, tmp_path):
    async def open_page(slot):
        return await engine._page(slot, create=True)

    a = engine.submit(open_page, "slot0")
    b = engine.submit(open_page, "slot1")
    shots = tmp_path / "shots"
    for slot in ("slot0", "slot1"):
        (shots / slot).mkdir(parents=True)
        (shots / slot / "one.png").write_bytes(b"png")
    assert engine.end("slot0") == {"context_closed": True, "shots_removed": 1}
    assert a.ctx.closed and a.closed and not b.ctx.closed  # control: the other slot keeps its page
    assert not (shots / "slot0" / "one.png").exists() and (shots / "slot1" / "one.png").exists()
    with pytest.raises(policy.Refused, match="no page open"):
        engine.submit(lambda slot: engine._page(slot, create=False), "slot0")
    assert engine.submit(lambda slot: engine._page(slot, create=False), "slot1") is b
    assert engine.end("slot0") == {"context_closed": False, "shots_removed": 0}


def test_a_context_made_for_another_cell_incarnation_is_never_served(engine):
    async def page(slot):
        return await engine._page(slot, create=True)

    first = engine.submit(page, "slot0", cell="100.1")
    assert engine.submit(page, "slot0", cell="100.1") is first  # control: the same run keeps its page
    second = engine.submit(page, "slot0", cell="200.2")  # the launcher's end was lost
    assert second is not first and first.ctx.closed and not second.ctx.closed
    assert engine.contexts["slot0"]["cell"] == "200.2"


def test_a_request_queued_behind_the_ended_run_is_refused(engine):
    gate = asyncio.Event()

    async def slow(slot):
        await engine._page(slot, create=True)
        await gate.wait()
        return "slow done"

    async def quick(slot):
        return await engine._page(slot, create=True)

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(engine.submit, slow, "slot0")
        while "slot0" not in engine.contexts:
            pass
        queued = pool.submit(engine.submit, quick, "slot0")
        while not engine._locks["slot0"]._waiters:
            pass
        assert engine.end("slot0")["context_closed"] is True  # not held up by the running request
        engine.loop.call_soon_threadsafe(gate.set)
        assert running.result(10) == "slow done"
        with pytest.raises(policy.Refused, match="has ended"):
            queued.result(10)
    assert "slot0" not in engine.contexts
    # control: the next run's request gets a fresh page
    fresh = engine.submit(quick, "slot0")
    assert not fresh.closed and len(FakeContext.made) == 2


def test_popups_beyond_the_cap_are_closed_at_once_and_all_when_the_request_ends(engine):
    seen = {}

    async def open_with_popups(slot):
        main = await engine._page(slot, create=True)
        popups = [main.ctx.popup() for _ in range(50)]
        await asyncio.sleep(0)  # the background closes run
        for _ in range(20):
            await asyncio.sleep(0)
        seen["open during the request"] = [p for p in popups if not p.closed]
        seen["pages"] = len(engine.contexts[slot]["pages"])
        return main

    main = engine.submit(open_with_popups, "slot0")
    assert len(seen["open during the request"]) == 3  # the cap is 4 pages, the slot's own included
    assert seen["pages"] == 4
    assert not main.closed  # the slot's own page stays
    assert all(p.closed for p in main.ctx.pages if p is not main)
    assert engine.contexts["slot0"]["pages"] == {main} and engine.contexts["slot0"]["popups_closed"] == 0
    # a popup opened while no request of the slot runs (a timer in the page) is closed at once
    late = on_loop(engine, _popup(main.ctx))
    on_loop(engine, asyncio.sleep(0.05))
    assert late.closed and engine.contexts["slot0"]["pages"] == {main}
    assert engine.submit(lambda slot: engine._page(slot, create=False), "slot0") is main  # next request works


async def _popup(ctx):
    return ctx.popup()
