"""A task's repository, cloned outside the cell (``chv-cell task start
--repo URL [--ref REF]``, docs/executor.md "The repository of a task").

The clone is chv-broker's sync door's own: its worker (broker/syncrun.py,
``clone_main``) is started as root with ``--jail``, makes the sync's mount
namespace (the slot's workspace is the only slot directory in it), becomes
the slot's uid and gid (so the guest's egress rules for the slot's uids
apply to what it sends: cell_nat's ``door_uids``), and runs git hardened
as for every sync: no hooks, no template, no submodules, no system or
global config, the allowed protocols and hosts of chv-broker's sync
(``chv_broker_sync_protocols``, ``chv_broker_sync_hosts``) only.  The
guest's credential file (``chv_broker_sync_credentials_file``) is read
here, as root, and reaches git only through an unnamed memfd and the
broker's credential helper given on git's command line: the workspace's
``.git/config`` keeps the URL as given (one with a user name or password
is refused) and no credential helper.

In proxy mode (the policy's egress_proxy) the clone's git goes through
the slot's egress proxy, as the sync door's does for a running cell: the
kernel refuses a door's direct connection (cell_nat's ``drop_door_direct``)
and the proxy applies the slot's list of names. The door reaches the
proxy on the slot's gateway address, which the slot's veth holds while a
cell runs; a task's clone comes before its first cell, so the address is
put on the guest's loopback for the clone's length (``door_gateway``).

chv-broker's package is the broker role's: without it (or without its
configuration, the policy's ``broker_config``) a clone is refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from typing import Any, Dict, Iterator, List, Optional

from . import argv as argvmod
from . import exits
from . import policy as policymod

EXIT_CLONE = 76  # EX_PROTOCOL: git could not clone or check out (the remote said no, the ref is missing)


class CloneError(Exception):
    """The clone was refused (``code`` 78: the request; 125: the guest) or git failed (EXIT_CLONE); ``str()`` says why."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _broker() -> Any:
    """chv-broker's server module (the broker role's), or CloneError."""
    try:
        from ..broker import server  # noqa: PLC0415 (the broker role's package: only for a clone)
    except ImportError as exc:
        raise CloneError(exits.EXIT_CONFIG, "task start --repo needs chv-broker's sync (the broker role) on this "
                         "guest: %s" % exc)
    return server


def load_sync_config(policy: policymod.Policy) -> Dict[str, Any]:
    """chv-broker's ``sync`` settings from the policy's ``broker_config``; CloneError when unusable."""
    path = policy.get("broker_config", policymod.DEFAULTS["broker_config"])
    if not path:
        raise CloneError(exits.EXIT_CONFIG, "task start --repo: the policy names no chv-broker configuration "
                         "(broker_config)")
    server = _broker()
    try:
        cfg = server.load_config(path)
    except (OSError, ValueError) as exc:
        raise CloneError(exits.EXIT_CONFIG, "task start --repo: chv-broker's configuration %s cannot be read: %s"
                         % (path, exc))
    errors = server.validate(cfg)
    if errors:
        raise CloneError(exits.EXIT_CONFIG, "task start --repo: chv-broker's configuration %s: %s"
                         % (path, "; ".join(errors)))
    if not cfg["sync"]["enabled"]:
        raise CloneError(exits.EXIT_CONFIG, "task start --repo: chv-broker's sync is disabled on this guest")
    return dict(cfg["sync"])


