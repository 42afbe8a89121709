"""Shared by every suite under tests/ (unit, integration, lab).

Makes this checkout importable as ``ansible_collections.chv.fleet`` (and its
test lab as ``ansible_collections.chv.fleet_lab``): a throwaway directory
holding ``ansible_collections/chv/fleet`` -> the repo root (``fleet_lab`` ->
lab/) goes first on sys.path (and on PYTHONPATH, for subprocesses), so the
tests always exercise this checkout, wherever it is cloned.  Puts
tests/helpers (the suites' shared helper modules, each with a unique name)
on sys.path.  Fixtures live in the conftest.py of each test directory."""

import atexit
import os
import shutil
import sys
import tempfile

from hypothesis import settings

_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'helpers')
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)

from testpaths import LAB_COLLECTION, ROOT  # noqa: E402  # pylint: disable=wrong-import-position
# the hook that fails a skip under CI=true unless its reason is on a reviewed list
from skipgate import pytest_runtest_makereport  # noqa: E402,F401  # pylint: disable=wrong-import-position,unused-import

_COLLECTIONS = tempfile.mkdtemp(prefix='chv-fleet-collections-')
os.makedirs(os.path.join(_COLLECTIONS, 'ansible_collections', 'chv'))
os.symlink(ROOT, os.path.join(_COLLECTIONS, 'ansible_collections', 'chv', 'fleet'))
os.symlink(LAB_COLLECTION, os.path.join(_COLLECTIONS, 'ansible_collections', 'chv', 'fleet_lab'))
atexit.register(shutil.rmtree, _COLLECTIONS, True)
sys.path.insert(0, _COLLECTIONS)
os.environ['PYTHONPATH'] = os.pathsep.join(
    p for p in (_COLLECTIONS, os.environ.get('PYTHONPATH')) if p)

# Property tests check results, never time: hypothesis' default 200 ms
# deadline per example failed under make test's load (four lanes on two
# cores). Timing is make bench's.
settings.register_profile('chv', deadline=None)
settings.load_profile('chv')


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cells: runs real systemd-nspawn cells on this machine (root, nspawn, ip, nsenter needed)"
    )
