"""chv-browser daemon.

Listens on a Unix socket that only chv-broker's group can reach; every
request names the slot it is for (the broker fills it in after its peer
check; chv-browser trusts it because nobody else can connect).  All
Playwright calls run on one worker thread (Playwright's sync API is not
thread-safe); connection threads hand requests to it through a queue.

Operations: open(url), snapshot, screenshot(name), close.  Nothing else:
no evaluate, no page content or DOM, no downloads, no DevTools endpoint
(Playwright talks to chromium over a pipe, never a port).
"""
import argparse
import grp
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future

from . import wire
from .policy import Refused, check_name, check_slot, check_url, truncate, url_allowed

DEFAULTS = {
    "socket": "/run/chv-browser/browser.sock",
    "socket_group": "",
    "shots_dir": "/run/chv-shots",
    "shots_cell_dir": "/run/chv/shots",
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
    "max_connections": 8,
}
ACTIONS = ("open", "snapshot", "screenshot", "close")


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path, encoding="utf-8") as fh:
            cfg.update(json.load(fh))
    return cfg


def _log(**fields):
    try:
        sys.stderr.write(json.dumps({"event": "chv-browser", **fields}, sort_keys=True) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Engine:
    """Owns Playwright, the chromium process and one browser context per slot."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.jobs = queue.Queue()
        self._pw = None
        self._browser = None
        self.contexts = {}  # slot -> {"context", "page", "used"}
        self.thread = threading.Thread(target=self._run, name="playwright", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, fn, *args):
        fut = Future()
        self.jobs.put((fut, fn, args))
        return fut.result(timeout=self.cfg["request_timeout"])

    def stop(self):
        fut = Future()
        self.jobs.put((fut, None, ()))
        try:
            fut.result(timeout=30)
        except Exception:  # shutting down anyway
            pass

    # ------------------------------------------------------------ worker thread
    def _run(self):
        while True:
            try:
                fut, fn, args = self.jobs.get(timeout=min(10.0, max(0.5, self.cfg["idle_timeout"] / 4)))
            except queue.Empty:
                self._reap_idle()
                continue
            if fn is None:
                self._shutdown()
                fut.set_result(None)
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed back to the connection thread
                fut.set_exception(exc)
            self._reap_idle()

    def _ensure_browser(self):
        if self._browser is not None and self._browser.is_connected():
            return self._browser
        from playwright.sync_api import sync_playwright
        if self._pw is None:
            self._pw = sync_playwright().start()
        self.contexts.clear()
        self._browser = self._pw.chromium.launch(
            executable_path=self.cfg["executable_path"],
            args=list(self.cfg["chromium_args"]),
            chromium_sandbox=bool(self.cfg["chromium_sandbox"]),
            headless=True,
            downloads_path=None,
        )
        _log(verdict="chromium-started", version=self._browser.version)
        return self._browser

    def _page(self, slot, create):
        entry = self.contexts.get(slot)
        if entry is None:
            if not create:
                raise Refused("no page open for this slot; use open first")
            ctx = self._ensure_browser().new_context(
                accept_downloads=False, service_workers="block", viewport=self.cfg["viewport"])
            ctx.set_default_navigation_timeout(self.cfg["navigation_timeout"] * 1000)
            ctx.set_default_timeout(self.cfg["navigation_timeout"] * 1000)
            entry = {"context": ctx, "page": ctx.new_page(), "used": time.monotonic()}
            self.contexts[slot] = entry
        entry["used"] = time.monotonic()
        return entry["page"]

    def _close_slot(self, slot):
        entry = self.contexts.pop(slot, None)
        if entry is not None:
            try:
                entry["context"].close()
            except Exception:  # the browser may already be gone
                pass
        return entry is not None

    def _reap_idle(self):
        now = time.monotonic()
        for slot in [s for s, e in self.contexts.items() if now - e["used"] > self.cfg["idle_timeout"]]:
            self._close_slot(slot)
            _log(slot=slot, action="close", verdict="idle-timeout")

    def _shutdown(self):
        for slot in list(self.contexts):
            self._close_slot(slot)
        for obj in (self._browser, self._pw):
            try:
                if obj is self._pw and obj is not None:
                    obj.stop()
                elif obj is not None:
                    obj.close()
            except Exception:  # best effort at exit
                pass

    def _describe(self, page):
        url = page.url
        if not url_allowed(url):
            # the page navigated itself somewhere we do not show (e.g. a data: URL)
            page.goto("about:blank")
            raise Refused("the page left http/https; it was closed")
        try:
            aria = page.locator("body").aria_snapshot()
        except AttributeError:  # very old Playwright: no aria_snapshot on locators
            aria = page.aria_snapshot()
        text, cut = truncate(aria or "", self.cfg["max_lines"], self.cfg["max_bytes"])
        return {"title": page.title(), "url": url, "aria_snapshot": text, "truncated": cut}

    # ------------------------------------------------------------ operations (worker thread)
    def op_open(self, slot, url):
        page = self._page(slot, create=True)
        resp = page.goto(url, wait_until="load")
        out = self._describe(page)
        out["status"] = resp.status if resp is not None else None
        return out

    def op_snapshot(self, slot):
        return self._describe(self._page(slot, create=False))

    def op_screenshot(self, slot, name):
        page = self._page(slot, create=False)
        if not url_allowed(page.url):
            raise Refused("nothing to capture: no http/https page is open")
        png = page.screenshot(type="png", full_page=False)
        d = os.path.join(self.cfg["shots_dir"], slot)
        os.makedirs(d, exist_ok=True)
        # the service's umask is 0077; screenshots (only) are for the cell's mapped uids to read
        os.chmod(d, 0o755)
        tmp = os.path.join(d, ".%s.png.tmp" % name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(png)
        os.replace(tmp, os.path.join(d, name + ".png"))
        # the cell sees only its own directory, bound read-only at shots_cell_dir
        return {"path": os.path.join(self.cfg["shots_cell_dir"], name + ".png"), "bytes": len(png)}

    def op_close(self, slot):
        return {"closed": self._close_slot(slot)}


class Server:
    def __init__(self, cfg, engine):
        self.cfg = cfg
        self.engine = engine
        self._stop = threading.Event()

    def dispatch(self, req):
        slot = check_slot(req.get("slot"))
        action = req.get("action")
        if action not in ACTIONS:
            raise Refused("action must be one of " + ", ".join(ACTIONS))
        if action == "open":
            return self.engine.submit(self.engine.op_open, slot, check_url(req.get("url")))
        if action == "snapshot":
            return self.engine.submit(self.engine.op_snapshot, slot)
        if action == "screenshot":
            return self.engine.submit(self.engine.op_screenshot, slot, check_name(req.get("name")))
        return self.engine.submit(self.engine.op_close, slot)

    def handle(self, conn):
        t0 = time.monotonic()
        fields = {"slot": None, "action": None, "verdict": "error"}
        with conn:
            try:
                req = wire.parse_object(wire.read_line(conn, self.cfg["max_request_bytes"], self.cfg["read_timeout"]))
                fields["slot"] = req.get("slot") if isinstance(req.get("slot"), str) else None
                fields["action"] = req.get("action") if isinstance(req.get("action"), str) else None
                reply = wire.ok(self.dispatch(req))
                fields["verdict"] = "ok"
            except (wire.WireError, Refused) as exc:
                reply = wire.err(exc)
                fields.update(verdict="refused", reason=str(exc)[:300])
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

    def serve(self, listener):
        wire.serve_connections(listener, self._stop, self.cfg["max_connections"], self.handle,
                               "browser busy, retry later")

    def stop(self, *_):
        self._stop.set()


def bind_socket(cfg):
    path = cfg["socket"]
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o750, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    old = os.umask(0o117)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    os.chmod(d, 0o750)
    if cfg["socket_group"]:
        gid = grp.getgrnam(cfg["socket_group"]).gr_gid
        os.chown(d, -1, gid)
        os.chown(path, -1, gid)
    s.listen(32)
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(prog="chv-browser")
    ap.add_argument("--config", default="/etc/chv-fleet/browser.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.config if os.path.exists(args.config) else None)
    os.environ.setdefault("PLAYWRIGHT_BROWSERS_PATH", "/nonexistent")
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    # systemd's chv-browser.socket (owner, group and mode set there), else bind it ourselves
    listener = wire.listener_from_env(os.environ) or bind_socket(cfg)
    engine = Engine(cfg)
    engine.start()
    server = Server(cfg, engine)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    _log(verdict="started", socket=cfg["socket"])
    try:
        server.serve(listener)
    finally:
        listener.close()
        engine.stop()
    return 0
