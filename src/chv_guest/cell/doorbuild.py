"""The doors' test builds of a counter-proof run (counterproof.py): for
the run of one loosening (a catalog Loosening's ``doors``), the installed
chv-broker and chv-browser, each started by its test build's wrapper
(chv_guest/broker/testbuild.py, chv_guest/browser/testbuild.py) with
exactly one check replaced, on a socket of its own in a directory of its
own; stopped and removed after the run.

Each build gets a directory ``/run/chv-audit-build.XXXX`` (root's; the
guard of the wrapper refuses any other, and any parent but this process,
whose pid the directory's ``owner`` file names) and runs in a transient
scope ``chv-audit-build-XXXX.scope`` (systemd-run --scope), so that
stopping it ends every process it started, chromium's too. The broker's
directory is mode 0750 with cell A's slot's uid_base as its group: only
root and that uid (the audit's own pings, IPC-02 and IPC-03) reach its
socket from the guest, and cells A and B of the run reach it as their
/run/chv (the policy copy's bind, loosen.through_doors). A build left by a
killed counter-proof (its owner gone) is stopped and removed by the next
counter-proof run (``remove_stale``).

Where the services are installed and how they run (interpreter, install
directory, configuration, user, environment) is read from their systemd
units (``systemctl show``), so the test build is the installed code."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

# wire/testbuild.py has the same values (the wrapper's guard); a unit test compares them
RUN_DIR_PARENT = "/run"
RUN_DIR_PREFIX = "chv-audit-build."
OWNER_FILE = "owner"
SCOPE_PREFIX = "chv-audit-build-"
UNITS = {"broker": "chv-broker.service", "browser": "chv-browser.service"}
# the wrapper's entry point: what the services' own entry points (the roles' chv-broker.j2,
# chv-browser.j2) do, with the test build's module instead of the server's
ENTRY = "import sys; sys.path.insert(0, %r); from chv_guest.%s.testbuild import main; sys.exit(main())"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0

Doors = Sequence[Tuple[str, str]]  # (service, variant) of each test build of a run


def exec_argv(show: str) -> List[str]:
    """The command line of ``systemctl show --property=ExecStart`` output (its first argv[]=)."""
    m = re.search(r"argv\[\]=(.*?) ;", show)
    if not m:
        raise RuntimeError("no ExecStart command in %r" % show[:200])
    return m.group(1).split()


def how_it_runs(argv: Sequence[str]) -> Dict[str, str]:
    """The interpreter, install directory and configuration of a door's
    ExecStart (``PYTHON -I INSTALL_DIR/ENTRY --config CONFIG``)."""
    words = list(argv)
    entry = next((w for w in words[1:] if not w.startswith("-")), None)
    if entry is None or not words[0].startswith("/") or not entry.startswith("/"):
        raise RuntimeError("not an interpreter and an entry point: %s" % " ".join(words))
    config = words[words.index("--config") + 1] if "--config" in words[:-1] else ""
    return {"python": words[0], "install_dir": os.path.dirname(entry), "config": config}


def unit_environment(show: str) -> Dict[str, str]:
    """Environment= of ``systemctl show --property=Environment`` output."""
    for line in show.splitlines():
        if line.startswith("Environment="):
            return dict(w.split("=", 1) for w in line[len("Environment="):].split() if "=" in w)
    return {}


def _show(systemctl: str, unit: str, prop: str) -> str:
    p = subprocess.run([systemctl, "show", "--property=" + prop, "--", unit], capture_output=True, text=True,
                       timeout=30, check=False)
    if p.returncode != 0:
        raise RuntimeError("systemctl show %s: %s" % (unit, p.stderr.strip()[-200:]))
    return p.stdout


def installed(systemctl: str, service: str) -> Dict[str, str]:
    """How the installed ``service`` runs (how_it_runs, and its unit's User= and Environment)."""
    unit = UNITS[service]
    out = how_it_runs(exec_argv(_show(systemctl, unit, "ExecStart")))
    out["user"] = _show(systemctl, unit, "User").strip().partition("=")[2]
    out["environment"] = json.dumps(unit_environment(_show(systemctl, unit, "Environment")))
    if not out["config"]:
        raise RuntimeError("%s names no --config" % unit)
    return out


def make_run_dir(group: int = 0, mode: int = 0o755, parent: str = RUN_DIR_PARENT) -> str:
    """A new build directory, root's (``group``, ``mode``), whose owner file names this process."""
    d = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent)
    os.chown(d, 0, group)
    os.chmod(d, mode)
    with open(os.path.join(d, OWNER_FILE), "w", encoding="ascii") as fh:
        fh.write("%d\n" % os.getpid())
    return d


def scope_of(run_dir: str) -> str:
    return SCOPE_PREFIX + os.path.basename(run_dir)[len(RUN_DIR_PREFIX):] + ".scope"


def owner_alive(run_dir: str) -> bool:
    """Whether the counter-proof that made ``run_dir`` still runs (another one than this process)."""
    try:
        with open(os.path.join(run_dir, OWNER_FILE), encoding="ascii") as fh:
            pid = int(fh.read().strip())
    except (OSError, ValueError):
        return False
    return pid != os.getpid() and os.path.exists("/proc/%d" % pid)


