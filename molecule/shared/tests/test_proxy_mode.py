"""Egress by name on the trixie guest (issue 33, docs/network.md "The
catalog in proxy mode"): test_faults.py's last converges put the guest in
proxy mode (tests/helpers/proxy_guests.py's variables; the scenario's lab
resolver stand-in answers the test names, molecule/trixie/molecule.yml).
chv-cell audit judges the catalog with the EGR cases and the doors through
the proxy, as tests/lab/test_proxy_mode.py does on a bookworm guest (which
also runs the EGR counter-proofs and the sync door through the proxy: they
do not depend on the distribution). After test_faults.py, before nothing:
the guest stays in proxy mode until destroy."""

import pytest

import proxy_guests
from conftest import lab_guest, lab_record, only_in

pytestmark = [only_in("trixie"), pytest.mark.ends_the_guest(order=0)]


def test_in_proxy_mode_the_egr_cases_and_the_doors_pass(host):
    """Every case of proxy mode passes beside its control, the EGR ones
    among them, the browser door's refusals are the proxy's, and the denied
    name's listener sees the guest's own control connection only
    (proxy_guests.check_report)."""
    guest = lab_guest(host)
    # molecule/trixie/molecule.yml names the stand-in's names itself (YAML): they must be these
    assert lab_record()["resolver_names"] == proxy_guests.resolver_names(guest["host_address"])

    def run(cmd):
        with host.sudo():
            return host.run(cmd)

    rep, seen = proxy_guests.audit_guest(run, guest["address"], guest["host_address"])
    proxy_guests.check_report(rep, "trixie", guest["address"], seen)
