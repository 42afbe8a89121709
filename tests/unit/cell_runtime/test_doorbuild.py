"""The doors' test builds of a counter-proof run (chv_guest/cell/doorbuild.py)
and the policy copy that takes cells to them (catalog/loosen.through_doors):
how the installed services run, read from their units; a build started
through the real path (with stand-ins for systemctl and systemd-run, no
systemd here), answering what the installed check refuses and removed
after; a killed counter-proof's build removed by the next one, a running
one's kept."""
import copy
import json
import os
import stat
import subprocess
import sys

import pytest

from testpaths import SRC

from chv_guest.cell import counterproof, doorbuild
from chv_guest.cell import policy as policymod
from chv_guest.cell.catalog import loosen

BROKER_SHOW = ("ExecStart={ path=/usr/bin/python3 ; argv[]=/usr/bin/python3 -I /usr/lib/chv-fleet/chv-broker --config "
               "/etc/chv-fleet/broker.json ; ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; "
               "code=(null) ; status=0/0 }\n")
BROWSER_ENV = "Environment=HOME=/var/lib/chv-browser PLAYWRIGHT_BROWSERS_PATH=/nonexistent PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1\n"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a counter-proof's directory is root's under /run")


def test_how_the_installed_door_runs_is_read_from_its_unit():
    argv = doorbuild.exec_argv(BROKER_SHOW)
    assert argv == ["/usr/bin/python3", "-I", "/usr/lib/chv-fleet/chv-broker", "--config", "/etc/chv-fleet/broker.json"]
    assert doorbuild.how_it_runs(argv) == {"python": "/usr/bin/python3", "install_dir": "/usr/lib/chv-fleet",
                                           "config": "/etc/chv-fleet/broker.json"}
    assert doorbuild.unit_environment(BROWSER_ENV) == {"HOME": "/var/lib/chv-browser",
                                                       "PLAYWRIGHT_BROWSERS_PATH": "/nonexistent",
                                                       "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"}
    with pytest.raises(RuntimeError, match="no ExecStart"):
        doorbuild.exec_argv("ExecStart=\n")  # a unit that is not there
    with pytest.raises(RuntimeError, match="not an interpreter"):
        doorbuild.how_it_runs(["chv-broker"])


def test_the_policy_copy_takes_cells_to_the_builds_and_changes_nothing_else(raw_policy, policy):
    doors = {"cell_run_dir": "/run/chv-audit-build.abc/run", "broker_socket": "/run/chv-audit-build.abc/run/broker.sock",
             "browser_socket": None}
    ctx = {"pol": policy, "doors": doors}
    before = copy.deepcopy(raw_policy)
    loose = counterproof.loosened_policy(raw_policy, counterproof.LOOSENINGS[[lo.name for lo in
                                                                              counterproof.LOOSENINGS].index("IPC-02")],
                                         ctx)
    assert raw_policy == before and policymod.validate(loose) == []
    changed = sorted(k for k in set(loose) | set(raw_policy) if loose.get(k) != raw_policy.get(k))
    assert changed == ["writable_binds"]
    assert [b for b in loose["writable_binds"] if b["target"] == "/run/chv"] == [
        {"source": "/run/chv-audit-build.abc/run", "target": "/run/chv", "optional": False}]
    # with a browser build: browser_socket too (where the launcher ends the run's browser state)
    doors["browser_socket"] = "/run/chv-audit-build.def/sock/browser.sock"
    brw = next(lo for lo in counterproof.LOOSENINGS if lo.name == "BRW-04")
    loose = counterproof.loosened_policy(raw_policy, brw, ctx)
    assert policymod.validate(loose) == [] and loose["browser_socket"] == doors["browser_socket"]
    # a policy that gives cells no /run/chv cannot be taken there: an error, never a run of the real door
    raw_policy["writable_binds"] = []
    with pytest.raises(RuntimeError, match="binds nothing at /run/chv"):
        loosen.through_doors(raw_policy, ctx)


def test_a_case_run_loosens_its_cases_boundary_only():
    assert [lo.name for lo in counterproof.selected(["IPC-03"])] == ["IPC-02"]
    assert [lo.name for lo in counterproof.selected(["IPC-04", "BRW-04"])] == ["IPC-04", "BRW-04"]
    assert counterproof.selected([]) == counterproof.LOOSENINGS


