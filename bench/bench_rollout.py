"""Benchmark (not a test, asserts nothing): what a site.yml rollout costs on
1, 4 and 8 lab guests, side by side in one run (issues 16 and 36).

Brings up one local lab, `brollout` (9 bookworm guests on 10.99.48.0/24,
lab/playbooks/lab_up.yml), and measures, one ansible-playbook run per
configuration (the fast no-change runs REPEATS times):
  1. the first converge of site.yml on guest 1 alone, then on guests 2-5
     together (--limit, -f 8, one batch: -e chv_fleet_batches=["100%"]),
     then on guests 6-9 together (for the 8-guest runs);
  2. the re-run that changes nothing (changed=0 checked in the PLAY RECAP),
     on 1, 4 and 8 guests (2-9), side by side: the full path (-e
     chv_fleet_full_converge=true: every role's tasks and the gate, as
     before the fast path; 1 and 4 guests) and the fast path
     (docs/operations.md "A run that changes nothing"), in the order full/1,
     full/1 without the chv.fleet.worker_gc callback, fast/1, fast/1 without
     it (the tree's ansible.cfg enables it; these two measure what it saves),
     fast/4, fast/8, full/4, each once the machine settled
     (settle()); each with -vvv, from which the module runs per guest are
     counted (one SSH EXEC each with pipelining, the lab inventory's
     ansible_pipelining: true; a `ping -vvv` probe shows it takes effect: no
     file PUT with it on, one with it off). Then the same two no-change runs
     on 1 guest with Mitogen for Ansible (PyPI mitogen, installed into
     build/bench/mitogen, strategy mitogen_linear) and on 4 guests with the
     free strategy, each rolling out a copy of the tree without the plays'
     `strategy: linear` pin (unpinned_source()), its full run first (which
     records the copy's stamp for the fast run to compare);
  3. the per-task profile of the 1-guest fast no-change re-run,
     from bench/callback_plugins/bench_task_times.py (enabled through
     ANSIBLE_CALLBACK_PLUGINS / ANSIBLE_CALLBACKS_ENABLED for these runs
     only): the 15 slowest tasks.
Then destroys the lab (lab/playbooks/lab_down.yml), also when a step failed.

Prints a table and writes the Markdown fragment build/bench/rollout.md
(bench/report.py collects it into docs/performance.md); each run's output
and task times go to build/bench/rollout/.
Run from the repository root: .venv/bin/python bench/bench_rollout.py
What is rolled out is the committed HEAD (a `git archive` of it under
build/bench/rollout/tree, with a collections path of its own), so that the
figures belong to a commit and other people's unfinished edits in a shared
working tree are not rolled out; --worktree rolls out the working tree as it
is (build/dev-collections, as make does).
"""

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests' readers of a -vvv run's module runs and of an ansible.cfg's callbacks
# (tests/helpers/playbook_output.py), one home for both
sys.path.insert(0, os.path.join(ROOT, 'tests', 'helpers'))
from playbook_output import enabled_callbacks, module_runs  # noqa: E402
VENV_BIN = os.path.join(ROOT, '.venv', 'bin')
LAB = 'brollout'
NETWORK = '10.99.48.0/24'
COUNT = 9
LAB_DIR = os.path.join('/var/lib/chv-fleet-lab', LAB)
INVENTORY = os.path.join(LAB_DIR, 'inventory.yml')
LAB_ARGS = ['-e', 'lab_name=' + LAB, '-e', 'lab_count=%d' % COUNT, '-e', 'lab_network=' + NETWORK]
OUT_DIR = os.path.join(ROOT, 'build', 'bench')
LOG_DIR = os.path.join(OUT_DIR, 'rollout')
FRAGMENT = os.path.join(OUT_DIR, 'rollout.md')
FORKS = 8
ONE_BATCH = '{"chv_fleet_batches": ["100%"]}'
PIPELINING_OFF = ['-e', 'ansible_pipelining=false']
FULL = ['-e', 'chv_fleet_full_converge=true']
TOP_TASKS = 15
TARGET_CONVERGE_RATIO = 1.5
TARGET_NOCHANGE_1 = 10.0
TARGET_MODULE_RUNS = 20
TARGET_CONTROLLER_CPU = 5.0
# The fast no-change runs are repeated (the median is the figure: one run of
# 8 to 40 s moves by a fifth with whatever else the 2-CPU machine does), each
# after the machine settles: at most SETTLE_BUSY of its CPUs busy over
# SETTLE_WINDOW seconds, waiting at most SETTLE_MAX (the guests' services
# still starting after a converge); what it found is in the runs' table.
REPEATS = 3
SETTLE_BUSY = 0.15
SETTLE_WINDOW = 5.0
SETTLE_MAX = 120.0
MITOGEN_DIR = os.path.join(ROOT, 'build', 'bench', 'mitogen')
RUN_TIMEOUT = 1200
RECAP_RE = re.compile(r'^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)'
                      r'\s+rescued=(\d+)\s+ignored=(\d+)', re.M)
