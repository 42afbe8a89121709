"""cell_nat_info's ruleset_applied: whether the ruleset file and the door
drop-ins are those chv-cell-nat.service last loaded. The digests file is
written here by sha256sum, the tool the unit runs after each load."""

import subprocess

from ansible_collections.chv.fleet.plugins.modules.cell_nat_info import ruleset_applied


def record(digests, *paths):
    digests.write_text(subprocess.run(["sha256sum", "--"] + [str(p) for p in paths], capture_output=True,
                                      text=True, check=True).stdout)


def test_the_files_as_loaded_are_applied_and_any_change_after_the_load_is_not(tmp_path):
    ruleset, doors, digests = tmp_path / "cell-nat.nft", tmp_path / "door.d", tmp_path / "loaded.sha256"
    doors.mkdir()
    ruleset.write_text("table inet chv_cell {}\n")
    (doors / "chv-browser.nft").write_text("add element inet chv_cell door_uids { 990 }\n")
    (doors / "README").write_text("not included: nft includes *.nft only\n")
    record(digests, ruleset, doors / "chv-browser.nft")
    assert ruleset_applied(str(ruleset), str(doors), str(digests))

    # the ruleset rewritten and not loaded (the run was killed before its reload)
    ruleset.write_text("table inet chv_cell { comment \"new\" }\n")
    assert not ruleset_applied(str(ruleset), str(doors), str(digests))
    record(digests, ruleset, doors / "chv-browser.nft")
    assert ruleset_applied(str(ruleset), str(doors), str(digests))

    # a door drop-in added, changed or removed after the load
    (doors / "other.nft").write_text("add element inet chv_cell door_uids { 991 }\n")
    assert not ruleset_applied(str(ruleset), str(doors), str(digests))
    record(digests, ruleset, doors / "chv-browser.nft", doors / "other.nft")
    assert ruleset_applied(str(ruleset), str(doors), str(digests))
    (doors / "other.nft").unlink()
    assert not ruleset_applied(str(ruleset), str(doors), str(digests))


def test_nothing_recorded_is_not_applied_and_without_the_paths_there_is_nothing_to_compare(tmp_path):
    ruleset = tmp_path / "cell-nat.nft"
    ruleset.write_text("table inet chv_cell {}\n")
    assert not ruleset_applied(str(ruleset), "", str(tmp_path / "missing.sha256"))
    (tmp_path / "empty.sha256").write_text("")
    assert not ruleset_applied(str(ruleset), "", str(tmp_path / "empty.sha256"))
    assert ruleset_applied(None, "", None) and ruleset_applied(str(ruleset), "", None)
