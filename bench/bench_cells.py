"""Benchmark (not a test): the cell-level figures of issue 16, on one lab guest.

Brings up the lab `bcell` (one bookworm guest, 10.99.49.0/28), converges
site.yml on it, measures over SSH on the guest and tears the lab down at the
end, also when something fails.  Both sides of each comparison are measured
in this one run, interleaved where they can be:

  a. cell start: `chv-cell run -- true` vs bare systemd-nspawn with the
     launcher's own argv (`chv-cell argv --json`) vs `unshare -Unpm -r -f true`;
  b. concurrency: every slot started at once (8 slots, then 32);
  c. NAT throughput and latency: iperf3 (TCP) and a TCP echo round trip from
     a cell through the NAT to the lab host, vs from the guest itself;
  d. rule scaling: the rules of `table inet chv_cell` at 4 .. 256 slots, and
     the cell's throughput at 256 slots vs 4.

Prints a table and writes build/bench/cells.md (bench/report.py puts it into
docs/performance.md).  Traffic goes only to the lab's own addresses.
Run: .venv/bin/python bench/bench_cells.py   (or `make bench`)
"""

import collections
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB_VARS = ['-e', 'lab_name=bcell', '-e', 'lab_count=1', '-e', 'lab_network=10.99.49.0/28']
# make bench: the rollout benchmark keeps its lab (CHV_BENCH_KEEP_LAB) and
# this one measures on its first guest, which site.yml has converged
# already (CHV_BENCH_LAB=brollout; make bench takes the lab down after):
# no lab of its own, no first whole converge.
SHARED_LAB = os.environ.get('CHV_BENCH_LAB', '')
LAB_NAME = SHARED_LAB or 'bcell'
INVENTORY = '/var/lib/chv-fleet-lab/%s/inventory.yml' % LAB_NAME
OUT_DIR = os.path.join(ROOT, 'build', 'bench')
OUT = os.path.join(OUT_DIR, 'cells.md')
LOG_DIR = os.path.join(OUT_DIR, 'cells-logs')
COMMAND = '.venv/bin/python bench/bench_cells.py'

START_RUNS = 25          # rounds of part a (every variant once per round)
BURSTS = (8, 32)         # part b: slots converged, all started at once
RULE_SLOTS = (4, 8, 32, 64, 256)   # part d: rules counted at each (8 and 32 come with part b)
IPERF_SECONDS = 2
IPERF_REPS = 3           # per side, guest and cell alternating
ECHO_ROUNDS = 300        # TCP round trips per latency sample
IPERF_PORT = 5249        # on the lab host's address of the lab network
ECHO_PORT = 5250
BENCH_DIR = '/run/chv-bench'   # on the guest: the bare side's resolv.conf, hosts and (open) gate
# 256 slots x MemoryMax must fit the guest's memory (the preflight checks it):
# every converge of this bench sets the same small MemoryMax, so that the
# cells of all parts run with one policy.
MEMORY_MAX = '64M'
# chv-browser is not deployed (the cells do not need it; its role is a third
# of a first converge); everything else of site.yml is.
BASE_VARS = {'chv_broker_browser_enabled': False, 'chv_cell_properties': {'MemoryMax': MEMORY_MAX}}
# Converges after the first change only the slots: the roles that read them.
SLOT_TAGS = 'cell_runtime,cell_nat'

# Runs on the guest (python3 -, the spec as argv[1]): times commands there,
# so that SSH is not part of any figure.
GUEST_TIMER = r'''
import json, subprocess, sys, time
spec = json.loads(sys.argv[1])
out = {}
if spec["mode"] == "rounds":
    for v in spec["variants"]:
        out[v["name"]] = {"times": [], "fails": 0, "error": "", "stderr": []}
        out[v["name"]]["starts"] = []
    for i in range(spec["rounds"] + 1):
        for v in spec["variants"]:
            argv = [a.replace("{i}", str(i)) for a in v["argv"]]
            if v.get("before"):
                subprocess.run(v["before"], timeout=60)  # untimed (e.g. until the warm cell waits)
            wall = time.time()
            t = time.perf_counter()
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            dt = time.perf_counter() - t
            if i == 0:
                continue  # warm-up round: page cache, first scope, first veth
            r = out[v["name"]]
            r["times"].append(dt)
            if v.get("stamp"):  # the payload printed its start time (date +%s.%N)
                try:
                    r["starts"].append(float(p.stdout.split()[-1]) - wall)
                except (IndexError, ValueError):
                    pass
            r["stderr"].append(p.stderr.decode(errors="replace")[-3000:])
            if p.returncode != 0:
                r["fails"] += 1
                r["error"] = "exit %d: %s" % (p.returncode, p.stderr.decode(errors="replace")[-300:])
elif spec["mode"] == "burst":
    t = time.perf_counter()
    procs = [subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for n in range(spec["count"])]
    done = []
    for p in procs:
        o, e = p.communicate()
        done.append((time.perf_counter() - t, p.returncode, o.decode(errors="replace"), e.decode(errors="replace")))
    total = time.perf_counter() - t
    fails = [d for d in done if d[1] != 0 or d[2].strip() != spec["expect"]]
    out = {"total": total, "first": min(d[0] for d in done), "fails": len(fails),
           "errors": sorted({"exit %d: %s" % (d[1], d[3].strip()[-200:]) for d in fails})[:5]}
else:
    p = subprocess.run(spec["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {"rc": p.returncode, "stdout": p.stdout.decode(errors="replace"), "stderr": p.stderr.decode(errors="replace")}
print(json.dumps(out))
'''

