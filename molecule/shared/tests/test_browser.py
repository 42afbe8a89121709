"""chv.fleet.browser on a converged guest, used from real cells through chv-broker.

The pages are served by this module on the lab host, bound to the guest's
gateway there (`/` a page with a known heading, `/slow` answers after 20 s):
outside the guest, as the cells' egress policy allows (the guest's own
services are refused to the browser: test_doors.py). Every refusal sits
beside a request that succeeds.
"""

import json
import shlex
import time

import pytest

from conftest import CLIENT, OutsideHTTP, html, in_cell, kill_mid_request, lab_guest, unit_value

PORT = 18700
HEADING = "Hello from outside the guest"
PNG_MAGIC = "89504e470d0a1a0a"
PAGE_BODY = html("Molecule page", "<h1>%s</h1><p>chv.fleet</p>" % HEADING)


@pytest.fixture(scope="module")
def outside(host):
    server = OutsideHTTP(lab_guest(host)["host_address"], PORT,
                         {"/": (200, {}, PAGE_BODY, 0), "/slow": (200, {}, PAGE_BODY, 20)})
    yield server
    server.close()


@pytest.fixture(scope="module")
def pages(outside):
    return outside.url + "/"


def test_service_runs_as_its_own_user_with_the_socket_for_the_broker_only(host):
    svc = host.service("chv-browser.service")
    assert svc.is_enabled and svc.is_running and host.service("chv-browser.socket").is_running
    assert host.check_output("systemctl show -p User --value chv-browser.service") == "chv-browser"
    assert host.check_output("systemctl show -p SupplementaryGroups --value chv-browser.service") == ""
    sock = host.file("/run/chv-browser/browser.sock")
    assert sock.is_socket and sock.mode == 0o660 and sock.user == "chv-browser" and sock.group == "chv-broker"
    # control: chv-broker (group chv-broker) reaches it, a guest user outside the group does not
    assert "chv-broker" in host.check_output("systemctl show -p SupplementaryGroups --value chv-broker.service")
    probe = ("import socket; s = socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect('/run/chv-browser/browser.sock'); print('connected')\n"
             "except OSError as e:\n    print(e.strerror)\n")
    assert host.check_output("setpriv --reuid=nobody --regid=nogroup --clear-groups python3 -c %s",
                             probe) == "Permission denied"
    assert host.check_output("setpriv --reuid=nobody --regid=nogroup --groups=chv-broker python3 -c %s",
                             probe) == "connected"


def test_open_returns_the_heading_in_the_aria_snapshot(host, pages, slots, from_one_cell):
    opened, again = from_one_cell(slots[0], [{"op": "browser", "action": "open", "url": pages},
                                             {"op": "browser", "action": "snapshot"}])
    assert opened["ok"], opened
    assert opened["result"]["title"] == "Molecule page" and opened["result"]["status"] == 200
    assert 'heading "%s"' % HEADING in opened["result"]["aria_snapshot"], opened
    assert opened["result"]["truncated"] is False
    assert again["ok"] and 'heading "%s"' % HEADING in again["result"]["aria_snapshot"], again


def test_contexts_are_per_slot(host, pages, slots, from_cell, from_one_cell):
    # slot0 has a page (control: its own snapshot works); slot1 sees none
    opened, mine = from_one_cell(slots[0], [{"op": "browser", "action": "open", "url": pages},
                                            {"op": "browser", "action": "snapshot"}])
    assert opened["ok"] and mine["ok"], mine
    theirs = from_cell(slots[1], {"op": "browser", "action": "snapshot"})
    assert theirs.rc == 1 and "no page open" in theirs.error, theirs


def test_screenshot_is_a_png_the_cell_reads_and_only_its_own(host, pages, slots):
    """A cell reads its own screenshot (read-only) and no other slot's; a screenshot does not
    outlive the run that took it (the launcher's end removes the slot's, docs/security.md)."""
    mine, theirs = slots[0], slots[1]

    def shoot_and_look(slot, name):
        # the requests and the look at /run/chv/shots in one cell: the run's end removes its screenshots
        script = ("python3 %s %s; echo; python3 %s %s; echo; python3 -c %s"
                  % (CLIENT, shlex.quote(json.dumps({"op": "browser", "action": "open", "url": pages})),
                     CLIENT, shlex.quote(json.dumps({"op": "browser", "action": "screenshot", "name": name})),
                     shlex.quote("import os\n"
                                 "print(open('/run/chv/shots/%s.png', 'rb').read(8).hex())\n"
                                 "print(sorted(os.listdir('/run/chv/shots')))\n"
                                 "try:\n    open('/run/chv/shots/x', 'w')\nexcept OSError as e:\n"
                                 "    print('write', e.errno)\n" % name)))
        r = in_cell(host, slot, ["sh", "-c", script])
        assert r.rc == 0, (r.stdout, r.stderr)
        opened, shot, magic, listing, write = [ln for ln in r.stdout.splitlines() if ln.strip()]
        assert json.loads(opened)["ok"], opened
        shot = json.loads(shot)
        assert shot["ok"] and shot["result"]["path"] == "/run/chv/shots/%s.png" % name, shot
        assert shot["result"]["bytes"] > 1000, shot
        return magic, listing, write

    # the other slot's screenshot, taken first: gone with its run
    assert shoot_and_look(theirs, "theirs")[1] == "['theirs.png']"
    with host.sudo():
        assert host.run("ls -A /run/chv-shots/%s", theirs).stdout.split() == []
    magic, listing, write = shoot_and_look(mine, "front")
    assert magic == PNG_MAGIC
    assert listing == "['front.png']"  # not the other slot's screenshot
    assert write == "write 30"  # EROFS: the cell's view of its screenshots is read-only


