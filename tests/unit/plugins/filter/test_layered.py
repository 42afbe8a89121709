"""chv.fleet.layered: debops-style layering (x_default + x + x_group + x_host).

Besides the filter's own properties, two tests hold it to the Jinja
expressions it replaced in roles/cell_runtime/vars/main.yml (kept below as
``OLD_*``): random layers rendered through Ansible's templar, and the role's
real defaults and vars rendered by ansible-playbook with a few override
combinations."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from hypothesis import HealthCheck, given, settings, strategies as st

from ansible_collections.chv.fleet.plugins.filter import layered as layered_mod
from ansible_collections.chv.fleet.plugins.filter.layered import layered

from role_defaults import role_defaults
from testpaths import ROOT

ROLE = os.path.join(ROOT, 'roles', 'cell_runtime')

# The expressions of roles/cell_runtime/vars/main.yml before the filter
# (commit 66ed42f), with X standing for the variable's base name.
OLD_UNIQUE_SORT = "{{ (X_default + X + X_group + X_host) | unique | sort }}"
OLD_UNIQUE = "{{ (X_default + X + X_group + X_host) | unique }}"
OLD_BY_TARGET = (
    "{{ (X_default + X + X_group + X_host)"
    " | groupby('target') | map('last') | map('last')"
    " | rejectattr('state', 'defined') | list"
    " + (X_default + X + X_group + X_host)"
    " | groupby('target') | map('last') | map('last')"
    " | selectattr('state', 'defined') | selectattr('state', 'equalto', 'present')"
    " | map('dict2items') | map('rejectattr', 'key', 'equalto', 'state') | map('items2dict') | list }}")
SUFFIXES = ('_default', '', '_group', '_host')


def _render(expression, layers):
    """Render an OLD_* expression with X_default, X, X_group, X_host = layers."""
    variables = dict(('X' + suffix, layer) for suffix, layer in zip(SUFFIXES, layers))
    templar = Templar(loader=DataLoader(), variables=variables)
    return templar.template(trust_as_template(expression))


def _exact(value):
    """JSON with the dicts' key order kept: equality down to the bytes written."""
    return json.dumps(value)


# ---- examples ---------------------------------------------------------------

def test_filter_is_registered():
    assert layered_mod.FilterModule().filters() == {'layered': layered}


def test_plain_lists_keep_the_first_of_each_item_in_layer_order():
    assert layered([['b', 'a'], [], ['c', 'a'], ['b', 'd']]) == ['b', 'a', 'c', 'd']
    assert layered([]) == []
    assert layered([[], []]) == []


def test_plain_lists_compare_case_insensitively_unless_asked():
    assert layered([['/etc/chv'], ['/ETC/chv', '/x']]) == ['/etc/chv', '/x']
    assert layered([['/etc/chv'], ['/ETC/chv', '/x']], case_sensitive=True) == [
        '/etc/chv', '/ETC/chv', '/x']
    assert layered([['/etc/chv'], ['/ETC/chv']], case_sensitive='yes') == ['/etc/chv', '/ETC/chv']


def test_merge_by_key_later_wins_absent_removes_present_loses_its_state():
    default = [{'source': '/app', 'target': '/app', 'optional': True},
               {'source': '/etc/ssl/certs', 'target': '/etc/ssl/certs', 'optional': True}]
    group = [{'source': '/x', 'target': '/etc/ssl/certs', 'state': 'absent'},
             {'source': '/nowhere', 'target': '/never', 'state': 'absent'}]
    host = [{'source': '/srv/app', 'target': '/app'},
            {'source': '/srv/z', 'target': '/z', 'state': 'present', 'optional': False},
            {'source': '/srv/b', 'target': '/b', 'state': 'present'}]
    assert _exact(layered([default, [], group, host], 'target')) == _exact([
        {'source': '/srv/app', 'target': '/app'},
        {'source': '/srv/b', 'target': '/b'},
        {'source': '/srv/z', 'target': '/z', 'optional': False},
    ])