# A TCP round-trip client (python3 in the guest and in a cell): ECHO_ROUNDS
# one-byte exchanges with the lab host's echo server; prints the median in us.
ECHO_CLIENT = (
    'import socket,statistics,sys,time\n'
    's=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5)\n'
    's.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n'
    'ts=[]\n'
    'for n in range(int(sys.argv[3])):\n'
    '    t=time.perf_counter();s.sendall(b"x");s.recv(1);ts.append(time.perf_counter()-t)\n'
    'print(round(statistics.median(ts)*1e6,1))\n'
)

GUEST_NAME = ['']  # the inventory name of the measured guest (converges are limited to it)
Row = collections.namedtuple('Row', 'what figure baseline ratio target met')


def log(msg):
    print('[bench_cells %s] %s' % (time.strftime('%H:%M:%S'), msg), flush=True)


def ansible_env():
    env = dict(os.environ)
    env.update(ANSIBLE_COLLECTIONS_PATH=os.path.join(ROOT, 'build', 'dev-collections'),
               ANSIBLE_ROLES_PATH=os.path.join(ROOT, 'roles'), ANSIBLE_NOCOLOR='1', ANSIBLE_FORCE_COLOR='0',
               PATH=os.path.join(ROOT, '.venv', 'bin') + ':' + env.get('PATH', '/usr/bin:/bin'))
    return env


def playbook(name, args):
    """ansible-playbook ARGS, its output in build/bench/cells-logs/NAME.log; the seconds it took."""
    os.makedirs(LOG_DIR, exist_ok=True)
    path = os.path.join(LOG_DIR, name + '.log')
    start = time.monotonic()
    with open(path, 'w') as fh:
        rc = subprocess.run(['ansible-playbook'] + args, cwd=ROOT, env=ansible_env(), stdout=fh,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False).returncode
    took = time.monotonic() - start
    if rc != 0:
        with open(path) as fh:
            tail = fh.read()[-3000:]
        raise RuntimeError('ansible-playbook %s failed (exit %d, log %s):\n%s' % (name, rc, path, tail))
    log('%s: %.0f s' % (name, took))
    return took


class Guest:
    """The lab guest over SSH, as the inventory describes it."""

    def __init__(self, inventory, lab=None):
        with open(inventory) as fh:
            inv = yaml.safe_load(fh)
        group = inv['all']['children']['chv_lab_' + (lab or LAB_NAME).replace('-', '_')]
        self.name, host = next(iter(group['hosts'].items()))  # the lab's first guest
        self.address = host['ansible_host']
        self.key = group['vars']['ansible_ssh_private_key_file']
        self.user = group['vars'].get('ansible_user', 'root')

    def ssh(self, command, stdin=None, timeout=600):
        argv = ['ssh', '-i', self.key, '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=no',
                '-o', 'UserKnownHostsFile=/dev/null', '-o', 'LogLevel=ERROR', '%s@%s' % (self.user, self.address),
                command]
        r = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                           check=False)
        return r.returncode, r.stdout.decode(errors='replace'), r.stderr.decode(errors='replace')

    def check(self, command, stdin=None):
        rc, out, err = self.ssh(command, stdin)
        if rc != 0:
            raise RuntimeError('on the guest: %s: exit %d: %s' % (command[:200], rc, err.strip()[-1000:]))
        return out

    def timer(self, spec):
        """Run GUEST_TIMER with ``spec`` on the guest; its JSON answer."""
        return json.loads(self.check('python3 - ' + shlex.quote(json.dumps(spec)), stdin=GUEST_TIMER.encode()))

    def run(self, argv):
        return self.timer({'mode': 'once', 'argv': argv})


def host_address(guest_address):
    """The lab host's own address on the guest's link (the peer beyond the guest's uplink)."""
    addrs = json.loads(subprocess.run(['ip', '-j', '-4', 'addr'], stdout=subprocess.PIPE, check=True).stdout)
    guest = ipaddress.ip_address(guest_address)
    for link in addrs:
        for a in link.get('addr_info', []):
            net = ipaddress.ip_interface('%s/%d' % (a['local'], a['prefixlen'])).network
            if guest in net and a['local'] != guest_address:
                return a['local']
    raise RuntimeError('no address of this host shares a network with the guest %s' % guest_address)


