"""chv-broker daemon: socket activation, peer check, op allow-list, audit log."""
from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Set, Tuple, Type, TypedDict, Union

from ..wire import wire
from .freeze import Freezer, FreezeError, thaw_all
from .peer import PeerChecker, PeerRejected, incarnation
from ..wire.protocol import (BROWSER_ACTIONS, OPS, SYNC_ACTIONS, URL_SCHEMES, audit, handlers, known,
                             url_scheme_allowed)
# DEFAULTS, SYNC_MOUNTS_DEFAULT and merge: config.py's, named here too for server.py's callers
from .config import DEFAULTS, SYNC_MOUNTS_DEFAULT, load_config, merge, validate  # pylint: disable=unused-import
from .syncrun import jail_plan

if TYPE_CHECKING:
    from .peer import Cell
    from .syncrun import JailSpec, SyncSpec

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # the sync worker's whole environment


def sync_mount_properties(scfg: wire.JSONObject, workspaces_dir: str, workspace: str) -> List[str]:
    """The worker's mount namespace as systemd properties, for both isolation modes.

    ``scfg["mounts"]`` (hides /var, /tmp, homes, /opt, /etc/chv, /run/chv-*...),
    then an empty read-only tmpfs over the whole workspaces directory and
    the slot's own workspace bound back into it (writable): other slots'
    workspaces do not exist in the namespace, whatever a path or link says.
    """
    for path in (workspaces_dir, workspace):
        jail_plan(["BindPaths=%s" % path])  # a plain absolute path, or ValueError
    return list(scfg["mounts"]) + ["TemporaryFileSystem=%s:ro" % workspaces_dir.rstrip("/"),
                                   "BindPaths=%s" % workspace, "ReadWritePaths=%s" % workspace]


def read_credentials(path: str) -> bytes:
    """The guest's git credential file (chv_broker_sync_credentials_file), read as root outside every
    cell (at most 1 MiB), or b"" when there is none."""
    if not path:
        return b""
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 20)
    except FileNotFoundError:
        return b""


# The sync's protocols in proxy mode: those git sends through http.proxy (worker_spec).
PROXY_PROTOCOLS = ("http", "https")


def worker_spec(scfg: wire.JSONObject, workspace: str, repo: str, argv: List[str], credentials: bytes,
                proxy: Optional[str] = None) -> SyncSpec:
    """The sync worker's spec for ``workspace`` (syncrun.SyncSpec): the protocols, hosts and limits of
    chv-broker's sync, its credential helper when there are ``credentials``, and ``proxy`` (the cell
    record's egress_proxy, proxy mode) for git's http.proxy. With ``proxy`` only the protocols git
    sends through it (PROXY_PROTOCOLS): git's ``git://`` and ``ssh://`` transports ignore http.proxy,
    and would connect straight to whatever address the repository's remote names, including another
    slot's gateway, where the proxy would take the connection for that slot's."""
    protocols = [p for p in scfg["protocols"] if p in PROXY_PROTOCOLS] if proxy else scfg["protocols"]
    spec: SyncSpec = {
        "workspace": workspace, "repo": repo, "argv": argv, "protocols": protocols, "hosts": scfg["hosts"],
        # run by the interpreter: the installed package's files are not executable
        "credential_helper": ("!%s -I %s" % (scfg["python"], os.path.join(HERE, "credential.py"))
                              if credentials else ""),
        "rlimit_as": int(scfg["rlimit_as"]), "rlimit_cpu": int(scfg["rlimit_cpu"])}
    if proxy:
        spec["proxy"] = proxy
    return spec


def worker_argv(scfg: wire.JSONObject) -> List[str]:
    """How the sync worker is started: the configured interpreter, isolated, on syncrun.py."""
    return [scfg["python"], "-I", os.path.join(HERE, "syncrun.py")]


def sync_unit_name(slot: str) -> str:
    return "chv-broker-sync-%s-%s" % (slot, uuid.uuid4().hex[:12])


