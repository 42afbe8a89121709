"""The macOS launcher: ``chv-cell run -- CMD`` on a darwin policy runs the
payload as the slot's user under ``sandbox-exec`` with the slot's Seatbelt
profile, while cell_nat's pf anchor filters that user's traffic.  The order
of a run, and why the privileges drop before sandbox-exec: docs/macos.md.
Nothing here has run on real macOS yet."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from . import claim as claimmod
from . import launcher as launchermod
from . import policy as policymod
from . import records
from . import seatbelt
from .exits import EXIT_BUSY, EXIT_CONFIG, EXIT_RUNTIME, EXIT_SETUP
from .fsutil import unlink
from .log import log

if TYPE_CHECKING:
    from types import FrameType

PATH = "/usr/bin:/bin:/usr/sbin:/sbin"

# resource module names of the policy's rlimits (those macOS has)
RLIMITS = {
    "NOFILE": "RLIMIT_NOFILE",
    "NPROC": "RLIMIT_NPROC",
    "CORE": "RLIMIT_CORE",
    "CPU": "RLIMIT_CPU",
    "FSIZE": "RLIMIT_FSIZE",
    "DATA": "RLIMIT_DATA",
    "STACK": "RLIMIT_STACK",
    "AS": "RLIMIT_AS",
    "MEMLOCK": "RLIMIT_MEMLOCK",
    "RSS": "RLIMIT_RSS",
}


class Refused(Exception):
    """A run refused before the payload started; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_SETUP) -> None:
        super().__init__(message)
        self.code = code


def profile_path(policy_path: str, slot: policymod.Slot) -> str:
    """Where the role renders the slot's profile: seatbelt/<slot>.sb beside the policy."""
    return os.path.join(os.path.dirname(policy_path), "seatbelt", slot["name"] + ".sb")


def build_argv(policy: policymod.Policy, profile_file: str, cmd: Sequence[str]) -> List[str]:
    """The argv the child execs as the slot user (pure)."""
    cmd = list(cmd)
    if not cmd or not cmd[0]:
        raise Refused("a command is required", EXIT_CONFIG)
    if cmd[0].startswith("-"):
        raise Refused("the command %r starts with '-' (sandbox-exec would read it as an option)" % cmd[0],
                      EXIT_CONFIG)
    return [policy["sandbox_exec"], "-f", profile_file] + cmd


def payload_env(policy: policymod.Policy, slot: policymod.Slot, term: Optional[str] = None) -> Dict[str, str]:
    """The payload's whole environment (pure): nothing of the caller's but TERM."""
    dirs = seatbelt.slot_dirs(policy, slot)
    env = dict(policy.get("setenv") or {})
    env = {k: str(v) for k, v in env.items()}
    env.update({
        "PATH": PATH,
        "HOME": dirs["agent_state"],
        "USER": slot["user"],
        "LOGNAME": slot["user"],
        "TMPDIR": dirs["tmp"] + "/",
        "CHV_CELL": "1",
        "CHV_CELL_SLOT": slot["name"],
        "CHV_WORKSPACE": dirs["workspace"],
    })
    if term:
        env["TERM"] = term
    return env


def rlimits(policy: policymod.Policy) -> List[Tuple[str, int, int]]:
    """(resource constant name, soft, hard) for each of the policy's rlimits macOS has (pure)."""
    out: List[Tuple[str, int, int]] = []
    for key, value in sorted((policy.get("rlimits") or {}).items()):
        name = key[7:] if key.startswith("RLIMIT_") else key
        if name not in RLIMITS:
            continue
        soft, _sep, hard = str(value).partition(":")
        hard = hard or soft
        conv = [-1 if v == "infinity" else int(v) for v in (soft, hard)]
        out.append((RLIMITS[name], conv[0], conv[1]))
    return out


def check_profile(path: str, expected: str, stat: Callable[[str], os.stat_result] = os.stat,
                  read: Optional[Callable[[str], str]] = None) -> None:
    """Refuse unless ``path`` is root's, writable by root only, and holds ``expected``."""
    try:
        st = stat(path)
        text = read(path) if read else _read(path)
    except OSError as exc:
        raise Refused("the slot's Seatbelt profile %s cannot be read (%s): converge the host"
                      % (path, exc.strerror)) from None
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise Refused("the Seatbelt profile %s must be root's and writable by root only" % path)
    if text != expected:
        raise Refused("the Seatbelt profile %s differs from the one the installed policy implies: "
                      "converge the host" % path)


def _read(path: str) -> str:
    with open(path, "r", encoding="utf-8") as fh:
        return fh.read()