def converge(name, slots, host, tags=None, warm=0):
    extra = dict(BASE_VARS, chv_cell_slots=slots, cell_nat_egress_allow=[{'cidr': host, 'comment': 'bench peer'}],
                 chv_cell_warm_slots=warm)
    args = ['-i', INVENTORY, 'site.yml', '-e', json.dumps(extra), '--limit', GUEST_NAME[0]]
    if tags:
        args += ['--tags', tags]
    return playbook(name, args)


def median_ms(times):
    return statistics.median(times) * 1000.0


def fmt_ratio(value):
    return '%.2f' % value


def verdict(ok):
    return 'met' if ok else 'missed'


# ------------------------------------------------------------------ part a
class StartContext:
    """What the start variants are built from: the guest's chv-cell and the
    launcher's own nspawn argv for two slots that the launcher does not use
    during part a (the launcher claims slot0, the first free one)."""

    def __init__(self, guest):
        self.chv_cell = '/usr/local/bin/chv-cell'
        self.policy = json.loads(guest.check('cat /etc/chv-fleet/cell-policy.json'))
        self.argv = {}
        for slot in ('slot1', 'slot2'):
            self.argv[slot] = json.loads(guest.check('%s argv --slot %s --json -- true' % (self.chv_cell, slot)))


def bare_argv(argv, tag):
    """The launcher's argv for a slot, runnable without the launcher: the
    slot's per-run files (resolv.conf, hosts, gate FIFO under the launcher's
    state_dir, which exist only during a run) replaced by files in BENCH_DIR
    (the gate a regular file that already reads "go", so the same gate script
    execs the payload at once), the scope named per round."""
    out = []
    for arg in argv:
        m = re.match(r'--bind-ro=(.+):(/etc/resolv\.conf|/etc/hosts|/run/chv-gate)$', arg)
        if m:
            arg = '--bind-ro=%s/%s:%s' % (BENCH_DIR, os.path.basename(m.group(2)), m.group(2))
        elif arg.startswith('--unit='):
            arg = '--unit=chv-bench-%s-{i}' % tag
        out.append(arg)
    return out


def start_launcher(ctx):
    return {'name': 'chv-cell run -- true', 'argv': [ctx.chv_cell, '-v', 'run', '--slot', 'slot0', '--', 'true'],
            'doc': 'the launcher as root on the guest (-v for its own timings), a cold cell in slot0'}


def start_bare(ctx):
    return {'name': 'bare systemd-run + nspawn', 'argv': bare_argv(ctx.argv['slot1'], 'scope'),
            'doc': 'slot1\'s argv from `chv-cell argv --json`, unchanged but for the per-run files and the '
                   'scope name: the same systemd-run transient scope with the same properties, the same nspawn '
                   'flags (volatile root, user namespace, binds, inaccessible paths, seccomp, veth). It does not '
                   'run Python, claim a slot, write the resolver files, configure the veth (ip/nsenter), check '
                   'the ruleset, the scope\'s limits or user.max_user_namespaces, or wait on the start gate (the gate '
                   'file already reads "go"); the veth is created and left unconfigured'}


def start_bare_noscope(ctx):
    argv = bare_argv(ctx.argv['slot2'], 'noscope')
    if os.path.basename(argv[0]) == 'systemd-run':
        argv = argv[argv.index('--') + 1:]
    return {'name': 'bare nspawn, no scope', 'argv': argv,
            'doc': 'as the bare side, slot2, without systemd-run (nspawn in the caller\'s cgroup): what the '
                   'transient scope costs'}


# The warm slot (converge-4 sets chv_cell_warm_slots: 1: the last of the 4
# slots); the cold launcher variant names slot0, so that it never takes the
# warm cell.
WARM_SLOT = 'slot3'
WARM_WAIT = ['sh', '-c', 'for i in $(seq 500); do [ -S /run/chv-fleet/warm/%s.sock ] && exit 0; sleep 0.01; done; '
             'exit 1' % WARM_SLOT]


def start_warm(ctx):
    return {'name': 'chv-cell run -- true, warm', 'argv': [ctx.chv_cell, 'run', '--slot', WARM_SLOT, '--', 'true'],
            'before': WARM_WAIT,
            'doc': 'the same command handed to the warm cell of %s (docs/cells.md "Warm cells"), after waiting '
                   '(untimed) until the next warm cell waits: the whole run, the payload\'s exit code back, the '
                   'warm cell torn down afterwards in the background' % WARM_SLOT}


