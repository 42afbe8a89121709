"""The fleet_summary callback's lines (plugins/module_utils/fleet_summary.py)."""

from ansible_collections.chv.fleet.plugins.module_utils.fleet_summary import MESSAGE_MAX, host_line, summary_lines

OK = {"ok": 40, "changed": 0, "failures": 0, "unreachable": 0}


def test_a_deployed_host_shows_its_changes_batch_drain_and_gate():
    line = host_line("guest-a", dict(OK, changed=3),
                     {"chv_fleet_batch": "1 of 3", "chv_fleet_drain": "restarting chv-broker: 2 look(s)",
                      "chv_fleet_gate": "healthy (7 checks)"}, None)
    assert line == ("guest-a: ok, changed=3, batch: 1 of 3, drain: restarting chv-broker: 2 look(s), "
                    "gate: healthy (7 checks)")


def test_a_failed_host_names_its_first_failure_and_a_rescued_one_does_not():
    failure = ("Check every role's variables", "chv_cell_slots must be >= 1, got 0\n  (more)")
    assert host_line("guest-c", dict(OK, failures=1), {}, failure) == (
        "guest-c: FAILED, changed=0, at \"Check every role's variables\": chv_cell_slots must be >= 1, got 0 (more)")
    # control: the same failure, rescued by a block (no failure in the counts), is not the host's
    assert host_line("guest-c", OK, {}, failure) == "guest-c: ok, changed=0"


def test_unreachable_and_skipped_hosts():
    assert host_line("guest-b", dict(OK, unreachable=1), {}, ("Gather", "ssh: connect refused")) == \
        'guest-b: UNREACHABLE, changed=0, at "Gather": ssh: connect refused'
    assert host_line("guest-b", OK, {"chv_fleet_state": "unreachable, skipped"}, None) == \
        "guest-b: unreachable, skipped, changed=0"


def test_long_messages_are_cut_and_hosts_keep_the_run_order():
    line = host_line("h", dict(OK, failures=1), {}, ("t", "x" * 1000))
    assert len(line) < MESSAGE_MAX + 40 and line.endswith("...")
    got = summary_lines(["b", "a"], {"a": OK, "b": OK}, {}, {})
    assert got == ["b: ok, changed=0", "a: ok, changed=0"]
