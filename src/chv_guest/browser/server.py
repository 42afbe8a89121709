"""chv-browser daemon.

Listens on a Unix socket that only chv-broker's group can reach; every
request names the slot it is for (the broker fills it in after its peer
check; chv-browser trusts it because nobody else can connect).  Each
connection is handled on a thread of its own (wire.serve_connections, at
most max_connections at once).

Door capacity: a slot has at most max_requests_per_slot requests in flight
here (read, queued behind its own earlier ones, or running; wire.SlotQuota
keyed by the request's slot). One more is answered at once with a "busy"
error naming the quota and that slot, and logged (verdict "busy"), so a
slot with slow pages fills its own quota, never another slot's room.
Every connection here carries one request, so this is also the slot's
connection count; a connection whose request has not arrived yet counts
against the global cap only, and ends after read_timeout. The global cap
is at least (slots + 1) * max_requests_per_slot (wire.global_cap).
A close (the context's teardown) is never refused for capacity.

Concurrency: one chromium, driven through Playwright's async API from one
asyncio event loop that runs on a thread of its own ("playwright").  Every
slot has its own browser context with one page, and its own asyncio.Lock:
a slot's requests run one at a time, in the order they reach the loop,
while other slots' requests run alongside them on the same loop, so a page
that never finishes loading for one slot holds up no other slot.  A
connection thread hands its request to the loop with
asyncio.run_coroutine_threadsafe and waits for the answer.

Deadline: every request is answered within request_timeout seconds of
reaching the engine, the wait behind the same slot's earlier requests
included (asyncio.wait_for).  Past it the client gets an error naming
request_timeout.  If the request had already started, the slot's context
(and page) is dropped at once and closed in the background (which also
stops whatever it was still loading), so the slot's next request starts on
a fresh page instead of queueing behind a stuck one.  A context or a
chromium launch that is still being created when its request runs out of
time is finished anyway and then closed (the context) or kept for the next
request (chromium), never left behind unowned.

Contexts unused for idle_timeout seconds are closed by a task on the loop
(checked every min(10, max(0.5, idle_timeout / 4)) seconds; a slot with a
request running or queued is never reaped).  A chromium that went away is
launched again by the next request that needs a page.  On SIGTERM/SIGINT
the listener stops accepting, every context, chromium and the Playwright
driver are closed (a request still running ends with an error), and the
process waits up to 10 s for those errors to reach their clients before it
exits.

A run's end (policy.ADMIN_ACTIONS "end", from chv-cell's launcher after a
cell stopped and before its slot can be claimed again, chv_cell/doors.py):
accepted only from uid 0 of the guest's own user namespace
(Server.check_admin_peer); the slot's context is closed at once, without
waiting for the slot's lock (a request still running fails), its
screenshots are removed, and the slot's epoch moves on, so a request of
the ended run still queued is refused.  A request may name the cell
incarnation it is for ("cell"): a context made for another one is closed
before the request runs (verdict "stale-context").  Pages per slot: a page
a slot's page opens is kept only while a request of the slot runs and the
context has fewer than pages_per_slot pages (policy.admit_page), else
closed at once; every page but the slot's own is closed when the request
ends (log action "close-popups").

Operations (protocol.BROWSER_ACTIONS, shared with chv-broker): open(url),
snapshot, screenshot(name), close; each is carried out by Engine.op_<action>.  Nothing else:
no evaluate, no page content or DOM, no downloads, no DevTools endpoint
(Playwright talks to chromium over a pipe, never a port).

Screenshots: each slot keeps at most shots_keep screenshots and
shots_max_bytes bytes in <shots_dir>/<slot> (policy.shots_to_prune).
Before a screenshot is written, the slot's oldest ones (by mtime) are
removed to leave room for it: at most shots_keep - 1 others and
shots_max_bytes minus its size, so with it the slot is within both limits
(one larger than shots_max_bytes alone is kept, alone).  A screenshot that
replaces one of the same name takes its place.  Only files chv-browser
may have written there count (regular <name>.png files it owns).  A write that fails (no space left on the device, a disk quota, any
OSError) leaves no temporary file behind and is answered with an error
naming the screenshot's path (ShotNotSaved); the service goes on serving.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import errno
import grp
import importlib.metadata
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Dict, List, Optional, Sequence, Set, Tuple,
                    Type, TypedDict, TypeVar, cast)

from ..wire import wire
from .config import DEFAULTS, load_config, validate
from .policy import (ADMIN_ACTIONS, FIELD_CHECKS, Refused, admin_peer_problem, admit_page, check_cell,
                     check_proxy, check_slot, is_shot_file, shots_to_prune, truncate, url_allowed)
from ..wire.protocol import BROWSER_ACTIONS, audit, handlers, known

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Page, Playwright

_T = TypeVar("_T")

LOG_EVENT = "chv-browser"


def config_problem(cfg: wire.JSONObject) -> Optional[str]:
    """What is wrong with the configuration (config.validate, each problem naming the role variable), or None."""
    return "; ".join(validate(cfg, at_start=True)) or None


def playwright_mismatch(expected: str,
                        installed: Callable[[], str] = lambda: importlib.metadata.version("playwright")
                        ) -> Optional[str]:
    """Why the venv's Playwright is not the version the role installed
    (the configuration's playwright_version; empty: not pinned, no check),
    or None. A venv the role has not finished upgrading must not serve."""
    if not expected:
        return None
    have: Optional[str]
    try:
        have = installed()
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have == expected:
        return None
    return "Playwright %s is installed, the configuration expects %s" % (have or "(none)", expected)


def _log(**fields: object) -> None:
    audit(sys.stderr, LOG_EVENT, **fields)


class DeadlineExceeded(Exception):
    """A request was not answered within request_timeout; the message goes back to the cell."""


class ShotNotSaved(Exception):
    """Writing a screenshot failed (e.g. no space left); the message goes back to the cell."""


def shot_error(exc: OSError, cell_path: str, host_dir: str) -> str:
    """The reply's message for an OSError that kept a screenshot from being written."""
    if exc.errno == errno.ENOSPC:
        why = "no space left on device"
    elif exc.errno == errno.EDQUOT:
        why = "no space left: disk quota exceeded"
    else:
        why = exc.strerror or type(exc).__name__
    return "screenshot %s not saved: %s (host directory %s)" % (cell_path, why, host_dir)


def list_shots(directory: str) -> List[Tuple[str, int, float]]:
    """(name, size, mtime) of the screenshots chv-browser wrote in ``directory``: the regular
    files it owns whose names it gives screenshots (policy.is_shot_file)."""
    shots: List[Tuple[str, int, float]] = []
    uid = os.geteuid()
    with os.scandir(directory) as entries:
        for entry in entries:
            if not is_shot_file(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                shots.append((entry.name, st.st_size, st.st_mtime))
    return shots


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# requests never refused for capacity: a slot's teardown must always get through
UNCOUNTED_ACTIONS = ("close",)
# Playwright's words when a goto lost to a navigation the page had already begun
NAVIGATION_INTERRUPTED = "is interrupted by another navigation"
# gotos an open makes at most when each lost to a navigation already under way
OPEN_ATTEMPTS = 3
# seconds a context.close() may take before it is given up on (logged); chromium is not waited for forever
CLOSE_TIMEOUT = 10.0
# how much longer than request_timeout a connection thread waits for the loop before giving up on it:
# the loop answers at the deadline itself, this only matters if the loop thread is stuck
LOOP_GRACE = 30.0


class SlotEntry(TypedDict):
    """A slot's browser context (Engine.contexts)."""
    context: BrowserContext
    page: Page  # the slot's own page: the one every operation acts on
    used: float  # time.monotonic() of its last request
    cell: Optional[str]  # the cell incarnation it was made for
    proxy: Optional[str]  # the egress proxy it goes through (proxy mode), as that incarnation's requests name it
    pages: Set[Page]  # its pages open, its own included
    popups_closed: int  # pages it opened that were closed at once, since its last request ended


class Turn(TypedDict):
    """The request that holds a slot's lock: the cell incarnation it names, the slot's epoch it came in."""
    cell: Optional[str]
    epoch: int
    proxy: Optional[str]


class Engine:
    """Owns Playwright, the chromium process and one browser context per slot.

    Why one asyncio loop rather than a worker thread per slot: Playwright's
    sync API binds every object to the thread that created it, so per-slot
    threads would each need their own Playwright driver (a node process)
    and their own chromium, multiplying memory per cell; and a sync call
    cannot be abandoned, so a request past its deadline would keep its
    thread (and so its slot) blocked until Playwright's own timeout fired.
    On one loop all slots share one driver and one chromium, and a request
    past its deadline is cancelled where it waits (asyncio.wait_for), after
    which closing the slot's context stops the page in chromium.

    Public methods (start, submit, stop) are called from other threads;
    everything else runs on the loop thread only, so the slot tables need no
    thread locks.
    """

    def __init__(self, cfg: wire.JSONObject) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="playwright", daemon=True)
        # loop thread only from here on
        self._pw: Optional[Playwright] = None
        self._browser: Optional[Browser] = None
        self._launching: Optional[asyncio.Task[Browser]] = None  # the Task launching chromium, shared by every request waiting for it
        self.contexts: Dict[str, SlotEntry] = {}  # slot -> SlotEntry
        # slot -> how many times a run of the slot was ended (end()): a request that arrived before
        # the last end belongs to an ended run and is refused
        self._epochs: Dict[str, int] = {}
        # slot -> {"cell", "epoch"} of the request that holds the slot's lock
        self._turns: Dict[str, Turn] = {}
        # slot -> asyncio.Lock, kept for every slot name seen (the host's cells, so few and small)
        self._locks: Dict[str, asyncio.Lock] = {}
        self._chores: Set[asyncio.Task[None]] = set()  # background tasks (context closes), referenced until they finish
        self._reaper: Optional[asyncio.Task[None]] = None

    # ------------------------------------------------------------ other threads
    def start(self) -> None:
        self.thread.start()

    def submit(self, op: Callable[..., Awaitable[_T]], slot: str, *args: str, cell: Optional[str] = None,
               proxy: Optional[str] = None) -> _T:
        """Run ``op(slot, *args)`` on the loop, in turn with ``slot``'s other requests; return its result.

        ``cell`` is the identity of the cell incarnation the request is for (policy.check_cell;
        None: not given): a context of the slot made for another one is closed, never served.
        ``proxy`` (policy.check_proxy; proxy mode) is the egress proxy the slot's context uses:
        a context made with another one is closed, never served.
        Raises DeadlineExceeded when no answer came within request_timeout.
        """
        timeout = float(self.cfg["request_timeout"])
        deadline = time.monotonic() + timeout
        fut = asyncio.run_coroutine_threadsafe(self._request(op, slot, args, deadline, cell, proxy), self.loop)
        try:
            return fut.result(timeout=timeout + LOOP_GRACE)
        except concurrent.futures.CancelledError:
            raise RuntimeError("chv-browser is shutting down") from None
        except concurrent.futures.TimeoutError:
            if fut.done():  # the operation's own exception, not our wait
                raise
            fut.cancel()
            raise DeadlineExceeded(self._deadline_message("the browser engine did not answer")) from None

    def end(self, slot: str) -> Dict[str, object]:
        """The run of ``slot``'s cell has ended (chv-cell's launcher says so, before the slot can be
        claimed again): close the slot's context (its pages, cookies, storage and cache) and remove
        its screenshots, at once, without waiting behind the slot's requests (one still running
        fails, one still queued is refused). Returns what was removed."""
        fut = asyncio.run_coroutine_threadsafe(self._end(slot), self.loop)
        try:
            return fut.result(timeout=CLOSE_TIMEOUT + LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceeded("the browser engine did not end slot %s in time" % slot) from None

    def stop(self) -> None:
        """Close every context, chromium and the driver, then end the loop thread (at most ~40 s)."""
        if not self.thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        try:
            fut.result(timeout=30)
        except Exception:  # shutting down anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    # ------------------------------------------------------------ loop thread
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._reaper = self.loop.create_task(self._reap_idle_forever())
        try:
            self.loop.run_forever()
        finally:
            # requests still in flight at shutdown: cancel them so the loop closes cleanly
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=5))
            self.loop.close()

    def _deadline_message(self, detail: str) -> str:
        return "deadline passed: no answer within request_timeout (%gs); %s" % (
            float(self.cfg["request_timeout"]), detail)

    async def _request(self, op: Callable[..., Awaitable[_T]], slot: str, args: Sequence[str], deadline: float,
                       cell: Optional[str] = None, proxy: Optional[str] = None) -> _T:
        lock = self._locks.setdefault(slot, asyncio.Lock())
        epoch = self._epochs.get(slot, 0)
        try:
            await asyncio.wait_for(lock.acquire(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(self._deadline_message(
                "this slot's previous request was still running")) from None
        try:
            if self._epochs.get(slot, 0) != epoch:
                raise Refused("the run of this slot's cell that sent this request has ended")
            self._turns[slot] = {"cell": cell, "epoch": epoch, "proxy": proxy}
            entry = self.contexts.get(slot)
            if entry is not None and (entry.get("cell") != cell or entry.get("proxy") != proxy):
                # made for another incarnation of the slot's cell (an earlier run whose end
                # chv-browser was not told): never served to this one
                await self._close_slot(slot, "stale-context")
                _log(slot=slot, action="close", verdict="stale-context")
            # Playwright raises its own TimeoutError class (not the builtin one) and the
            # operations do nothing else that could, so a TimeoutError here is the deadline.
            return await asyncio.wait_for(op(slot, *args), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if self._drop_slot(slot):
                _log(slot=slot, action="close", verdict="deadline")
            raise DeadlineExceeded(self._deadline_message(
                "this slot's page was closed, open it again")) from None
        finally:
            try:
                await self._close_popups(slot)
            finally:
                self._turns.pop(slot, None)
                entry = self.contexts.get(slot)
                if entry is not None:
                    entry["used"] = time.monotonic()
                lock.release()

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = self.loop.create_task(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _ensure_browser(self) -> Browser:
        if self._browser is not None and self._browser.is_connected():
            return self._browser
        if self._launching is None:
            self._launching = self.loop.create_task(self._launch())
        # shielded: a request that runs out of time stops waiting, the launch goes on for the next one
        return await asyncio.shield(self._launching)

    async def _launch(self) -> Browser:
        try:
            from playwright.async_api import async_playwright
            if self._pw is None:
                self._pw = await async_playwright().start()
            self.contexts.clear()  # a chromium that went away took its contexts with it
            browser = await self._pw.chromium.launch(
                executable_path=self.cfg["executable_path"],
                args=list(self.cfg["chromium_args"]),
                chromium_sandbox=bool(self.cfg["chromium_sandbox"]),
                headless=True,
                downloads_path=None,
            )
            self._browser = browser
            _log(verdict="chromium-started", version=browser.version)
            return browser
        finally:
            self._launching = None

    async def _create_context(self, slot: str, cell: Optional[str] = None, proxy: Optional[str] = None) -> SlotEntry:
        # proxy mode: every request of the context goes through the slot's egress proxy (squid applies
        # the slot's list to it by the source address, the slot's gateway); chromium resolves nothing
        ctx = await (await self._ensure_browser()).new_context(
            accept_downloads=False, service_workers="block", viewport=self.cfg["viewport"],
            proxy={"server": proxy} if proxy else None)
        try:
            ctx.set_default_navigation_timeout(self.cfg["navigation_timeout"] * 1000)
            ctx.set_default_timeout(self.cfg["navigation_timeout"] * 1000)
            page = await ctx.new_page()
        except BaseException:
            await self._close_context(ctx, None, "new_page failed")
            raise
        entry: SlotEntry
        entry = {"context": ctx, "page": page, "used": time.monotonic(), "cell": cell, "proxy": proxy,
                 "pages": {page}, "popups_closed": 0}
        # registered once the slot's own page exists: every page after it is one the page opened
        ctx.on("page", lambda new: self._on_page(slot, entry, new))
        return entry

    def _on_page(self, slot: str, entry: SlotEntry, page: Page) -> None:
        """A page of ``slot``'s context opened another page (a popup, window.open, target=_blank):
        keep it only while a request of the slot runs and the slot is below pages_per_slot
        (policy.admit_page); else close it at once and count it against the slot."""
        lock = self._locks.get(slot)
        if self.contexts.get(slot) is entry and admit_page(
                len(entry["pages"]), int(self.cfg["pages_per_slot"]), lock is not None and lock.locked()):
            entry["pages"].add(page)
            pages = entry["pages"]

            def forget(closed: Page) -> None:  # a function: Playwright keeps attributes on its handlers
                pages.discard(closed)
            page.on("close", forget)
            return
        entry["popups_closed"] += 1
        self._background(self._close_page(page, slot))

    async def _close_page(self, page: Page, slot: str) -> None:
        try:
            await asyncio.wait_for(page.close(), CLOSE_TIMEOUT)
        except Exception as exc:  # the context or the browser may be gone already
            _log(slot=slot, action="close-page", verdict="error", reason="%s: %s" % (
                type(exc).__name__, (str(exc).splitlines() or [""])[0][:200]))

    async def _close_popups(self, slot: str) -> None:
        """The request that let the slot's pages open others ends: close every page of the slot
        but its own (operations act on that one only), and log how many were closed or refused."""
        entry = self.contexts.get(slot)
        if entry is None or "pages" not in entry:
            return
        extra = [p for p in list(entry["pages"]) if p is not entry["page"]]
        for page in extra:
            entry["pages"].discard(page)
            await self._close_page(page, slot)
        refused, entry["popups_closed"] = entry["popups_closed"], 0
        if extra or refused:
            _log(slot=slot, action="close-popups", verdict="closed", popups=len(extra) + refused,
                 over_cap=refused)

    def _close_orphan(self, task: asyncio.Task[SlotEntry]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._background(self._close_context(task.result()["context"], None, "request gone"))

    async def _page(self, slot: str, create: bool) -> Page:
        entry = self.contexts.get(slot)
        if entry is None:
            if not create:
                raise Refused("no page open for this slot; use open first")
            turn = self._turns.get(slot) or {"cell": None, "epoch": self._epochs.get(slot, 0), "proxy": None}
            # shielded: a deadline mid-creation must not leave a context in chromium that nobody owns
            task = self.loop.create_task(self._create_context(slot, turn["cell"], turn["proxy"]))
            try:
                created = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.add_done_callback(self._close_orphan)
                raise
            entry = created  # a name of its own: mypy would infer shield()'s result from entry's Optional
            if self._epochs.get(slot, 0) != turn["epoch"]:
                # the slot's run ended while its context was being made: it never serves
                await self._close_context(entry["context"], slot, "ended")
                raise Refused("the run of this slot's cell that sent this request has ended")
            self.contexts[slot] = entry
        entry["used"] = time.monotonic()
        return entry["page"]

    async def _close_context(self, ctx: BrowserContext, slot: Optional[str], why: str) -> None:
        try:
            await asyncio.wait_for(ctx.close(), CLOSE_TIMEOUT)
        except Exception as exc:  # the browser may already be gone
            _log(slot=slot, action="close", verdict="error", reason="%s (%s: %s)" % (
                why, type(exc).__name__, (str(exc).splitlines() or [""])[0][:200]))

    async def _close_slot(self, slot: str, why: str = "close") -> bool:
        entry = self.contexts.pop(slot, None)
        if entry is not None:
            await self._close_context(entry["context"], slot, why)
        return entry is not None

    async def _end(self, slot: str) -> Dict[str, object]:
        self._epochs[slot] = self._epochs.get(slot, 0) + 1
        closed = await self._close_slot(slot, "end")
        shots = 0
        d = os.path.join(self.cfg["shots_dir"], slot)
        try:
            for name, dummy_size, dummy_mtime in list_shots(d):
                _unlink_quietly(os.path.join(d, name))
                shots += 1
        except FileNotFoundError:
            pass
        return {"context_closed": closed, "shots_removed": shots}

    def _drop_slot(self, slot: str) -> bool:
        """Forget the slot's context now (its next request gets a new one) and close it in the background."""
        entry = self.contexts.pop(slot, None)
        if entry is not None:
            self._background(self._close_context(entry["context"], slot, "deadline"))
        return entry is not None

    async def _reap_idle_forever(self) -> None:
        every = min(10.0, max(0.5, self.cfg["idle_timeout"] / 4))
        while True:
            await asyncio.sleep(every)
            try:
                await self._reap_idle()
            except Exception as exc:  # keep reaping
                _log(action="close", verdict="error", reason="idle reaper: %s: %s" % (type(exc).__name__, exc))

    async def _reap_idle(self) -> None:
        idle = self.cfg["idle_timeout"]
        for slot in list(self.contexts):
            entry, lock = self.contexts.get(slot), self._locks.get(slot)
            if entry is None or time.monotonic() - entry["used"] <= idle or lock is None or lock.locked():
                continue
            async with lock:  # free a moment ago: taken at once, in turn with anything that just queued
                entry = self.contexts.get(slot)
                if entry is None or time.monotonic() - entry["used"] <= idle:
                    continue
                await self._close_slot(slot)
                _log(slot=slot, action="close", verdict="idle-timeout")

    async def _shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in list(self.contexts):
            await self._close_slot(slot)
        for name in ("_browser", "_pw"):
            obj = getattr(self, name)
            setattr(self, name, None)
            try:
                if obj is not None:
                    await asyncio.wait_for(obj.stop() if name == "_pw" else obj.close(), CLOSE_TIMEOUT)
            except Exception:  # best effort at exit
                pass

    async def _describe(self, page: Page) -> Dict[str, object]:
        url = page.url
        if not url_allowed(url):
            # the page navigated itself somewhere we do not show (e.g. a data: URL)
            await page.goto("about:blank")
            raise Refused("the page left http/https; it was closed")
        try:
            aria = await page.locator("body").aria_snapshot()
        except AttributeError:  # very old Playwright: no aria_snapshot on locators
            aria = await page.aria_snapshot()
        text, cut = truncate(aria or "", self.cfg["max_lines"], self.cfg["max_bytes"])
        return {"title": await page.title(), "url": url, "aria_snapshot": text, "truncated": cut}

    # ------------------------------------------------------------ operations (loop thread, slot lock held)
    async def op_open(self, slot: str, url: str) -> Dict[str, object]:
        page = await self._page(slot, create=True)
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            try:
                resp = await page.goto(url, wait_until="load")
                break
            except Exception as exc:  # Playwright's Error: only this one message is retried
                if NAVIGATION_INTERRUPTED not in str(exc) or attempt == OPEN_ATTEMPTS:
                    raise
            # the page was still committing an earlier navigation (chromium's own error page
            # after a refused open, the previous request's, or, on a loaded guest, the lost
            # goto's own): let the one that won finish loading, then ask for ours again
            try:
                await page.wait_for_load_state("load")
            except Exception:  # the next goto reports what is wrong with the page
                pass
        out = await self._describe(page)
        out["status"] = resp.status if resp is not None else None
        return out

    async def op_snapshot(self, slot: str) -> Dict[str, object]:
        return await self._describe(await self._page(slot, create=False))

    def _make_room(self, slot: str, directory: str, filename: str, incoming: int) -> None:
        """Remove the slot's oldest screenshots so that one of ``incoming`` bytes written as
        ``filename`` (replacing the one of that name, left out here) leaves the slot within its
        quota (policy.shots_to_prune). Errors are logged, not raised: the write decides the answer."""
        victim = directory
        try:
            shots = [shot for shot in list_shots(directory) if shot[0] != filename]
            for victim in shots_to_prune(shots, self.cfg["shots_keep"], self.cfg["shots_max_bytes"],
                                         incoming=incoming):
                _unlink_quietly(os.path.join(directory, victim))
        except OSError as exc:
            _log(slot=slot, action="screenshot", verdict="error",
                 reason="quota: %s not pruned: %s" % (victim, exc.strerror or type(exc).__name__))

    async def op_screenshot(self, slot: str, name: str) -> Dict[str, object]:
        page = await self._page(slot, create=False)
        if not url_allowed(page.url):
            raise Refused("nothing to capture: no http/https page is open")
        png = await page.screenshot(type="png", full_page=False)
        d = os.path.join(self.cfg["shots_dir"], slot)
        filename = name + ".png"
        # the cell sees only its own directory, bound read-only at shots_cell_dir
        cell_path = os.path.join(self.cfg["shots_cell_dir"], filename)
        tmp = os.path.join(d, ".%s.tmp" % filename)
        try:
            os.makedirs(d, exist_ok=True)
            # the service's umask is 0077; screenshots (only) are for the cell's mapped uids to read
            os.chmod(d, 0o755)
            self._make_room(slot, d, filename, len(png))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.fchmod(fd, 0o644)
                view = memoryview(png)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(d, filename))
        except OSError as exc:
            try:
                _unlink_quietly(tmp)
            except OSError:
                pass  # the error below is the answer; the next screenshot of that name truncates it
            raise ShotNotSaved(shot_error(exc, cell_path, d)) from None
        return {"path": cell_path, "bytes": len(png)}

    async def op_close(self, slot: str) -> Dict[str, object]:
        return {"closed": await self._close_slot(slot)}


def cell_of(req: wire.JSONObject) -> Dict[str, str]:
    """Engine.submit's keywords for the cell incarnation a request names (policy.check_cell) and
    the egress proxy its context uses (policy.check_proxy), where the request has them."""
    out = {}
    cell, proxy = check_cell(req.get("cell")), check_proxy(req.get("proxy"))
    if cell is not None:
        out["cell"] = cell
    if proxy is not None:
        out["proxy"] = proxy
    return out


class Server:
    def __init__(self, cfg: wire.JSONObject, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.actions = handlers(engine, BROWSER_ACTIONS)
        self._stop = threading.Event()
        self._busy = threading.Condition()
        self._inflight = 0  # connections being handled
        # the configuration's JSON values, as SlotQuota and global_cap check and convert them
        per_slot = cast(int, cfg.get("max_requests_per_slot", DEFAULTS["max_requests_per_slot"]))
        self.requests = wire.SlotQuota("max_requests_per_slot", per_slot, "requests in flight")
        slots = cfg.get("slots", 0) or wire.policy_slots(cast(str, cfg.get("cell_policy", DEFAULTS["cell_policy"])))
        self.max_connections = wire.global_cap(cast(int, cfg.get("max_connections", DEFAULTS["max_connections"])),
                                               slots, per_slot)

    def dispatch(self, req: wire.JSONObject, conn: Optional[socket.socket] = None) -> object:
        slot = check_slot(req.get("slot"))
        action: Any = req.get("action")  # whatever the client sent: known() decides
        if known(ADMIN_ACTIONS, action):  # never refused for capacity: a run's end must get through
            self.check_admin_peer(conn)
            return self.engine.end(slot)
        if not known(BROWSER_ACTIONS, action):
            raise Refused("action must be one of " + ", ".join(BROWSER_ACTIONS))
        args = [FIELD_CHECKS[field](req.get(field)) for field in BROWSER_ACTIONS[action]]
        if action in UNCOUNTED_ACTIONS:
            return self.engine.submit(self.actions[action], slot, *args, **cell_of(req))
        with self.requests.acquire(slot):  # wire.Busy at the slot's quota
            return self.engine.submit(self.actions[action], slot, *args, **cell_of(req))

    @staticmethod
    def check_admin_peer(conn: Optional[socket.socket], uid_map_path: str = "/proc/self/uid_map") -> None:
        """Refused unless the peer of ``conn`` is root of the guest's own user namespace
        (policy.admin_peer_problem): chv-cell's launcher, never a cell, never a peer we cannot see."""
        if conn is None:
            raise Refused("end needs a connection whose peer can be checked")
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            dummy_pid, uid, dummy_gid = struct.unpack("3i", raw)
            with open(uid_map_path, encoding="ascii") as fh:
                uid_map = fh.read()
        except (OSError, AttributeError) as exc:
            raise Refused("cannot check the peer of end: %s" % exc) from None
        problem = admin_peer_problem(uid, uid_map)
        if problem:
            raise Refused(problem)

    def handle(self, conn: socket.socket) -> None:
        with self._busy:
            self._inflight += 1
        try:
            self._handle(conn)
        finally:
            with self._busy:
                self._inflight -= 1
                self._busy.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the connections being handled to get their replies."""
        with self._busy:
            return self._busy.wait_for(lambda: self._inflight == 0, timeout)

    def _handle(self, conn: socket.socket) -> None:
        t0 = time.monotonic()
        fields: Dict[str, object] = {"slot": None, "action": None, "verdict": "error"}
        with conn:
            try:
                req = wire.parse_object(wire.read_line(conn, self.cfg["max_request_bytes"], self.cfg["read_timeout"]))
                fields["slot"] = req.get("slot") if isinstance(req.get("slot"), str) else None
                fields["action"] = req.get("action") if isinstance(req.get("action"), str) else None
                reply = wire.ok(self.dispatch(req, conn))
                fields["verdict"] = "ok"
            except (wire.WireError, Refused) as exc:
                reply = wire.err(exc)
                fields.update(verdict="refused", reason=str(exc)[:300])
            except wire.Busy as exc:
                reply = wire.err(exc)
                fields.update(verdict="busy", quota=exc.quota, limit=exc.limit, reason=str(exc)[:300])
            except (DeadlineExceeded, ShotNotSaved) as exc:
                reply = wire.err(exc)
                fields.update(verdict="error", reason=str(exc)[:300])
            except Exception as exc:  # Playwright errors (timeouts, DNS, ...) are answers, not crashes
                msg = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                reply = wire.err("%s: %s" % (type(exc).__name__, msg))
                fields.update(verdict="error", reason=reply["error"])
            try:
                conn.settimeout(5)
                conn.sendall(wire.encode(reply))
            except OSError:
                pass
        fields["duration_ms"] = round((time.monotonic() - t0) * 1000, 1)
        _log(**fields)

    def serve(self, listener: socket.socket) -> None:
        busy = ("busy: chv-browser serves at most %d connections at once (max_connections); retry later"
                % self.max_connections)
        wire.serve_connections(listener, self._stop, self.max_connections, self.handle, busy,
                               on_busy=lambda exc: _log(verdict="busy", quota=exc.quota, limit=exc.limit,
                                                        slot=exc.slot, duration_ms=0))

    def stop(self, *_: object) -> None:
        self._stop.set()


def bind_socket(cfg: wire.JSONObject) -> socket.socket:
    """Listen on cfg["socket"]: bound under a temporary name, given its mode
    and group, listening, then renamed into place, so that the path exists
    only once it accepts connections (a client that sees it never gets
    ECONNREFUSED from a socket not listening yet)."""
    path = cfg["socket"]
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o750, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    old = os.umask(0o117)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(tmp)
    finally:
        os.umask(old)
    os.chmod(tmp, 0o660)
    os.chmod(d, 0o750)
    if cfg["socket_group"]:
        gid = grp.getgrnam(cfg["socket_group"]).gr_gid
        os.chown(d, -1, gid)
        os.chown(tmp, -1, gid)
    s.listen(32)
    os.rename(tmp, path)
    return s


def main(argv: Optional[List[str]] = None, engine_class: Type[Engine] = Engine) -> int:
    """chv-browser; ``engine_class`` is Engine but in a counter-proof's test build
    (testbuild.py), which the entry point never imports."""
    ap = argparse.ArgumentParser(prog="chv-browser")
    ap.add_argument("--config", default="/etc/chv-fleet/browser.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.config if os.path.exists(args.config) else None)
    mismatch = config_problem(cfg) or playwright_mismatch(cfg["playwright_version"])
    if mismatch:
        _log(verdict="refused-start", reason=mismatch)
        return 1
    os.environ.setdefault("PLAYWRIGHT_BROWSERS_PATH", "/nonexistent")
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    # systemd's chv-browser.socket (owner, group and mode set there), else bind it ourselves
    listener = wire.listener_from_env(os.environ) or bind_socket(cfg)
    engine = engine_class(cfg)
    engine.start()
    server = Server(cfg, engine)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    _log(verdict="started", socket=cfg["socket"], max_connections=server.max_connections,
         max_requests_per_slot=server.requests.limit)
    try:
        server.serve(listener)
    finally:
        listener.close()
        engine.stop()  # requests still running end with an error ...
        server.drain(10)  # ... which their clients get before the process exits
    return 0
