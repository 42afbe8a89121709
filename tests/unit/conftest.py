"""Make this checkout importable as ``ansible_collections.chv.fleet``.

A throwaway directory holding ``ansible_collections/chv/fleet`` -> the repo
root goes first on sys.path (and on PYTHONPATH, for subprocesses), so the
tests always exercise this checkout, wherever it is cloned.  Nothing else
belongs here: fixtures live in the conftest.py of each test directory."""

import atexit
import os
import shutil
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COLLECTIONS = tempfile.mkdtemp(prefix='chv-fleet-collections-')
os.makedirs(os.path.join(_COLLECTIONS, 'ansible_collections', 'chv'))
os.symlink(_ROOT, os.path.join(_COLLECTIONS, 'ansible_collections', 'chv', 'fleet'))
atexit.register(shutil.rmtree, _COLLECTIONS, True)
sys.path.insert(0, _COLLECTIONS)
os.environ['PYTHONPATH'] = os.pathsep.join(
    p for p in (_COLLECTIONS, os.environ.get('PYTHONPATH')) if p)
