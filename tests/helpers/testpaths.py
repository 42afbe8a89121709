"""Where the tests find the checkout: the one home of the paths every suite needs."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The guest-side programs: the chv_guest package and the chv-cell entry points
# (on sys.path as pytest.ini's pythonpath; subprocesses are given it).
SRC = os.path.join(ROOT, "src")
# Scripts the tests run inside cells and network namespaces (never imported).
# The test lab: an internal collection (chv.fleet_lab) kept out of the released one.
LAB_COLLECTION = os.path.join(ROOT, "lab")
LAB_ROLE = os.path.join(LAB_COLLECTION, "roles", "lab")
LAB_PLAYBOOKS = os.path.join(LAB_COLLECTION, "playbooks")
PROBES = os.path.join(ROOT, "tests", "probes")
# ansible-playbook --list-tasks with the roles' platform task files in the listing.
LIST_TASKS = os.path.join(ROOT, "tests", "helpers", "list_tasks.py")
