"""LIM: the limits a cell runs under (wall clock, tasks)."""

from __future__ import annotations

from .. import exits
from .case import Case, Result, pair, skip
from .facts import Facts


def _lim01(case: Case, facts: Facts) -> Result:
    lim = facts["guest"].get("runtime", {})
    return pair(lim.get("limited_rc") == exits.EXIT_RUNTIME, "exit %s" % lim.get("limited_rc"),
                lim.get("control_rc") == 0, "exit %s" % lim.get("control_rc"))


def _lim02(case: Case, facts: Facts) -> Result:
    g = facts["guest"]
    tasks = g.get("tasks")
    if tasks is None:
        return skip(g.get("tasks_skip", "TasksMax in the policy"))
    return pair(tasks["started"] < tasks["limit"], "threads started: %s of %s asked, TasksMax %s"
                % (tasks["started"], tasks["limit"] + 16, tasks["limit"]), tasks["control"] == 4,
                "4 threads: %s started" % tasks["control"])


CASES = [
    Case("LIM-01", (), "The wall-clock limit stops a cell (exit 124)",
         "--runtime-max 1 -- sleep 30 exits 124",
         "--runtime-max 30 -- true exits 0", _lim01, "the probe sets --runtime-max itself", lifecycle=True),
    Case("LIM-02", (), "The task limit (TasksMax) is enforced", "start TasksMax + 16 threads in a cell",
         "start 4 threads", _lim02,
         "not yet: a TasksMax loosening needs the lifecycle run and a guest with the pids controller delegated",
         lifecycle=True),
]
