"""The cordon, the drain's look and the health gate on a busy guest, with
real cells through `chv-cell run` on this machine.

Needs root, systemd-nspawn, ip and nsenter. Its own throwaway policy:
veths lth80..lth82, machines lc-slot0..2, subnets 10.231.80-82.0/24, uid
ranges from 5000000, a private state dir; touches nothing else (no nftables table: the health
checks that need the ruleset or systemd units are not what is tested here,
only which slot its cell takes and the busy verdict).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import cellrt
from cellrt import ENTRY, NEEDS_REAL_CELLS, NOISE
from testpaths import SRC

pytestmark = [pytest.mark.cells] + NEEDS_REAL_CELLS

TAG = "lc%d" % os.getpid()


def slot(i):
    return dict(cellrt.make_slot(i, base=80, uid_base=5000000 + i * 65536, host_prefix="lth8"),
                machine="lc-slot%d" % i)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cordon")
    pol = {
        "version": 1,
        "state_dir": "/run/chv-fleet-%s" % TAG,
        "workspace_root": str(root / "ws"),
        "agent_state_root": str(root / "state"),
        "writable_binds": [],
        # health.py runs in the cell from this tree (a guest has it under /usr/lib/chv-fleet, in every cell)
        "readonly_binds": [{"source": SRC, "target": SRC, "optional": False}],
        "dns_servers": ["192.0.2.53"],
        "claim_timeout": 0,
        "stop_grace": 1,
        "require_ruleset": False,
        "browser_socket": "",
        "slots": [slot(0), slot(1), slot(2)],
    }
    path = str(root / "policy.json")
    with open(path, "w") as fh:
        json.dump(pol, fh)
    yield {"policy": path, "pol": pol}
    shutil.rmtree(pol["state_dir"], ignore_errors=True)


def chv(env, *args, timeout=60):
    r = subprocess.run([sys.executable, "-I", ENTRY, "--policy", env["policy"], *args], capture_output=True,
                       text=True, timeout=timeout, check=False)
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True) if not ln.startswith(NOISE))
    return r


def hold(env, name):
    """A cell in slot ``name`` that runs until its go file appears, then says so."""
    go = os.path.join(env["pol"]["workspace_root"], name, ".go")
    if os.path.exists(go):
        os.unlink(go)
    proc = subprocess.Popen([sys.executable, "-I", ENTRY, "--policy", env["policy"], "run", "--slot", name, "--",
                             "sh", "-c", "until test -e /workspace/.go; do sleep 0.1; done; echo ended-normally"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rec = os.path.join(env["pol"]["state_dir"], "cells", name + ".json")
    end = time.monotonic() + 30
    while not os.path.exists(rec):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no cell record for %s" % name
        time.sleep(0.05)
    return proc, go


def release(proc, go, timeout=30):
    with open(go, "w"):
        pass
    out, err = proc.communicate(timeout=timeout)
    os.unlink(go)
    return proc.returncode, out, err


@pytest.fixture
def cells(env):
    held = []

    def start(name):
        held.append(hold(env, name))
        return held[-1]

    yield start
    for proc, go in held:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    chv(env, "uncordon")


def test_a_cordon_refuses_new_runs_while_a_running_cell_ends_normally(env, cells):
    proc, go = cells("slot0")
    r = chv(env, "cordon", "--reason", "integration test")
    assert r.returncode == 0 and r.stdout.startswith("cordoned: "), r
    # a new run is refused with its own code, naming the cordon and its reason; no cell started
    r = chv(env, "run", "--", "echo", "should-not-run")
    assert r.returncode == 69, r
    assert "should-not-run" not in r.stdout
    assert "cordoned" in r.stderr and "(reason: integration test)" in r.stderr and "another guest" in r.stderr
    assert not os.path.exists(os.path.join(env["pol"]["state_dir"], "cells", "slot1.json"))
    st = chv(env, "status")
    assert st.stdout.splitlines()[0].startswith("cordon: cordoned for ") and "running pid=" in st.stdout
    js = json.loads(chv(env, "status", "--json").stdout)
    assert js["cordoned"] and js["cordon"]["reason"] == "integration test"
    assert [s["state"] for s in js["slots"]] == ["running", "idle", "idle"]
    # the drain's look names the running slot, its pid and age
    d = chv(env, "drain")
    assert d.returncode == 75 and d.stdout.startswith("waiting for 1 cell(s): slot0 (pid %d, running "
                                                      % js["slots"][0]["pid"]), d
    assert d.stdout.rstrip().endswith("; cordoned")
    # the cell started before the cordon keeps running and ends by itself, normally
    assert proc.poll() is None
    rc, out, err = release(proc, go)
    assert rc == 0 and out == "ended-normally\n", err
    d = chv(env, "drain", "--wait", "10")
    assert d.returncode == 0 and d.stdout == "drained: no cell runs (cordoned)\n", d
    # positive control: uncordoned, runs start again
    assert chv(env, "uncordon").stdout == "uncordoned\n"
    r = chv(env, "run", "--", "echo", "runs-again")
    assert r.returncode == 0 and r.stdout == "runs-again\n", r.stderr


def _health(env):
    from chv_guest.cell import health

    # no units, no broker (this machine has neither): the cell check and the busy verdict
    return health.run(env["policy"], [], {"broker_client": "", "allow": [], "deny": []}, claim_timeout=5)


def test_health_takes_the_one_free_slot_and_says_busy_when_none_is(env, cells):
    from chv_guest.cell import health

    held = [cells("slot0"), cells("slot2")]
    checks = _health(env)
    cell = [c for c in checks if c["check"] == "cell runs"]
    # the cell ran in the only free slot (its gateway is slot1's)
    assert cell == [{"check": "cell runs", "ok": True, "detail": "gateway %s" % slot(1)["gateway"]}], checks
    assert health.outcome(checks) != "busy"
    # on a cordoned guest too (the gate runs before its play uncordons)
    assert chv(env, "cordon", "--reason", "gate").returncode == 0
    checks = _health(env)
    assert [c["ok"] for c in checks if c["check"] == "cell runs"] == [True], checks
    assert chv(env, "uncordon").returncode == 0
    held.append(cells("slot1"))
    t = time.monotonic()
    checks = _health(env)
    assert time.monotonic() - t < 5  # no wait for a slot: every one runs a cell
    assert health.outcome(checks) == "busy" and health.exit_code(checks) == 75
    assert checks == [{"check": "cell runs", "ok": False,
                       "detail": "busy, not unhealthy: every slot the check may use runs a cell (slot0, slot1, slot2)"}]
    for proc, go in held:
        rc, out, err = release(proc, go)
        assert rc == 0 and out == "ended-normally\n", err
