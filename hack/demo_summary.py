"""Print what `make demo` deployed: roles applied, per-host settings, changed
counts from the converge log, and, where cells exist, the isolation case
catalog (`chv-cell audit`, docs/isolation-cases.md) run in real cells on
each guest, with the executor's path (SSH as the agent user).

usage: demo_summary.py INVENTORY CONVERGE_LOG
"""

import base64
import json
import os
import re
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
# Settings worth showing per host (whatever of them the inventory sets).
SETTINGS = re.compile(r"^(chv_|cell_nat_)")
REPORTS = "/var/lib/chv-fleet/audit"
# the catalog's allowed destination (NET-01) and page (BRW): a listener on this lab host, the guests' gateway
# (tests/helpers and src on PYTHONPATH: the Makefile's demo target)
from listeners import HelloServer  # noqa: E402


def ansible(inventory, *args, **kw):
    proc = subprocess.run([os.path.join(BIN, "ansible"), "-i", inventory, kw.get("limit", "all")] + list(args),
                          capture_output=True, text=True, check=False,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
                                   ANSIBLE_STDOUT_CALLBACK="ansible.builtin.oneline"))
    # the launcher's warnings (stderr; in the lab: limits not enforced) are reported once, not per line
    return {h: out.split(" (stderr) ")[0] for h, out in
            re.findall(r"^(\S+) \| \S+ \| rc=\d+ \| \(stdout\) (.*)$", proc.stdout, re.M)}


def slurp_json(inventory, host, path):
    proc = subprocess.run([os.path.join(BIN, "ansible"), "-i", inventory, host, "-m", "ansible.builtin.slurp", "-a",
                           "src=%s" % path], capture_output=True, text=True, check=False,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
                                   ANSIBLE_STDOUT_CALLBACK="ansible.builtin.oneline"))
    m = re.search(r"^\S+ \| SUCCESS => (\{.*\})$", proc.stdout, re.M)
    return json.loads(base64.b64decode(json.loads(m.group(1))["content"])) if m else None


SPECIAL = "198.18.254.252"  # not Molecule's (198.18.254.253/254): both may run at once


def catalog(inventory, host, address):
    """The catalog on one guest (10 consecutive runs for LIFE-02 here; 100 by default)."""
    src = json.loads(subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True,
                                    check=True).stdout)[0]["prefsrc"]
    # ports inside the lab host's listener range (lab.json listener_ports,
    # docs/lab.md): the lab host refuses guests every other port. TEN-06's
    # stand-in: an address of a special-purpose range (198.18.0.0/15) that
    # no deny entry or carve-out names, on the lab host's loopback for the run
    subprocess.run(["ip", "addr", "replace", SPECIAL + "/32", "dev", "lo"], check=True)
    try:
        with HelloServer(src, 18790) as allow, HelloServer(SPECIAL, 18791) as special:
            ansible(inventory, "-m", "ansible.builtin.command", "-a",
                    "chv-cell audit --runs 10 --metadata-stand-in --allow %s:%d --allow-url http://%s:%d/ "
                    "--special %s:%d --trusted /etc/chv-fleet/nft/cell-nat.nft --report-dir %s"
                    % (src, allow.port, src, allow.port, SPECIAL, special.port, REPORTS), limit=host)
    finally:
        subprocess.run(["ip", "addr", "del", SPECIAL + "/32", "dev", "lo"], check=False)
    return slurp_json(inventory, host, REPORTS + "/audit.json")


def main():
    inventory, log_path = sys.argv[1], sys.argv[2]
    with open(log_path) as f:
        log = f.read()
    roles = []
    for role in re.findall(r"^TASK \[(?:chv\.fleet\.)?([a-z_]+) : ", log, re.M):
        if role not in roles:
            roles.append(role)
    recap = re.findall(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", log, re.M)
    inv = json.loads(subprocess.run([os.path.join(BIN, "ansible-inventory"), "-i", inventory, "--list"],
                                    capture_output=True, text=True, check=True).stdout)
    hostvars = inv.get("_meta", {}).get("hostvars", {})

    print("\n=== chv.fleet demo: what was deployed")
    print("roles applied: %s" % (", ".join(roles) or "(none: site.yml has no roles yet)"))
    for host, ok, changed, unreachable, failed in recap:
        settings = {k: v for k, v in sorted(hostvars.get(host, {}).items()) if SETTINGS.match(k)}
        print("host %s: ok=%s changed=%s unreachable=%s failed=%s" % (host, ok, changed, unreachable, failed))
        print("  address %s, settings from inventory: %s"
              % (hostvars.get(host, {}).get("ansible_host", "?"), json.dumps(settings) if settings else "defaults"))

    have = ansible(inventory, "-m", "ansible.builtin.shell", "-a", "command -v chv-cell || echo none")
    cell_hosts = [h for h, out in have.items() if out.strip() != "none"]
    if not cell_hosts:
        print("isolation: no chv-cell on the guests yet; nothing to probe")
        return 0
    print("\n=== isolation: the case catalog in real cells on each guest (docs/isolation-cases.md)")
    # the executor's path: SSH as the agent user (not root), chv-cell through its sudo rule
    agent = ansible(inventory, "-e", "ansible_user=chv", "-m", "ansible.builtin.command", "-a",
                    "chv-cell run -- sh -c 'echo user=$USER home=$HOME slot=$CHV_SLOT'")
    for host in sorted(cell_hosts):
        rep = catalog(inventory, host, hostvars.get(host, {}).get("ansible_host", host))
        if rep is None:
            print("%s: the catalog did not run (no report in %s)" % (host, REPORTS))
            continue
        print("%s: %s, %s" % (host, rep["verdict"].upper(),
                              "%(pass)d passed, %(fail)d failed, %(error)d errors, %(skip)d skipped" % rep["counts"]))
        for c in rep["cases"]:
            mark = {"pass": "ok  ", "fail": "FAIL", "error": "ERR ", "skip": "skip"}[c["verdict"]]
            print("  %s %-7s %s: %s" % (mark, c["id"], c["title"], c["probe"][:110]))
        print("  reports on the guest: %s/audit.md, audit.json, audit.xml (JUnit)" % REPORTS)
        print("%s: as the agent user chv over SSH, `chv-cell run`: %s" % (host, agent.get(host, "failed")))
    print("(lab guests get no cgroup controllers: cells run with chv_cell_require_limits false and chv-cell"
          " warns that MemoryMax/TasksMax/CPUQuota are not enforced; docs/lab.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
