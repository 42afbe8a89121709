"""The LaunchDaemon plists of macOS hosts, rendered from the roles'
templates for several variable variants and read with plistlib: each has
the keys launchd needs (Label, ProgramArguments, RunAtLoad, KeepAlive,
UserName), runs what the role means it to run, and a broken one fails the
same checks."""

import plistlib
import shlex
from xml.parsers.expat import ExpatError

import pytest

from darwin_render import darwin_vars, render
from role_defaults import role_defaults

BROKER = darwin_vars("broker")
BROWSER = darwin_vars("browser")
CELL_NAT = darwin_vars("cell_nat")
CELL_RUNTIME = darwin_vars("cell_runtime")
COMMON = darwin_vars("_common")
REQUIRED = {"Label": str, "ProgramArguments": list, "RunAtLoad": bool, "KeepAlive": bool, "UserName": str}


def check_plist(data, label, user, keep_alive):
    plist = plistlib.loads(data.encode())
    for key, kind in REQUIRED.items():
        assert isinstance(plist.get(key), kind), (key, plist.get(key))
    assert plist["Label"] == label
    args = plist["ProgramArguments"]
    assert args and all(isinstance(a, str) and a for a in args) and args[0].startswith("/"), args
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] is keep_alive
    assert plist["UserName"] == user
    assert plist["StandardErrorPath"] == "/var/log/%s.log" % label
    return plist


def broker_vars(**over):
    v = {k: val for k, val in role_defaults("broker").items() if isinstance(val, (str, int))}
    v.update(BROKER)
    v.update(over)
    return v


@pytest.mark.parametrize("over", [{}, {"chv_broker_install_dir": "/opt/chv fleet", "chv_broker_group": "_chvbroker",
                                       "chv_broker_socket_path": "/run/chv/b&r.sock"}])
def test_the_broker_plist(over):
    v = broker_vars(**over)
    plist = check_plist(render("broker", "chv-broker.plist.j2", **v), BROKER["__broker_launchd_label"], "root", True)
    assert plist["ProgramArguments"] == [BROKER["__broker_python"], "-I", v["chv_broker_install_dir"] + "/chv-broker",
                                         "--config", v["chv_broker_config_path"], "--listen", v["chv_broker_socket_path"]]
    assert plist["GroupName"] == v["chv_broker_group"] and plist["Umask"] == 0o077


@pytest.mark.parametrize("user", ["chv-browser", "_chvbrowser"])
def test_the_browser_plist(user):
    v = {k: val for k, val in role_defaults("browser").items() if isinstance(val, (str, int))}
    v.update(BROWSER)
    v["chv_browser_user"] = user
    plist = check_plist(render("browser", "chv-browser.plist.j2", **v), BROWSER["__browser_launchd_label"], user, True)
    assert plist["ProgramArguments"] == [v["chv_browser_venv"] + "/bin/python", "-I",
                                         v["chv_browser_install_dir"] + "/chv-browser", "--config", v["chv_browser_config_path"]]
    assert plist["GroupName"] == user
    assert plist["EnvironmentVariables"]["HOME"] == v["chv_browser_state_dir"]


def test_the_pf_loader_plist_loads_the_anchor_and_never_pf_conf():
    data = render("cell_nat", "pf-loader.plist.j2", **CELL_NAT)
    plist = check_plist(data, CELL_NAT["__cell_nat_pf_label"], "root", False)
    assert plist["ProgramArguments"] == [CELL_NAT["__cell_nat_pfctl"], "-E", "-a", CELL_NAT["__cell_nat_pf_anchor"],
                                         "-f", CELL_NAT["__cell_nat_pf_anchor_file"]]
    assert CELL_NAT["__cell_nat_pf_anchor_file"].startswith("/etc/pf.anchors/")
    assert "/etc/pf.conf" not in plist["ProgramArguments"]
    # the anchor is one the stock pf.conf evaluates (anchor "com.apple/*")
    assert CELL_NAT["__cell_nat_pf_anchor"].startswith("com.apple/")


def tmpfiles_dirs(text):
    """(path, mode, owner, group) of each "d" line of a tmpfiles.d text."""
    return [tuple(line.split()[1:5]) for line in text.splitlines() if line.startswith("d ")]


def rundirs_commands(plist):
    assert plist["ProgramArguments"][:2] == ["/bin/sh", "-ec"]
    return [shlex.split(c) for c in plist["ProgramArguments"][2].split("; ")]


def expected_commands(dirs):
    gid0 = {"root": "0"}
    return [[COMMON["__common_install"], "-d", "-m", mode, "-o", gid0.get(owner, owner), "-g", gid0.get(group, group), path]
            for path, mode, owner, group in dirs]


def test_the_cell_runtime_rundirs_plist_makes_the_tmpfiles_directories():
    tmpfiles = render("cell_runtime", "chv-fleet-tmpfiles.conf.j2")
    dirs = tmpfiles_dirs(tmpfiles)
    assert ("/run/chv-fleet", "0700", "root", "root") in dirs
    data = render("_common", "chv-fleet-rundirs.plist.j2", __chv_rundirs_label=CELL_RUNTIME["__cell_runtime_rundirs_label"],
                  __chv_rundirs_tmpfiles=tmpfiles,
                  __common_install=COMMON["__common_install"])
    plist = check_plist(data, CELL_RUNTIME["__cell_runtime_rundirs_label"], "root", False)
    assert rundirs_commands(plist) == expected_commands(dirs)


@pytest.mark.parametrize("slots", [["slot0"], ["slot0", "slot1", "slot2"]])
def test_the_browser_rundirs_plist_makes_its_socket_and_screenshot_directories(slots):
    v = {k: val for k, val in role_defaults("browser").items() if isinstance(val, (str, int))}
    v["chv_browser_slots"] = slots
    tmpfiles = ("d /run/chv-browser 0750 %s %s -\n" % (v["chv_browser_user"], v["chv_browser_broker_group"])
                + render("browser", "chv-browser.tmpfiles.j2", **v))
    dirs = tmpfiles_dirs(tmpfiles)
    assert len(dirs) == 2 + len(slots)
    data = render("_common", "chv-fleet-rundirs.plist.j2", __chv_rundirs_label=BROWSER["__browser_rundirs_label"],
                  __chv_rundirs_tmpfiles=tmpfiles,
                  __common_install=COMMON["__common_install"])
    plist = check_plist(data, BROWSER["__browser_rundirs_label"], "root", False)
    assert rundirs_commands(plist) == expected_commands(dirs)


BREAKAGES = {
    "Label missing": lambda t: t.replace("<key>Label</key>", "<key>Labe1</key>"),
    "RunAtLoad false": lambda t: t.replace("<key>RunAtLoad</key>\n\t<true/>", "<key>RunAtLoad</key>\n\t<false/>"),
    "not XML": lambda t: t.replace("</dict>", "</dic>"),
    "KeepAlive missing": lambda t: t.replace("<key>KeepAlive</key>\n\t<true/>", ""),
    "another user": lambda t: t.replace("<string>root</string>", "<string>nobody</string>"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_checks_reject_a_broken_plist(breakage):
    good = render("broker", "chv-broker.plist.j2", **broker_vars())
    check_plist(good, BROKER["__broker_launchd_label"], "root", True)  # control
    broken = BREAKAGES[breakage](good)
    assert broken != good
    with pytest.raises((AssertionError, plistlib.InvalidFileException, ExpatError)):
        check_plist(broken, BROKER["__broker_launchd_label"], "root", True)