RECAP_KEYS = ('ok', 'changed', 'unreachable', 'failed', 'skipped', 'rescued', 'ignored')
# What is rolled out: a snapshot of HEAD or, with --worktree, the checkout (make's development collections path).
SOURCE = {'tree': ROOT, 'collections': os.path.join(ROOT, 'build', 'dev-collections'), 'what': 'the working tree (--worktree)'}


def snapshot_head():
    """Extract HEAD (git archive) to LOG_DIR/tree and give it a collections path of its own."""
    tree = os.path.join(LOG_DIR, 'tree')
    collections = os.path.join(LOG_DIR, 'collections')
    for path in (tree, collections):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(tree)
    archive = subprocess.run(['git', 'archive', 'HEAD'], cwd=ROOT, stdout=subprocess.PIPE, check=True).stdout
    subprocess.run(['tar', '-x', '-C', tree], input=archive, check=True)
    link_collections(tree, collections)
    SOURCE.update({'tree': tree, 'collections': collections, 'what': 'a clean export of HEAD'})


def link_collections(tree, collections):
    """A collections path at `collections` for the tree: chv.fleet and the test lab (lab/, an internal
    collection of the checkout), linked as make devcoll links them."""
    os.makedirs(os.path.join(collections, 'ansible_collections', 'chv'))
    os.symlink(tree, os.path.join(collections, 'ansible_collections', 'chv', 'fleet'))
    os.symlink(os.path.join(tree, 'lab'), os.path.join(collections, 'ansible_collections', 'chv', 'fleet_lab'))


# The collection's plays pin `strategy: linear` (playbooks/validate.yml says
# why): ANSIBLE_STRATEGY alone would not take effect. The Mitogen and free
# runs roll out a copy of the tree with that one line removed from each play,
# to measure what the strategy would save.
PIN = re.compile(r'^  strategy: linear\n', re.M)


def unpinned_source():
    """A copy of SOURCE's tree (LOG_DIR/unpinned) without the plays' strategy pin, with a collections path of its own."""
    base = os.path.join(LOG_DIR, 'unpinned')
    tree, collections = os.path.join(base, 'tree'), os.path.join(base, 'collections')
    shutil.rmtree(base, ignore_errors=True)
    shutil.copytree(SOURCE['tree'], tree, symlinks=True, ignore=shutil.ignore_patterns('.git', 'build', '.venv*'))
    removed = 0
    playbooks = os.path.join(tree, 'playbooks')
    for name in sorted(os.listdir(playbooks)):
        if name.endswith('.yml'):
            with open(os.path.join(playbooks, name)) as handle:
                text, count = PIN.subn('', handle.read())
            with open(os.path.join(playbooks, name), 'w') as handle:
                handle.write(text)
            removed += count
    if not removed:
        raise RuntimeError('no play of %s pins strategy: linear: the unpinned copy would equal the tree' % playbooks)
    link_collections(tree, collections)
    return {'tree': tree, 'collections': collections}


def source(strategy=None):
    """The tree a run rolls out: the unpinned copy for a run with a strategy of its own."""
    return SOURCE['unpinned'] if strategy else SOURCE


# The callback that spares the task workers Python's garbage collector
# (plugins/callback/worker_gc.py): the tree's ansible.cfg enables it; the
# runs of WITHOUT_GC_KEYS measure the same runs without it, side by side.
WORKER_GC = 'chv.fleet.worker_gc'


