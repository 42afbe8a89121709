"""What the launcher's entry module loads (chv_guest.cell.cli, all a plain
`chv-cell run -- CMD` imports at its start; docs/performance.md, issue 36:
the launcher's start is its interpreter and imports). The modules below are
imported only where they are used: the argument parser and the audit's
modules by the other verbs, secrets (with hmac, hashlib and random) by a
new task's id. Each is checked beside its
control: the verb that uses it does import it."""

import subprocess
import sys

import pytest

from testpaths import SRC

# not on a plain run's path
LAZY = ("argparse", "secrets", "hmac", "random", "chv_guest.cell.audit", "chv_guest.cell.counterproof",
        "chv_guest.cell.health", "chv_guest.cell.catalog")


def imported_after(code):
    """The modules of LAZY in sys.modules after ``code``, in a fresh
    interpreter started as the launcher's (python3 -IS)."""
    probe = ("import sys; sys.path.insert(0, %r); %s; "
             "print(' '.join(m for m in %r if m in sys.modules))" % (SRC, code, LAZY))
    out = subprocess.run([sys.executable, "-IS", "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_a_plain_runs_imports_leave_out_the_parser_the_audit_and_secrets():
    assert imported_after("import chv_guest.cell.cli") == []


@pytest.mark.parametrize("code,expected", [
    ("from chv_guest.cell import cli; cli.build_parser()",
     ["argparse", "chv_guest.cell.audit", "chv_guest.cell.counterproof", "chv_guest.cell.health",
      "chv_guest.cell.catalog"]),
    ("from chv_guest.cell import taskrec; taskrec.new_id()", ["secrets", "hmac", "random"]),
])
def test_control_the_verbs_that_use_them_import_them(code, expected):
    got = imported_after(code)
    assert [m for m in expected if m not in got] == [], got