def start_warm_payload(ctx):
    return {'name': 'warm: payload start', 'stamp': True, 'before': WARM_WAIT,
            'argv': [ctx.chv_cell, 'run', '--slot', WARM_SLOT, '--', 'date', '+%s.%N'],
            'doc': 'from the start of `chv-cell run` to the payload\'s first instruction in the warm cell (the '
                   'payload is `date +%s.%N`; both clocks are the guest\'s CLOCK_REALTIME)'}


def start_cold_payload(ctx):
    return {'name': 'cold: payload start', 'stamp': True,
            'argv': [ctx.chv_cell, 'run', '--slot', 'slot0', '--', 'date', '+%s.%N'],
            'doc': 'the same for a cold cell in slot0'}


def start_unshare(ctx):
    return {'name': 'unshare -Unpm -r -f true', 'argv': ['unshare', '-Unpm', '-r', '-f', 'true'],
            'doc': 'the namespaces alone (user, net, pid, mount): no root file system, no binds, no veth'}


def start_python(ctx):
    return {'name': 'python3 -I -c pass', 'argv': ['python3', '-I', '-c', 'pass'], 'doc': 'the interpreter alone'}


def start_help(ctx):
    return {'name': 'chv-cell --help', 'argv': [ctx.chv_cell, '--help'],
            'doc': 'the launcher\'s interpreter and imports, parsing its arguments'}


# Every variant runs once per round, in this order (a warm launcher mode is
# one more function here, with its row in START_RATIOS).
START_VARIANTS = (start_launcher, start_bare, start_bare_noscope, start_warm, start_warm_payload, start_cold_payload,
                  start_unshare, start_python, start_help)
# (figure, baseline, target as (text, predicate) or None)
START_RATIOS = (
    ('chv-cell run -- true', 'bare systemd-run + nspawn', ('<= 1.3', lambda r: r <= 1.3)),
    ('bare systemd-run + nspawn', 'unshare -Unpm -r -f true', None),
    ('bare systemd-run + nspawn', 'bare nspawn, no scope', None),
    ('chv-cell run -- true, warm', 'chv-cell run -- true', None),
)


def launcher_steps(stderrs):
    """Medians (ms) of the launcher's own -v timings: claim, gate open, done."""
    keys = {'claimed': r'claimed after ([0-9.]+)s', 'released': r'payload released ([0-9.]+)s after start',
            'done': r'done in ([0-9.]+)s'}
    got = {k: [] for k in keys}
    for text in stderrs:
        for k, pat in keys.items():
            m = re.search(pat, text)
            if m:
                got[k].append(float(m.group(1)))
    return {k: statistics.median(v) * 1000.0 for k, v in got.items() if v}


def part_start(guest):
    guest.check('mkdir -p %s && cp /etc/resolv.conf %s/resolv.conf && printf "127.0.0.1 localhost\\n" > %s/hosts '
                '&& printf "go\\n" > %s/chv-gate && chmod 0644 %s/*' % ((BENCH_DIR,) * 5))
    ctx = StartContext(guest)
    variants = [f(ctx) for f in START_VARIANTS]
    log('part a: %d rounds of %s' % (START_RUNS, ', '.join(v['name'] for v in variants)))
    res = guest.timer({'mode': 'rounds', 'rounds': START_RUNS,
                       'variants': [dict((k, v[k]) for k in ('name', 'argv', 'before', 'stamp') if k in v)
                                    for v in variants]})
    med = {name: median_ms(r['starts'] if r['starts'] else r['times']) for name, r in res.items()}
    rows = []
    for fig, base, target in START_RATIOS:
        ratio = med[fig] / med[base]
        rows.append(Row(fig, '%.0f ms' % med[fig], '%s: %.0f ms' % (base, med[base]), fmt_ratio(ratio),
                        target[0] if target else '-', verdict(target[1](ratio)) if target else '-'))
    warm, bare = med['warm: payload start'], med['bare systemd-run + nspawn']
    rows.append(Row('warm: payload start', '%.0f ms' % warm, 'cold: payload start: %.0f ms' % med['cold: payload start'],
                    fmt_ratio(warm / med['cold: payload start']), '<= 20 ms', verdict(warm <= 20)))
    rows.append(Row('bare systemd-run + nspawn (whole run)', '%.0f ms' % bare, 'warm: payload start: %.0f ms' % warm,
                    fmt_ratio(bare / warm), '>= 5 (warm 5x faster)', verdict(bare / warm >= 5)))
    fails = {name: (r['fails'], r['error']) for name, r in res.items() if r['fails']}
    steps = launcher_steps(res['chv-cell run -- true']['stderr'])
    total = med['chv-cell run -- true']
    breakdown = []
    if len(steps) == 3:
        breakdown = [
            ('interpreter, imports, policy load, exit (total - done)', total - steps['done']),
            ('for comparison: `chv-cell --help` (interpreter, imports, argument parser, help text)', med['chv-cell --help']),
            ('for comparison: `python3 -I -c pass` (the interpreter alone)', med['python3 -I -c pass']),
            ('claim a slot (flock), after run() starts', steps['claimed']),
            ('prepare, systemd-run + nspawn up, veth configured, checks, gate opened', steps['released'] - steps['claimed']),
            ('payload, nspawn teardown, veth gone, clean-up', steps['done'] - steps['released']),
            ('bare systemd-run + nspawn, whole run (for comparison)', med['bare systemd-run + nspawn']),
        ]
    return {'rows': rows, 'medians': med, 'variants': variants, 'fails': fails, 'breakdown': breakdown}


