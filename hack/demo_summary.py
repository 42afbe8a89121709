"""Print what `make demo` deployed: roles applied, per-host settings, changed
counts from the converge log, and, where cells exist, a short isolation
summary measured by running a probe inside a real cell on each guest.

usage: demo_summary.py INVENTORY CONVERGE_LOG
"""

import json
import os
import re
import shlex
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
# Settings worth showing per host (whatever of them the inventory sets).
SETTINGS = re.compile(r"^(chv_|cell_nat_)")
CLIENT = "/usr/lib/chv-fleet/chv_broker/client.py"
PROBE = r"""
import ctypes, json, subprocess
libc = ctypes.CDLL(None, use_errno=True)
st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
r = libc.syscall(425, 8, ctypes.create_string_buffer(120))
try:
    open('/etc/chv/.probe').read(); secret = 'READABLE'
except FileNotFoundError:
    secret = 'absent'
except PermissionError:
    secret = 'denied'
ping = subprocess.run(['python3', 'CLIENT_PATH', '{"op": "ping"}'], capture_output=True, text=True)
if ping.returncode == 0:
    broker = 'pong/%s' % json.loads(ping.stdout)['result']['slot']
else:
    broker = 'refused' if ping.returncode == 1 else 'unreachable'
try:
    import playwright; pw = 'IMPORTABLE'
except ImportError:
    pw = 'absent'
print('uid_map=%s caps=%s nnp=%s io_uring=%s etc_chv=%s broker=%s playwright=%s' % (
    '/'.join(open('/proc/self/uid_map').read().split()), st['CapEff'].strip(),
    st['NoNewPrivs'].strip(), 'EPERM' if r < 0 and ctypes.get_errno() == 1 else r, secret, broker, pw))
""".replace("CLIENT_PATH", CLIENT)


def ansible(inventory, *args):
    proc = subprocess.run([os.path.join(BIN, "ansible"), "-i", inventory, "all"] + list(args),
                          capture_output=True, text=True, check=False,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
                                   ANSIBLE_STDOUT_CALLBACK="ansible.builtin.oneline"))
    # the launcher's warnings (stderr; in the lab: limits not enforced) are reported once, not per line
    return {h: out.split(" (stderr) ")[0] for h, out in
            re.findall(r"^(\S+) \| \S+ \| rc=\d+ \| \(stdout\) (.*)$", proc.stdout, re.M)}


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
    print("\n=== isolation summary (one real cell per guest, probe inside it)")
    probes = ansible(inventory, "-m", "ansible.builtin.command", "-a",
                     "chv-cell run -- /usr/bin/python3 -c %s" % shlex.quote(PROBE))
    outside = ansible(inventory, "-m", "ansible.builtin.command", "-a",
                      "python3 %s '{\"op\": \"ping\"}'" % CLIENT)
    # the executor's path: SSH as the agent user (not root), chv-cell through its sudo rule
    agent = ansible(inventory, "-e", "ansible_user=chv", "-m", "ansible.builtin.command", "-a",
                    "chv-cell run -- sh -c 'echo user=$USER home=$HOME slot=$CHV_SLOT'")
    for host in sorted(cell_hosts):
        print("%s: %s" % (host, probes.get(host, "probe failed")))
        print("%s: the same broker ping from a guest process outside any cell: %s"
              % (host, outside.get(host, "no chv-broker client")))
        print("%s: as the agent user chv over SSH, `chv-cell run`: %s" % (host, agent.get(host, "failed")))
    print("(uid_map: cell root -> high guest UID; caps: effective set; nnp: no_new_privs;"
          " io_uring: syscall 425 result; etc_chv: /etc/chv inside the cell;"
          " broker: ping through /run/chv/broker.sock; playwright: import inside the cell)")
    print("(lab guests get no cgroup controllers: cells run with chv_cell_require_limits false and chv-cell"
          " warns that MemoryMax/TasksMax/CPUQuota are not enforced; docs/lab.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