def test_evaluate_and_file_urls_are_refused(host, pages, slots, from_cell):
    control = from_cell(slots[0], {"op": "browser", "action": "open", "url": pages})
    assert control.ok, control
    evaluate = from_cell(slots[0], {"op": "browser", "action": "evaluate", "expression": "document.cookie"})
    assert evaluate.rc == 1 and "browser action must be one of" in evaluate.error, evaluate
    for url in ("file:///etc/passwd", "chrome://version", "javascript:alert(1)", "data:text/html,<h1>x</h1>"):
        refused = from_cell(slots[0], {"op": "browser", "action": "open", "url": url})
        assert refused.rc == 1 and "http and https" in refused.error, (url, refused)


def test_playwright_and_chromium_are_not_reachable_from_a_cell(host):
    # control: on the guest, the service's venv imports playwright and chromium is there
    host.run_expect([0], "/opt/chv-browser/venv/bin/python -c 'import playwright'")
    host.run_expect([0], "test -x /usr/bin/chromium && test -d /usr/lib/chromium")
    probe = ("import os, sys\n"
             "try:\n    import playwright\n    print('playwright imported')\n"
             "except ImportError as e:\n    print('import', type(e).__name__)\n"
             "for p in ('/opt/chv-browser/venv/bin/python', '/usr/bin/chromium', '/usr/lib/chromium/chromium',\n"
             "          '/usr/lib/chv-fleet/chv_guest/browser/server.py'):\n"
             "    try:\n        open(p, 'rb').close(); print(p, 'readable')\n"
             "    except OSError as e:\n        print(p, e.strerror)\n")
    r = in_cell(host, "slot0", ["python3", "-c", probe])
    assert r.rc == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "import ModuleNotFoundError"
    assert lines[1] == "/opt/chv-browser/venv/bin/python No such file or directory"
    assert all(line.endswith("Permission denied") for line in lines[2:]), lines
    r = in_cell(host, "slot0", ["/usr/bin/chromium", "--version"])
    assert r.rc != 0


def test_killed_browser_fails_the_request_then_recovers(host, pages, slots, from_cell):
    # chv-browser is SIGKILLed while it waits for a page that answers after 20 s
    killed, before, out = kill_mid_request(
        host, "chv-browser.service", slots[0],
        ["python3", CLIENT, '{"op": "browser", "action": "open", "url": "%sslow"}' % pages],
        "ss -tnH state established dst %s | grep -q ." % pages.split("/")[2])
    assert killed > 0 and "rc=1" in out and "browser unavailable" in out, out
    host.run_expect([0], "for i in $(seq 100); do systemctl is-active -q chv-browser.service && exit 0; sleep 0.1; done; exit 1")
    after = from_cell(slots[0], {"op": "browser", "action": "open", "url": pages})
    assert after.ok and 'heading "%s"' % HEADING in after.result["aria_snapshot"], after
    assert int(unit_value(host, "chv-browser.service", "NRestarts")) == before + 1


def test_a_stalled_page_in_one_slot_does_not_stall_another(host, outside, pages, slots, from_cell):
    # slot0 waits for a page that answers after 20 s; meanwhile slot1 opens a page and gets it
    asked = outside.requests.count("/slow")
    req = '{"op": "browser", "action": "open", "url": "%sslow"}' % pages
    host.run("systemctl stop chv-molecule-stall.service 2>/dev/null")
    host.run_expect([0], "systemd-run --unit=chv-molecule-stall chv-cell run --slot %s -- python3 %s %s",
                         slots[0], CLIENT, req)
    try:
        for dummy in range(200):
            if outside.requests.count("/slow") > asked:
                break
            time.sleep(0.1)
        assert outside.requests.count("/slow") > asked, host.run("journalctl -u chv-molecule-stall -o cat").stdout
        other = from_cell(slots[1], {"op": "browser", "action": "open", "url": pages})
        assert other.ok and 'heading "%s"' % HEADING in other.result["aria_snapshot"], other
        # slot0's request was still waiting for its page when slot1's answer came
        state = host.run("systemctl show -p ActiveState --value chv-molecule-stall.service").stdout.strip()
        assert state == "active", host.run("journalctl -u chv-molecule-stall -o cat").stdout
    finally:
        host.run("systemctl stop chv-molecule-stall.service; systemctl reset-failed chv-molecule-stall.service")
