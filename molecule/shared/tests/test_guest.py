"""The lab guest Molecule converged is a real systemd machine reached over SSH."""
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import yaml


def test_guest_runs_systemd_as_pid1(host):
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"


def test_guest_is_running(host):
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), state


def test_guest_has_unified_cgroup_hierarchy(host):
    assert host.file("/sys/fs/cgroup/cgroup.controllers").exists
    assert host.run("stat -fc %T /sys/fs/cgroup").stdout.strip() == "cgroup2fs"


def test_role_packages_installed(host):
    for pkg in ("systemd-container", "iproute2", "python3"):
        assert host.package(pkg).is_installed, pkg


def test_the_apt_pin_of_the_converge_is_in_force(host):
    """molecule/shared/converge.yml pins iproute2 at the guest's version (chv_cell_apt_pins): the
    preferences file has its stanza, and apt gives that version the pin's priority, 1001; the
    control, python3, unpinned, keeps the default priority of an installed version, 100."""
    version = host.check_output("dpkg-query -W -f '${Version}' iproute2")
    pins = host.file("/etc/apt/preferences.d/chv-fleet").content_string
    assert "\nPackage: iproute2\nPin: version %s\nPin-Priority: 1001\n" % version in pins, pins
    policy = host.check_output("apt-cache policy iproute2 python3")
    iproute2, python3 = policy.split("\npython3:")
    assert "*** %s 1001" % version in iproute2, policy
    assert " 1001" not in python3 and "*** " in python3, policy


def test_install_path_installed_what_the_image_lacked(host):
    """On the minimal image (the trixie scenario) the roles installed their
    packages from the Debian mirror after the guest booted; on baked images
    (the fleet) they came with the image, installed before the guest booted."""
    assert host.run("dpkg-query -W -f '${Status}' systemd-container").stdout == "install ok installed"
    boot = int(host.run("date -d \"$(ps -o lstart= -p 1)\" +%s").stdout)
    # dpkg's log and its rotations (logrotate runs daily, and may have run since the converge); a baked
    # image's logs were emptied when it was made (chv.fleet_lab.lab_generalize): no line at all there
    line = host.run("zcat -f /var/log/dpkg.log* 2>/dev/null | grep ' status installed systemd-container:' | sort "
                    "| tail -n1").stdout.strip()
    installed_since_boot = bool(line) and int(host.check_output("date -d '%s' +%%s" % " ".join(line.split()[:2]))) >= boot
    scenario = yaml.safe_load((Path(os.environ["MOLECULE_SCENARIO_DIRECTORY"]) / "molecule.yml").read_text())
    platform = [p for p in scenario["platforms"] if p["name"] == host.backend.get_hostname()][0]
    minimal = platform.get("image_variant", "baked") == "minimal"
    assert installed_since_boot == minimal, (line, boot)


# The roles install their parts of src/chv_guest (chv.fleet.guest_tree: the
# *.py of each package directory GUEST_TREE names for the role): every module
# of the checkout, with the same bytes, as regular root-owned files, a script
# (first line "#!") executable; the directories of earlier releases are gone.
# A module the copy missed would only show as an ImportError on the guest.
REPO = Path(__file__).parents[3]
PACKAGES = [("cell_runtime", "chv_cell_lib_dir", "chv_cell"),
            ("broker", "chv_broker_install_dir", "chv_broker"),
            ("browser", "chv_browser_install_dir", "chv_browser")]


def guest_tree():
    """GUEST_TREE, imported as the collection's filter (the collections path make exports)."""
    for path in os.environ.get("ANSIBLE_COLLECTIONS_PATH", "").split(os.pathsep):
        if path and path not in sys.path:
            sys.path.append(path)
    from ansible_collections.chv.fleet.plugins.filter.package_sync import GUEST_TREE  # pylint: disable=import-outside-toplevel
    return GUEST_TREE
GUEST_LISTING = (
    "import hashlib, json, os, stat, sys\n"
    "d = sys.argv[1]\n"
    "out = {}\n"
    "for n in sorted(os.listdir(d)):\n"
    "    if n.endswith('.py'):\n"
    "        st = os.lstat(os.path.join(d, n))\n"
    "        with open(os.path.join(d, n), 'rb') as fh:\n"
    "            digest = hashlib.sha256(fh.read()).hexdigest()\n"
    "        out[n] = [digest, stat.S_ISREG(st.st_mode), oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid]\n"
    "print(json.dumps(out))\n")


@pytest.mark.parametrize("role,dir_var,retired", PACKAGES, ids=[p[0] for p in PACKAGES])
def test_every_module_of_the_package_is_installed(host, role, dir_var, retired):
    install_dir = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())[dir_var]
    tree = guest_tree()[role]
    assert tuple(tree["retired"]) == (retired,)
    for package in tree["packages"]:
        expected = {}
        for src in sorted((REPO / "src" / package).glob("*.py")):
            content = src.read_bytes()
            expected[src.name] = [hashlib.sha256(content).hexdigest(), True,
                                  "0o755" if content.startswith(b"#!") else "0o644", 0, 0]
        assert "__init__.py" in expected, (package, expected)
        guest = json.loads(host.check_output("python3 -I -c %s %s", GUEST_LISTING, "%s/%s" % (install_dir, package)))
        assert sorted(guest) == sorted(expected), package
        assert guest == expected, package
    assert not host.file("%s/%s" % (install_dir, retired)).exists  # an earlier release's directory