def test_merge_by_key_orders_entries_without_state_before_present_ones():
    # The order the role's vars always had: targets sorted, stateless first.
    out = layered([[{'target': '/b', 'state': 'present'}, {'target': '/c'}, {'target': '/a'}]],
                  'target')
    assert out == [{'target': '/a'}, {'target': '/c'}, {'target': '/b'}]


def test_merge_by_key_removing_then_readding_keeps_the_readded_entry():
    out = layered([[{'target': '/t', 'source': '/1'}],
                   [{'target': '/t', 'state': 'absent', 'source': '/1'}],
                   [{'target': '/t', 'source': '/2', 'state': 'present'}]], 'target')
    assert out == [{'target': '/t', 'source': '/2'}]


def test_merge_by_key_case():
    layers = [[{'target': '/app', 'source': '/1'}], [{'target': '/APP', 'source': '/2'}]]
    assert layered(layers, 'target') == [{'target': '/APP', 'source': '/2'}]
    assert layered(layers, 'target', case_sensitive=True) == [
        {'target': '/APP', 'source': '/2'}, {'target': '/app', 'source': '/1'}]


def test_merge_by_key_does_not_modify_its_input():
    entry = {'target': '/t', 'state': 'present'}
    assert layered([[entry]], 'target') == [{'target': '/t'}]
    assert entry == {'target': '/t', 'state': 'present'}


def test_documented_example():
    # plugins/filter/layered.yml, EXAMPLES
    out = layered([[{'source': '/app', 'target': '/app'},
                    {'source': '/etc/ssl/certs', 'target': '/etc/ssl/certs'}],
                   [{'source': '/srv/app', 'target': '/app'},
                    {'source': '/etc/ssl/certs', 'target': '/etc/ssl/certs', 'state': 'absent'},
                    {'source': '/srv/data', 'target': '/data', 'state': 'present'}]], 'target')
    assert out == [{'source': '/srv/app', 'target': '/app'}, {'source': '/srv/data', 'target': '/data'}]


@pytest.mark.parametrize('args, text', [
    (('abc',), 'expected a list of layers'),
    (({'a': []},), 'expected a list of layers'),
    ((None,), 'expected a list of layers'),
    (([['a'], 'b'],), 'layer 1 is a str, not a list'),
    (([['a'], None],), 'layer 1 is a NoneType, not a list'),
    (([[], {'target': '/a'}], 'target'), 'layer 1 is a dict, not a list'),
    (([['/a']], 'target'), "layer 0 holds '/a', not a dict with 'target'"),
    (([[{'target': '/a'}], [{'source': '/b'}]], 'target'), "an entry of layer 1 has no 'target'"),
    (([[{'target': '/a'}, {'target': 1}]], 'target'), 'cannot be ordered'),
    (([[{'target': ['/a']}]], 'target'), 'cannot be merged on'),
    (([[]], 1), 'key 1 is not a string'),
    (([[]], None, 'maybe'), "case_sensitive 'maybe' is not a boolean"),
])
def test_errors(args, text):
    with pytest.raises(AnsibleFilterError) as err:
        layered(*args)
    assert text in str(err.value)


# ---- properties -------------------------------------------------------------

NAMES = st.sampled_from(['CAP_A', 'cap_a', 'CAP_B', 'x', 'X', '/p', '/p/q', ''])
TARGETS = st.sampled_from(['/a', '/A', '/b', '/a/b', '/c', '/'])
STATES = st.sampled_from([None, None, 'present', 'absent'])


@st.composite
def binds(draw):
    entry = {'source': draw(st.sampled_from(['/s1', '/s2', '/s3'])), 'target': draw(TARGETS)}
    if draw(st.booleans()):
        entry['optional'] = draw(st.booleans())
    state = draw(STATES)
    if state is not None:
        entry['state'] = state
    return entry


def _fold(text, case_sensitive):
    return text if case_sensitive else text.lower()


