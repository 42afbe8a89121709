"""What ansible-playbook printed, read back: the recap's counts per host and
site.yml's batches (the integration playbook tests and the Molecule
verifier both read site.yml runs)."""

import configparser
import re

# site.yml's first pre-task: every batch of its deploy play runs it, on each
# host of the batch (the validation play before it runs it once, on every host)
FIRST_TASK = "TASK [Refuse rollout settings from the inventory that Ansible ignores]"
DEPLOY_PLAY = "PLAY [Deploy chv.fleet cells]"


def enabled_callbacks(cfg):
    """The callbacks the ansible.cfg at path `cfg` enables (callbacks_enabled, in order), whose
    output a run with it prints: ANSIBLE_CALLBACKS_ENABLED replaces that list, so a run that adds
    its own starts from this one."""
    config = configparser.ConfigParser()
    config.read(cfg)
    return [c.strip() for c in config.get("defaults", "callbacks_enabled", fallback="").split(",") if c.strip()]


def recap(out):
    """{host: {ok: N, changed: N, ...}} from the last PLAY RECAP."""
    return dict((h, dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", rest)))
                for h, rest in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", out.split("PLAY RECAP")[-1], re.M))


def changed_tasks(out):
    """{host: [the names of the tasks and handlers that changed on it, in order, each once]}."""
    got, task = {}, None
    for line in out.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line[line.index("[") + 1:line.rindex("]")]
            continue
        m = re.match(r"^changed: \[([^\]]+)\]", line)
        if m:
            names = got.setdefault(m.group(1).split(" -> ")[0], [])
            if task not in names:
                names.append(task)
    return got


# ansible-playbook -vvv over SSH: one such line per module run on a host, the interpreter (python3, or
# the versioned name interpreter discovery finds first, such as python3.13 on Debian 13) reading the
# module from stdin (pipelining) or running the AnsiballZ file it put there (pipelining off)
MODULE_RUN = re.compile(r"^<([^>]+)> SSH: EXEC .*python3(?:\.\d+)?(?: \S*/AnsiballZ_\w+\.py)? && sleep 0", re.M)


def module_runs(out):
    """{host address: how many modules ran on it} of a -vvv run over SSH, pipelining on or off."""
    got = {}
    for address in MODULE_RUN.findall(out):
        got[address] = got.get(address, 0) + 1
    return got


def batches(out):
    """site.yml's batches, in order: the hosts of each run of its deploy play's first pre-task."""
    deploy = out.split(DEPLOY_PLAY, 1)[1] if DEPLOY_PLAY in out else ""
    return [sorted(set(re.findall(r"^(?:ok|fatal|skipping|changed): \[([\w-]+)\]", chunk.split("TASK [")[0], re.M)))
            for chunk in deploy.split(FIRST_TASK)[1:]]
