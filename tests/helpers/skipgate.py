"""No green on skips: under CI=true a skipped test is a failure unless its
reason is on the reviewed list below.

A test that skips because this machine lacks what it needs (root, nspawn,
chromium, Playwright, a Python leg) proves nothing; a run where whole parts
skipped must not look like a run where they passed. Outside CI a skip stays a
skip, so a developer without root can still run what they can.

Every conftest that collects tests (tests/conftest.py,
molecule/shared/tests/conftest.py) imports ``pytest_runtest_makereport``
from here; the hook is found by its name in the conftest's namespace.
"""

import os
import re

import pytest

# The skips a CI run may have, each a regular expression matched against the
# skip's reason (from the start), and why it is not a missing prerequisite.
ALLOWED = {
    # molecule/shared/tests/conftest.py only_in(): a distribution-independent
    # test runs in one named scenario (which must exist: only_in checks) and is
    # skipped by design in the others.
    r"distribution-independent: runs in the \w+ scenario": "proven once, in the named scenario",
    # Opposite outcomes of one property of the machine: the test that shows the
    # refusal where limits cannot be applied skips where they can (and its twin,
    # the enforcement case, runs there instead).
    r"this (host|guest) delegates memory, pids and cpu": "the refusal's twin: limits are enforced here",
    # The AF_VSOCK control needs a vsock transport in the kernel (a Cloud
    # Hypervisor guest has one); the cell's refusal of the family is asserted
    # either way, the guest's own bind is the control only where it can exist.
    r"this host has no AF_VSOCK transport": "the guest control needs a vsock device (docs/security.md)",
}
_ALLOWED = [re.compile(p) for p in ALLOWED]


def strict():
    """CI=true (what .ci/run and CI set)."""
    return os.environ.get("CI", "").lower() == "true"


def allowed(reason):
    """Whether a skip's reason is on the reviewed list."""
    reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return any(p.match(reason) for p in _ALLOWED)


def _reason(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and strict()) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = ("CI=true: %s skipped, and its reason is not on the reviewed list "
                       "(tests/helpers/skipgate.py ALLOWED): %s" % (item.nodeid, reason))