def sync_unit_argv(scfg: wire.JSONObject, slot: str, workspace: str, uid: int, gid: int, env: Mapping[str, str],
                   worker: List[str], workspaces_dir: Optional[str] = None, unit: Optional[str] = None) -> List[str]:
    """systemd-run argv that runs the sync worker in a transient service of its own.

    The service starts as root with CAP_SETUID/CAP_SETGID only, in the
    mount namespace of ``sync_mount_properties``, and setpriv drops to the
    slot's uid/gid (systemd's User= needs a passwd entry, the cells' mapped
    uids have none). Its output and exit status come back through
    --pipe/--wait; RuntimeMaxSec makes systemd stop a sync that hangs.
    """
    mounts = sync_mount_properties(scfg, workspaces_dir or os.path.dirname(workspace), workspace)
    argv = [scfg["systemd_run"], "--quiet", "--wait", "--pipe", "--collect", "--service-type=exec",
            "--unit=" + (unit or sync_unit_name(slot)),
            "--description=chv-broker sync for %s" % slot,
            "--property=RuntimeMaxSec=%d" % max(1, int(scfg["timeout"])),
            "--property=WorkingDirectory=/"]
    argv += ["--property=" + p for p in mounts + list(scfg["unit_properties"])]
    argv += ["--setenv=%s=%s" % kv for kv in sorted(env.items())]
    argv += ["--", scfg["setpriv"], "--reuid=%d" % uid, "--regid=%d" % gid, "--clear-groups",
             "--inh-caps=-all", "--"] + worker
    return argv


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes, NULs, CRs) as "?"; newlines and tabs kept."""
    return _CONTROL.sub("?", text)


class WorkerResult(TypedDict):
    """What run_worker returns."""
    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    ended: Optional[str]


def run_worker(argv: List[str], env: Mapping[str, str], stdin_data: Optional[bytes], cap: int, timeout: float,
               leader_pidfd: Optional[int] = None, kill: Optional[Callable[[], None]] = None) -> WorkerResult:
    """Run the sync worker; never hold more than ``cap`` bytes of each of its outputs.

    Reads stdout and stderr as they come; once either passes ``cap`` the
    worker's process group is killed (and ``kill()`` called: the transient
    unit) and the result says "truncated". The same happens at ``timeout``
    and when ``leader_pidfd`` (the cell's leader) becomes readable: the cell
    ended, its sync must not outlive it. Returns {"returncode", "stdout",
    "stderr", "truncated", "ended": None | "timeout" | "cell" | "output"}.
    """
    proc = subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all three PIPE
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    ended: Optional[str]
    pending, ended, truncated = memoryview(stdin_data or b""), None, False
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in bufs:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    wfd = proc.stdin.fileno()
    if pending:
        os.set_blocking(wfd, False)
        poller.register(wfd, select.POLLOUT)
    else:
        proc.stdin.close()
    if leader_pidfd is not None:
        poller.register(leader_pidfd, select.POLLIN)
    open_fds = set(bufs)
    finished = False  # the loop ended by itself, not by an exception (a stop signal of the caller's)
    try:
        while open_fds and ended is None:
            left = deadline - time.monotonic()
            if left <= 0:
                ended = "timeout"
                break
            for fd, ev in poller.poll(min(left, 1.0) * 1000):
                if fd == leader_pidfd:
                    ended = "cell"
                elif fd == wfd:
                    try:
                        pending = pending[os.write(wfd, pending):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending or ev & (select.POLLERR | select.POLLHUP):
                        poller.unregister(wfd)
                        proc.stdin.close()
                elif fd in bufs:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    room = cap - len(bufs[fd])
                    bufs[fd] += chunk[:max(room, 0)]
                    if len(chunk) > room:
                        truncated, ended = True, "output"
        finished = True
    finally:
        if ended is not None or not finished:  # never left running after its caller stops watching it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if kill is not None:
                kill()
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()) if ended is None and finished else 10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return {"returncode": proc.returncode, "stdout": bytes(bufs[out_fd]), "stderr": bytes(bufs[err_fd]),
            "truncated": truncated, "ended": None if ended == "output" else ended}


class OpError(Exception):
    """A request the broker refuses; the message goes back to the client."""


AUDIT_EVENT = "chv-broker.audit"


class Broker:
    def __init__(self, config: wire.JSONObject, log: IO[str] = sys.stderr) -> None:
        errors = validate(config)
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg = config
        self.log = log
        self.peers = PeerChecker(config["cells_dir"])
        self.freezer = Freezer(systemctl=config["sync"]["systemctl"])
        self.slots_seen: Set[str] = set()  # slots that used the browser, for the reaper
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ops = handlers(self, OPS)
        self.connections = wire.SlotQuota("max_connections_per_slot", config["max_connections_per_slot"],
                                          "connections open")
        self.requests = wire.SlotQuota("max_requests_per_slot", config["max_requests_per_slot"],
                                       "requests in flight")
        slots = config["slots"] or wire.policy_slots(config["cell_policy"])
        self.max_connections = wire.global_cap(config["max_connections"], slots,
                                               config["max_connections_per_slot"])

    # -------------------------------------------------------------- operations
    def enabled(self, op: str) -> bool:
        switch = OPS[op]["switch"]
        return switch is None or bool(self.cfg[switch]["enabled"])

    def dispatch(self, cell: Cell, req: wire.JSONObject) -> object:
        op: Any = req.get("op")  # whatever the client sent: known() decides
        if not known(OPS, op) or not self.enabled(op):
            raise OpError("unknown or disabled op: %r" % (op,) if isinstance(op, str) else "missing op")
        return self.ops[op](cell, req)

    def op_ping(self, cell: Cell, req: wire.JSONObject) -> Dict[str, object]:  # pylint: disable=unused-argument
        return {"pong": True, "slot": cell["slot"]}

    def _sync_identity(self, cell: Cell, workspace: str) -> Tuple[int, int]:
        """(uid, gid) of the sync worker: the slot's uid_base for both (the cell's root).

        Never the workspace's group (the agent group reads every slot) nor
        any other id shared between slots; the worker gets no supplementary
        groups. The workspace must be a directory (not a link) owned by a
        uid of the slot's range. Only an operator's chv_broker_sync_user, or
        chv_broker_sync_shared_user owning the workspace, make it that user
        (one identity for every slot: the mount namespace still holds only
        this slot's workspace).
        """
        scfg = self.cfg["sync"]
        try:
            st = os.lstat(workspace)
        except FileNotFoundError:
            raise OpError("slot workspace does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise OpError("slot workspace is not a directory")
        if scfg["user"]:
            pw = pwd.getpwnam(scfg["user"])
            return pw.pw_uid, pw.pw_gid
        base, size = int(cell["uid_base"]), int(cell["uid_size"])
        if base > 0 and base <= st.st_uid < base + size:
            return base, base
        if scfg["shared_user"]:
            pw = pwd.getpwnam(scfg["shared_user"])
            if st.st_uid == pw.pw_uid and pw.pw_uid != 0:
                return pw.pw_uid, pw.pw_gid
        raise OpError("slot workspace owner is neither in the slot's UID range nor the shared user")

    def op_sync(self, cell: Cell, req: wire.JSONObject) -> Dict[str, object]:
        scfg = self.cfg["sync"]
        action = req.get("action")
        if not known(SYNC_ACTIONS, action) or action not in scfg["commands"]:
            raise OpError("sync action must be one of %s" % ", ".join(a for a in SYNC_ACTIONS if a in scfg["commands"]))
        repo = req.get("repo", ".")
        if not isinstance(repo, str):
            raise OpError("repo must be a string")
        workspace = os.path.join(self.cfg["workspaces_dir"], cell["slot"])
        uid, gid = self._sync_identity(cell, workspace)
        credentials = read_credentials(scfg["credentials_file"])
        spec = worker_spec(scfg, workspace, repo, scfg["commands"][action], credentials, cell.get("egress_proxy"))
        env = dict(WORKER_ENV)
        worker = worker_argv(scfg)
        unit: Optional[str] = None
        if scfg["isolation"] == "unit":
            # systemd stops the unit after RuntimeMaxSec; give systemd-run a moment to report that
            unit = sync_unit_name(cell["slot"])
            argv = sync_unit_argv(scfg, cell["slot"], workspace, uid, gid, env, worker + [json.dumps(spec)],
                                  self.cfg["workspaces_dir"], unit=unit)
            grace = 10
        else:
            # the worker starts as root, makes the same mount namespace and drops to uid/gid
            # itself before it reads anything of the workspace (syncrun.enter_jail)
            jail: JailSpec
            jail = {"uid": uid, "gid": gid, "workspace": workspace,
                    "properties": sync_mount_properties(scfg, self.cfg["workspaces_dir"], workspace)}
            argv, grace = worker + ["--jail", json.dumps(jail), json.dumps(spec)], 0
        # the sync ends with the run it is for: the leader's pidfd is watched while the worker runs
        try:
            leader = os.pidfd_open(int(cell["pid"]))
        except OSError:
            raise OpError("the cell has ended") from None
        try:
            # the cell does not run while its repository is checked and used (freeze.py)
            try:
                frozen = self.freezer.freeze(cell)
            except FreezeError as exc:
                raise OpError("sync refused: the cell cannot be frozen for its sync: %s" % exc) from None
            try:
                res = run_worker(argv, env, credentials, scfg["max_output_bytes"], scfg["timeout"] + grace,
                                 leader, kill=lambda: self._kill_unit(unit))
            finally:
                self.freezer.thaw(frozen)
        finally:
            os.close(leader)
        if res["ended"] == "timeout":
            raise OpError("sync %s timed out after %ss" % (action, scfg["timeout"]))
        if res["ended"] == "cell":
            raise OpError("sync %s stopped: the cell ended" % action)
        out, errout = res["stdout"], res["stderr"]
        if res["returncode"] == 120 and not res["truncated"]:
            try:
                reason = json.loads(out.decode("utf-8").splitlines()[0])["rejected"]
            except (ValueError, KeyError, IndexError):
                reason = "rejected"
            raise OpError("sync rejected: " + reason)
        return {"action": action, "returncode": res["returncode"],
                "stdout": out.decode("utf-8", "replace"),
                "stderr": printable(errout.decode("utf-8", "replace")),
                "truncated": res["truncated"]}

    def _kill_unit(self, unit: Optional[str]) -> None:
        """Stop a sync's transient service (killing systemd-run does not stop the unit)."""
        if unit is None:
            return
        subprocess.run([self.cfg["sync"]["systemctl"], "kill", "--signal=SIGKILL", "--", unit + ".service"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False)

    def op_browser(self, cell: Cell, req: wire.JSONObject) -> object:
        action: Any = req.get("action")  # whatever the client sent: known() decides
        if not known(BROWSER_ACTIONS, action):
            raise OpError("browser action must be one of " + ", ".join(sorted(BROWSER_ACTIONS)))
        fwd: Dict[str, str] = {"slot": cell["slot"], "action": action}
        for key in BROWSER_ACTIONS[action]:
            if not isinstance(req.get(key), str):
                raise OpError("browser %s needs a string %r" % (action, key))
            fwd[key] = req[key]
        if "url" in fwd and not url_scheme_allowed(fwd["url"]):
            raise OpError("only %s URLs may be opened" % " and ".join(URL_SCHEMES))
        with self._lock:
            self.slots_seen.add(cell["slot"])
        # the run the request is for: chv-browser closes a context made for an earlier run
        # of the slot instead of serving it (a request that passed this check before its
        # cell ended and reaches chv-browser after the launcher's "end")
        fwd["cell"] = incarnation(cell)
        if cell.get("egress_proxy"):  # proxy mode: the slot's context goes through the slot's proxy
            fwd["proxy"] = cell["egress_proxy"]
        bcfg = self.cfg["browser"]
        try:
            reply = wire.call(bcfg["socket"], fwd, bcfg["timeout"])
        except (OSError, wire.WireError) as exc:
            raise OpError("browser unavailable: %s" % exc) from None
        if reply.get("ok") is True:
            return reply.get("result")
        raise OpError("browser: %s" % reply.get("error", "failed"))

    # -------------------------------------------------------------- connections
    def admit(self, conn: socket.socket) -> Union[PeerRejected, wire.Hold[Cell]]:
        """The accept loop's step (wire.serve_connections): the peer check, then one of its
        slot's connections (wire.Hold, the cell record as data). Raises wire.Busy when the
        slot has max_connections_per_slot open; a rejected peer's PeerRejected is returned
        for handle to answer. Reads only kernel state and root-owned records: never waits
        for the peer."""
        try:
            cell = self.peers.identify(conn)
        except PeerRejected as exc:
            return exc
        except Exception as exc:  # never let one connection take the accept loop down
            return PeerRejected("peer check failed: %s: %s" % (type(exc).__name__, exc))
        return self.connections.acquire(cell["slot"], data=cell)

    def handle(self, conn: socket.socket, admitted: Union[PeerRejected, wire.Hold[Cell], None] = None) -> None:
        t0 = time.monotonic()
        fields: Dict[str, object] = {"slot": None, "op": None, "verdict": "error"}
        try:
            with conn:
                try:
                    if admitted is None:  # called without the accept loop (tests): admit here
                        try:
                            admitted = self.admit(conn)
                        except wire.Busy as exc:
                            fields.update(self.busy_fields(exc))
                            wire.send_quietly(conn, wire.err(exc))
                            return
                    if isinstance(admitted, PeerRejected):
                        rejected = admitted
                        fields.update(verdict="rejected", reason=rejected.reason, peer_pid=rejected.pid,
                                      peer_uid=rejected.uid)
                        wire.send_quietly(conn, wire.err("peer is not a process of a live chv cell"))
                        return
                    cell = admitted.data
                    fields["slot"] = cell["slot"]
                    try:
                        req = wire.parse_object(wire.read_line(conn, self.cfg["max_request_bytes"],
                                                               self.cfg["read_timeout"]))
                    except wire.WireError as exc:
                        fields.update(verdict="bad-request", reason=str(exc))
                        wire.send_quietly(conn, wire.err(exc))
                        return
                    fields["op"] = req.get("op") if isinstance(req.get("op"), str) else repr(req.get("op"))[:64]
                    if isinstance(req.get("action"), str):
                        fields["action"] = req["action"][:64]
                    try:
                        with self.requests.acquire(cell["slot"]):
                            reply = wire.ok(self.dispatch(cell, req))
                        fields["verdict"] = "ok"
                    except wire.Busy as exc:
                        reply = wire.err(exc)
                        fields.update(self.busy_fields(exc))
                    except OpError as exc:
                        reply = wire.err(exc)
                        fields.update(verdict="denied", reason=str(exc)[:300])
                    except Exception as exc:  # never let one request take the daemon down
                        reply = wire.err("internal error")
                        fields.update(verdict="error", reason="%s: %s" % (type(exc).__name__, exc))
                    wire.send_quietly(conn, reply)
                finally:
                    # the slot's connection ends here, before the socket is closed (released once:
                    # serve_connections too): a client that reads to the end of the connection may
                    # open its next one at once, without a false "busy"
                    if isinstance(admitted, wire.Hold):
                        admitted.release()
        except Exception as exc:
            fields.update(verdict="error", reason="%s: %s" % (type(exc).__name__, exc))
        finally:
            fields["duration_ms"] = round((time.monotonic() - t0) * 1000, 1)
            audit(self.log, AUDIT_EVENT, **fields)

    @staticmethod
    def busy_fields(exc: wire.Busy) -> Dict[str, object]:
        """Audit fields of a refusal for capacity (wire.Busy): the quota, its value, the slot."""
        return {"slot": exc.slot, "verdict": "busy", "quota": exc.quota, "limit": exc.limit,
                "reason": str(exc)[:300]}

    def serve(self, listener: socket.socket) -> None:
        busy = ("busy: chv-broker serves at most %d connections at once (max_connections); retry later"
                % self.max_connections)
        wire.serve_connections(
            listener, self._stop, self.max_connections, self.handle, busy,
            on_busy=lambda exc: audit(self.log, AUDIT_EVENT, op=None, duration_ms=0, **self.busy_fields(exc)),
            admit=self.admit)

    def reap(self) -> None:
        """Tell chv-browser to drop contexts of slots whose cell is gone."""
        bcfg = self.cfg["browser"]
        while not self._stop.wait(bcfg["reap_interval"]):
            with self._lock:
                seen = set(self.slots_seen)
            if not seen:
                continue
            gone = seen - self.peers.live_slots()
            for slot in gone:
                try:
                    wire.call(bcfg["socket"], {"slot": slot, "action": "close"}, bcfg["timeout"])
                except (OSError, wire.WireError):
                    continue
                with self._lock:
                    self.slots_seen.discard(slot)
                audit(self.log, AUDIT_EVENT, slot=slot, op="browser", action="close", verdict="reaped", duration_ms=0)

    def stop(self, *_: object) -> None:
        self._stop.set()


def main(argv: Optional[List[str]] = None, broker_class: Type[Broker] = Broker) -> int:
    """chv-broker; ``broker_class`` is Broker but in a counter-proof's test build
    (testbuild.py), which the entry point never imports."""
    ap = argparse.ArgumentParser(prog="chv-broker")
    ap.add_argument("--config", default="/etc/chv-fleet/broker.json")
    ap.add_argument("--listen", help="bind this Unix socket path instead of socket activation (development)")
    ap.add_argument("--thaw-all", action="store_true",
                    help="thaw every cell's cgroup of the cell records and exit (ExecStartPre=/ExecStopPost=:"
                         " a crashed chv-broker leaves no cell frozen)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config if os.path.exists(args.config) else None)
    if args.thaw_all:
        for d in thaw_all(cfg["cells_dir"], Freezer(systemctl=cfg["sync"]["systemctl"])):
            audit(sys.stderr, AUDIT_EVENT, verdict="thawed", slot=None, op=None, duration_ms=0, cgroup=d)
        return 0
    listener = wire.listener_from_env(os.environ)
    if listener is None:
        if not args.listen:
            ap.error("no socket passed by systemd (LISTEN_FDS) and no --listen")
        # bound under a temporary name, listening, then renamed into place:
        # the path exists only once it accepts connections
        tmp = "%s.%d.tmp" % (args.listen, os.getpid())
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        listener.bind(tmp)
        os.chmod(tmp, 0o666)
        listener.listen(64)
        os.rename(tmp, args.listen)
    broker = broker_class(cfg)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    if cfg["browser"]["enabled"] and cfg["browser"]["reap_interval"] > 0:
        threading.Thread(target=broker.reap, daemon=True).start()
    audit(sys.stderr, AUDIT_EVENT, verdict="started", slot=None, op=None, duration_ms=0,
          max_connections=broker.max_connections, max_connections_per_slot=cfg["max_connections_per_slot"],
          max_requests_per_slot=cfg["max_requests_per_slot"])
    broker.serve(listener)
    return 0
