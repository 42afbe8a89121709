"""chv-cell audit on a busy guest: the slots it picks, and the cases that
need every slot free (--exclusive), skipped otherwise with the reason."""

import pytest

from chv_guest.cell import audit, catalog

from test_audit import facts, not_passing  # noqa: F401 (the fixture)

NAMES = ["slot0", "slot1", "slot2"]


@pytest.mark.parametrize("busy,slot,reserved,want", [
    ([], None, None, ("slot0", "slot1")),
    (["slot0"], None, None, ("slot1", "slot2")),  # slot0 runs an agent's cell: never slot0
    (["slot0", "slot1"], None, None, ("slot2", None)),  # one free slot: cell A only
    (["slot0", "slot2"], "slot2", None, ("slot2", "slot1")),  # --slot is taken as asked
    ([], None, "slot0", ("slot1", "slot2")),  # the health gate's slot last
    (["slot1", "slot2"], None, "slot0", ("slot0", None)),
    (NAMES, None, None, ("slot0", "slot1")),  # none free: the first ones (their runs report busy)
])
def test_the_audit_takes_free_slots(busy, slot, reserved, want):
    assert audit.choose_slots(NAMES, busy, slot, reserved) == want


def test_the_every_slot_cases_are_life03_only():
    assert catalog.EVERY_SLOT_CASES == ("LIFE-03",)
    assert set(catalog.EVERY_SLOT_CASES) <= set(catalog.LIFECYCLE_CASES)


def test_without_exclusive_life03_is_skipped_with_the_reason_and_strict_mode_decides(facts):  # noqa: F811
    del facts["guest"]["busy"]
    facts["guest"]["busy_skip"] = catalog.EXCLUSIVE_SKIP
    facts["guest"]["busy_control"] = {"extra_rc": 75, "extra_record": {"verdict": "busy", "exit": 75}}
    results = catalog.judge(facts)
    # TEN-07 keeps its control: a run in cell A's slot while the audit held its lock
    assert not_passing(results) == {"LIFE-03": "skip"}
    assert catalog.EXCLUSIVE_SKIP in results["LIFE-03"]["probe"]
    assert "a run in cell A's held slot" in results["TEN-07"]["control"]
    assert audit.verdict_of(results)[:2] == ("passed", 0)
    assert audit.verdict_of(results, strict_skips=True)[:2] == ("failed", audit.EXIT_FAILED)


def test_exclusive_is_an_audit_option():
    from chv_guest.cell import cli

    ns = cli.build_parser().parse_args(["audit", "--exclusive"])
    assert ns.exclusive is True
    assert cli.build_parser().parse_args(["audit"]).exclusive is False


def test_the_fleet_audit_allows_exactly_the_every_slot_skips_with_the_launchers_reason():
    import os

    import yaml

    from testpaths import ROOT

    with open(os.path.join(ROOT, "playbooks", "vars", "audit.yml")) as fh:
        skips = yaml.safe_load(fh)["__chv_fleet_audit_every_slot_skips"]
    assert skips == dict((cid, catalog.EXCLUSIVE_SKIP) for cid in catalog.EVERY_SLOT_CASES)
