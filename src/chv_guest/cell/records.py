"""A slot's live cell record (``<state_dir>/cells/<slot>.json``): written by
its launcher while a cell runs, read by ``chv-cell status``, the audit and
the broker's peer check."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional

from . import argv as argvmod
from . import policy as policymod
from .fsutil import write_atomic


def write(path: str, rec: Mapping[str, object]) -> None:
    write_atomic(path, json.dumps(rec, sort_keys=True) + "\n", 0o600)


def read_record(policy: policymod.Policy, slot: policymod.Slot) -> Optional[Dict[str, Any]]:
    """The slot's live record, or None when there is none."""
    try:
        with open(argvmod.cell_paths(policy, slot)["record"]) as fh:
            rec = json.load(fh)
    except FileNotFoundError:
        return None
    return rec if isinstance(rec, dict) else {}


def warm_idle(rec: Optional[Dict[str, Any]]) -> bool:
    """A record of a warm cell that has no payload (yet): starting or waiting."""
    return bool(rec and rec.get("warm") and not rec.get("payload"))


def warm_waiting(policy: policymod.Policy, slot: policymod.Slot, rec: Optional[Dict[str, Any]] = None) -> bool:
    """The slot's warm cell is started and waits for a payload (``rec``: its
    record, when the caller has read it already)."""
    rec = read_record(policy, slot) if rec is None else rec
    return warm_idle(rec) and os.path.exists(argvmod.cell_paths(policy, slot)["warm_socket"])


def payload_running(policy: policymod.Policy, slot: policymod.Slot) -> bool:
    """A payload runs in the slot, or a cold cell is starting for one (a
    record that is not an idle warm cell's)."""
    rec = read_record(policy, slot)
    return rec is not None and not warm_idle(rec)
