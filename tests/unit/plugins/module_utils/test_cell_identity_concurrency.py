"""Sixteen writers against one ledger at the same moment: no identity is
handed out twice and the ledger stays valid.

Two variants: processes calling the locked read-modify-write directly
(fake host facts, deterministic), and sixteen real runs of the module file
as Ansible would execute it on a target (live, read-only host facts)."""

import json
import multiprocessing
import os
import subprocess
import sys

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci

from testpaths import ROOT

WRITERS = 16
MODULE = os.path.join(ROOT, 'plugins', 'modules', 'cell_identity.py')


def _writer(path, name, barrier, queue):
    facts = ci.HostFacts(ifnames=['lo', 'eth0'], networks=[('10.200.0.0/24', 'eth0')],
                         ids=[0, 1000])
    barrier.wait()
    try:
        result = ci.update_ledger(path, [name], ci.Settings(), facts, purge=False,
                                  lock_timeout=60)
        mine = [r for r in result['identities'] if r['name'] == name]
        queue.put((name, mine[0], result['added']))
    except Exception as exc:  # reported to the parent, which fails the test
        queue.put((name, repr(exc), None))


def _assert_unique(ledger, count):
    ci.validate_ledger(ledger)
    recs = list(ledger['slots'].values())
    assert len(recs) == count
    for field in ('index', 'host_ifname', 'machine', 'subnet', 'gateway', 'address', 'uid_base'):
        assert len(set(r[field] for r in recs)) == count, field


def test_sixteen_processes_allocate_without_duplicates(tmp_path):
    path = str(tmp_path / 'state' / 'identities.json')
    ctx = multiprocessing.get_context('fork')
    barrier, queue = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, 'w%d' % i, barrier, queue))
             for i in range(WRITERS)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for dummy in procs]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert all(added == [name] for name, _rec, added in results), results
    ledger = ci.parse_ledger(ci.read_ledger_bytes(path), path)
    _assert_unique(ledger, WRITERS)
    for name, rec, _added in results:
        assert ledger['slots'][name] == rec      # what each writer was told is what was kept
    assert all(r['subnet'] != '10.200.0.0/24' for r in ledger['slots'].values())
    assert sorted(os.listdir(os.path.dirname(path))) == ['identities.json', 'identities.json.lock']


def test_sixteen_module_runs_allocate_without_duplicates(tmp_path):
    path = str(tmp_path / 'identities.json')
    procs = []
    for i in range(WRITERS):
        args = tmp_path / ('args%d.json' % i)
        args.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': {
            'slots': ['m%d' % i], 'purge': False, 'ledger': path, 'pool': '10.231.0.0/16',
            '_ansible_tmpdir': str(tmp_path), '_ansible_remote_tmp': str(tmp_path)}}))
        procs.append(subprocess.Popen([sys.executable, MODULE, str(args)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env=dict(os.environ, LC_ALL='C.UTF-8')))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (out, err)
        outputs.append(json.loads(out))
    assert all(o['changed'] and len(o['added']) == 1 for o in outputs), outputs
    ledger = ci.parse_ledger(ci.read_ledger_bytes(path), path)
    _assert_unique(ledger, WRITERS)
    assert sorted(ledger['slots']) == sorted('m%d' % i for i in range(WRITERS))
