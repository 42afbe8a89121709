"""Where the tests find the checkout: the one home of the paths every suite needs."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_FILES = os.path.join(ROOT, "roles", "cell_runtime", "files")
BROKER_FILES = os.path.join(ROOT, "roles", "broker", "files")
BROWSER_FILES = os.path.join(ROOT, "roles", "browser", "files")
# Scripts the tests run inside cells and network namespaces (never imported).
# The test lab: an internal collection (chv.fleet_lab) kept out of the released one.
LAB_COLLECTION = os.path.join(ROOT, "lab")
LAB_ROLE = os.path.join(LAB_COLLECTION, "roles", "lab")
LAB_PLAYBOOKS = os.path.join(LAB_COLLECTION, "playbooks")
PROBES = os.path.join(ROOT, "tests", "probes")
