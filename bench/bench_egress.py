"""Benchmark (not a test): the cost of the egress proxy (proxy mode,
docs/network.md "Egress by name") against the NAT (cidr mode), measured
side by side in one run, in the network namespaces of
tests/helpers/egress_lab.py (root; squid and dnsmasq installed).

From one cell, to the same far end (198.20.1.1:443 inside the namespaces):
  latency:    COUNT connections each to its first answer: connect and a
              small request, directly through the NAT (cidr mode) or as a
              CONNECT tunnel through squid (proxy mode); median and p90, ms;
  throughput: one transfer of SIZE bytes, MB/s.
The ratios proxy / NAT are what to compare across machines.
Run: .venv/bin/python bench/bench_egress.py   (or `make bench`)
Also writes build/bench/egress.md (bench/report.py puts it into
docs/performance.md).
"""

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FRAGMENT = os.path.join(ROOT, 'build', 'bench', 'egress.md')
COUNT = 200
SIZE = 256 * 1024 * 1024
ROUNDS = 3

# the checkout as ansible_collections.chv.fleet, tests/helpers and src/ importable (as tests/conftest.py does)
_COLLECTIONS = tempfile.mkdtemp(prefix='chv-bench-collections-')
os.makedirs(os.path.join(_COLLECTIONS, 'ansible_collections', 'chv'))
os.symlink(ROOT, os.path.join(_COLLECTIONS, 'ansible_collections', 'chv', 'fleet'))
atexit.register(shutil.rmtree, _COLLECTIONS, True)
sys.path[:0] = [_COLLECTIONS, os.path.join(ROOT, 'tests', 'helpers'), os.path.join(ROOT, 'src')]

import egress_lab  # noqa: E402
from cellnat_lab import run  # noqa: E402


def measure(lab, proxy):
    """latency samples (ms) and MB/s of ROUNDS rounds, from cell A."""
    argv = [sys.executable, str(egress_lab.PROBE), 'bench']
    argv += (['allowed.test', 443, COUNT, SIZE, lab.slots[0]['gateway'], egress_lab.PORT] if proxy
             else ['198.20.1.1', 443, COUNT, SIZE])
    latency, rates = [], []
    for dummy in range(ROUNDS):
        out = json.loads(run(*argv, ns=lab.cell_a, timeout=300).stdout)
        latency += out['latency_ms']
        rates.append(out['mbytes_per_s'])
    return latency, statistics.median(rates)


def p90(samples):
    return sorted(samples)[int(len(samples) * 0.9)]


def main():
    reason = egress_lab.lab_available()
    if reason:
        print('skipped: %s' % reason)
        return 0
    lab = egress_lab.ProxyLab()
    try:
        lab.up()
        lab.apply_proxy(egress_mode='cidr')          # the NAT: the cell's own connection, masqueraded
        nat_lat, nat_rate = measure(lab, proxy=False)
        lab.apply_proxy()                            # proxy mode: through squid, as a door
        lab.start_squid()
        px_lat, px_rate = measure(lab, proxy=True)
    finally:
        lab.down()
    rows = [('NAT (cidr mode)', nat_lat, nat_rate), ('proxy (squid, CONNECT)', px_lat, px_rate)]
    lines = ['### Egress: the proxy against the NAT (bench/bench_egress.py)', '',
             'One cell to one far end inside network namespaces, %d connections x %d rounds to the first '
             'answer, and %d MiB x %d rounds:' % (COUNT, ROUNDS, SIZE // (1024 * 1024), ROUNDS), '',
             '| path | connect to first answer, median ms | p90 ms | throughput MB/s |', '|---|---|---|---|']
    for name, lat, rate in rows:
        lines.append('| %s | %.3f | %.3f | %.0f |' % (name, statistics.median(lat), p90(lat), rate))
    lines += ['', 'Ratios proxy / NAT: latency (median) %.2f, throughput %.2f.'
              % (statistics.median(px_lat) / statistics.median(nat_lat), px_rate / nat_rate)]
    text = '\n'.join(lines) + '\n'
    print(text)
    os.makedirs(os.path.dirname(FRAGMENT), exist_ok=True)
    with open(FRAGMENT, 'w') as fh:
        fh.write(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