# ------------------------------------------------------------------ part b
def part_burst(guest, count, single_ms):
    argv = ['/usr/local/bin/chv-cell', 'run', '--timeout', '120', '--', '/bin/sh', '-c', 'echo ran']
    res = guest.timer({'mode': 'burst', 'count': count, 'argv': argv, 'expect': 'ran'})
    serial = count * single_ms / 1000.0
    row = Row('%d cells started at once (%d slots)' % (count, count),
              'all done in %.2f s (first %.2f s), %d failed' % (res['total'], res['first'], res['fails']),
              '%d x one start (part a): %.2f s' % (count, serial), fmt_ratio(res['total'] / serial),
              '0 failures', verdict(res['fails'] == 0))
    log('part b: %d at once: %.2f s, %d failed %s' % (count, res['total'], res['fails'], res['errors']))
    return row, res


# ------------------------------------------------------------------ part c/d
class EchoServer(threading.Thread):
    """One-byte TCP echo on the lab host's address (the latency peer)."""

    def __init__(self, address, port):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(8)

    def run(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    @staticmethod
    def serve(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                data = conn.recv(64)
                if not data:
                    return
                conn.sendall(data)

    def close(self):
        self.sock.close()


def iperf_bps(guest, host, in_cell):
    argv = ['iperf3', '-c', host, '-p', str(IPERF_PORT), '-t', str(IPERF_SECONDS), '-J']
    if in_cell:
        argv = ['/usr/local/bin/chv-cell', 'run', '--'] + argv
    r = guest.run(argv)
    if r['rc'] != 0:
        where = 'in a cell' if in_cell else 'on the guest'
        raise RuntimeError('iperf3 %s failed (exit %d): %s %s' % (where, r['rc'], r['stdout'][-500:], r['stderr'][-500:]))
    return json.loads(r['stdout'])['end']['sum_received']['bits_per_second']


def throughput(guest, host):
    """IPERF_REPS runs from the guest and from a cell, alternating; medians in Gbit/s."""
    got = {'guest': [], 'cell': []}
    for n in range(IPERF_REPS):
        got['guest'].append(iperf_bps(guest, host, False))
        got['cell'].append(iperf_bps(guest, host, True))
    return {k: statistics.median(v) / 1e9 for k, v in got.items()}


def latency(guest, host):
    """Median TCP round trip (us) from the guest and from a cell; ping where it works."""
    out = {}
    for side in ('guest', 'cell', 'guest2', 'cell2'):
        argv = ['python3', '-I', '-c', ECHO_CLIENT, host, str(ECHO_PORT), str(ECHO_ROUNDS)]
        if side.startswith('cell'):
            argv = ['/usr/local/bin/chv-cell', 'run', '--'] + argv
        r = guest.run(argv)
        if r['rc'] != 0:
            raise RuntimeError('echo client (%s) failed: %s' % (side, r['stderr'][-500:]))
        out.setdefault(side.rstrip('2'), []).append(float(r['stdout'].split()[-1]))
    lat = {k: statistics.median(v) for k, v in out.items()}
    ping = {}
    for side in ('guest', 'cell'):
        argv = ['ping', '-n', '-q', '-c', '20', '-i', '0.05', host]
        if side == 'cell':
            argv = ['/usr/local/bin/chv-cell', 'run', '--'] + argv
        r = guest.run(argv)
        m = re.search(r'= [0-9.]+/([0-9.]+)/', r['stdout'])
        if r['rc'] == 0 and m:
            ping[side] = float(m.group(1)) * 1000.0
        else:  # the launcher's own lines left out
            text = r['stderr'] + r['stdout']
            ping[side] = ' / '.join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith('chv-cell:'))[-200:]
    return lat, ping


def save_ruleset(guest, slots):
    guest.check('mkdir -p %s && nft list table inet chv_cell > %s/ruleset-%d.nft' % (BENCH_DIR, BENCH_DIR, slots))


def load_ruleset(guest, slots):
    """Replace table inet chv_cell with the listing saved at ``slots`` slots, in one transaction."""
    guest.check("{ printf 'table inet chv_cell {}\\ndelete table inet chv_cell\\n'; cat %s/ruleset-%d.nft; } | nft -f -"
                % (BENCH_DIR, slots))


def ruleset_throughput(guest, host, low, top):
    """The cell's throughput (Gbit/s, medians) with the ruleset of ``low`` slots and of ``top`` slots, loaded in
    turn on the guest converged with ``top`` (slot0, which the cell uses, has the same identity in both), the
    ``top`` one last."""
    got = {low: [], top: []}
    for n in range(IPERF_REPS):
        for slots in (low, top):
            load_ruleset(guest, slots)
            got[slots].append(iperf_bps(guest, host, True))
    return {k: statistics.median(v) / 1e9 for k, v in got.items()}


def rule_count(guest):
    data = json.loads(guest.check('nft -j list table inet chv_cell'))
    count = collections.Counter()
    for obj in data['nftables']:
        for kind in ('rule', 'set', 'map', 'chain'):
            if kind in obj:
                count[kind] += 1
                if kind in ('set', 'map'):
                    count['elements'] += len(obj[kind].get('elem', []))
    return count


def install_iperf3(guest):
    """iperf3 into the guest (no mirror there): the controller's .debs."""
    rc, out, err = guest.ssh('command -v iperf3')
    if rc == 0:
        return
    debs = tempfile.mkdtemp(prefix='chv-bench-debs-')
    try:
        shutil.chown(debs, user='_apt')  # apt-get downloads as _apt where it can write
    except (LookupError, OSError):
        pass
    wanted = ['iperf3', 'libiperf0', 'libsctp1']
    missing = [p for p in wanted
               if guest.ssh("dpkg-query -W -f='${Status}' %s 2>/dev/null | grep -q 'ok installed'" % p)[0] != 0]
    subprocess.run(['apt-get', 'download'] + missing, cwd=debs, check=True, stdout=subprocess.DEVNULL)
    files = [f for f in sorted(os.listdir(debs)) if f.split('_')[0] in missing]
    guest.check('rm -rf /tmp/chv-bench-debs && mkdir /tmp/chv-bench-debs')
    for f in files:
        with open(os.path.join(debs, f), 'rb') as fh:
            guest.check('cat > /tmp/chv-bench-debs/%s' % shlex.quote(f), stdin=fh.read())
    shutil.rmtree(debs)
    guest.check('DEBIAN_FRONTEND=noninteractive dpkg -i /tmp/chv-bench-debs/*.deb >/dev/null && systemctl disable --now '
                'iperf3.service >/dev/null 2>&1; rm -rf /tmp/chv-bench-debs; command -v iperf3')
    log('iperf3 installed in the guest from %s' % ', '.join(files))


# ------------------------------------------------------------------ output
def table(rows):
    lines = ['| what | figure | baseline | ratio | target | met? |', '|---|---|---|---|---|---|']
    lines += ['| %s |' % ' | '.join(r) for r in rows]
    return lines


def render(result):
    a, c = result['start'], result['nat']
    lines = ['### Cells', '',
             'Reproduce: `%s` (one bookworm lab guest: its own lab `bcell` on 10.99.49.0/28, or in `make bench` the '
             'first guest of the rollout benchmark\'s lab, CHV_BENCH_LAB; %s). %s' % (COMMAND, result['when'], result['wall']),
             '',
             'Every converge: `site.yml` with `%s` (chv-browser left out: cells do not need it; MemoryMax small '
             'enough for 256 slots on this guest), the lab host\'s address %s allowed in `cell_nat_egress_allow`; '
             'after the first, `--tags %s` with `chv_cell_slots` changed. The first converge (4 slots, part a) keeps '
             'one warm cell (`chv_cell_warm_slots: 1`, %s); the others none.' % (json.dumps(BASE_VARS), result['host'],
                                                                                 SLOT_TAGS, WARM_SLOT),
             '', '#### a. Cell start (medians of %d rounds, every variant once per round, after one warm-up round)'
             % START_RUNS, '']
    lines += table(a['rows'])
    lines += ['', 'The variants (the lab inventory sets `chv_cell_require_limits: false`: the lab guest, itself a '
              'container, has no cgroup controllers to delegate, so neither side\'s scope enforces MemoryMax, TasksMax '
              'or CPUQuota, and the launcher logs a warning per run):', '']
    lines += ['* `%s`: %s.' % (v['name'], v['doc']) for v in a['variants']]
    if a['breakdown']:
        lines += ['', 'Where the launcher\'s time goes (medians; from its own `-v` timings):', '',
                  '| step | ms |', '|---|---:|']
        lines += ['| %s | %.0f |' % (what, ms) for what, ms in a['breakdown']]
    if a['fails']:
        lines += ['', 'Failed runs: ' + '; '.join('%s: %d (%s)' % (k, n, e) for k, (n, e) in a['fails'].items())]
    lines += ['', '#### b. Concurrency (`chv-cell run -- /bin/sh -c "echo ran"` in every slot at once; a failure is a '
              'non-zero exit or a payload that did not print)', '']
    lines += table(result['burst'])
    lines += ['', '#### c. NAT throughput and latency (cell through the NAT vs the guest itself, to the lab host %s)'
              % result['host'], '']
    lines += table(c['rows'])
    lines += ['', 'iperf3 TCP, %d s per run, %d runs per side alternating; the TCP round trip is the median of %d '
              'one-byte exchanges (Python client, the same in both), two samples per side. %s'
              % (IPERF_SECONDS, IPERF_REPS, ECHO_ROUNDS, c['ping_note']), '',
              '#### d. Rule scaling', '']
    lines += table(result['rules_rows'])
    lines += ['', '| slots | rules | chains | sets | maps | set/map elements |', '|---:|---:|---:|---:|---:|---:|']
    lines += ['| %d | %d | %d | %d | %d | %d |' % (n, k['rule'], k['chain'], k['set'], k['map'], k['elements'])
              for n, k in sorted(result['rules'].items())]
    counts = sorted({k['rule'] for k in result['rules'].values()})
    if len(counts) == 1:
        scaling = 'The rule count stayed at %d from %d to %d slots: a slot adds elements to the sets and maps, not rules.' % (
            counts[0], min(result['rules']), max(result['rules']))
    else:
        scaling = 'The rule count changed with the slots (%s).' % ', '.join(str(c) for c in counts)
    top, low = max(RULE_SLOTS), min(RULE_SLOTS)
    lines += ['', scaling + ' The throughput at %d vs %d slots is measured side by side on the guest converged '
              'with %d slots: the ruleset listed after the %d-slot converge and the %d-slot one are loaded in turn '
              '(`nft -f`, one transaction each), a cell in slot0 (the same identity in both) runs iperf3 after each, '
              '%d times; the %d-slot ruleset is loaded last.' % (top, low, top, low, top, IPERF_REPS, top), '',
              'Fewer repetitions than part a (iperf3 %d x %d s per side) to keep the benchmark within about '
              '6 minutes; converges (their time follows the machine\'s load): %s.'
              % (IPERF_REPS, IPERF_SECONDS, result['converges']), '']
    return '\n'.join(lines)


def print_tables(result):
    a = result['start']
    rows = a['rows'] + result['burst'] + result['nat']['rows'] + result['rules_rows']
    widths = [max(len(r[i]) for r in rows + [Row._fields]) for i in range(6)]
    print()
    for r in [Row._fields] + rows:
        print('  '.join(v.ljust(w) for v, w in zip(r, widths)))
    if a['breakdown']:
        print('\nwhere the launcher\'s time goes (ms, medians):')
        for what, ms in a['breakdown']:
            print('  %6.0f  %s' % (ms, what))
    print('\n' + result['nat']['ping_note'])
    for n, k in sorted(result['rules'].items()):
        print('  %3d slots: %d rules, %d chains, %d sets, %d maps, %d elements'
              % (n, k['rule'], k['chain'], k['set'], k['map'], k['elements']))


# ------------------------------------------------------------------ main
def measure(guest, host):
    result = {'host': host, 'burst': [], 'rules': {}}
    conv = []
    if SHARED_LAB:  # site.yml converged the guest already (the rollout benchmark)
        conv.append('4 slots %.0f s' % converge('converge-4', 4, host, SLOT_TAGS, warm=1))
    else:
        conv.append('4 slots, whole site.yml %.0f s' % converge('converge-4', 4, host, warm=1))
    install_iperf3(guest)
    result['rules'][min(RULE_SLOTS)] = rule_count(guest)
    save_ruleset(guest, min(RULE_SLOTS))
    result['start'] = start = part_start(guest)
    single = start['medians']['chv-cell run -- true']

    iperf = subprocess.Popen(['iperf3', '-s', '-B', host, '-p', str(IPERF_PORT)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    echo = EchoServer(host, ECHO_PORT)
    echo.start()
    try:
        time.sleep(0.5)
        log('part c: iperf3 and TCP round trips, guest and cell')
        tp4 = throughput(guest, host)
        lat, ping = latency(guest, host)
        for n in BURSTS:
            conv.append('%d slots %.0f s' % (n, converge('converge-%d' % n, n, host, SLOT_TAGS)))
            result['rules'][n] = rule_count(guest)
            result['burst'].append(part_burst(guest, n, single)[0])
        for n in RULE_SLOTS:
            if n not in result['rules']:
                conv.append('%d slots %.0f s' % (n, converge('converge-%d' % n, n, host, SLOT_TAGS)))
                result['rules'][n] = rule_count(guest)
        log('part d: iperf3 from a cell, the rulesets of %d and %d slots in turn' % (min(RULE_SLOTS), max(RULE_SLOTS)))
        save_ruleset(guest, max(RULE_SLOTS))
        try:
            tpr = ruleset_throughput(guest, host, min(RULE_SLOTS), max(RULE_SLOTS))
        except RuntimeError as exc:
            log('part d: %s' % exc)
            tpr = {min(RULE_SLOTS): float('nan'), max(RULE_SLOTS): float('nan')}
            load_ruleset(guest, max(RULE_SLOTS))
    finally:
        iperf.terminate()
        iperf.wait()
        echo.close()

    ratio = tp4['cell'] / tp4['guest']
    rows = [Row('TCP throughput, cell (iperf3)', '%.2f Gbit/s' % tp4['cell'], 'guest: %.2f Gbit/s' % tp4['guest'],
                fmt_ratio(ratio), '>= 0.8', verdict(ratio >= 0.8)),
            Row('TCP round trip, cell', '%.0f us' % lat['cell'], 'guest: %.0f us' % lat['guest'],
                fmt_ratio(lat['cell'] / lat['guest']), '-', '-')]
    if isinstance(ping['guest'], float) and isinstance(ping['cell'], float):
        rows.append(Row('ping rtt avg, cell', '%.0f us' % ping['cell'], 'guest: %.0f us' % ping['guest'],
                        fmt_ratio(ping['cell'] / ping['guest']), '-', '-'))
        note = 'ping worked on both sides.'
    else:
        note = 'ping: guest %s; cell: %s.' % (
            '%.0f us' % ping['guest'] if isinstance(ping['guest'], float) else 'failed (%s)' % ping['guest'],
            '%.0f us' % ping['cell'] if isinstance(ping['cell'], float) else 'failed (%s)' % ping['cell'])
    result['nat'] = {'rows': rows, 'ping_note': note}

    base = result['rules'][min(RULE_SLOTS)]['rule']
    rrows = []
    for n in sorted(result['rules']):
        if n == min(RULE_SLOTS):
            continue
        got = result['rules'][n]['rule']
        rrows.append(Row('nft rules at %d slots' % n, str(got), '%d slots: %d' % (min(RULE_SLOTS), base),
                         fmt_ratio(got / base), 'constant', verdict(got == base)))
    top, low = max(RULE_SLOTS), min(RULE_SLOTS)
    ratio = tpr[top] / tpr[low]
    rrows.append(Row('cell TCP throughput, ruleset of %d slots' % top, '%.2f Gbit/s' % tpr[top],
                     'ruleset of %d slots: %.2f Gbit/s' % (low, tpr[low]), fmt_ratio(ratio), '>= 0.95',
                     verdict(ratio >= 0.95)))  # nan (the swap failed, logged): missed
    result['rules_rows'] = rrows
    result['converges'] = ', '.join(conv)
    return result


def main():
    start = time.monotonic()
    when = time.strftime('%Y-%m-%d %H:%M')
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, stdout=subprocess.PIPE,
                            check=False).stdout.decode().strip()
    if subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT, stdout=subprocess.PIPE,
                      check=False).stdout.strip():
        commit += ' with uncommitted changes in the working tree'
    os.makedirs(OUT_DIR, exist_ok=True)
    result = None
    own = not SHARED_LAB
    if not own and not os.path.exists(INVENTORY):
        sys.exit('bench_cells: CHV_BENCH_LAB=%s, but %s is not there (the rollout benchmark keeps it with '
                 'CHV_BENCH_KEEP_LAB=1)' % (SHARED_LAB, INVENTORY))
    try:
        if own:
            playbook('lab-up', ['lab/playbooks/lab_up.yml'] + LAB_VARS)
        guest = Guest(INVENTORY)
        GUEST_NAME[0] = guest.name
        host = host_address(guest.address)
        result = measure(guest, host)
    finally:
        if own:
            try:
                playbook('lab-down', ['lab/playbooks/lab_down.yml'] + LAB_VARS)
            except RuntimeError as exc:
                log('lab_down failed: %s' % exc)
    wall = time.monotonic() - start
    result['when'] = '%s, commit %s, load average %.1f on %d CPUs at the end' % (
        when, commit, os.getloadavg()[0], os.cpu_count())
    result['wall'] = 'Wall time %d min %02d s%s.' % (divmod(int(wall), 60) + (
        ', lab up and down included' if own else ', on the first guest of the rollout benchmark\'s lab `%s`, which '
        'site.yml had converged' % SHARED_LAB,))
    print_tables(result)
    with open(OUT, 'w') as fh:
        fh.write(render(result))
    log('wrote %s; wall time %.0f s' % (os.path.relpath(OUT, ROOT), wall))


if __name__ == '__main__':
    sys.exit(main())
