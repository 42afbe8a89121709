"""Benchmark (not a test): the CPU chv.fleet.metrics costs an idle guest
(issue 35: at most 1 % of one CPU, the collector's CPU time over 10 minutes
of its timer).

On the first guest of a lab that site.yml has converged (make bench: the
rollout benchmark's lab, CHV_BENCH_LAB; else --lab NAME), it deploys the
metrics role when its timer is not there yet (textfile-only,
chv_metrics_create_textfile_dir, unless node_exporter's directory is
there), lets the timer run for --minutes (10 by default) with nothing else
started, and reads the CPU time of every run in that window from the
kernel: a runtime drop-in (/run, removed at the end) puts
chv-fleet-metrics.service in a slice of its own, whose cgroup's cpu.stat
usage_usec keeps the CPU time of every run's cgroup after it is gone
(Python, nft, systemctl and journalctl, from the sandbox's set-up on).
systemd's own CPUUsageNSec is not used: the lab's nspawn guests have no
cgroup controllers delegated, and systemd reports none there. Not counted:
the work of the guest's systemd (PID 1) starting the unit, shown beside it
as PID 1's CPU time over the same window (all its work, not only for the
timer).

Prints the figures and writes build/bench/metrics.md (bench/report.py puts
it into docs/performance.md).
Run: .venv/bin/python bench/bench_metrics.py [--lab NAME] [--minutes N]   (or `make bench`)
"""

import argparse
import json
import os
import sys
import time

from bench_cells import Guest, playbook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, 'build', 'bench', 'metrics.md')
TARGET_PERCENT = 1.0
UNIT = 'chv-fleet-metrics.service'
TIMER = 'chv-fleet-metrics.timer'
DEACTIVATED = '7ad2d189f7e94e70a38c781354912448'  # systemd's "<unit>: Deactivated successfully." message
SLICE = 'chvbench.slice'
DROP_IN = '/run/systemd/system/%s.d/zz-bench-slice.conf' % UNIT
NODE_EXPORTER_DIR = '/var/lib/prometheus/node-exporter'
TEXTFILE_ONLY_DIR = '/var/lib/chv-fleet-textfile'  # as molecule/fleet/group_vars/chv_fleet/metrics.yml
PLAY = os.path.join(ROOT, 'build', 'bench', 'metrics-role.yml')


def log(msg):
    print('[bench_metrics %s] %s' % (time.strftime('%H:%M:%S'), msg), flush=True)


def deploy(guest, inventory):
    """The metrics role on the guest (once: a guest that has the timer keeps its settings)."""
    rc, _out, _err = guest.ssh('systemctl is-active --quiet %s' % TIMER)
    if rc == 0:
        return 'deployed already'
    rc, _out, _err = guest.ssh('test -d %s' % NODE_EXPORTER_DIR)
    extra = {} if rc == 0 else {'chv_metrics_create_textfile_dir': True, 'chv_metrics_textfile_dir': TEXTFILE_ONLY_DIR}
    os.makedirs(os.path.dirname(PLAY), exist_ok=True)
    with open(PLAY, 'w') as fh:
        fh.write('- hosts: all\n  become: true\n  gather_facts: false\n  roles:\n    - chv.fleet.metrics\n')
    playbook('metrics-role', ['-i', inventory, '--limit', guest.name, PLAY, '-e', json.dumps(extra)])
    return 'deployed by the benchmark (%s)' % ('textfile-only, %s' % TEXTFILE_ONLY_DIR if extra else NODE_EXPORTER_DIR)


def guest_clock(guest):
    """The guest's time, the bench slice's CPU seconds (cpu.stat usage_usec) and PID 1's
    (utime + stime of /proc/1/stat)."""
    out = guest.check("date +%%s.%%N; sed -n 's/^usage_usec //p' /sys/fs/cgroup/%s/cpu.stat; "
                      "cut -d' ' -f14,15 /proc/1/stat; getconf CLK_TCK" % SLICE).split()
    return float(out[0]), int(out[1]) / 1e6, (int(out[2]) + int(out[3])) / float(out[4])


def runs_between(guest, since, until):
    """How many runs of the unit ended in the window."""
    out = guest.check("journalctl -q -o cat -u %s --since=@%.6f --until=@%.6f MESSAGE_ID=%s"
                      % (UNIT, since, until, DEACTIVATED))
    return len([line for line in out.splitlines() if line.strip()])


