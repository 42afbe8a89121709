"""site.yml on hosts of platforms chv.fleet does not support: each fails in
the first role's checks (the roles' validate entry points, which site.yml
runs before the first role), before any change, naming its distribution and
release and the supported platforms; beside them Debian 12 and 13 pass that
check and load their variables.

Every host is this machine (ansible_connection local) and the run is
`--check --tags nothing`, as in test_site_rollout.py: only the always-tagged
pre-tasks run, all read-only. Each host's facts come from the real setup
module, run in a mount namespace of its own in which /etc/os-release (and
/etc/debian_version or /etc/redhat-release) describe the host's platform
and /proc/1/comm says systemd (the rollout's support check skips a host
without systemd before any role looks at its platform, and this machine's
init may be another program): the host's ansible_python_interpreter is a
wrapper that lays those files over /etc (a read-only overlay) and
/proc/1/comm and runs this Python. The Debian 12 host's /etc is this
machine's own. Needs root (mount namespaces, overlayfs)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from playbook_output import recap
from testpaths import ROOT

BIN = os.path.dirname(sys.executable)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="mount namespaces (unshare, mount --bind) need root")

# Each host's files over /etc.
ETC = {
    # another distribution of the same family: without the platform check its
    # vars/<os_family>.yml (Debian.yml) would load
    "ubuntu2404": {"os-release": 'NAME="Ubuntu"\nVERSION_ID="24.04"\nVERSION="24.04.1 LTS (Noble Numbat)"\n'
                                 'VERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\nUBUNTU_CODENAME=noble\n'},
    # another family: no vars file of any role would load
    "rocky9": {"os-release": 'NAME="Rocky Linux"\nVERSION="9.4 (Blue Onyx)"\nID="rocky"\n'
                             'ID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\n',
               "redhat-release": "Rocky Linux release 9.4 (Blue Onyx)\n"},
    # a release of the supported distribution that is not supported
    "debian11": {"os-release": 'PRETTY_NAME="Debian GNU/Linux 11 (bullseye)"\nNAME="Debian GNU/Linux"\n'
                               'VERSION_ID="11"\nVERSION="11 (bullseye)"\nVERSION_CODENAME=bullseye\nID=debian\n',
                 "debian_version": "11.11\n"},
    # control: the other supported release
    "debian13": {"os-release": 'PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nNAME="Debian GNU/Linux"\n'
                               'VERSION_ID="13"\nVERSION="13 (trixie)"\nVERSION_CODENAME=trixie\nID=debian\n',
                 "debian_version": "13.1\n"},
    # control: this machine's own /etc (Debian 12)
    "debian12": {},
}
UNSUPPORTED = {"ubuntu2404": "Ubuntu 24.04 (Debian family)", "rocky9": "Rocky 9.4 (RedHat family)",
               "debian11": "Debian 11.11 (Debian family)"}
SUPPORTED = {"debian13": "13", "debian12": "12"}

WRAPPER = """#!/bin/sh
# {python}, with the files of {fake}/etc over /etc (a read-only overlay) and
# /proc/1/comm saying systemd, in a mount namespace of its own (gone with it)
exec unshare --mount --propagation private /bin/sh -c '
mount -t overlay chv-fake-etc -o "lowerdir=$0/etc:/etc" /etc || exit 97
mount --bind "$0/comm" /proc/1/comm || exit 97
exec "$@"' {fake} {python} "$@"
"""

# site.yml's validation play: the _common role's platform_vars, once for every role of the run
ROLES = ("cell_runtime", "cell_nat", "broker", "browser")
PLATFORM_TASK = "TASK [chv.fleet._common : Check that chv.fleet supports this platform]"
LOAD_TASK = "TASK [chv.fleet._common : Load the platform's variables of %s]" % ", ".join("chv.fleet." + r for r in ROLES)


def fake_host(tmp_path, name):
    fake = tmp_path / name
    (fake / "etc").mkdir(parents=True)
    (fake / "comm").write_text("systemd\n")
    for filename, content in ETC[name].items():
        (fake / "etc" / filename).write_text(content)
    wrapper = fake / "python"
    wrapper.write_text(WRAPPER.format(fake=fake, python=sys.executable))
    wrapper.chmod(0o755)
    return {"ansible_connection": "local", "ansible_python_interpreter": str(wrapper)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("platforms")
    inventory = {"all": {"children": {"chv_fleet": {"hosts": dict(
        (name, fake_host(tmp_path, name)) for name in ETC)}}}}
    (tmp_path / "inventory.yml").write_text(json.dumps(inventory))
    # one batch, and failed hosts do not stop it: the controls run on after the check
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           os.path.join(ROOT, "site.yml"), "--check", "--tags", "nothing",
                           "-e", json.dumps({"chv_fleet_batches": ["100%"], "chv_fleet_max_fail_percentage": 100})],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    return proc, proc.stdout + proc.stderr


def task_output(out, header):
    """What the task printed, from its header to the next one (the first run of it)."""
    assert header in out, out[-3000:]
    return out.split(header, 1)[1].split("\nTASK [", 1)[0]


def failure(out, host):
    """The task a host failed in and its result."""
    before, line = re.search(r"^(?s:(.*))fatal: \[%s\]: FAILED! => (\{.*\})$" % host, out, re.M).groups()
    return before.rsplit("TASK [", 1)[1].split("]", 1)[0], json.loads(line)


def supported():
    with open(os.path.join(ROOT, "roles", "_common", "vars", "main.yml"), encoding="utf-8") as fh:
        platforms = yaml.safe_load(fh)["__common_platforms"]
    return ", ".join("%(distribution)s %(major)s (%(release)s)" % p for p in platforms)


@pytest.mark.parametrize("host", sorted(UNSUPPORTED))
def test_an_unsupported_platform_fails_in_the_roles_checks_naming_it_and_changes_nothing(run, host):
    proc, out = run
    assert proc.returncode != 0
    task, result = failure(out, host)
    assert task == PLATFORM_TASK[len("TASK ["):-1], task
    assert result["msg"] == (
        "%s: chv.fleet does not support %s until it has a vars file and a Molecule scenario; it supports %s. "
        "chv.fleet changed nothing on this host (docs/operations.md, \"Platforms\")."
        % (host, UNSUPPORTED[host], supported())), result["msg"]
    assert "Debian 12 (bookworm), Debian 13 (trixie)" in result["msg"]
    counts = recap(out)[host]
    assert counts["failed"] == 1 and counts["changed"] == 0, counts
    # the host got past the rollout's support check (systemd), and no further than the platform check:
    # its platform's variables were never loaded (Ubuntu's family file, Debian.yml, exists)
    assert "ok: [%s]" % host in task_output(out, "TASK [Gather the facts the roles need]")
    assert "[%s]" % host not in task_output(out, LOAD_TASK)
    assert "[%s]" % host not in out.split(PLATFORM_TASK, 1)[1].split("PLAY RECAP")[0].replace(
        "fatal: [%s]" % host, "", 1)


@pytest.mark.parametrize("host", sorted(SUPPORTED))
def test_debian_12_and_13_pass_the_check_and_load_their_variables(run, host):
    proc, out = run
    # the check is a fail task with a condition: a supported platform skips it
    platform = task_output(out, PLATFORM_TASK)
    assert "skipping: [%s]" % host in platform and "fatal: [%s]" % host not in platform, platform
    loaded = task_output(out, LOAD_TASK)
    # the facts the wrapper gave: Debian, this release (no vars file of its own: Debian.yml serves both),
    # for every role
    for role in ROLES:
        assert "ok: [%s] => (item=%s/vars/Debian.yml)" % (host, role) in loaded, loaded
        assert "skipping: [%s] => (item=%s/vars/Debian_%s.yml)" % (host, role, SUPPORTED[host]) in loaded, loaded
    assert recap(out)[host]["changed"] == 0