def _script(path, text):
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def stand_ins(tmp_path):
    """systemctl (show: the broker's unit running this checkout's server; stop:
    logged) and systemd-run (runs the command after "--"), side by side."""
    entry = os.path.join(SRC, "chv-broker")
    config = tmp_path / "broker.json"
    cells = tmp_path / "cells"
    cells.mkdir()
    config.write_text(json.dumps({"cells_dir": str(cells), "slots": 2, "read_timeout": 2.0,
                                  "sync": {"enabled": False}, "browser": {"enabled": False}}))
    calls = tmp_path / "calls"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _script(bindir / "systemctl", 'echo "$@" >> %s\ncase "$1 $2" in\n'
            '  "show --property=ExecStart") echo "ExecStart={ path=%s ; argv[]=%s -I %s --config %s ; pid=0 }";;\n'
            '  "show --property=User") echo "User=";;\n  "show --property=Environment") echo "Environment=";;\n'
            'esac\n' % (calls, sys.executable, sys.executable, entry, config))
    _script(bindir / "systemd-run", 'while [ "$1" != "--" ]; do shift; done; shift; exec "$@"\n')
    return {"systemd_run": str(bindir / "systemd-run"), "calls": calls}


@needs_root
@pytest.mark.parametrize("variant, answered", [("as-installed", False), ("any-peer", True)])
def test_a_build_starts_through_the_real_path_answers_as_its_variant_and_is_removed(stand_ins, variant, answered):
    doors = doorbuild.DoorBuilds(stand_ins["systemd_run"], cell_gid=100000)
    try:
        doors.start([("broker", variant)])
        paths = doors.paths()
        d = os.path.dirname(paths["cell_run_dir"])
        st = os.stat(d)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 100000, 0o750)  # root and cell A's uid only
        p = subprocess.run([sys.executable, "-I", os.path.join(SRC, "chv_guest", "broker", "client.py"),
                            '{"op": "ping"}'], env={"CHV_BROKER_SOCKET": paths["broker_socket"]},
                           capture_output=True, text=True, timeout=30, check=False)
        assert json.loads(p.stdout)["ok"] is answered, p.stdout  # guest root, outside every cell
    finally:
        doors.stop()
    assert not os.path.exists(d)
    assert "stop -- %s" % doorbuild.scope_of(d) in stand_ins["calls"].read_text()


@needs_root
def test_a_build_that_does_not_start_is_an_error_and_leaves_nothing(stand_ins, tmp_path):
    doors = doorbuild.DoorBuilds(stand_ins["systemd_run"], cell_gid=100000)
    with pytest.raises(RuntimeError, match="did not start"):
        doors.start([("broker", "no-such-variant")])
    d = doors.dirs[0]
    doors.stop()
    assert not os.path.exists(d)


@needs_root
def test_the_next_counter_proof_removes_a_killed_ones_builds_and_keeps_a_running_ones(stand_ins, tmp_path):
    parent = tmp_path / "run"
    parent.mkdir()
    dead = doorbuild.make_run_dir(parent=str(parent))
    live = doorbuild.make_run_dir(parent=str(parent))
    other = parent / "chv-something-else"
    other.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        for d, pid in ((dead, gone.pid), (live, running.pid)):
            with open(os.path.join(d, doorbuild.OWNER_FILE), "w") as fh:
                fh.write("%d\n" % pid)
        systemctl = os.path.join(os.path.dirname(stand_ins["systemd_run"]), "systemctl")
        assert doorbuild.remove_stale(systemctl, str(parent)) == 1
    finally:
        running.kill()
        running.wait()
    assert not os.path.exists(dead) and os.path.isdir(live) and other.is_dir()
    calls = stand_ins["calls"].read_text()
    assert "stop -- %s" % doorbuild.scope_of(dead) in calls and doorbuild.scope_of(live) not in calls


def test_the_next_counter_proof_removes_a_killed_ones_policy_copies_only(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        names = [counterproof.copy_prefix(pid) + "x.json" for pid in (gone.pid, running.pid, os.getpid())]
        for name in names + ["audit-policy-old.json", "cells"]:
            (tmp_path / name).write_text("{}")
        assert counterproof.remove_stale_copies(str(tmp_path)) == 1
    finally:
        running.kill()
        running.wait()
    assert sorted(os.listdir(str(tmp_path))) == sorted(names[1:] + ["audit-policy-old.json", "cells"])