@given(st.lists(st.lists(NAMES, max_size=6), max_size=5), st.booleans())
def test_plain_no_duplicates_nothing_lost_first_occurrence_order(layers, case_sensitive):
    out = layered(layers, case_sensitive=case_sensitive)
    flat = [item for layer in layers for item in layer]
    folded = [_fold(item, case_sensitive) for item in out]
    assert len(folded) == len(set(folded))
    assert set(folded) == set(_fold(item, case_sensitive) for item in flat)
    firsts = []
    for item in flat:
        if _fold(item, case_sensitive) not in [_fold(f, case_sensitive) for f in firsts]:
            firsts.append(item)
    assert out == firsts
    assert layered([out], case_sensitive=case_sensitive) == out


@given(st.lists(st.lists(binds(), max_size=5), max_size=5), st.booleans())
def test_by_key_the_last_entry_of_each_key_decides(layers, case_sensitive):
    out = layered(layers, 'target', case_sensitive=case_sensitive)
    last = {}
    for layer in layers:
        for entry in layer:
            last[_fold(entry['target'], case_sensitive)] = entry
    keys = [_fold(entry['target'], case_sensitive) for entry in out]
    assert len(keys) == len(set(keys))
    assert all('state' not in entry for entry in out)
    kept = dict((k, e) for k, e in last.items() if e.get('state', 'present') == 'present')
    assert set(keys) == set(kept)
    for entry in out:
        winner = kept[_fold(entry['target'], case_sensitive)]
        assert entry == dict((k, v) for k, v in winner.items() if k != 'state')


@given(st.lists(st.lists(binds(), max_size=5), max_size=4), binds(), st.booleans())
def test_by_key_a_later_layer_wins_and_readding_restores(layers, entry, case_sensitive):
    entry = dict((k, v) for k, v in entry.items() if k != 'state')
    target = _fold(entry['target'], case_sensitive)

    def others(out):
        return [e for e in out if _fold(e['target'], case_sensitive) != target]

    base = layered(layers, 'target', case_sensitive=case_sensitive)
    added = layered(layers + [[entry]], 'target', case_sensitive=case_sensitive)
    assert entry in added
    assert others(added) == others(base)
    removed = layered(layers + [[dict(entry, state='absent')]], 'target',
                      case_sensitive=case_sensitive)
    assert removed == others(base)
    readded = layered(layers + [[dict(entry, state='absent')], [dict(entry, state='present')]],
                      'target', case_sensitive=case_sensitive)
    assert entry in readded
    assert others(readded) == others(base)


# ---- the expressions it replaced --------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(NAMES, max_size=5), min_size=4, max_size=4))
def test_same_as_the_old_unique_and_sort_expressions(layers):
    assert _exact(sorted(layered(layers), key=str.lower)) == _exact(_render(OLD_UNIQUE_SORT, layers))
    assert _exact(layered(layers)) == _exact(_render(OLD_UNIQUE, layers))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(binds(), max_size=5), min_size=4, max_size=4))
def test_same_as_the_old_merge_by_target_expression(layers):
    assert _exact(layered(layers, 'target')) == _exact(_render(OLD_BY_TARGET, layers))


def test_the_oracle_can_tell_a_difference():
    # Positive control for the two tests above: the case-sensitive merge is
    # a different function, and the comparison sees it.
    layers = [[{'target': '/a', 'source': '/1'}], [{'target': '/A', 'source': '/2'}], [], []]
    assert _exact(layered(layers, 'target', case_sensitive=True)) != _exact(
        _render(OLD_BY_TARGET, layers))
    assert _exact(layered([['/b', '/a'], [], [], []])) != _exact(
        _render(OLD_UNIQUE_SORT, [['/b', '/a'], [], [], []]))


