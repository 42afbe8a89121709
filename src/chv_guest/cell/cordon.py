"""The host's cordon (``chv-cell cordon`` / ``uncordon``): while the marker
``<state_dir>/cordon`` (root's, in the policy's state directory, by default
/run/chv-fleet) exists, a new ``chv-cell run`` is refused with
exits.EXIT_CORDONED and a message naming the cordon and its reason; cells
that run already are untouched.  A rollout's drain cordons a host before it
waits for its cells and uncordons it after the health gate
(docs/operations.md "Cordon and drain"); the executor retries such a run on
another guest (docs/executor.md).

The marker holds one JSON object: {"reason": text, "since": epoch seconds,
"by": who set it}.  Only a regular file owned by root counts (the state
directory is root's; anything else there is not a cordon)."""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from .exits import EXIT_CORDONED
from .fsutil import write_atomic

MARKER = "cordon"
REASON_MAX = 200


def marker_path(state_dir: str) -> str:
    """The cordon marker of a policy's ``state_dir``."""
    return os.path.join(state_dir, MARKER)


def record(reason: Optional[str], now: float, by: str, rollout: bool = False) -> Dict[str, Any]:
    """The marker's content (pure): the reason (one line, at most REASON_MAX
    characters; "" when none was given), when and by whom, and whether a
    rollout's drain set it (``chv-cell cordon --rollout``: the next
    rollout's passed gate lifts it, even when the run that set it was
    killed before its own gate; a cordon set by hand stays)."""
    text = " ".join((reason or "").split())[:REASON_MAX]
    return {"reason": text, "since": round(now, 3), "by": by, "rollout": rollout}


def parse(text: str) -> Dict[str, Any]:
    """The record in a marker's text (pure).  A marker that is not the JSON
    this module writes still cordons the host: its reason says so."""
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        return {"reason": "(unreadable cordon marker)", "since": None, "by": None, "rollout": False}
    since = rec.get("since")
    return {"reason": str(rec.get("reason") or ""),
            "since": since if isinstance(since, (int, float)) and not isinstance(since, bool) else None,
            "by": str(rec["by"]) if rec.get("by") is not None else None,
            "rollout": rec.get("rollout") is True}


def read(state_dir: str) -> Optional[Dict[str, Any]]:
    """The host's cordon, or None when it is not cordoned."""
    path = marker_path(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        # a link or a file root cannot open is no cordon of this module's
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return None
        return parse(os.read(fd, 65536).decode(errors="replace"))
    finally:
        os.close(fd)


def set_cordon(state_dir: str, reason: Optional[str], by: str, now: Optional[float] = None,
               rollout: bool = False) -> Tuple[bool, Dict[str, Any]]:
    """Cordon the host; (False, the cordon there) when it was cordoned already
    (kept as it is: its reason, time and setter stay), else (True, the new one)."""
    old = read(state_dir)
    if old is not None:
        return False, old
    os.makedirs(state_dir, mode=0o755, exist_ok=True)
    rec = record(reason, time.time() if now is None else now, by, rollout)
    write_atomic(marker_path(state_dir), json.dumps(rec, sort_keys=True) + "\n", 0o644)
    return True, rec


def clear(state_dir: str, only_rollout: bool = False) -> str:
    """Uncordon the host: "uncordoned", "not cordoned", or with
    ``only_rollout`` "kept" for a cordon a rollout did not set (by hand)."""
    if only_rollout:
        rec = read(state_dir)
        if rec is None:
            return "not cordoned"
        if not rec["rollout"]:
            return "kept"
    try:
        os.unlink(marker_path(state_dir))
    except FileNotFoundError:
        return "not cordoned"
    return "uncordoned"


def age_text(seconds: float) -> str:
    """A duration for people (pure): 45s, 12m03s, 1h02m, 3d04h."""
    s = max(0, int(seconds))
    if s < 60:
        return "%ds" % s
    if s < 3600:
        return "%dm%02ds" % (s // 60, s % 60)
    if s < 86400:
        return "%dh%02dm" % (s // 3600, s % 3600 // 60)
    return "%dd%02dh" % (s // 86400, s % 86400 // 3600)


def describe(rec: Mapping[str, Any], now: float) -> str:
    """One line naming the cordon (pure): its reason, since when, by whom."""
    parts = ["cordoned"]
    if rec.get("since") is not None:
        parts.append("for %s" % age_text(now - float(rec["since"])))
    if rec.get("by"):
        parts.append("by %s" % rec["by"])
    return "%s (reason: %s)" % (" ".join(parts), rec.get("reason") or "none given")


def refusal(rec: Mapping[str, Any], now: float) -> str:
    """What a run refused on a cordoned host logs (pure)."""
    return ("this guest is %s: no new cell starts here until `chv-cell uncordon`; running cells are untouched; "
            "retry on another guest (exit %d)" % (describe(rec, now), EXIT_CORDONED))


# ------------------------------------------------------------- the drain

def drain_line(running: Iterable[Tuple[str, Optional[int], Optional[float]]], now: float,
               cordon: Optional[Mapping[str, Any]]) -> str:
    """The drain's progress line (pure): ``running``: (slot, pid, started)
    of each cell the drain waits for; ``cordon``: the host's, or None."""
    cells = sorted(running, key=lambda r: r[0])
    state = "cordoned" if cordon is not None else "NOT cordoned (new cells may start)"
    if not cells:
        return "drained: no cell runs (%s)" % state
    named = ", ".join("%s (pid %s, running %s)"
                      % (slot, pid if pid is not None else "?", age_text(now - started) if started is not None else "?")
                      for slot, pid, started in cells)
    return "waiting for %d cell(s): %s; %s" % (len(cells), named, state)
