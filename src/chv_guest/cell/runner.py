"""The Linux launcher of ``chv-cell run`` (a cold cell; warm.py's WarmCell
starts its cells the same way): claim a slot, start the cell, gate the
payload on the network, relay the exit code, clean up.  Side effects live
here; the argv and the resolver files come from the pure modules."""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from . import argv as argvmod
from . import cgroups
from . import checks
from . import claim as claimmod
from . import disk as diskmod
from . import host
from . import launcher as launchermod
from . import policy as policymod
from . import records
from . import resolver
from . import taskenv
from . import taskrec
from .errors import Interrupted, RuntimeLimit, SetupError
from .exits import EXIT_BUSY, EXIT_NO_TASK, EXIT_RUNTIME, EXIT_SETUP
from .fsutil import ensure_dir, ensure_dir_beneath, ensure_slot_dir, is_mountpoint, unlink, write_atomic
from .log import log


PROPAGATE_DIR = "/run/systemd/nspawn/propagate"
_PR_SET_PDEATHSIG = 1


def _start(cmd: Sequence[str], data: str) -> subprocess.Popen[bytes]:
    """Popen ``cmd`` with ``data`` written to its stdin (closed after), its
    stdout and stderr together in one pipe."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None  # stdin=PIPE
    try:
        proc.stdin.write(data.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    proc.stdin = None  # written and closed: communicate() only reads
    return proc


class TaskGone(Exception):
    """The task of a turn ended (or expired) before its slot was claimed."""


class Launcher(launchermod.Launcher):
    """One ``chv-cell run`` of a Linux policy: a cold cell (launcher.py has
    the run's skeleton)."""

    def __init__(self, policy: policymod.Policy, verbose: bool = False, caller: Optional[str] = None,
                 watch_fds: Optional[Iterable[int]] = None) -> None:
        super().__init__(policy, verbose=verbose, caller=caller, watch_fds=watch_fds)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.exe = "systemd-nspawn"
        # a warm launcher (warm.WarmCell) sets these: nspawn's stdin, the fds
        # the run waits on besides nspawn (its caller's connection), and
        # what its cell record says besides a cold one's
        self.spawn_stdin: Optional[int] = None
        self.wait_fds: List[int] = []
        self.record_extra: Dict[str, Any] = {}
        self.scope = "standalone"  # host.resolve_scope's, and the run's start: set before run_claimed
        self.t0 = 0.0

    # -- stale state ----------------------------------------------------
    def reap(self, slot: policymod.Slot, scope: str) -> None:
        """Remove whatever a dead launcher left for this slot (we hold its lock)."""
        paths = argvmod.cell_paths(self.policy, slot)
        try:
            pid = int((records.read_record(self.policy, slot) or {})["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = None
        if pid and host.pidns(pid) not in (None, host.pidns(os.getpid())) and host.uid_map_matches(pid, slot):
            log("slot %s: killing stale cell (leader pid %d) left by a dead launcher" % (slot["name"], pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        unlink(paths["record"])
        if scope == "standalone":
            for d in cgroups.dirs_for(slot["name"]):
                cgroups.remove_tree(d, kill=True)
        self._wait_ifname_gone(slot)
        self._remove_runtime_files(slot)

    def _wait_ifname_gone(self, slot: policymod.Slot, wait: float = 3.0) -> None:
        """A cell's veth dies with its network namespace, a moment after the
        cell.  One that stays is not ours to delete: fail loudly instead."""
        ifname = slot["host_ifname"]
        deadline = time.monotonic() + wait
        while os.path.exists("/sys/class/net/" + ifname):
            if time.monotonic() > deadline:
                raise SetupError(
                    "interface %s still exists (a cell outside this launcher's control, or a foreign "
                    "interface): not touching it; inspect with 'ip link show %s'" % (ifname, ifname)
                )
            time.sleep(0.01)

    def _remove_runtime_files(self, slot: policymod.Slot) -> None:
        paths = argvmod.cell_paths(self.policy, slot)
        unlink(paths["gate"])
        if os.path.isdir(paths["net_dir"]) and not os.path.islink(paths["net_dir"]):
            shutil.rmtree(paths["net_dir"], ignore_errors=True)
        prop = os.path.join(PROPAGATE_DIR, slot["machine"])
        if os.path.isdir(prop) and not os.path.islink(prop) and not is_mountpoint(prop):
            shutil.rmtree(prop, ignore_errors=True)

    # -- setup ----------------------------------------------------------
    def prepare(self, slot: policymod.Slot, shared_network: bool) -> int:
        p = self.policy
        paths = argvmod.cell_paths(p, slot)
        diskmod.check_slot(p, slot, paths, SetupError)  # policy disk_max: the slot's own file system, or refuse
        state = p["state_dir"]
        ensure_dir(state, 0o700)
        for sub in ("locks", "cells", "net", "gate"):
            ensure_dir(os.path.join(state, sub), 0o700)
        ensure_slot_dir(paths["workspace"], slot["uid_base"])
        ensure_slot_dir(paths["agent_state"], slot["uid_base"])
        for parts in argvmod.alias_mountpoints(p):
            ensure_dir_beneath(paths["agent_state"], parts, 0o755, slot["uid_base"])
        if not shared_network:
            # proxy mode: no resolver at all (the proxy resolves; the guest drops the cell's DNS)
            servers: List[str] = []
            search: List[str] = []
            if not p["egress_proxy"]:
                servers, search = resolver.host_upstream(p["dns_servers"], p["dns_search"])
            ensure_dir(paths["net_dir"], 0o755)
            write_atomic(paths["resolv_conf"], resolver.render_resolv_conf(servers, search), 0o644)
            write_atomic(paths["hosts"], resolver.render_hosts(slot["machine"], slot["address"]), 0o644)
        unlink(paths["gate"])
        os.mkfifo(paths["gate"], 0o600)
        os.chmod(paths["gate"], 0o644)  # cell may read (unmapped "other"), never write
        # O_RDWR never blocks on a FIFO and keeps a writer present, so the
        # cell's reader blocks in read() until we write "go".
        return os.open(paths["gate"], os.O_RDWR | os.O_CLOEXEC)

    def spawn(self, argv: Sequence[str], cgroup_dirs: Iterable[str]) -> subprocess.Popen[bytes]:
        from . import families as familiesmod  # noqa: PLC0415 (spawn's own concern)

        parent = os.getpid()
        libc = self._libc
        procs_files = [os.path.join(d, "cgroup.procs") for d in cgroup_dirs]
        # loaded last in the child, so that nspawn and every process of the
        # cell inherit it (docs/cells.md "Socket families"); no filter, no cell
        try:
            family_filter = familiesmod.filter_for(self.policy["socket_families"])
        except familiesmod.FilterUnavailable as exc:
            raise SetupError(familiesmod.refusal(exc))
        if family_filter is not None:
            self.debug("%s allowed in the cell" % familiesmod.describe(self.policy["socket_families"]))

        def child_setup() -> None:
            # nspawn gets SIGTERM if the launcher dies in any way; nspawn
            # then kills the cell and tears it down (veth included).
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(EXIT_SETUP)
            for f in procs_files:
                with open(f, "w") as fh:
                    fh.write("%d\n" % os.getpid())
            if family_filter is not None:
                try:
                    family_filter.load()
                except BaseException as exc:  # noqa: B036 (say why, then never exec unfiltered)
                    os.write(2, ("chv-cell: %s\n" % familiesmod.refusal(exc)).encode(errors="replace"))
                    os._exit(EXIT_SETUP)

        return subprocess.Popen(
            argv,
            env=argvmod.nspawn_environment(self.policy),
            preexec_fn=child_setup,
            close_fds=True,
            stdin=self.spawn_stdin,
        )

    def wait_leader(self, proc: subprocess.Popen[bytes], pidfd: int, deadline: float) -> int:
        own = host.pidns(os.getpid())
        while True:
            for c in host.children(proc.pid):
                ns = host.pidns(c)
                if ns is not None and ns != own:
                    return c
            if proc.poll() is not None:
                raise SetupError("%s exited with %d before the cell started" % (self.exe, proc.returncode))
            if time.monotonic() > deadline:
                raise SetupError("the cell did not start within %ss" % self.policy["start_timeout"])
            self.sleep(0.002, [pidfd])

    def configure_network(self, slot: policymod.Slot, leader: int, proc: subprocess.Popen[bytes], pidfd: int,
                          deadline: float) -> None:
        p = self.policy
        host_if, cell_if = slot["host_ifname"], slot["cell_ifname"]
        while not (os.path.exists("/sys/class/net/" + host_if) and cell_if in host.netdev_names(leader)):
            if proc.poll() is not None:
                raise SetupError("%s exited with %d before the veth appeared" % (self.exe, proc.returncode))
            if time.monotonic() > deadline:
                raise SetupError("veth %s/%s did not appear within %ss" % (host_if, cell_if, p["start_timeout"]))
            self.sleep(0.002, [pidfd])
        plen = slot["prefixlen"]
        host_cmds = "addr replace %s/%d dev %s\nlink set %s up\n" % (slot["gateway"], plen, host_if, host_if)
        cell_cmds = (
            "link set lo up\n"
            "addr replace %s/%d dev %s\n"
            "link set %s up\n"
            "route replace default via %s dev %s\n" % (slot["address"], plen, cell_if, cell_if, slot["gateway"], cell_if)
        )
        # both sides at once (independent); each must succeed
        started = [
            ("host side " + host_if, _start([p["ip"], "-batch", "-"], host_cmds)),
            ("cell side " + cell_if, _start([p["nsenter"], "-t", str(leader), "-n", p["ip"], "-batch", "-"], cell_cmds)),
        ]
        for what, cmd in started:
            out = cmd.communicate()[0]
            if cmd.returncode != 0:
                raise SetupError("cannot configure the veth (%s): %s" % (what, out.decode(errors="replace").strip()))

    def write_record(self, slot: policymod.Slot, leader: int, **extra: object) -> None:
        paths = argvmod.cell_paths(self.policy, slot)
        rec = {
            "slot": slot["name"],
            "pid": leader,
            "uid_base": slot["uid_base"],
            "uid_size": slot["uid_size"],
            "started": round(time.time(), 3),
        }
        url = argvmod.proxy_url(self.policy, slot)
        if url is not None:  # proxy mode: the doors acting for this cell use the cell's own proxy URL
            rec["egress_proxy"] = url
        rec.update(self.record_extra, **extra)
        records.write(paths["record"], rec)

    # -- stop -----------------------------------------------------------
    def stop(self, proc: subprocess.Popen[bytes], pidfd: Optional[int], leader: Optional[int]) -> None:
        """Orderly stop: SIGTERM the payload, give it stop_grace seconds,
        then SIGTERM nspawn (which SIGKILLs the cell), then SIGKILL."""
        if proc.poll() is not None:
            return
        payload = host.children(leader) if leader else []
        for pid in payload:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for sig, wait in (
            (None, self.policy["stop_grace"] if payload else 0),
            (signal.SIGTERM, 5.0),
            (signal.SIGKILL, 5.0),
        ):
            if sig is not None:
                try:
                    proc.send_signal(sig)
                    if sig == signal.SIGKILL and leader:
                        os.kill(leader, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait
            while proc.poll() is None and time.monotonic() < end:
                if pidfd is None:  # pidfd_open failed after the spawn: poll
                    time.sleep(0.01)
                else:
                    select.select([pidfd], [], [], max(0.0, end - time.monotonic()))
            if proc.poll() is not None:
                return

    def end_doors(self, slot: policymod.Slot) -> None:
        """The cell has stopped and the slot's lock is still held: have
        chv-browser destroy the slot's browser state before anyone can
        claim the slot again (doors.py; warm cells end here too)."""
        from . import doors  # noqa: PLC0415 (the end of a run only)

        outcome, detail = doors.end_browser_slot(
            self.policy.get("browser_socket", policymod.DEFAULTS["browser_socket"]), slot["name"])
        if outcome == "failed":
            log("slot %s: ERROR: chv-browser did not confirm the end of this run (%s): the slot's browser "
                "context may outlive the run until chv-browser sees the next run's cell" % (slot["name"], detail))
        else:
            self.debug("slot %s: browser state: %s (%s)" % (slot["name"], outcome, detail))

    # -- what a warm launcher (warm.WarmCell) changes ------------------
    def cell_command(self, command: Sequence[str]) -> Sequence[str]:
        """What the cell's pid 2 execs once the gate opens: the payload."""
        return command

    def after_gate(self, slot: policymod.Slot, proc: subprocess.Popen[bytes], pidfd: int,
                   runtime_max: float) -> float:
        """Called once the gate is open; returns the run's runtime_max (the
        payload's clock starts when it returns)."""
        return runtime_max

    def on_ready(self, ready: List[int]) -> None:
        """Called with the ``wait_fds`` that became readable while the payload runs."""

    # -- the run (launcher.Launcher.run calls these) ----------------------
    def preflight(self) -> Optional[int]:
        if os.geteuid() != 0:
            log("run must be started as root (it starts systemd-nspawn)")
            self.stage = "setup"
            return EXIT_SETUP
        return None

    def claim_and_run(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
                      runtime_max: float) -> int:
        self.scope = host.resolve_scope(self.policy)
        self.t0 = time.monotonic()
        if self.caller:
            self.debug("run requested by %s" % self.caller)
        self.install_signals()
        self.stage = "setup"
        try:
            return super().claim_and_run(slots, wait, command, shared_network, runtime_max)
        finally:
            self.restore_signals()

    def claim(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
              runtime_max: float) -> launchermod.Claimed:
        p = self.policy
        try:
            ensure_dir(p["state_dir"], 0o700)
            # a warm cell's gate opened before this run's variables were known: a run with some is cold
            warm = [] if shared_network or self.task_id or self.env else [s for s in slots if s["name"] in p["warm_slots"]]
            claimed = self._claim(slots, warm, wait, command, runtime_max)
        except claimmod.SlotBusy:
            log("all %d slot(s) busy (%s) for %gs; giving up" % (len(slots), ", ".join(s["name"] for s in slots), wait))
            self.stage = "busy"
            return EXIT_BUSY
        except TaskGone:
            log("task %s: ended or expired before its turn could start" % self.task_id)
            self.stage = "config"
            return EXIT_NO_TASK
        except Interrupted as exc:
            if exc.reason:
                log("%s; giving up waiting for a slot (exit %d, as on SIGHUP)" % (exc.reason, 128 + exc.signum))
            self.stage = "signal"
            return 128 + exc.signum
        if isinstance(claimed, int):
            # a warm cell ran the payload; a verdict needs its launcher's word
            # on how the payload ended (an older one gives none: "warm")
            self.stage = "claimed" if self.warm_reported else "warm"
        return claimed

    def _claim(self, slots: List[policymod.Slot], warm: List[policymod.Slot], wait: float, command: Sequence[str],
               runtime_max: float) -> launchermod.Claimed:
        """A free slot and its lock, or the exit code of the run a warm cell
        of ``warm`` took (handover.py).  Until ``wait`` has passed (SlotBusy),
        each round offers the payload to the ready warm cells, then tries
        the other slots' locks.  A warm slot's lock is its warm launcher's
        but between two warm cells: a cold run takes it only after
        start_timeout (its warm unit stopped)."""
        start = time.monotonic()
        deadline = start + wait
        locks = [(s, argvmod.cell_paths(self.policy, s)["lock"]) for s in slots]
        cold = [lk for lk in locks if lk[0] not in warm]
        delay = 0.05
        req = None
        if warm:
            from . import handover  # noqa: PLC0415 (only with warm slots: start-up time)

            req = handover.request(self, command, runtime_max)
        while True:
            if warm:
                rc = None if req is None else handover.handover(self, warm, req, self.t0)
                if rc is not None:
                    return rc
                if time.monotonic() - start > self.policy["start_timeout"]:
                    cold = locks
            try:
                return self._claim_open(cold)
            except claimmod.SlotBusy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
            self.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.5)

    def _slot_open(self, slot: policymod.Slot) -> bool:
        """The slot may run this launcher's payload: a plain run's slot is
        no task's, a turn's slot is its task's (taskrec.py)."""
        return taskrec.reserved_by(self.policy, slot["name"]) == self.task_id

    def _claim_open(self, locks: List[Tuple[policymod.Slot, str]]) -> Tuple[policymod.Slot, claimmod.Claim]:
        """One try at the locks of the slots open to this run (SlotBusy when
        none is free).  Checked again once locked: a task's start reserves
        its slot holding the lock (TaskGone: the turn's task is gone)."""
        open_locks = locks if self.task_id else [lk for lk in locks if self._slot_open(lk[0])]
        slot, held = claimmod.claim_any(open_locks, 0, sleep=self.sleep, label=launchermod.slot_name)
        if self._slot_open(slot):
            return slot, held
        held.release()
        if self.task_id:
            raise TaskGone()
        raise claimmod.SlotBusy(slot["name"])

    def before_release(self, slot: policymod.Slot) -> None:
        """A turn's task was used now (its TTL counts from here)."""
        if self.task_id:
            taskrec.touch(self.policy, self.task_id)

    def run_claimed(self, slot: policymod.Slot, command: Sequence[str], shared_network: bool,
                    runtime_max: float) -> int:
        """The cell's whole life in the claimed ``slot`` (``scope`` and ``t0``
        set); its exit code.  The slot's browser state ends here, whatever
        happened, while the caller still holds the lock."""
        p, scope, t0 = self.policy, self.scope, self.t0
        proc = pidfd = gate_fd = leader = None
        cg_dirs: List[str] = []
        rc = EXIT_SETUP
        gate_open = False
        try:
            self.reap(slot, scope)
            if shared_network:
                log("slot %s: WARNING: --shared-network: the cell uses the host's network namespace" % slot["name"])
            gate_fd = self.prepare(slot, shared_network)
            if scope == "standalone":
                cg_dirs = cgroups.dirs_for(slot["name"])
                for d in cg_dirs:
                    os.mkdir(d, 0o755)
                checks.apply_standalone_limits(p, slot, cgroups.cgroup2_dir_for(slot["name"]), self.debug)
            self.paths_probed = host.probe(argvmod.probe_paths(p, slot))
            run_id = str(os.getpid())
            facts = argvmod.HostFacts(scope=scope, existing=self.paths_probed, shared_network=shared_network, run_id=run_id)
            argv = argvmod.build_argv(p, slot, self.cell_command(command), facts)
            if any(a.startswith("--inaccessible=") for a in argv):
                host.ensure_inaccessible_nodes()
            self.debug("slot %s claimed after %.3fs (scope %s)" % (slot["name"], time.monotonic() - t0, scope))
            self.exe = os.path.basename(argv[0])
            proc = self.spawn(argv, cg_dirs)
            pidfd = os.pidfd_open(proc.pid)
            deadline = time.monotonic() + p["start_timeout"]
            leader = self.wait_leader(proc, pidfd, deadline)
            self.leader = leader
            self.write_record(slot, leader)
            # the checks that wait on other processes run at the same time:
            # nft's listing and the user-namespace child start now, the veth
            # is configured meanwhile, their verdicts come before the gate
            listing = checks.list_ruleset(p) if p["require_ruleset"] and not shared_network else None
            userns = None if p["allow_user_namespaces"] else checks.start_userns_restriction(self._libc, leader)
            if not shared_network:
                self.configure_network(slot, leader, proc, pidfd, deadline)
            if scope == "systemd":
                checks.check_scope_limits(p, slot, leader, argvmod.scope_unit(slot, run_id) + ".scope")
            if userns is not None:
                checks.userns_verdict(userns)
            if shared_network:
                pass  # no veth of the slot: the cell is in the host's network namespace
            elif p["require_ruleset"]:
                checks.check_ruleset(p, slot, listing)
            else:
                log("slot %s: WARNING: the cell_nat ruleset is not checked (policy require_ruleset is false)"
                    % slot["name"])
            if self.env:
                self.debug("slot %s: passing %d variable(s) to the payload: %s"
                           % (slot["name"], len(self.env), ", ".join(sorted(self.env))))
            os.write(gate_fd, taskenv.gate_message(self.env))
            gate_open = True
            self.mark_payload_started()
            runtime_max = self.after_gate(slot, proc, pidfd, runtime_max)
            released = time.monotonic()
            self.debug("slot %s: payload released %.3fs after start" % (slot["name"], released - t0))
            while proc.poll() is None:
                if runtime_max:
                    left = released + runtime_max - time.monotonic()
                    if left <= 0:
                        raise RuntimeLimit()
                    self.on_ready(self.sleep(min(left, 3600), [pidfd] + self.wait_fds))
                else:
                    self.on_ready(self.sleep(3600, [pidfd] + self.wait_fds))
            rc = proc.returncode
            self.payload_exit = rc
        except Interrupted as exc:
            if exc.reason:
                log("slot %s: %s; stopping the cell (exit %d, as on SIGHUP)"
                    % (slot["name"], exc.reason, 128 + exc.signum))
            else:
                log("slot %s: stopping on signal %d" % (slot["name"], exc.signum))
            rc = 128 + exc.signum
        except RuntimeLimit:
            log("slot %s: runtime_max of %gs reached; stopping the cell (exit %d)"
                % (slot["name"], runtime_max, EXIT_RUNTIME))
            rc = EXIT_RUNTIME
        except (SetupError, resolver.ResolverError, OSError) as exc:
            log("slot %s: %s" % (slot["name"], exc))
            rc = EXIT_SETUP
        finally:
            if proc is not None:
                self.stop(proc, pidfd, leader)
            self.report(rc)
            if pidfd is not None:
                os.close(pidfd)
            if gate_fd is not None:
                os.close(gate_fd)
            unlink(argvmod.cell_paths(p, slot)["record"])
            for d in cg_dirs:
                cgroups.remove_tree(d, kill=True)
            try:
                if not shared_network:
                    self._wait_ifname_gone(slot)
            except SetupError as exc:
                log("slot %s: %s" % (slot["name"], exc))
                rc = rc or EXIT_SETUP
            self._remove_runtime_files(slot)
            self.end_doors(slot)
            self.debug("slot %s: done in %.3fs, exit %d" % (slot["name"], time.monotonic() - t0, rc))
        return rc
