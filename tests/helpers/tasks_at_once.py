"""Tasks at once, each pushing its own branch (issue 31): the check shared by
tests/integration/cells/test_task_repo_real.py (chv-cell on this machine)
and molecule/shared/tests/test_executor_tasks.py (over SSH on a guest).
The agent is tests/probes/agent_host.py: each task's AGENT_BRANCH, two
turns, the second pushes; the server is tests/helpers/gitserver.py."""

import threading


def two_turns_each(started, turn):
    """Two turns of every task of ``started`` (task start's JSON), the tasks at
    once: {task id: [the first turn's JSON line, the second's]}; ``turn(task_id)``
    runs one."""
    results = {}

    def work(t):
        results[t["task"]] = [turn(t["task"]), turn(t["task"])]

    threads = [threading.Thread(target=work, args=(t,)) for t in started]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    return results


def assert_each_on_its_own_branch(server, started, branches, results, export):
    """Each task's push is on its own branch of ``server`` (``branches``: each
    one's AGENT_BRANCH, in the order of ``started``), and its export of the
    workspace (``export(task_id, path)``: {member name: text}) holds its own
    result, branch and commits and nothing of the other tasks'."""
    for t, branch in zip(started, branches):
        assert t["task"] in results, ("no turns of the task (its thread failed)", t)
        one, two = results[t["task"]]
        assert two["push"]["ok"] is True and two["push"]["result"]["returncode"] == 0, two["push"]
        assert two["branch"] == branch and server.ref("refs/heads/" + branch) == two["commit"]
        assert server.ref("refs/heads/%s^" % branch) == one["commit"]
        got = export(t["task"], "/workspace")
        assert got["workspace/RESULT.md"] == "result after turn 2 in %s\n" % t["slot"]
        assert got["workspace/.git/HEAD"] == "ref: refs/heads/%s\n" % branch
        assert two["commit"] in got["workspace/.git/refs/heads/" + branch]  # the search below finds what is there
        # nothing of the other tasks: their results, branches or commits
        marks = [m for x, b in zip(started, branches) if x is not t
                 for m in ["result after turn 2 in " + x["slot"], b] + [r["commit"] for r in results[x["task"]]]]
        assert not [n for n, v in got.items() if any(m in v for m in marks)], sorted(got)