def ansible_env(profile=None, strategy=None, worker_gc=True):
    env = dict(os.environ)
    env.update({
        'ANSIBLE_COLLECTIONS_PATH': source(strategy)['collections'],
        'ANSIBLE_ROLES_PATH': os.path.join(source(strategy)['tree'], 'roles'),
        'ANSIBLE_NOCOLOR': '1',
        'ANSIBLE_FORCE_COLOR': '0',
        'PATH': VENV_BIN + os.pathsep + os.environ.get('PATH', ''),
    })
    # the tree's callbacks (ANSIBLE_CALLBACKS_ENABLED replaces its list), the profile's too
    callbacks = [c for c in enabled_callbacks(os.path.join(source(strategy)['tree'], 'ansible.cfg'))
                 if worker_gc or c != WORKER_GC]
    if profile:
        env['ANSIBLE_CALLBACK_PLUGINS'] = os.path.join(ROOT, 'bench', 'callback_plugins')
        callbacks.append('bench_task_times')
        env['CHV_BENCH_TASK_TIMES'] = profile
    env['ANSIBLE_CALLBACKS_ENABLED'] = ','.join(callbacks)
    if strategy == 'mitogen_linear':
        env.update({'ANSIBLE_STRATEGY_PLUGINS': os.path.join(MITOGEN_DIR, 'ansible_mitogen', 'plugins', 'strategy'),
                    'PYTHONPATH': MITOGEN_DIR, 'ANSIBLE_HOST_KEY_CHECKING': 'False'})  # its SSH checks host keys itself
    if strategy:
        env['ANSIBLE_STRATEGY'] = strategy
    return env


def install_mitogen():
    """Mitogen for Ansible from PyPI into MITOGEN_DIR (not into the venv: make test never sees it); its version."""
    pip = [os.path.join(VENV_BIN, 'pip'), 'install', '-q', '--no-deps', '--upgrade', '--target', MITOGEN_DIR, 'mitogen']
    subprocess.run(pip, check=True, timeout=300)
    meta = [d for d in os.listdir(MITOGEN_DIR) if d.startswith('mitogen-') and d.endswith('.dist-info')]
    return meta[0][len('mitogen-'):-len('.dist-info')] if meta else '?'



def machine_cpu_seconds():
    """Busy CPU time of the whole machine (every process, the guests too) from /proc/stat."""
    with open('/proc/stat') as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / float(os.sysconf('SC_CLK_TCK'))


def settle():
    """Wait (at most SETTLE_MAX s) until the machine's CPUs are at most SETTLE_BUSY busy over SETTLE_WINDOW s;
    returns (the busy fraction last seen, the seconds waited)."""
    start = time.monotonic()
    while True:
        cpu0, t0 = machine_cpu_seconds(), time.monotonic()
        time.sleep(SETTLE_WINDOW)
        busy = (machine_cpu_seconds() - cpu0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))
        if busy <= SETTLE_BUSY or time.monotonic() - start >= SETTLE_MAX:
            return busy, time.monotonic() - start


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(label, argv, profile=False, strategy=None, quiet=False, worker_gc=True):
    """Run one command (cwd: the tree rolled out), its output to LOG_DIR/<label>.log; returns its figures.
    quiet: after the machine settles (settle())."""
    busy, waited = settle() if quiet else (None, 0.0)
    log = os.path.join(LOG_DIR, label + '.log')
    times = os.path.join(LOG_DIR, label + '.tasks.json') if profile else None
    if times and os.path.exists(times):
        os.unlink(times)
    load = os.getloadavg()[0]
    cpu0, kids0, start = machine_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    with open(log, 'w') as out:
        try:
            proc = subprocess.run(argv, cwd=source(strategy)['tree'], env=ansible_env(times, strategy, worker_gc), stdout=out,
                                  stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 'timeout after %d s' % RUN_TIMEOUT
    wall = time.monotonic() - start
    result = {'label': label, 'argv': argv, 'rc': rc, 'wall': wall, 'load': load, 'log': log, 'busy': busy, 'waited': waited,
              'machine_cpu': machine_cpu_seconds() - cpu0, 'controller_cpu': children_cpu_seconds() - kids0}
    with open(log) as handle:
        text = handle.read()
    result['output'] = text
    result['module_runs'] = module_runs(text)
    recap = text[text.rfind('PLAY RECAP'):] if 'PLAY RECAP' in text else ''
    result['recap'] = dict((m.group(1), dict(zip(RECAP_KEYS, (int(v) for v in m.groups()[1:]))))
                           for m in RECAP_RE.finditer(recap))
    if times and os.path.exists(times):
        with open(times) as handle:
            result['tasks'] = json.load(handle)['tasks']
    print('  %-22s %7.1f s  rc=%s  %s' % (label, wall, rc, summary(result)), flush=True)
    return result


def totals(result):
    return dict((k, sum(h[k] for h in result['recap'].values())) for k in RECAP_KEYS)


def summary(result):
    if not result['recap']:
        return '(no PLAY RECAP)'
    t = totals(result)
    return '%d hosts: ok=%d changed=%d skipped=%d failed=%d unreachable=%d' % (
        len(result['recap']), t['ok'], t['changed'], t['skipped'], t['failed'], t['unreachable'])


def healthy(result, hosts):
    """The run ended well on exactly these hosts (rc 0, none failed or unreachable)."""
    return (result['rc'] == 0 and sorted(result['recap']) == sorted(hosts)
            and all(h['failed'] == 0 and h['unreachable'] == 0 for h in result['recap'].values()))


def command_output(argv, env=None):
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              universal_newlines=True, timeout=60, check=False).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return 'unknown (%s)' % exc


