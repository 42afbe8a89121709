"""What ansible-playbook printed, read back: the recap's counts per host and
site.yml's batches (the integration playbook tests and the Molecule
verifier both read site.yml runs)."""

import re

# site.yml's first pre-task: every batch runs it, on each host of the batch
FIRST_TASK = "TASK [Refuse rollout settings from the inventory that Ansible ignores]"


def recap(out):
    """{host: {ok: N, changed: N, ...}} from the last PLAY RECAP."""
    return dict((h, dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", rest)))
                for h, rest in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", out.split("PLAY RECAP")[-1], re.M))


def batches(out):
    """site.yml's batches, in order: the hosts of each run of its first pre-task."""
    return [sorted(set(re.findall(r"^(?:ok|fatal|skipping|changed): \[([\w-]+)\]", chunk.split("TASK [")[0], re.M)))
            for chunk in out.split(FIRST_TASK)[1:]]
