"""Helpers shared by the broker and browser verifiers: requests to chv-broker
from inside a real cell (chv-cell run) and from guest processes outside any cell."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

# tests/helpers: what the verifier shares with the integration suites (testpaths, listeners).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "helpers"))

from playbook_output import changed_tasks, enabled_callbacks, recap  # noqa: E402 (tests/helpers, on the path above)
from skipgate import pytest_runtest_makereport  # noqa: E402,F401 (the hook: no green on skips under CI=true)

CLIENT = "/usr/lib/chv-fleet/chv_guest/broker/client.py"
LAB_ROOT = Path(os.environ.get("LAB_ROOT", "/var/lib/chv-fleet-lab"))
# molecule/: one directory per scenario (its molecule.yml)
SCENARIOS = Path(__file__).resolve().parents[2]


# The guests this run verifies (the verifier's --hosts; none: every guest of
# the inventory). Every re-run of ansible-playbook from a test is limited to
# them: in the fleet scenario the suite verifies the canary only.
VERIFIED = []


def pytest_configure(config):
    VERIFIED[:] = [h.split("://")[-1] for h in (config.option.hosts or "").split(",") if h]
    config.addinivalue_line(
        "markers", "ends_the_guest(order=1): runs after every other test and leaves the guest changed (it does not "
                   "restore what it changed: a re-converge would cost a minute, and destroy follows verify); among "
                   "these, a lower order runs first")


def only_in(scenario):
    """A test of something the distribution does not change (the roles' rendering, a re-run's
    result), proven once in the named scenario: every re-run of ansible-playbook costs a minute
    of make test (its time budget; the lanes kept even). A scenario that does not exist is an
    error when the tests are collected, not a test that silently never runs."""
    if not (SCENARIOS / scenario / "molecule.yml").is_file():
        raise ValueError("only_in(%r): no such Molecule scenario (molecule/%s/molecule.yml); scenarios: %s"
                         % (scenario, scenario, ", ".join(sorted(p.parent.name for p in
                                                                 SCENARIOS.glob("*/molecule.yml")))))
    return pytest.mark.skipif(os.environ.get("MOLECULE_SCENARIO_NAME") != scenario,
                              reason="distribution-independent: runs in the %s scenario" % scenario)


def pytest_collection_modifyitems(items):
    """Tests marked ends_the_guest run last, by their order, then in their usual order."""
    def key(item):
        marker = item.get_closest_marker("ends_the_guest")
        return (0, 0) if marker is None else (1, marker.kwargs.get("order", 1))
    items.sort(key=key)


class Reply(object):
    """One client run: exit status (0 ok, 1 refused, 2 no reply) and the reply."""

    def __init__(self, cmd):
        self.rc = cmd.rc
        self.stdout = cmd.stdout
        self.stderr = cmd.stderr
        try:
            self.body = json.loads(cmd.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.body = None

    @property
    def ok(self):
        return self.rc == 0 and self.body is not None and self.body.get("ok") is True

    @property
    def result(self):
        return self.body["result"]

    @property
    def error(self):
        return (self.body or {}).get("error", "")

    def __repr__(self):
        return "Reply(rc=%r, stdout=%r, stderr=%r)" % (self.rc, self.stdout, self.stderr[-2000:])


def in_cell(host, slot, argv):
    """Run argv in a fresh cell of `slot` on the guest."""
    return host.run("chv-cell run --slot %s -- %s" % (slot, " ".join(shlex.quote(a) for a in argv)))


@pytest.fixture(scope="module")
def policy_slots(host):
    """Slot name -> slot identity, from the policy chv-cell uses."""
    with host.sudo():
        policy = json.loads(host.file("/etc/chv-fleet/cell-policy.json").content_string)
    return {s["name"]: s for s in policy["slots"]}


@pytest.fixture(scope="module")
def slots(policy_slots):
    """The slot names (at least two)."""
    names = sorted(policy_slots)
    assert len(names) >= 2, "the broker/browser verifiers need two slots"
    return names


@pytest.fixture
def from_cell(host):
    def request(slot, req):
        return Reply(in_cell(host, slot, ["python3", CLIENT, json.dumps(req)]))
    return request


@pytest.fixture
def from_one_cell(host):
    """Several requests from one cell, in order (chv-broker closes the browser
    context of a slot whose cell is gone, so a page must be used by the cell that opened it)."""
    def requests(slot, reqs):
        script = "; ".join("python3 %s %s; echo" % (CLIENT, shlex.quote(json.dumps(r))) for r in reqs)
        out = in_cell(host, slot, ["sh", "-c", script])
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        replies = []
        for line in lines:
            body = json.loads(line)
            replies.append(body)
        assert len(replies) == len(reqs), (out.rc, out.stdout, out.stderr)
        return replies
    return requests


@pytest.fixture
def from_guest(host):
    """The same client, run by a guest process outside any cell (as `user`)."""
    def request(req, user=None):
        prefix = "" if user is None else "setpriv --reuid=%d --regid=%d --clear-groups " % (user, user)
        return Reply(host.run("%spython3 %s %s" % (prefix, CLIENT, shlex.quote(json.dumps(req)))))
    return request


def unit_value(host, unit, prop):
    return host.check_output("systemctl show -p %s --value %s", prop, unit)


def kill_mid_request(host, unit, slot, argv, ready):
    """Run argv in a cell of `slot` in the background, SIGKILL `unit` once the
    shell condition `ready` holds (it may read the cell's output in $OUT),
    and wait for the cell. Returns (killed MainPID, NRestarts before, the
    cell's output followed by `rc=<its exit status>`)."""
    before = int(unit_value(host, unit, "NRestarts"))
    script = ("OUT=$(mktemp); chv-cell run --slot %s -- %s > $OUT 2>&1 & C=$!; "
              "for i in $(seq 200); do %s && break; sleep 0.1; done; sleep 0.3; "
              "echo killed=$(systemctl show -p MainPID --value %s); systemctl kill --signal=SIGKILL %s; "
              "wait $C; echo rc=$?; cat $OUT; rm -f $OUT"
              % (slot, " ".join(shlex.quote(a) for a in argv), ready, unit, unit))
    out = host.check_output(script)
    return int(out.split("killed=")[1].split()[0]), before, out


def lab_record():
    name = os.environ["MOLECULE_SCENARIO_NAME"]
    return json.loads((LAB_ROOT / "".join(c for c in name if c.isalnum()) / "lab.json").read_text())


def inventory_argv(whole=False):
    """ansible-playbook's inventory (Molecule's inventory directory: its hosts,
    the linked group_vars and host_vars), limited to the verified guests
    unless `whole`."""
    return ["-i", os.path.dirname(os.environ["MOLECULE_INVENTORY_FILE"])] + (
        ["--limit", ",".join(VERIFIED)] if VERIFIED and not whole else [])


def roles_argv(roles, extra_vars):
    """The ansible-playbook command that runs roles of the collection on the
    verified guests with their lab settings (as the converge applies them;
    the guests of one scenario's verify share one distribution) and extra
    variables."""
    guests = [g for g in lab_record()["guests"] if not VERIFIED or g["name"] in VERIFIED]
    extra_vars = dict(guests[0]["vars"], **extra_vars)
    play = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / ("variant-%s.yml" % "-".join(r.split(".")[-1] for r in roles))
    play.write_text(
        "- hosts: all\n  become: true\n  gather_facts: false\n  tasks:\n"
        + "".join("    - ansible.builtin.include_role:\n        name: %s\n" % r for r in roles))
    return ["ansible-playbook"] + inventory_argv() + [str(play), "-e", json.dumps(extra_vars)]


def run_roles(roles, extra_vars, expect_ok=True):
    """Re-run roles (roles_argv) and wait for the run."""
    proc = subprocess.run(roles_argv(roles, extra_vars), capture_output=True, text=True, check=False, timeout=600)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc


CONVERGE = Path(__file__).resolve().parents[2] / "shared" / "converge.yml"
# A run with the fleet_summary callback's lines: the callbacks an operator's
# ansible.cfg enables (docs/examples/ansible.cfg, read here: one list), in
# place of the scenario's own (ANSIBLE_CALLBACKS_ENABLED replaces the list).
SUMMARY_CALLBACKS = ",".join(enabled_callbacks(SCENARIOS.parent / "docs" / "examples" / "ansible.cfg"))


def run_converge(args, expect_ok=True, whole=False, summary=False, env=None):
    """The scenario's own converge (the lab's guest settings, then site.yml)
    again, with extra ansible-playbook arguments (--check, --tags, -e ...),
    on the verified guests (every guest of the inventory with `whole`), with
    the fleet_summary callback's lines at the end when `summary`, and the
    variables of `env` added to the environment.
    Returns (process, {host: recap counts}, [names of the tasks that changed])."""
    env = dict(os.environ, **(env or {}))
    if summary:
        env["ANSIBLE_CALLBACKS_ENABLED"] = SUMMARY_CALLBACKS
    proc = subprocess.run(["ansible-playbook"] + inventory_argv(whole) + [str(CONVERGE)] + list(args),
                          capture_output=True, text=True, check=False, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, out[-4000:]
    changed = []
    for names in changed_tasks(proc.stdout).values():
        changed += [t for t in names if t not in changed]
    return proc, recap(out), changed


def fleet_guest(name):
    """A testinfra host of another guest of the scenario's inventory, by name."""
    import testinfra

    inventory = os.path.dirname(os.environ["MOLECULE_INVENTORY_FILE"])
    return testinfra.get_host("ansible://%s?ansible_inventory=%s" % (name, inventory))


def lab_guest(host):
    """This guest's record in the lab (address, host_address = its gateway on the lab host)."""
    hostname = host.backend.get_hostname()
    return next(g for g in lab_record()["guests"] if g["name"] == hostname)


def guest_ssh(host, user):
    """The lab host's own ssh to this guest as `user`, with the lab's key, as an executor logs in:
    the argv, without the command."""
    return ["ssh", "-i", lab_record()["key"], "-o", "StrictHostKeyChecking=no", "-o",
            "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
            "%s@%s" % (user, lab_guest(host)["address"])]


def over_ssh(ssh, command, tty=False, stdin="", timeout=120, text=True):
    """One command over `ssh` (guest_ssh's argv); stdin is handed over as given (a secret the test
    passes goes there, never on a command line: the guest's journal keeps Ansible's module arguments)."""
    argv = ssh + (["-tt"] if tty else []) + [command]
    return subprocess.run(argv, input=stdin, capture_output=True, text=text, timeout=timeout, check=False)


class OutsideHTTP(object):
    """An HTTP server on the lab host, bound to the guest's gateway there:
    outside the guest, reached from it through its uplink only. `routes` maps
    a path to (status, headers, body, delay seconds); every request is logged."""

    def __init__(self, address, port, routes):
        import http.server
        import threading
        import time

        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                status, headers, body, delay = routes.get(self.path.split("?")[0], (404, {}, b"", 0))
                time.sleep(delay)
                self.send_response(status)
                for key, value in dict({"Content-Type": "text/html"}, **headers).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.url = "http://%s:%d" % (address, port)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def html(title, body):
    return ("<!doctype html><html><head><title>%s</title></head><body>%s</body></html>" % (title, body)).encode()
