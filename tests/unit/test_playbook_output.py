"""tests/helpers/playbook_output.module_runs: one count per module run in a -vvv
log over SSH, with pipelining (the lab's inventory) and without (the AnsiballZ
file put on the host first), and none for the other commands of a module run;
enabled_callbacks: an ansible.cfg's callbacks_enabled, as a list."""

import os

from playbook_output import enabled_callbacks, module_runs
from testpaths import ROOT

TMP = "/root/.ansible/tmp/ansible-tmp-1764800000.1-42-1"
SSH = "<%s> SSH: EXEC ssh -C -o ControlMaster=auto -o ControlPersist=60s -o User=root %s "
PIPELINED = SSH + "'/bin/sh -c '\"'\"'/usr/bin/python3 && sleep 0'\"'\"''"
PUT_FIRST = [
    SSH + "'/bin/sh -c '\"'\"'( umask 77 && mkdir -p \"` echo " + TMP + " `\" ) && sleep 0'\"'\"''",
    "<%s> SSH: EXEC sftp -b - -C -o ControlMaster=auto %s",
    SSH + "'/bin/sh -c '\"'\"'chmod u+x " + TMP + "/ " + TMP + "/AnsiballZ_setup.py && sleep 0'\"'\"''",
    SSH + "'/bin/sh -c '\"'\"'/usr/bin/python3 " + TMP + "/AnsiballZ_setup.py && sleep 0'\"'\"''",
    SSH + "'/bin/sh -c '\"'\"'rm -f -r " + TMP + "/ > /dev/null 2>&1 && sleep 0'\"'\"''",
]


def lines(templates, address):
    return "\n".join(t % (address, address) for t in templates) + "\n"


def test_pipelined_runs_are_counted_per_host():
    out = lines([PIPELINED] * 3, "10.99.61.2") + lines([PIPELINED], "10.99.61.3")
    assert module_runs(out) == {"10.99.61.2": 3, "10.99.61.3": 1}


def test_a_discovered_versioned_interpreter_counts_too():
    # interpreter discovery on Debian 13 (no interpreter_python set) finds python3.13 first
    out = lines([PIPELINED.replace("python3 ", "python3.13 ")] * 2, "10.99.61.2")
    out += lines([t.replace("python3 ", "python3.13 ") for t in PUT_FIRST], "10.99.61.3")
    assert module_runs(out) == {"10.99.61.2": 2, "10.99.61.3": 1}


def test_a_run_without_pipelining_counts_once_not_once_per_command():
    out = lines(PUT_FIRST, "10.99.61.2") * 2
    assert module_runs(out) == {"10.99.61.2": 2}


def test_the_other_commands_alone_are_not_module_runs():
    # the control: the same log without its python3 lines counts nothing
    out = lines([t for t in PUT_FIRST if "python3" not in t], "10.99.61.2")
    assert module_runs(out) == {}


def test_enabled_callbacks_reads_the_list_in_order(tmp_path):
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[defaults]\ncallbacks_enabled = a.b.one,  a.b.two ,\n")
    assert enabled_callbacks(cfg) == ["a.b.one", "a.b.two"]
    # none set, or no file: no callback
    (tmp_path / "none.cfg").write_text("[defaults]\nforks = 5\n")
    assert enabled_callbacks(tmp_path / "none.cfg") == []
    assert enabled_callbacks(tmp_path / "missing.cfg") == []
    # the example an operator starts from: the collection's two
    assert enabled_callbacks(os.path.join(ROOT, "docs", "examples", "ansible.cfg")) == [
        "chv.fleet.fleet_summary", "chv.fleet.worker_gc"]