def machine():
    env = ansible_env()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--', 'site.yml', 'playbooks', 'roles', 'plugins'],
                           cwd=ROOT, stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout.splitlines()
    return {
        'date': time.strftime('%Y-%m-%d %H:%M %Z'),
        'commit': command_output(['git', 'rev-parse', '--short', 'HEAD']),
        'dirty': len(dirty),
        'nproc': os.cpu_count(),
        'kernel': os.uname().release,
        'systemd': command_output(['systemd', '--version']),
        'ansible': re.sub(r'^ansible-playbook \[core (.*)\]$', r'\1', command_output([os.path.join(VENV_BIN, 'ansible-playbook'), '--version'], env)),
    }


def guest_systemd(guest):
    return command_output(['ssh', '-i', os.path.join(LAB_DIR, 'id_ed25519'), '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=no',
                           '-o', 'UserKnownHostsFile=/dev/null', '-o', 'LogLevel=ERROR', 'root@' + guest['address'],
                           'systemd --version'])


def pipelining_probe(guest, off):
    """ping -vvv with become, as site.yml runs: (SSH commands, file PUTs) for one module run."""
    argv = [os.path.join(VENV_BIN, 'ansible'), '-i', INVENTORY, guest, '-m', 'ansible.builtin.ping', '-b', '-vvv']
    res = run('probe-pipelining-' + ('off' if off else 'on'), argv + (PIPELINING_OFF if off else []))
    lines = res['output'].splitlines()
    return (res['rc'], sum(1 for ln in lines if 'SSH: EXEC' in ln), sum(1 for ln in lines if re.search(r'> PUT ', ln)))


def site(label, hosts, extra=(), strategy=None, quiet=False, worker_gc=True):
    argv = [os.path.join(VENV_BIN, 'ansible-playbook'), '-i', INVENTORY, 'site.yml', '-f', str(FORKS),
            '--limit', ','.join(hosts), '-e', ONE_BATCH] + list(extra)
    result = run(label, argv, profile=True, strategy=strategy, quiet=quiet, worker_gc=worker_gc)
    result['hosts'] = len(hosts)
    return result


def per_guest_runs(result):
    """Module runs per guest (the most of any guest), or None without -vvv output."""
    return max(result['module_runs'].values()) if result and result.get('module_runs') else None


