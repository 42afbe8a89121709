"""One lab of one booted guest, shared by the lab tests that need a guest of
their own but not a converged site.yml (the lab host's input filter, the
slots' disks): one lab_up and lab_down for all of them."""

import json
import os

import pytest

from labtraces import LAB_ROOT, lab_traces
from test_lab import playbook

ONE_GUEST_LAB = "lone"
ONE_GUEST_NETWORK = "10.99.41.0/24"


@pytest.fixture(scope="session")
def one_guest_lab():
    """lab.json of the lab (its "lab" is the lab's name); down after the session, nothing left."""
    rc, dummy_out, raw = playbook("lab_up.yml", "lab_name=" + ONE_GUEST_LAB, "lab_count=1",
                                  "lab_network=" + ONE_GUEST_NETWORK, "lab_browser_wheels=false")
    try:
        assert rc == 0, raw[-3000:]
        with open(os.path.join(LAB_ROOT, ONE_GUEST_LAB, "lab.json")) as fh:
            yield json.load(fh)
    finally:
        playbook("lab_down.yml", "lab_name=" + ONE_GUEST_LAB)
        assert lab_traces(ONE_GUEST_LAB) == []
