"""Where the tests find the checkout: the one home of the paths every suite needs."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_FILES = os.path.join(ROOT, "roles", "cell_runtime", "files")
BROKER_FILES = os.path.join(ROOT, "roles", "broker", "files")
BROWSER_FILES = os.path.join(ROOT, "roles", "browser", "files")
# Scripts the tests run inside cells and network namespaces (never imported).
PROBES = os.path.join(ROOT, "tests", "probes")