# The role's policy lists, rendered by ansible-playbook from the role's own
# defaults/main.yml and vars/main.yml, next to the old expressions.
OVERRIDES = {
    'defaults': {},
    'plain': {
        # dicts layered key by key: a host's MemoryMax keeps TasksMax; null drops CPUQuota
        'chv_cell_properties_host': {'MemoryMax': '2G'},
        'chv_cell_properties': {'CPUQuota': None},
        'chv_cell_rlimits_group': {'NOFILE': '1024'},
        'chv_cell_drop_capabilities': ['CAP_WAKE_ALARM', 'CAP_SYS_ADMIN'],
        'chv_cell_drop_capabilities_group': ['CAP_AUDIT_WRITE', 'CAP_WAKE_ALARM'],
        'chv_cell_drop_capabilities_host': ['cap_sys_admin', 'CAP_BLOCK_SUSPEND', 'CAP_AUDIT_WRITE'],
        'chv_cell_syscall_deny': ['kexec_load', 'io_uring_setup'],
        'chv_cell_syscall_deny_group': ['add_key'],
        'chv_cell_syscall_deny_host': ['Add_Key', 'bpf', 'kexec_load'],
        'chv_cell_inaccessible': ['/srv/secret', '/etc/chv'],
        'chv_cell_inaccessible_group': ['/srv/a', '/srv/secret'],
        'chv_cell_inaccessible_host': ['/ETC/chv', '/srv/b', '/Srv/A'],
    },
    'binds': {
        'chv_cell_readonly_binds': [{'source': '/srv/data', 'target': '/data'},
                                    {'source': '/app2', 'target': '/app', 'optional': False}],
        'chv_cell_readonly_binds_group': [
            {'target': '/etc/ssl/certs', 'source': '/x', 'state': 'absent'},
            {'source': '/srv/zz', 'target': '/zz', 'state': 'present', 'optional': True},
            {'source': '/nowhere', 'target': '/never', 'state': 'absent'}],
        'chv_cell_readonly_binds_host': [
            {'source': '/certs', 'target': '/etc/ssl/certs', 'state': 'present'},
            {'source': '/srv/data2', 'target': '/data'},
            {'source': '/srv/b', 'target': '/b', 'state': 'present'},
            {'source': '/srv/APP', 'target': '/APP'}],
        'chv_cell_writable_binds': [{'source': '/srv/out', 'target': '/out', 'optional': True}],
        'chv_cell_writable_binds_group': [{'source': '/run/chv', 'target': '/run/chv', 'state': 'absent'}],
        'chv_cell_writable_binds_host': [
            {'source': '/srv/out2', 'target': '/out', 'state': 'absent'},
            {'source': '/run/chv2', 'target': '/run/chv', 'optional': True, 'state': 'present'},
            {'source': '/srv/out3', 'target': '/out'}],
    },
    'emptied': {
        'chv_cell_readonly_binds_host': [
            {'source': '/app', 'target': '/app', 'state': 'absent'},
            {'source': '/etc/ssl/certs', 'target': '/etc/ssl/certs', 'state': 'absent'},
            {'source': '/x', 'target': '/run/chv/shots', 'state': 'absent'}],
        'chv_cell_writable_binds_default': [],
        'chv_cell_inaccessible_default': [],
        'chv_cell_agent_home': '/home/agent',
        'chv_cell_drop_capabilities_default': [],
        'chv_cell_drop_capabilities_host': ['CAP_SYS_ADMIN', 'CAP_SYS_ADMIN'],
    },
}
POLICY_LISTS = {
    'drop_capabilities': ('__cell_runtime_drop_caps', OLD_UNIQUE_SORT, 'chv_cell_drop_capabilities'),
    'syscall_deny': ('__cell_runtime_syscall_deny', OLD_UNIQUE_SORT, 'chv_cell_syscall_deny'),
    # the platform's paths (vars/Debian.yml, chromium) came into the role's inaccessible list as a first layer
    'inaccessible': ('__cell_runtime_inaccessible',
                     OLD_UNIQUE.replace('(X_default', '(__cell_runtime_inaccessible_platform + X_default'),
                     'chv_cell_inaccessible'),
    'readonly_binds': ('__cell_runtime_readonly_binds', OLD_BY_TARGET, 'chv_cell_readonly_binds'),
    'writable_binds': ('__cell_runtime_writable_binds', OLD_BY_TARGET, 'chv_cell_writable_binds'),
}
PLAYBOOK = '''
- hosts: all
  gather_facts: false
  vars_files:
    - {role}/defaults/main.yml
    - "{out}/{{{{ inventory_hostname }}}}-overrides.yml"
    - {role}/vars/Debian.yml
    - {role}/vars/main.yml
  vars:
    chv_cell_identities: []
  tasks:
    - ansible.builtin.copy:
        dest: "{out}/{{{{ inventory_hostname }}}}.json"
        mode: "0644"
        content: |
          {{{{ {{'policy': __cell_runtime_policy | to_nice_json(indent=2, sort_keys=true),
                 'new': {new}, 'old': {old}}} | to_json }}}}
'''