def remove_stale(systemctl: str, parent: str = RUN_DIR_PARENT) -> int:
    """Stop and remove every build a killed counter-proof left (its owner gone); returns how many."""
    removed = 0
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return 0
    for name in names:
        d = os.path.join(parent, name)
        if not name.startswith(RUN_DIR_PREFIX) or os.path.islink(d) or not os.path.isdir(d) or owner_alive(d):
            continue
        subprocess.run([systemctl, "stop", "--", scope_of(d)], capture_output=True, timeout=60, check=False)
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:].strip()
    except OSError:
        return ""


class Build:
    """One running test build: its directory, scope and process."""

    def __init__(self, service: str, variant: str, run_dir: str, argv: List[str], env: Dict[str, str],
                 ready: str) -> None:
        self.service, self.variant, self.run_dir, self.ready = service, variant, run_dir, ready
        self.log = os.path.join(run_dir, "log")
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until its socket is there (the servers rename it into place once they listen)."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("%s test build (%s) did not start (exit %s): %s" % (
                    self.service, self.variant, self.proc.poll(), _tail(self.log)))
            time.sleep(0.1)

    def stop(self, systemctl: str) -> None:
        """SIGTERM and its own shutdown, then the scope stopped (whatever is left of it killed)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        subprocess.run([systemctl, "stop", "--", scope_of(self.run_dir)], capture_output=True, timeout=60,
                       check=False)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)


class DoorBuilds:
    """The test builds of one loosening's run (``doors``: (service, variant)
    pairs; a browser build gets an unchanged broker build in front of it,
    which forwards to it, when ``doors`` has no broker of its own).
    ``paths()`` is what the policy copy and the audit's guest-side pings
    use; ``stop()`` ends and removes all of them."""

    def __init__(self, systemd_run: str, cell_gid: int) -> None:
        self.systemd_run = systemd_run
        self.systemctl = os.path.join(os.path.dirname(systemd_run), "systemctl")
        self.cell_gid = cell_gid
        self.builds: List[Build] = []
        self.dirs: List[str] = []
        self.broker_socket: Optional[str] = None
        self.browser_socket: Optional[str] = None

    def paths(self) -> Dict[str, Optional[str]]:
        return {"broker_socket": self.broker_socket, "browser_socket": self.browser_socket,
                "cell_run_dir": os.path.dirname(self.broker_socket) if self.broker_socket else None}

    def _argv(self, run_dir: str, how: Dict[str, str], service: str, args: List[str]) -> List[str]:
        return [self.systemd_run, "--scope", "--quiet", "--collect", "--unit=" + scope_of(run_dir), "--",
                how["python"], "-I", "-c", ENTRY % (how["install_dir"], service)] + ["--run-dir", run_dir] + args

    def start(self, doors: Doors) -> None:
        """Start the builds (the browser's first); RuntimeError when one does not
        start (what is started by then is still stop()'s to end)."""
        wanted = dict(doors)
        try:
            if "browser" in wanted:
                self._browser(wanted["browser"])
            self._broker(wanted.get("broker", "as-installed"))
        except (OSError, KeyError, ValueError) as exc:
            raise RuntimeError("test build: %s: %s" % (type(exc).__name__, exc)) from None

    def _browser(self, variant: str) -> None:
        how = installed(self.systemctl, "browser")
        pw = pwd.getpwnam(how["user"])
        d = self._run_dir()
        for sub in ("sock", "shots", "home"):
            os.mkdir(os.path.join(d, sub), 0o700)
            os.chown(os.path.join(d, sub), pw.pw_uid, pw.pw_gid)
        with open(how["config"], encoding="utf-8") as fh:
            cfg = json.load(fh)
        self.browser_socket = os.path.join(d, "sock", "browser.sock")
        cfg.update(socket=self.browser_socket, socket_group="", shots_dir=os.path.join(d, "shots"))
        config = os.path.join(d, "browser.json")
        with open(config, "w", encoding="utf-8") as fh:
            json.dump(cfg, fh)
        os.chmod(config, 0o644)
        env = dict(json.loads(how["environment"]), HOME=os.path.join(d, "home"), TMPDIR=os.path.join(d, "home"),
                   PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8")
        self._run(Build("browser", variant, d, self._argv(d, how, "browser", [
            "--variant", variant, "--user", how["user"], "--config", config]), env, self.browser_socket))

    def _broker(self, variant: str) -> None:
        how = installed(self.systemctl, "broker")
        d = self._run_dir(self.cell_gid, 0o750)
        run = os.path.join(d, "run")
        os.mkdir(run, 0o755)
        os.chmod(run, 0o755)
        config = how["config"]
        if self.browser_socket:  # in front of the browser's test build: forward to it
            with open(config, encoding="utf-8") as fh:
                cfg = json.load(fh)
            cfg.setdefault("browser", {})["socket"] = self.browser_socket
            config = os.path.join(d, "broker.json")
            with open(config, "w", encoding="utf-8") as fh:
                json.dump(cfg, fh)
        self.broker_socket = os.path.join(run, "broker.sock")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        self._run(Build("broker", variant, d, self._argv(d, how, "broker", [
            "--variant", variant, "--config", config, "--listen", self.broker_socket]), env, self.broker_socket))

    def _run_dir(self, group: int = 0, mode: int = 0o755) -> str:
        d = make_run_dir(group, mode)
        self.dirs.append(d)
        return d

    def _run(self, build: Build) -> None:
        self.builds.append(build)
        build.wait_ready()

    def stop(self) -> None:
        for build in reversed(self.builds):
            build.stop(self.systemctl)
        for d in self.dirs:  # those of builds that never started too
            shutil.rmtree(d, ignore_errors=True)
        self.builds, self.dirs = [], []