def clone_into(policy: policymod.Policy, slot: policymod.Slot, url: str, ref: Optional[str]) -> Dict[str, Any]:
    """Clone ``url`` at ``ref`` into the slot's (empty) workspace, as the
    slot, with the guest's credential; {"url", "head", "branch"} or
    CloneError (78: the URL or ref refused; 125: the worker could not
    run; EXIT_CLONE: git failed)."""
    scfg = load_sync_config(policy)
    server = _broker()
    workspace = argvmod.cell_paths(policy, slot)["workspace"]
    credentials = server.read_credentials(scfg["credentials_file"])
    spec = server.worker_spec(scfg, workspace, ".", ["git"], credentials, argvmod.proxy_url(policy, slot))
    spec["clone"] = {"url": url} if ref is None else {"url": url, "ref": ref}
    jail = {"uid": slot["uid_base"], "gid": slot["uid_base"], "workspace": workspace,
            "properties": server.sync_mount_properties(scfg, policy["workspace_root"], workspace)}
    argv = server.worker_argv(scfg) + ["--jail", json.dumps(jail), json.dumps(spec)]
    with door_gateway(policy, slot):
        res = server.run_worker(argv, dict(server.WORKER_ENV), credentials, scfg["max_output_bytes"], scfg["timeout"])
    del credentials
    return clone_result(res, scfg["timeout"], url)


def _ip(policy: policymod.Policy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([policy["ip"]] + list(args), capture_output=True, text=True, check=False)


@contextlib.contextmanager
def door_gateway(policy: policymod.Policy, slot: policymod.Slot) -> Iterator[None]:
    """Proxy mode: the slot's gateway address (/32) on the guest's loopback
    while the block runs, so that the clone's git reaches the slot's proxy
    there (argv.proxy_url) from that address, which squid's ACL for the
    slot matches; removed afterwards (release_gateway), also when the add
    failed or a signal stopped the start. ``replace``: a leftover of a clone
    that was killed is taken over. Outside proxy mode, nothing. CloneError
    125 when the address cannot be added."""
    if not policy.get("egress_proxy"):
        yield
        return
    addr = "%s/32" % slot["gateway"]
    try:
        added = _ip(policy, "addr", "replace", addr, "dev", "lo")
        if added.returncode != 0:
            raise CloneError(exits.EXIT_SETUP, "the clone cannot reach the slot's egress proxy: ip addr replace %s "
                             "dev lo: %s" % (addr, added.stderr.strip()))
        yield
    finally:
        release_gateway(policy, slot)


def release_gateway(policy: policymod.Policy, slot: policymod.Slot) -> None:
    """Proxy mode: the slot's gateway address off the guest's loopback
    (door_gateway's, and a leftover of a clone killed with SIGKILL when the
    slot is emptied: tasks.empty_slot), with the signals a start turns into
    StartStopped held until it is done; the veth of a running cell keeps its
    own. Nothing outside proxy mode."""
    if not policy.get("egress_proxy"):
        return
    # held by handlers of our own (a mask holds them only for the thread that sets it), then sent again
    pending: List[int] = []
    old = dict((s, signal.signal(s, lambda signum, _frame: pending.append(signum)))
               for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))
    try:
        _ip(policy, "addr", "del", "%s/32" % slot["gateway"], "dev", "lo")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for signum in pending:
            os.kill(os.getpid(), signum)


def clone_result(res: Dict[str, Any], timeout: float, url: str) -> Dict[str, Any]:
    """The worker's answer (server.run_worker's result) as the clone's result, or CloneError."""
    if res["ended"] == "timeout":
        raise CloneError(EXIT_CLONE, "the clone timed out after %gs (chv_broker_sync_timeout)" % timeout)
    try:
        answer = json.loads(res["stdout"].decode("utf-8").splitlines()[0])
    except (ValueError, IndexError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict) or res["truncated"]:
        raise CloneError(EXIT_CLONE, "the clone's worker exited %s without an answer: %s"
                         % (res["returncode"], res["stderr"].decode("utf-8", "replace").strip()[-300:]))
    if "cloned" in answer and res["returncode"] == 0:
        return dict(answer["cloned"], url=url)
    reason = str(answer.get("rejected", "no reason given"))
    # git ran and failed: the remote's or the ref's answer; the URL or ref refused: the request's;
    # anything else (the worker's namespace, the workspace): the guest's
    if reason.startswith("git "):
        code = EXIT_CLONE
    elif reason.startswith(("clone URL", "clone ref")):
        code = exits.EXIT_CONFIG
    else:
        code = exits.EXIT_SETUP
    raise CloneError(code, "the clone was refused: " + reason)