def _render_per_host(tmp, playbook, overrides_by_host):
    """Run ``playbook`` (which writes <host>.json into ``tmp``) with one
    local host per entry of ``overrides_by_host``, whose overrides sit in a
    vars file after the roles' defaults (inventory variables would lose to
    them); return host -> the JSON it wrote."""
    collections = tmp / 'collections'
    (collections / 'ansible_collections' / 'chv').mkdir(parents=True)
    (collections / 'ansible_collections' / 'chv' / 'fleet').symlink_to(ROOT)
    (tmp / 'render.yml').write_text(playbook)
    for name, overrides in overrides_by_host.items():
        (tmp / ('%s-overrides.yml' % name)).write_text(yaml.safe_dump(overrides or {'__none': 0}))
    inventory = {'all': {'hosts': dict(
        (name, {'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable})
        for name in overrides_by_host)}}
    (tmp / 'inventory.yml').write_text(yaml.safe_dump(inventory))
    (tmp / 'ansible.cfg').write_text('[defaults]\n')
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR='1',
               ANSIBLE_RETRY_FILES_ENABLED='0', ANSIBLE_CONFIG=str(tmp / 'ansible.cfg'))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'),
                           '-i', str(tmp / 'inventory.yml'), str(tmp / 'render.yml')],
                          cwd=str(tmp), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, check=False)
    assert proc.returncode == 0, proc.stdout
    return dict((name, json.loads((tmp / ('%s.json' % name)).read_text())) for name in overrides_by_host)


@pytest.fixture(scope='module')
def rendered(tmp_path_factory):
    new = '{%s}' % ', '.join("'%s': %s" % (name, var) for name, (var, dummy, dummy2)
                             in POLICY_LISTS.items())
    old = '{%s}' % ', '.join("'%s': %s" % (name, expr.replace('X', base)[3:-3])
                             for name, (dummy, expr, base) in POLICY_LISTS.items())
    tmp = tmp_path_factory.mktemp('layered-role')
    return _render_per_host(tmp, PLAYBOOK.format(role=ROLE, out=tmp, new=new, old=old), OVERRIDES)


@pytest.mark.parametrize('combo', sorted(OVERRIDES))
def test_role_renders_the_policy_lists_as_before(rendered, combo):
    result = rendered[combo]
    assert _exact(result['new']) == _exact(result['old'])
    policy = json.loads(result['policy'])
    for name in POLICY_LISTS:
        assert policy[name] == result['old'][name]


