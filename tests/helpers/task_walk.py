"""Every task of a task file or playbook as YAML loads it, the tasks of its
blocks (block, rescue, always) and plays (tasks, pre_tasks, post_tasks,
handlers) included: the one walk of the tests that read the roles' and
playbooks' tasks as written (tests/unit/test_contracts.py,
tests/unit/test_common_entry_points.py)."""

NESTED = ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers")


def walk_tasks(items):
    """Yield each task (or play) dict of ``items``, then the ones nested in it, depth first."""
    for task in items or []:
        if not isinstance(task, dict):
            continue
        yield task
        for key in NESTED:
            yield from walk_tasks(task.get(key))
