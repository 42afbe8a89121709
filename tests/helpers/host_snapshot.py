"""What a host is made of, as far as chv.fleet's uninstall must leave it as
it found it: files (one file system walk, volatile places left out), unit
files, users, groups, nftables tables and the sysctls the collection sets.
Runs on the guest (python3 host_snapshot.py [OUT]): Molecule's converge
writes /root/chv-fleet-before.json before the first converge, and the
uninstall test compares a second snapshot with it (molecule/shared/tests/
test_uninstall.py). Standard library only."""

import json
import os
import subprocess
import sys

# Places that change by themselves (logs, caches, runtime state, the daily
# backups of dpkg's database, Ansible's and Python's own scratch files):
# outside what a converge may leave behind.
VOLATILE = ("/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", "/var/log", "/var/cache", "/var/backups",
            "/var/lib/systemd", "/var/lib/apt", "/var/lib/dpkg", "/var/lib/private", "/root/.ansible", "/root/.cache",
            "/home/chv/.ansible", "/home/chv/.cache")
SYSCTLS = ("net.ipv4.ip_forward",)


def _lines(argv):
    """The sorted output lines of argv; none when the tool is not installed
    (a minimal guest before its first converge has no nft)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return []
    return sorted(line.strip() for line in proc.stdout.splitlines() if line.strip())


def files(top="/"):
    found = []
    for root, dirs, names in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in VOLATILE and d != "__pycache__"
                   and not os.path.ismount(os.path.join(root, d))]
        found.extend(os.path.join(root, n) for n in names)
        found.extend(os.path.join(root, d) + "/" for d in dirs)
    return sorted(found)


def snapshot():
    return {
        "files": files(),
        # unit files on disk (transient and generated units, such as login session scopes, come and go)
        "units": [u for u in _lines(["systemctl", "list-unit-files", "--no-legend", "--no-pager"])
                  if u.split()[1:2] not in (["transient"], ["generated"])],
        "users": sorted(line.split(":")[0] for line in _lines(["getent", "passwd"])),
        "groups": sorted(line.split(":")[0] for line in _lines(["getent", "group"])),
        "nft_tables": _lines(["nft", "list", "tables"]),
        "sysctls": {k: open("/proc/sys/" + k.replace(".", "/")).read().strip() for k in SYSCTLS},
    }


if __name__ == "__main__":
    data = json.dumps(snapshot(), indent=1)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            out.write(data)
    else:
        print(data)
