"""hack/lane_summary.py: make test's line per lane (passed, failed, skipped,
every skip's reason), read from the lane's own output."""

import importlib.util
import os

from testpaths import ROOT

_SPEC = importlib.util.spec_from_file_location("lane_summary", os.path.join(ROOT, "hack", "lane_summary.py"))
lane_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lane_summary)

LOG = """\
[host] make test: lint passed in 39 s
[host] ........................................................ [100%]
[host] 1662 passed in 196.04s (0:03:16)
[host] make test: units passed in 199 s
[host] =========================== short test summary info ============================
[host] SKIPPED [2] tests/integration/cells/test_socket_families.py:210: this host has no AF_VSOCK transport: the guest control cannot bind one
[host] 48 passed, 2 skipped in 301.2s
[host] FAILED tests/integration/broker/test_x.py::test_y - assert 1 == 2
[host] FAILED - RETRYING: [localhost]: Wait for the guests (119 retries left).
[host] ERROR tests/integration/broker/test_z.py::test_w[ansible://g1]
[host] ============= 1 failed, 84 passed, 1 skipped, 1 error in 88.10s (0:01:28) =============
[host] SKIPPED [1] /work/x/molecule/shared/tests/test_fleet.py:40: distribution-independent: runs in the fleet scenario
[host] make test: integration FAILED after 400 s
"""


def test_counts_every_pytest_run_of_the_lane_and_each_skips_reason():
    s = lane_summary.summarize(LOG)
    assert (s["passed"], s["failed"], s["skipped"], s["errors"]) == (1662 + 48 + 84, 1, 3, 1)
    assert s["skips"] == {
        "test_socket_families.py: this host has no AF_VSOCK transport: the guest control cannot bind one": 2,
        "test_fleet.py: distribution-independent: runs in the fleet scenario": 1}
    assert s["stages"] == [("lint", "passed"), ("units", "passed"), ("integration", "FAILED")]
    out = lane_summary.lines("host", s)
    assert out[0] == "make test: lane host: 1794 passed, 1 failed, 1 errors, 3 skipped; stage FAILED: integration"
    assert s["failures"] == ["FAILED tests/integration/broker/test_x.py::test_y - assert 1 == 2",
                             "ERROR tests/integration/broker/test_z.py::test_w[ansible://g1]"]
    assert out[1:3] == ["  " + f for f in s["failures"]]
    assert out[3:] == ["  skipped 1: test_fleet.py: distribution-independent: runs in the fleet scenario",
                       "  skipped 2: test_socket_families.py: this host has no AF_VSOCK transport: the guest control "
                       "cannot bind one"]


def test_a_lane_without_tests_says_so():
    assert lane_summary.lines("lab", lane_summary.summarize("[lab] make test: lab-tests passed in 3 s\n")) == [
        "make test: lane lab: 0 passed, 0 failed, 0 errors, 0 skipped"]
