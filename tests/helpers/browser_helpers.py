"""Fixtures for chv-browser tests.

The integration tests drive Debian's chromium (/usr/bin/chromium, package
`chromium`) through Playwright for Python.  Playwright is looked up in the
interpreter named by CHV_BROWSER_PYTHON, else in the test interpreter; it is
never asked to download a browser.  The service runs as `nobody` with
chromium's own sandbox on, as in production.
"""
import contextlib
import http.server
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import procs
from testpaths import SRC

from chv_guest.browser import server as _server
from chv_guest.wire import wire


class Recorder(_server.Engine):
    """A real Engine, never started: ``submit`` records (handler, slot,
    checked arguments) instead of driving chromium."""

    def __init__(self):
        super().__init__(dict(_server.DEFAULTS))
        self.calls = []

    def submit(self, op, slot, *args):
        self.calls.append((op, slot) + args)
        return "submitted"


CHROMIUM = "/usr/bin/chromium"
PY = os.environ.get("CHV_BROWSER_PYTHON", sys.executable)


def _playwright_ok():
    try:
        r = subprocess.run([PY, "-c", "import playwright.sync_api"], capture_output=True, timeout=30, check=False)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


SKIP_REASON = None
if not os.path.exists(CHROMIUM):
    SKIP_REASON = "Debian's chromium is not installed (apt-get install chromium)"
elif not _playwright_ok():
    SKIP_REASON = ("Playwright for Python is not importable by %s (pip install playwright, or point "
                   "CHV_BROWSER_PYTHON at an interpreter that has it; never `playwright install`)" % PY)
elif os.geteuid() != 0:
    SKIP_REASON = "the service is started as an unprivileged user, which needs root"
needs_browser = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

PAGE = b"""<!doctype html><html><head><title>Cell test page</title></head>
<body><h1>Hello from the guest</h1><p>First paragraph.</p>
<a href="/long">long page</a></body></html>"""
LONG = ("<!doctype html><html><head><title>Long</title></head><body><ul>%s</ul></body></html>"
        % "".join("<li>item %d</li>" % i for i in range(400))).encode()
ESCAPE = b"""<!doctype html><html><head><title>bye</title></head><body>
<script>location.href = "data:text/html,<h1>gone</h1>";</script></body></html>"""
DOWNLOAD = b"PK\x03\x04 not really a zip"
SLOW = b"""<!doctype html><html><head><title>Slow page</title></head>
<body><h1>Finally here</h1></body></html>"""


class Stall:
    """GET /stall/<key> answers only once release(key) is called: a page that never finishes by itself.

    ``arrived(key)`` is set when chromium's request reached the server; ``abandoned(key)`` when
    chromium closed that connection before getting an answer (its page or context was closed).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._events = {}

    def _event(self, kind, key):
        with self._lock:
            return self._events.setdefault((kind, key), threading.Event())

    def arrived(self, key):
        return self._event("arrived", key)

    def abandoned(self, key):
        return self._event("abandoned", key)

    def release(self, key):
        self._event("release", key).set()

    def serve(self, handler, key):
        """Wait (in the server's handler thread) for release(key) or for the client to hang up."""
        self.arrived(key).set()
        release = self._event("release", key)
        sock = handler.connection
        deadline = time.monotonic() + 600  # never outlive a broken test run by much
        while not release.wait(0.05):
            if time.monotonic() > deadline:
                return False
            readable, dummy, dummy = select.select([sock], [], [], 0)
            if readable and not sock.recv(1, socket.MSG_PEEK):  # EOF: chromium gave up on this request
                self.abandoned(key).set()
                return False
        return True


STALL = Stall()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that answers with reply() and logs nothing."""

    def reply(self, status, body, ctype, extra=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler):
    """An HTTP server of ``handler`` on 127.0.0.1 (a free port), in a thread of its own; yields its URL."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield "http://127.0.0.1:%d" % srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


class Handler(QuietHandler):
    def do_GET(self):  # noqa: N802 (stdlib name)
        if self.path.startswith("/stall/"):
            if not STALL.serve(self, self.path[len("/stall/"):]):
                self.close_connection = True
                return
            self.path = "/slow"
        body, ctype, extra = {
            "/": (PAGE, "text/html", {}),
            "/long": (LONG, "text/html", {}),
            "/escape": (ESCAPE, "text/html", {}),
            "/slow": (SLOW, "text/html", {}),
            "/download": (DOWNLOAD, "application/zip", {"Content-Disposition": "attachment; filename=x.zip"}),
        }.get(self.path, (b"not found", "text/plain", {}))
        self.reply(200 if body != b"not found" else 404, body, ctype, extra)


@pytest.fixture(scope="module")
def site():
    with serving(Handler) as url:
        yield url


class BrowserProc:
    def __init__(self, root, netns=None, **overrides):
        """chv-browser as nobody; with ``netns``, in that network namespace (ip netns exec, then setpriv)."""
        self.root = root
        self.cfg = {"socket": os.path.join(root, "run", "browser.sock"),
                    "shots_dir": os.path.join(root, "shots"), "shots_cell_dir": "/run/chv/shots",
                    "navigation_timeout": 15.0, "request_timeout": 40.0, "idle_timeout": 300.0}
        self.cfg.update(overrides)
        os.makedirs(self.cfg["shots_dir"], exist_ok=True)
        os.makedirs(os.path.join(root, "home"), exist_ok=True)
        for d in (self.cfg["shots_dir"], os.path.join(root, "home")):
            os.chown(d, 65534, 65534)
        os.makedirs(os.path.dirname(self.cfg["socket"]), exist_ok=True)
        os.chown(os.path.dirname(self.cfg["socket"]), 65534, 65534)
        self.config = os.path.join(root, "browser.json")
        with open(self.config, "w") as fh:
            json.dump(self.cfg, fh)
        self.log = os.path.join(root, "browser.log")
        code = "import sys; sys.path.insert(0, %r); from chv_guest.browser.server import main; sys.exit(main(['--config', %r]))" % (
            SRC, self.config)
        env = {"PATH": "/usr/bin:/bin", "HOME": os.path.join(root, "home"),
               "PLAYWRIGHT_BROWSERS_PATH": os.path.join(root, "no-browsers")}
        with open(self.log, "ab") as err:
            if netns:
                self.proc = subprocess.Popen(["ip", "netns", "exec", netns, "setpriv", "--reuid=65534",
                                              "--regid=65534", "--clear-groups", PY, "-c", code], env=env,
                                             stderr=err, cwd=root)
            else:
                self.proc = subprocess.Popen([PY, "-c", code], user=65534, group=65534, extra_groups=[], env=env,
                                             stderr=err, cwd=root)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.cfg["socket"]):
            assert self.proc.poll() is None and time.monotonic() < deadline, open(self.log).read()
            time.sleep(0.05)

    def call(self, req, timeout=60):
        return wire.call(self.cfg["socket"], req, timeout)

    def log_tail(self, size=3000):
        """The end of the service's stderr, for failure messages."""
        with open(self.log, "rb") as fh:
            return fh.read()[-size:].decode("utf-8", "replace")

    def stop(self):
        procs.stop(self.proc, 20)


@contextlib.contextmanager
def running_browser(**overrides):
    """A chv-browser of its own (config ``overrides``), stopped and cleaned up afterwards."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    root = tempfile.mkdtemp(prefix="chvbr-")
    os.chmod(root, 0o755)
    try:
        b = BrowserProc(root, **overrides)
        try:
            yield b
        finally:
            b.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    with running_browser(max_lines=50, max_bytes=4096) as b:
        yield b