def anchor_loaded(policy: policymod.Policy, run: Callable[..., subprocess.CompletedProcess[bytes]] = subprocess.run) -> bool:
    """Whether the pf anchor holds rules (read only)."""
    try:
        proc = run([policy["pfctl"], "-a", policy["pf_anchor"], "-s", "rules"],
                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


class Launcher(launchermod.Launcher):
    """``chv-cell run`` for a darwin policy (launcher.py has the run's
    skeleton; no signals are caught until the payload runs)."""

    def __init__(self, policy: policymod.Policy, verbose: bool = False, caller: Optional[str] = None,
                 policy_path: str = policymod.DEFAULT_POLICY_PATH) -> None:
        super().__init__(policy, verbose=verbose, caller=caller)
        self.policy_path = policy_path

    def refusal(self, shared_network: bool) -> Optional[str]:
        pol = self.policy
        if pol["platform"] != "darwin" or sys.platform != "darwin":
            return "this launcher runs darwin policies on macOS only (policy %s, system %s)" % (
                pol["platform"], sys.platform)
        if shared_network:
            return "--shared-network does not exist on macOS: every cell shares the host's network, filtered by pf"
        return None

    def no_slot(self, slot_name: Optional[str]) -> str:
        return "no slot named %r" % slot_name

    def claim(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
              runtime_max: float) -> launchermod.Claimed:
        locks = [(s, os.path.join(self.policy["state_dir"], "locks", s["name"] + ".lock")) for s in slots]
        try:
            return claimmod.claim_any(locks, wait, label=launchermod.slot_name)
        except claimmod.SlotBusy as exc:
            log("every slot is busy: %s" % exc)
            return EXIT_BUSY

    def run_claimed(self, slot: policymod.Slot, command: Sequence[str], shared_network: bool,
                    runtime_max: float) -> int:
        try:
            return self._run_payload(slot, command, runtime_max)
        except Refused as exc:
            log(str(exc))
            return exc.code

    def _run_payload(self, slot: policymod.Slot, cmd: Sequence[str], limit: float) -> int:
        pol = self.policy
        path = profile_path(self.policy_path, slot)
        check_profile(path, seatbelt.profile(pol, slot))
        if pol["require_ruleset"] and not anchor_loaded(pol):
            raise Refused("pf anchor %s holds no rules (chv.fleet.cell_nat's LaunchDaemon loads it); "
                          "refusing to run without the egress policy" % pol["pf_anchor"])
        argv = build_argv(pol, path, cmd)
        dirs = seatbelt.slot_dirs(pol, slot)
        uid = gid = slot["uid_base"]
        self._fresh_tmp(dirs["tmp"], uid, gid)
        record = os.path.join(pol["state_dir"], "cells", slot["name"] + ".json")
        env = payload_env(pol, slot, os.environ.get("TERM"))
        if self.verbose:
            log("slot %s: user %s (uid %d)%s" % (slot["name"], slot["user"], uid,
                                                 ", for %s" % self.caller if self.caller else ""))
        pid = os.fork()
        if pid == 0:  # the child: become the slot user, then sandbox-exec
            try:
                for name, soft, hard in rlimits(pol):
                    resource.setrlimit(getattr(resource, name), (soft, hard))
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                if os.getuid() != uid or os.geteuid() != uid:
                    os._exit(EXIT_SETUP)
                os.chdir(dirs["workspace"])
                os.execve(argv[0], argv, env)
            except OSError as exc:
                os.write(2, ("chv-cell: cannot start the payload: %s\n" % exc).encode())
            os._exit(EXIT_SETUP)
        try:
            os.makedirs(os.path.dirname(record), mode=0o700, exist_ok=True)
            records.write(record, {"slot": slot["name"], "pid": pid, "uid_base": uid, "uid_size": 1})
            return self._wait(pid, limit)
        finally:
            unlink(record)
            self._fresh_tmp(dirs["tmp"], uid, gid, recreate=False)

    def _wait(self, pid: int, limit: float) -> int:
        def forward(signum: int, _frame: Optional[FrameType]) -> None:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, forward)
        deadline = time.monotonic() + limit if limit else None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            if deadline is not None and time.monotonic() >= deadline:
                os.kill(pid, signal.SIGTERM)
                time.sleep(self.policy["stop_grace"])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                log("runtime_max reached: stopped")
                return EXIT_RUNTIME
            time.sleep(0.05)

    @staticmethod
    def _fresh_tmp(path: str, uid: int, gid: int, recreate: bool = True) -> None:
        subprocess.run(["/bin/rm", "-rf", "--", path], check=False)
        if recreate:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            os.mkdir(path, 0o700)
            os.chown(path, uid, gid)