def measure(guest, minutes):
    """(window s, runs, the slice's CPU s, PID 1's CPU s) of `minutes` of the timer, the unit in SLICE."""
    guest.check("mkdir -p %s && printf '[Service]\\nSlice=%s\\n' > %s && systemctl daemon-reload"
                % (os.path.dirname(DROP_IN), SLICE, DROP_IN))
    try:
        # one run first: it makes the slice, and the window holds the timer's steady state
        guest.check('systemctl start %s' % UNIT)
        since, cpu_before, pid1_before = guest_clock(guest)
        time.sleep(minutes * 60.0)
        # a run under way ends first: every run in the window has its CPU time and its end in it
        guest.check('for i in $(seq 600); do [ "$(systemctl show -p ActiveState --value %s)" = activating ] || exit 0; '
                    'sleep 0.1; done; exit 1' % UNIT)
        until, cpu_after, pid1_after = guest_clock(guest)
        runs = runs_between(guest, since, until)
    finally:
        guest.check("rm -f %s && systemctl daemon-reload" % DROP_IN)
    return until - since, runs, cpu_after - cpu_before, pid1_after - pid1_before


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--lab', default=os.environ.get('CHV_BENCH_LAB', ''),
                    help='a lab converged by site.yml (default $CHV_BENCH_LAB, make bench\'s rollout lab)')
    ap.add_argument('--minutes', type=float, default=10.0, help='how long the timer runs while measured (10)')
    args = ap.parse_args()
    if not args.lab:
        sys.exit('bench_metrics: no lab: --lab NAME or CHV_BENCH_LAB (make bench sets it)')
    inventory = '/var/lib/chv-fleet-lab/%s/inventory.yml' % args.lab
    if not os.path.exists(inventory):
        sys.exit('bench_metrics: %s is not there (lab %s is not up)' % (inventory, args.lab))
    guest = Guest(inventory, args.lab)
    how = deploy(guest, inventory)
    interval = guest.check('systemctl cat %s | grep ^OnUnitActiveSec=' % TIMER).strip()
    slots = int(guest.check("python3 -c \"import json; print(len(json.load(open('/etc/chv-fleet/cell-policy.json'))"
                            "['slots']))\"").strip())
    log('%s; the timer runs for %.1f min, nothing else started (%s)' % (how, args.minutes, interval))
    window, runs, cpu, pid1_cpu = measure(guest, args.minutes)
    if runs == 0:
        sys.exit('bench_metrics: no run of %s ended in the window (is its timer active?)' % UNIT)
    share = 100.0 * cpu / window
    pid1 = 100.0 * pid1_cpu / window
    load = os.getloadavg()[0]
    lines = [
        '### The metrics collector on an idle guest (`chv.fleet.metrics`)', '',
        'Reproduce: `.venv/bin/python bench/bench_metrics.py --lab NAME --minutes %g` (make bench: the rollout '
        'benchmark\'s lab, 10 minutes). First guest of lab `%s`, %d slots in its policy, the role %s; timer %s. '
        'CPU time: the kernel\'s (cpu.stat) of every run of `%s` in a slice of its own for the window: the whole '
        'unit, Python, nft, systemctl and journalctl. Load average %.1f on %d CPUs at the end.'
        % (args.minutes, args.lab, slots, how, interval, UNIT, load, os.cpu_count()), '',
        '| what | figure | target | met? |', '|---|---|---|---|',
        '| collector CPU time over %.1f min, share of one CPU | %.2f %% (%.2f s in %d runs) | <= %g %% | %s |'
        % (window / 60.0, share, cpu, runs, TARGET_PERCENT, 'met' if share <= TARGET_PERCENT else 'missed'),
        '| one run, mean | %.0f ms | - | - |' % (1000 * cpu / runs),
        '| the guest\'s systemd (PID 1), all its work over the window | %.2f %% | - | - |' % pid1,
    ]
    text = '\n'.join(lines) + '\n'
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, 'w') as fh:
        fh.write(text)
    print(text)
    log('wrote %s' % os.path.relpath(OUT, ROOT))
    return 0


if __name__ == '__main__':
    sys.exit(main())
