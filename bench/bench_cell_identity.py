"""Benchmark (not a test): allocate one more slot with N slots already in
the ledger, N in 10, 1000, 4000.  Target: <= 20 ms at 4000 for the logic.

Prints, per N, the best and median of several runs of
  allocate:  the pure logic (validate the ledger + allocate + build the new
             ledger dict), what the target is about;
  dump:      serialising the new ledger for the file and the diff;
  update:    the whole locked read-modify-write on a temp ledger (read,
             JSON decode, validate, allocate, dump, temp file + fsync +
             rename + dir fsync), i.e. what one module run costs besides
             Python start-up and gathering host facts.
  json.loads (ref): decoding the same ledger text, measured side by side
             as a yardstick for the machine; ratio = allocate / json.loads
             (best times) is what to compare across machines.
Run: .venv/bin/python bench/bench_cell_identity.py   (or `make bench`)
Also writes build/bench/identity.md (bench/report.py puts it into
docs/performance.md).
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FRAGMENT = os.path.join(HERE, '..', 'build', 'bench', 'identity.md')
TARGET_MS = 20.0
sys.path.insert(0, os.path.join(HERE, '..', 'plugins', 'module_utils'))
import cell_identity as ci  # noqa: E402  (standard library only: imported without Ansible)

SIZES = (10, 1000, 4000)
RUNS = 15
POOL = '10.192.0.0/12'      # 4096 /24 subnets: room for 4001 slots
HOST = ci.HostFacts(
    ifnames=['lo', 'eth0', 'wg0'],
    networks=[('192.0.2.0/24', 'eth0'), ('192.0.2.1/32', 'eth0'), ('10.192.0.0/24', 'wg0')],
    ids=[0, 1, 2, 100, 1000, 65534], id_ranges=[(100000, 65536), (165536, 65536)])


def timed(func, runs=RUNS):
    samples = []
    for dummy in range(runs):
        start = time.perf_counter()
        func()
        samples.append((time.perf_counter() - start) * 1000.0)
    return min(samples), statistics.median(samples)


def write_fragment(rows, results):
    """build/bench/identity.md: the same figures as the printed table."""
    best, median = results[4000]
    size, alloc, dump, upd, ref = rows[-1]
    lines = ['### Slot identity allocation (`chv.fleet.cell_identity`)', '',
             'Reproduce: `.venv/bin/python bench/bench_cell_identity.py` (python %s; pool %s, /24 cells; %d runs each; '
             'load average %.1f on %d CPUs at the end). Allocate one more slot with N already in the ledger.'
             % (sys.version.split()[0], POOL, RUNS, os.getloadavg()[0], os.cpu_count()), '',
             '| what | figure | baseline | ratio | target | met? |', '|---|---|---|---|---|---|',
             '| allocate at %s slots, median (best) | %.1f ms (%.1f) | json.loads of the same ledger: %.2f ms (%.2f) '
             '| %.1f (best / best) | <= %g ms (median) | %s |'
             % ('{:,}'.format(size), median, best, ref[1], ref[0], best / ref[0], TARGET_MS,
                'met' if median <= TARGET_MS else 'missed'),
             '| allocate at %s slots, median | %.1f ms | %s slots: %.2f ms | %.1f | about %.0f (linear) | - |'
             % ('{:,}'.format(size), median, '{:,}'.format(SIZES[-2]), results[SIZES[-2]][1],
                median / results[SIZES[-2]][1], size / SIZES[-2]),
             '', 'Best / median, ms:', '',
             '| slots in ledger | allocate | dump | update (file I/O) | json.loads (yardstick) | allocate / json.loads |',
             '|---:|---:|---:|---:|---:|---:|']
    for size, alloc, dump, upd, ref in rows:
        lines.append('| %s | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.1f |'
                     % ('{:,}'.format(size), alloc[0], alloc[1], dump[0], dump[1], upd[0], upd[1], ref[0], ref[1],
                        alloc[0] / ref[0]))
    os.makedirs(os.path.dirname(FRAGMENT), exist_ok=True)
    with open(FRAGMENT, 'w') as fh:
        fh.write('\n'.join(lines) + '\n')


def main():
    settings = ci.Settings(pool=POOL, prefix=24)
    tmp = tempfile.mkdtemp(prefix='chv-bench-')
    try:
        print('python %s; pool %s /24; %d runs each (best / median, ms)'
              % (sys.version.split()[0], POOL, RUNS))
        header = ('existing', 'allocate', 'dump', 'update (file I/O)', 'json.loads (ref)', 'ratio')
        print('%8s %18s %18s %18s %18s %8s' % header)
        results = {}
        rows = []
        for size in SIZES:
            ledger = ci.allocate(None, size, settings, HOST).ledger
            names = ['slot%d' % i for i in range(size)] + ['new']
            alloc = timed(lambda: ci.allocate(ledger, names, settings, HOST))
            new = ci.allocate(ledger, names, settings, HOST).ledger
            assert len(new['slots']) == size + 1
            dump = timed(lambda: ci.dump_ledger(new))
            path = os.path.join(tmp, 'identities-%d.json' % size)
            ci.write_ledger_text(path, ci.dump_ledger(ledger))
            counter = iter(range(RUNS))

            def update():
                # purge=False: each run adds one more slot (N, N+1, ...).
                name = 'extra%d' % next(counter)
                result = ci.update_ledger(path, [name], settings, HOST, purge=False)
                assert result['added'] == [name]

            upd = timed(update)
            text = ci.dump_ledger(ledger)
            ref = timed(lambda: json.loads(text))
            results[size] = alloc
            print('%8d %8.2f / %7.2f %8.2f / %7.2f %8.2f / %7.2f %8.2f / %7.2f %8.1f'
                  % (size, alloc[0], alloc[1], dump[0], dump[1], upd[0], upd[1], ref[0], ref[1],
                     alloc[0] / ref[0]))
            rows.append((size, alloc, dump, upd, ref))
        best, median = results[4000]
        print('allocate at 4000 vs 10: x%.0f (median); target <= 20 ms at 4000: best %.1f ms (%s), '
              'median %.1f ms (%s)' % (median / results[10][1], best,
                                       'met' if best <= 20.0 else 'NOT met', median,
                                       'met' if median <= 20.0 else 'NOT met'))
        print('load average during the run: %.1f on %d CPUs (timings scale with it)'
              % (os.getloadavg()[0], os.cpu_count()))
        write_fragment(rows, results)
    finally:
        shutil.rmtree(tmp)


if __name__ == '__main__':
    main()