def per_guest_cpu(result):
    """Controller CPU-s per guest of a run, or of its repeats (the median; result['repeats'])."""
    if not result or not result.get('hosts'):
        return None
    values = sorted(x['controller_cpu'] / x['hosts'] for x in result.get('repeats', [result]))
    return values[len(values) // 2]


def ratio(a, b):
    return a['wall'] / b['wall'] if a and b and b['wall'] else None


def fmt_s(result):
    if not result:
        return 'not measured'
    text = '%.1f s' % result['wall']
    return text if result.get('ok') else text + ' (FAILED: rc=%s, see %s)' % (result['rc'], os.path.relpath(result['log'], ROOT))


def fmt_r(value):
    return '%.2f' % value if value is not None else 'n/a'


def met(value, limit):
    if value is None:
        return 'not measured'
    return 'met' if value <= limit else 'missed'


def changed_cell(result):
    if not result or not result['recap']:
        return 'no PLAY RECAP'
    return '%d' % totals(result)['changed']


def fmt_n(value, fmt='%d'):
    return fmt % value if value is not None else 'not measured'


def pair(full, fast, fn, fmt):
    """'full -> fast' of a figure."""
    return '%s -> %s' % (fmt_n(fn(full), fmt), fmt_n(fn(fast), fmt))


def build_rows(r):
    c1, c4 = r.get('converge-1'), r.get('converge-4')
    full1, full4, fast1, fast4, fast8 = r.get('full-1'), r.get('full-4'), r.get('fast-1'), r.get('fast-4'), r.get('fast-8')
    conv_ratio = ratio(c4, c1)
    wall = lambda x: x['wall'] if x else None  # noqa: E731
    cpu = dict((n, per_guest_cpu(x)) for n, x in ((1, fast1), (4, fast4), (8, fast8)))
    cpu_over = [n for n, v in sorted(cpu.items()) if v is None or v > TARGET_CONTROLLER_CPU]
    rows = [
        ('first converge of site.yml', fmt_s(c1), fmt_s(c4), '-', fmt_r(conv_ratio), '4/1 <= %.1f' % TARGET_CONVERGE_RATIO,
         met(conv_ratio, TARGET_CONVERGE_RATIO)),
        ('no-change re-run, full path (chv_fleet_full_converge)', fmt_s(full1), fmt_s(full4), '-', fmt_r(ratio(full4, full1)),
         '-', '-'),
        ('no-change re-run, fast path (the first of its %d runs)' % REPEATS, fmt_s(fast1), fmt_s(fast4), fmt_s(fast8),
         fmt_r(ratio(fast4, fast1)), '1 guest <= %.0f s' % TARGET_NOCHANGE_1, met(wall(fast1), TARGET_NOCHANGE_1)),
        ('module runs per guest, no-change re-run (full -> fast)', pair(full1, fast1, per_guest_runs, '%d'),
         pair(full4, fast4, per_guest_runs, '%d'), fmt_n(per_guest_runs(fast8)), '-', '<= %d' % TARGET_MODULE_RUNS,
         met(per_guest_runs(fast1), TARGET_MODULE_RUNS)),
        ('controller CPU-s per guest, no-change re-run (full -> fast: the median of %d runs)' % REPEATS,
         pair(full1, fast1, per_guest_cpu, '%.1f'), pair(full4, fast4, per_guest_cpu, '%.1f'),
         fmt_n(cpu[8], '%.1f'), '-', '<= %.0f (1, 4 and 8 guests)' % TARGET_CONTROLLER_CPU,
         'met' if not cpu_over else 'missed (%s)' % ', '.join('%d guest%s' % (n, 's' if n > 1 else '') for n in cpu_over)),
        ('changed= in the no-change re-runs\' PLAY RECAP (full / fast)', '%s / %s' % (changed_cell(full1), changed_cell(fast1)),
         '%s / %s' % (changed_cell(full4), changed_cell(fast4)), changed_cell(fast8), '-', '0',
         'met' if all(x and x['recap'] and totals(x)['changed'] == 0
                      for x in (full1, full4) + tuple(y for f in (fast1, fast4, fast8) if f for y in f.get('repeats', [f])))
         and fast8 else 'missed: NOT a no-change run where it is not 0'),
    ]
    for key, label, hosts in (('mitogen', 'Mitogen (mitogen_linear, the plays unpinned)', '1 guest'),
                               ('free', 'strategy free (the plays unpinned)', '4 guests')):
        full, fast = r.get(key + '-full'), r.get(key + '-fast')
        base_full, base_fast = (full1, fast1) if key == 'mitogen' else (full4, fast4)
        rows.append(('%s, no-change re-run full / fast, %s (linear: %s / %s)' % (label, hosts, fmt_s(base_full), fmt_s(base_fast)),
                     '%s / %s' % (fmt_s(full), fmt_s(fast)), '-', '-',
                     '%s / %s' % (fmt_r(ratio(full, base_full)), fmt_r(ratio(fast, base_fast))), '-',
                     'not offered as a speed-up (docs/operations.md says why)'))
    full0, fast0 = r.get('full-1-nogc'), r.get('fast-1-nogc')
    rows.append(('without %s (the same runs, 1 guest): no-change re-run full / fast, wall and controller CPU-s '
                 '(with it: %s / %s, %s / %s CPU-s)' % (WORKER_GC, fmt_s(full1), fmt_s(fast1), fmt_n(per_guest_cpu(full1), '%.1f'),
                                                        fmt_n(per_guest_cpu(fast1), '%.1f')),
                 '%s / %s, %s / %s CPU-s' % (fmt_s(full0), fmt_s(fast0), fmt_n(per_guest_cpu(full0), '%.1f'),
                                             fmt_n(per_guest_cpu(fast0), '%.1f')), '-', '-',
                 'CPU with / without: %s / %s' % (fmt_r(cpu_ratio(full1, full0)), fmt_r(cpu_ratio(fast1, fast0))), '-',
                 'enabled in docs/examples/ansible.cfg'))
    return rows


def cpu_ratio(a, b):
    """Controller CPU per guest of a over b (medians of their repeats)."""
    x, y = per_guest_cpu(a), per_guest_cpu(b)
    return x / y if x is not None and y else None


def run_rows(r):
    rows = []
    for key in RUN_ORDER:
        x = r.get(key)
        if x:
            for y in x.get('repeats', [x]):
                rows.append((y['label'], '%.1f' % y['wall'], '%.0f' % y['machine_cpu'], '%.1f' % (y['machine_cpu'] / y['wall']),
                             '%.1f' % y['controller_cpu'], fmt_n(per_guest_runs(y)), '%.1f' % y['load'],
                             '-' if y.get('busy') is None else '%.0f %% after %.0f s' % (100 * y['busy'], y['waited']),
                             str(y['rc']), summary(y)))
    return rows


def top_tasks(result):
    tasks = sorted(result.get('tasks', []), key=lambda t: -t['seconds'])
    return tasks[:TOP_TASKS]


def task_label(task):
    name = task['name']
    if task['role'] and not name.startswith(task['role']):
        name = '%s : %s' % (task['role'], name)
    return name + (' (handler)' if task.get('handler') else '')


def text_table(header, rows):
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ['  '.join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append('  '.join('-' * w for w in widths))
    lines.extend('  '.join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)
    return '\n'.join(lines)


def md_table(header, rows, align=None):
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join(align or ['---'] * len(header)) + '|']
    lines.extend('| ' + ' | '.join(str(c).replace('|', '\\|') for c in row) + ' |' for row in rows)
    return '\n'.join(lines)


MAIN_HEADER = ('what', '1 guest', '4 guests', '8 guests', 'ratio 4/1', 'target', 'met?')
RUN_HEADER = ('run', 'wall s', 'machine CPU-s', 'CPUs busy', 'controller CPU-s', 'module runs per guest',
              'load (1 min) at start', 'machine busy before it (settled)', 'rc', 'PLAY RECAP')
# key: (guests, extra arguments, strategy), in the order they run
# (the no-change runs, with -vvv, after the machine settles; the fast ones REPEATS times)
RUNS = [('converge-1', 'one', (), None), ('converge-4', 'four', (), None), ('converge-4b', 'rest', (), None),
        ('full-1', 'one', ('-vvv',) + tuple(FULL), None), ('full-1-nogc', 'one', ('-vvv',) + tuple(FULL), None),
        ('fast-1', 'one', ('-vvv',), None), ('fast-1-nogc', 'one', ('-vvv',), None),
        ('fast-4', 'four', ('-vvv',), None), ('fast-8', 'eight', ('-vvv',), None),
        ('full-4', 'four', ('-vvv',) + tuple(FULL), None),
        ('mitogen-full', 'one', ('-vvv',) + tuple(FULL), 'mitogen_linear'), ('mitogen-fast', 'one', ('-vvv',), 'mitogen_linear'),
        ('free-full', 'four', ('-vvv',) + tuple(FULL), 'free'), ('free-fast', 'four', ('-vvv',), 'free')]
RUN_ORDER = [key for key, _, _, _ in RUNS]
# the runs without chv.fleet.worker_gc (each right after its twin with it)
WITHOUT_GC_KEYS = ('full-1-nogc', 'fast-1-nogc')


def report(info, r, probe, lab, errors, total):
    rows, runs = build_rows(r), run_rows(r)
    on1 = r.get('fast-1')
    top = top_tasks(on1) if on1 else []
    print()
    print('machine: %(nproc)s CPUs, kernel %(kernel)s, %(systemd)s, ansible-core %(ansible)s; commit %(commit)s (%(source)s), %(date)s'
          % info)
    print(text_table(MAIN_HEADER, rows))
    print()
    print(text_table(RUN_HEADER, runs))
    if top:
        print('\n%d slowest tasks of the 1-guest fast no-change re-run, %d tasks, %.1f s in tasks:'
              % (len(top), len(on1['tasks']), sum(t['seconds'] for t in on1['tasks'])))
        for task in top:
            print('  %6.2f s  %s' % (task['seconds'], task_label(task)))
    for err in errors:
        print('ERROR: ' + err)
    print('\nrollout benchmark: %.0f s end to end' % total)

    md = ['### Rollout', '',
          '`.venv/bin/python bench/bench_rollout.py` (in `make bench`): site.yml on local lab guests (bookworm, baked image,',
          'systemd-nspawn -b), lab `%s` (%d guests, %s): guest 1 alone, guests 2-5 together and guests 2-9 together'
          % (LAB, COUNT, NETWORK),
          '(guests 6-9 converged first on their own; `--limit`, `-f %d`, one' % FORKS,
          'batch: `-e \'%s\'`; site.yml\'s default batches would run 4 guests as 1, 1, 2 in turn).' % ONE_BATCH,
          'Measured %s at commit %s%s, rolling out %s; %s CPUs, kernel %s, %s (host), %s (guests), ansible-core %s.'
          % (info['date'], info['commit'], ' (%d uncommitted files under site.yml, playbooks, roles, plugins)'
             % info['dirty'] if info['dirty'] else '', info['source'], info['nproc'], info['kernel'], info['systemd'], lab.get('guest_systemd', '?'),
             info['ansible']),
          'Mitogen for Ansible: %s.' % info.get('mitogen', 'not reached'),
          'On a shared 2-CPU machine (load average at each run\'s start below); both sides of each ratio ran in the same session.',
          'The no-change runs, in the order full/1, full/1 without chv.fleet.worker_gc, fast/1, fast/1 without it, fast/4, fast/8, '
          'full/4 (-vvv each: module runs counted from its',
          'SSH EXEC lines), each start once the machine settled (at most %.0f %% of its CPUs busy over %.0f s, waiting at most'
          % (100 * SETTLE_BUSY, SETTLE_WINDOW),
          '%.0f s: the guests\' services are still starting after a converge); each fast one ran %d times, and its controller'
          % (SETTLE_MAX, REPEATS),
          'CPU per guest is the median of them (its wall time the first run\'s); every other figure is a single run. '
          'The whole benchmark took %.0f s (lab up %s, down %s).'
          % (total, '%.0f s' % lab['up'] if 'up' in lab else '?',
             '%.0f s' % lab['down'] if 'down' in lab else 'not measured: kept for the cells benchmark'), '']
    if probe:
        counts = (probe['on'][1], probe['on'][2], probe['off'][1], probe['off'][2])
        md += ['Pipelining off takes effect: a `ping -b -vvv` with the lab inventory made %d SSH command(s) and %d file PUT(s) with '
               'pipelining on, %d and %d with `-e ansible_pipelining=false`.' % counts, '']
    md += [md_table(MAIN_HEADER, rows), '',
           md_table(RUN_HEADER, runs, ['---', '---:', '---:', '---:', '---:', '---:', '---:', '---:', '---:', '---']), '',
           'machine CPU-s: busy time of the whole machine during the run (/proc/stat: the guests, ansible and anything else '
           'running), CPUs busy: machine CPU-s / wall (%d = every CPU busy all the time: the lab\'s guests run on the controller\'s '
           'CPUs, so the 4/1 ratios here are bound by CPU); controller CPU-s: ansible-playbook and its ssh processes.'
           % info['nproc'], '']
    if top:
        counts = (len(top), len(on1['tasks']), sum(t['seconds'] for t in on1['tasks']))
        md += ['The %d slowest tasks of the 1-guest fast no-change re-run (%d tasks, %.1f s in tasks; from a task\'s start '
               'to the next\'s, bench/callback_plugins/bench_task_times.py):' % counts, '',
               md_table(('seconds', 'task'), [('%.2f' % t['seconds'], task_label(t)) for t in top], ['---:', '---']), '']
    for err in errors:
        md += ['**Error:** ' + err, '']
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(FRAGMENT, 'w') as handle:
        handle.write('\n'.join(md))
    print('wrote ' + os.path.relpath(FRAGMENT, ROOT))


def main():
    start = time.monotonic()
    os.makedirs(LOG_DIR, exist_ok=True)
    info = machine()
    if '--worktree' not in sys.argv[1:]:
        snapshot_head()
        info['dirty'] = 0
    info['source'] = SOURCE['what']
    SOURCE['unpinned'] = unpinned_source()
    print('rollout benchmark: lab %s (%d guests, %s), logs in %s' % (LAB, COUNT, NETWORK, os.path.relpath(LOG_DIR, ROOT)), flush=True)
    r, probe, lab, errors = {}, {}, {}, []
    playbook = os.path.join(VENV_BIN, 'ansible-playbook')
    try:
        if os.path.exists(LAB_DIR):   # left by an interrupted run: its guests are not fresh
            run('lab-down-stale', [playbook, 'lab/playbooks/lab_down.yml'] + LAB_ARGS)
        up = run('lab-up', [playbook, 'lab/playbooks/lab_up.yml'] + LAB_ARGS)
        lab['up'] = up['wall']
        if up['rc'] != 0:
            raise RuntimeError('lab_up failed (rc=%s), see %s' % (up['rc'], up['log']))
        with open(os.path.join(LAB_DIR, 'lab.json')) as handle:
            guests = json.load(handle)['guests']
        names = [g['name'] for g in guests]
        if len(names) != COUNT:
            raise RuntimeError('lab_up made %d guests, not %d' % (len(names), COUNT))
        # guest 1 alone; guests 2-5 the four; guests 2-9 the eight (6-9 converged on their own first)
        one, four, rest = names[:1], names[1:5], names[5:9]
        lab['guest_systemd'] = guest_systemd(guests[0])
        probe = {'on': pipelining_probe(one[0], False), 'off': pipelining_probe(one[0], True)}
        if probe['on'][0] != 0 or probe['off'][0] != 0 or probe['on'][2] != 0 or probe['off'][2] == 0:
            errors.append('the pipelining probe did not show pipelining on without PUTs and off with them: %r' % (probe,))
        sets = {'one': one, 'four': four, 'rest': rest, 'eight': four + rest}
        for key, which, extra, strategy in RUNS:
            if strategy == 'mitogen_linear' and 'mitogen' not in info:
                try:
                    info['mitogen'] = install_mitogen()
                except (OSError, subprocess.SubprocessError) as exc:
                    info['mitogen'] = 'not installed: %s' % exc
                    errors.append('mitogen: %s' % exc)
            if strategy == 'mitogen_linear' and info['mitogen'].startswith('not installed'):
                continue
            hosts = sets[which]
            nochange = '-vvv' in extra
            repeats = [site(key if n == 1 else '%s.%d' % (key, n), hosts, extra, strategy, quiet=nochange,
                            worker_gc=key not in WITHOUT_GC_KEYS)
                       for n in range(1, (REPEATS if nochange and key.startswith('fast-') else 1) + 1)]
            for x in repeats:
                x['ok'] = healthy(x, hosts)
                if not x['ok']:
                    errors.append('%s: rc=%s, %s (see %s)' % (x['label'], x['rc'], summary(x), os.path.relpath(x['log'], ROOT)))
            r[key] = dict(repeats[0], repeats=repeats, ok=all(x['ok'] for x in repeats))
    except Exception as exc:  # noqa: B902  (whatever went wrong: the lab goes down and the report says it)
        errors.append('%s: %s' % (type(exc).__name__, exc))
    finally:
        if os.environ.get('CHV_BENCH_KEEP_LAB') == '1' and not errors:
            # make bench: the cells benchmark measures on guest 1 next, and make takes the lab down
            print('lab %s kept (CHV_BENCH_KEEP_LAB=1)' % LAB, flush=True)
        else:
            down = run('lab-down', [playbook, 'lab/playbooks/lab_down.yml'] + LAB_ARGS)
            lab['down'] = down['wall']
            if down['rc'] != 0:
                errors.append('lab_down failed (rc=%s), see %s: the lab %s may be left running' % (down['rc'], down['log'], LAB))
    with open(os.path.join(LOG_DIR, 'results.json'), 'w') as handle:
        json.dump({'info': info, 'runs': dict((k, dict((f, v) for f, v in x.items() if f != 'output')) for k, x in r.items()),
                   'probe': probe, 'lab': lab, 'errors': errors}, handle, indent=1)
    report(info, r, probe, lab, errors, time.monotonic() - start)
    return 1 if errors else 0


def lab_down():
    """--lab-down: only take this benchmark's lab down (make bench, after
    the cells benchmark measured on its first guest)."""
    if not os.path.exists(LAB_DIR):
        return 0
    os.makedirs(LOG_DIR, exist_ok=True)
    down = run('lab-down', [os.path.join(VENV_BIN, 'ansible-playbook'), 'lab/playbooks/lab_down.yml'] + LAB_ARGS)
    return 0 if down['rc'] == 0 else 1


if __name__ == '__main__':
    if shutil.which('systemd-nspawn') is None:
        sys.exit('bench_rollout: needs systemd-nspawn (make sysdeps) and root')
    sys.exit(lab_down() if '--lab-down' in sys.argv[1:] else main())
