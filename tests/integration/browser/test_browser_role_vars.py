"""The screenshot quota's role variables, through ansible-playbook on this machine.

The browser role's validate entry point (what site.yml runs before any
change) on chv_browser_shots_keep and chv_browser_shots_max_bytes, and the
configuration the role renders from them (templates/browser.json.j2), read
back by chv-browser's own load_config and its start check.
"""
import json
import os
import subprocess
import sys

from testpaths import ROOT
from chv_guest.browser import server

BIN = os.path.dirname(sys.executable)
PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: chv.fleet.browser, tasks_from: validate, public: true}
    - ansible.builtin.copy:
        dest: "%(out)s"
        mode: "0600"
        content: "{{ lookup('ansible.builtin.template', '%(template)s') }}"
"""


def play(tmp_path, extra):
    out = tmp_path / "browser.json"
    (tmp_path / "play.yml").write_text(PLAYBOOK % {
        "out": out, "template": os.path.join(ROOT, "roles", "browser", "templates", "browser.json.j2")})
    extra = dict(extra, ansible_python_interpreter=sys.executable)
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", json.dumps(extra), str(tmp_path / "play.yml")],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    return proc, (str(out) if out.exists() else None)


def test_the_quota_reaches_the_service_configuration(tmp_path):
    # the least values the role accepts, neither of them chv-browser's own defaults
    proc, out = play(tmp_path, {"chv_browser_shots_keep": 1, "chv_browser_shots_max_bytes": 1048576})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cfg = server.load_config(out)
    assert (cfg["shots_keep"], cfg["shots_max_bytes"]) == (1, 1048576) != \
        (server.DEFAULTS["shots_keep"], server.DEFAULTS["shots_max_bytes"])
    assert server.config_problem(cfg) is None


def test_a_bad_quota_fails_naming_the_variable_and_its_value(tmp_path):
    proc, out = play(tmp_path, {"chv_browser_shots_keep": 0, "chv_browser_shots_max_bytes": 1048575})
    assert proc.returncode != 0 and out is None
    assert '"msg": "chv_browser_shots_keep must be at least 1, not 0"' in proc.stdout, proc.stdout[-3000:]
    assert '"msg": "chv_browser_shots_max_bytes must be at least 1048576, not 1048575"' in proc.stdout
    # only the bad one is named
    proc, out = play(tmp_path, {"chv_browser_shots_keep": 5, "chv_browser_shots_max_bytes": 1048575})
    assert proc.returncode != 0 and out is None
    assert "chv_browser_shots_keep must be" not in proc.stdout
    assert '"msg": "chv_browser_shots_max_bytes must be at least 1048576, not 1048575"' in proc.stdout
