"""`ansible-playbook --list-tasks` with each role's platform tasks in it.

Each role's tasks/main.yml includes its tasks/converge.yml (site.yml's fast
path skips that include); it is expanded the same way.

Every role's tasks/main.yml includes its platform's task file dynamically
(`include_tasks: "{{ ansible_facts['system'] | lower }}.yml"`, so that a host
lists no task of another platform), and --list-tasks shows an include, not
what it includes. Run as a script with ansible-playbook's arguments and
CHV_LIST_SYSTEM (Linux or Darwin): the same listing, in which each such
include that --tags selects is followed by the tasks of the file it includes
on that system, loaded as ansible-core's strategy loads an included file
(the include as their parent, so tags are inherited as in a run: the role's
tag from the play, not the include's own tags). A task file named without
the system stays an include. ansible-core does the tag filtering and the
printing itself (ansible.cli.playbook)."""

import os
import sys

from ansible import context
from ansible.cli.playbook import PlaybookCLI
from ansible.playbook.block import Block
from ansible.playbook.helpers import load_list_of_blocks
from ansible.playbook.play import Play
from ansible.playbook.task_include import TaskInclude
from ansible.template import Templar

PLATFORM_KEY = "ansible_facts['system']"
# each role's main.yml includes its tasks from converge.yml (site.yml's fast path skips that include)
BODY = "converge.yml"


def platform_file(task):
    """The task file a platform include names (the template, unrendered), or None."""
    if not isinstance(task, TaskInclude) or task.action not in ("include_tasks", "ansible.builtin.include_tasks"):
        return None
    name = task.args.get("_raw_params") or task.args.get("file")
    return name if isinstance(name, str) and (PLATFORM_KEY in name or name == BODY) else None


def expand(block, play, system, all_vars):
    """block with the tasks of each selected platform include put right after it."""
    tasks = []
    for task in block.block:
        if isinstance(task, Block):
            tasks.append(expand(task, play, system, all_vars))
            continue
        tasks.append(task)
        name = platform_file(task)
        if name is None or not task.evaluate_tags(context.CLIARGS["tags"], context.CLIARGS["skip_tags"], all_vars):
            continue
        loader = play._loader
        rendered = Templar(loader=loader, variables={"ansible_facts": {"system": system}}).template(name)
        path = os.path.join(task._role._role_path, "tasks", rendered)
        parent = task.copy(exclude_parent=True)
        parent._parent = task._parent
        parent.args = {"_raw_params": path}  # rendered, as a run has it (imports in the file are found beside it)
        for inner in load_list_of_blocks(loader.load_from_file(path, trusted_as_template=True), play=play,
                                         parent_block=parent.build_parent_block(), role=task._role,
                                         loader=loader, variable_manager=play._variable_manager):
            tasks.append(expand(inner, play, system, all_vars))
    block.block = tasks
    return block


def main():
    system = os.environ["CHV_LIST_SYSTEM"]
    compile_play = Play.compile

    def compile_expanded(play):
        all_vars = play._variable_manager.get_vars(play=play)
        return [expand(b, play, system, all_vars) for b in compile_play(play)]

    Play.compile = compile_expanded
    PlaybookCLI.cli_executor(["ansible-playbook"] + sys.argv[1:])


if __name__ == "__main__":
    main()