def test_role_defaults_render_the_documented_lists(rendered):
    # Positive control: the comparison above is not between two empty lists.
    with open(os.path.join(ROLE, 'defaults', 'main.yml')) as handle:
        defaults = yaml.safe_load(handle)
    with open(os.path.join(ROLE, 'vars', 'Debian.yml')) as handle:
        platform = yaml.safe_load(handle)
    policy = json.loads(rendered['defaults']['policy'])
    assert policy['drop_capabilities'] == sorted(defaults['chv_cell_drop_capabilities_default'])
    assert policy['syscall_deny'] == sorted(defaults['chv_cell_syscall_deny_default'])
    assert platform['__cell_runtime_inaccessible_platform']
    assert policy['inaccessible'] == platform['__cell_runtime_inaccessible_platform'] + [
        p.replace('{{ chv_cell_agent_home }}', '/home/chv') for p in defaults['chv_cell_inaccessible_default']]
    assert policy['readonly_binds'] == sorted(defaults['chv_cell_readonly_binds_default'],
                                              key=lambda b: b['target'])
    assert policy['writable_binds'] == defaults['chv_cell_writable_binds_default']
    binds = rendered['binds']['new']
    assert [b['target'] for b in binds['readonly_binds']] == [
        '/APP', '/data', '/run/chv/shots', '/b', '/etc/ssl/certs', '/zz']
    assert binds['writable_binds'] == [{'source': '/srv/out3', 'target': '/out'},
                                       {'source': '/run/chv2', 'target': '/run/chv', 'optional': True}]


def test_role_layers_the_limit_dicts_key_by_key(rendered):
    with open(os.path.join(ROLE, 'defaults', 'main.yml')) as handle:
        defaults = yaml.safe_load(handle)
    policy = json.loads(rendered['defaults']['policy'])
    assert policy['properties'] == defaults['chv_cell_properties_default']
    assert policy['rlimits'] == defaults['chv_cell_rlimits_default']
    policy = json.loads(rendered['plain']['policy'])
    assert policy['properties'] == {'MemoryMax': '2G', 'TasksMax': 1024}
    assert policy['rlimits'] == dict(defaults['chv_cell_rlimits_default'], NOFILE='1024')


# The broker's sync commands and the browser's chromium arguments, layered
# the same way (rendered by ansible-playbook from the roles' own files).
SERVICES_PLAYBOOK = '''
- hosts: all
  gather_facts: false
  vars_files:
    - {root}/roles/broker/defaults/main.yml
    - {root}/roles/browser/defaults/main.yml
    - "{out}/{{{{ inventory_hostname }}}}-overrides.yml"
    - {root}/roles/broker/vars/main.yml
    - {root}/roles/browser/vars/main.yml
  tasks:
    - ansible.builtin.copy:
        dest: "{out}/{{{{ inventory_hostname }}}}.json"
        mode: "0644"
        content: "{{{{ {{'sync': __broker_sync_commands, 'chromium': __browser_chromium_args}} | to_json }}}}"
'''
SERVICES_OVERRIDES = {
    'defaults': {},
    'layered': {
        'chv_broker_sync_commands': {'pull': ['git', 'pull', '--rebase']},
        'chv_broker_sync_commands_host': {'push': None, 'status': ['git', 'status']},
        'chv_browser_chromium_args': ['--lang=en-US'],
        'chv_browser_chromium_args_group': ['--disable-gpu', '--force-dark-mode'],
        'chv_browser_chromium_args_host': ['--window-size=800,600'],
    },
}


def test_services_layer_sync_commands_key_by_key_and_chromium_args_in_order(tmp_path):
    got = _render_per_host(tmp_path, SERVICES_PLAYBOOK.format(root=ROOT, out=tmp_path), SERVICES_OVERRIDES)
    broker, browser = role_defaults('broker'), role_defaults('browser')
    # control: the defaults render as documented
    assert got['defaults'] == {'sync': broker['chv_broker_sync_commands_default'],
                               'chromium': browser['chv_browser_chromium_args_default']}
    # a later layer wins per action, null drops one; arguments append, the first of equal ones kept
    assert got['layered']['sync'] == {'status': ['git', 'status'], 'pull': ['git', 'pull', '--rebase']}
    assert got['layered']['chromium'] == browser['chv_browser_chromium_args_default'] + [
        '--lang=en-US', '--force-dark-mode', '--window-size=800,600']
