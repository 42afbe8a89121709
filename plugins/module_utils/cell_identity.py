# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Cell slot identities: allocation logic, host-fact parsers and the ledger.

This file is standard-library Python with no Ansible imports on purpose:
the ``chv.fleet.cell_identity`` module imports it through Ansible's
module_utils mechanism, and ``bench/bench_cell_identity.py`` and the unit
tests import it standalone.  It is not installed on targets: the ``chv-cell``
launcher never reads the ledger, it takes each slot's identity from the slot
table of the cell policy, which the cell_runtime role renders from this
module's result.

Layout:

* ``Settings``, ``HostFacts``: validated inputs.
* ``allocate()``: pure function, (ledger dict, requested slots, settings,
  host facts) -> new ledger dict plus what changed.  No I/O.
* ``recover_ledger()``: pure, rebuilds slot identities from live interfaces.
* ``parse_*`` / ``gather_host_facts()``: read host facts (interfaces,
  addresses, routes of all tables, passwd/group ids, subuid/subgid ranges,
  user namespaces in use).
* ``changed_slots()``, ``find_running()``, ``CellProbe``: which slots a new
  ledger releases or changes, and which of them have a running cell (the
  launcher's slot lock is held, or the slot's veth exists).  The probe is a
  parameter, so the logic is tested without root.
* ``LedgerLock``, ``read_ledger_bytes()``, ``write_ledger_text()``,
  ``update_ledger()``: the locked, atomic read-modify-write of the ledger.
"""

from __future__ import absolute_import, division, print_function

import errno
import fcntl
import ipaddress
import json
import os
import re
import socket
import stat
import struct
import tempfile
import time

__metaclass__ = type

LEDGER_VERSION = 1
DEFAULT_LEDGER = '/var/lib/chv-fleet/identities.json'
DEFAULT_POOL = '10.200.0.0/16'
DEFAULT_PREFIX = 24
MAX_PREFIX = 30
DEFAULT_IFNAME_PREFIX = 'chvh'
DEFAULT_CELL_IFNAME = 'eth0'
DEFAULT_MACHINE_PREFIX = 'chv-'
DEFAULT_SHARED_UID = 1000
DEFAULT_LOCK_TIMEOUT = 60.0
# Runtime state of the chv-cell launcher (its policy's state_dir).
DEFAULT_STATE_DIR = '/run/chv-fleet'
SYS_CLASS_NET = '/sys/class/net'
FORCE_HINT = 'set force: true (role variable chv_cell_identity_force)'

UID_MODES = ('per_slot', 'shared')
UID_RANGE_SIZE = 0x10000
# systemd's container UID range is 0x00080000..0x6FFFFFFF; nspawn accepts
# range bases from CONTAINER_UID_BASE_MIN up to CONTAINER_UID_BASE_MAX.
UID_PER_SLOT_MIN = 0x80000
UID_PER_SLOT_MAX_BASE = 0x6FFF0000
UID_MAX = 0xFFFFFFFE  # (uid_t) -1 is invalid
OVERFLOW_ID = 65534  # the kernel's overflowuid/overflowgid: nobody, nogroup
IFNAMSIZ_MAX = 15  # IFNAMSIZ (16) minus the terminating NUL
# The host ifname is ifname_prefix + index in IFNAMSIZ_MAX bytes: a prefix of
# at most 12 bytes leaves room for indexes 0..999.  The one limit of the
# collection: cell_nat's ifname prefix check and the cell_runtime role's
# validate.yml use the same number.
IFNAME_PREFIX_MAX = 12
MACHINE_NAME_MAX = 64  # systemd's (and nspawn --machine's) limit, HOST_NAME_MAX
MAX_SLOT_COUNT = 65536
# Cell subnets in these networks are refused by the consumers of the slot
# records (chv-cell's policy, cell_nat for link-local), so no pool may
# overlap them.
UNUSABLE_POOL_NETS = (
    (ipaddress.IPv4Network('127.0.0.0/8'), 'loopback'),
    (ipaddress.IPv4Network('169.254.0.0/16'), 'link-local'),
    (ipaddress.IPv4Network('224.0.0.0/4'), 'multicast'),
)

RECORD_FIELDS = ('name', 'index', 'machine', 'host_ifname', 'cell_ifname',
                 'subnet', 'gateway', 'address', 'prefixlen', 'uid_base',
                 'uid_size')
LEDGER_KEYS = ('version', 'pool', 'prefix', 'uid_mode', 'slots')
COMPONENTS = ('ifname', 'subnet', 'uid', 'machine', 'cell_ifname')

_SLOT_NAME = r'[a-z](?:[a-z0-9-]{0,29}[a-z0-9])?'
_IFNAME = r'[A-Za-z][A-Za-z0-9_.-]*'
_MACHINE = r'[a-z0-9](?:[a-z0-9-]*[a-z0-9])?'
# Unanchored: always used with fullmatch (``^...$`` with match would let a
# trailing newline through).
SLOT_NAME_RE = re.compile(_SLOT_NAME)
IFNAME_PREFIX_RE = re.compile(r'[a-z][a-z0-9_-]*')
IFNAME_RE = re.compile(_IFNAME)
MACHINE_PREFIX_RE = re.compile(r'(?:[a-z][a-z0-9-]*)?')
MACHINE_RE = re.compile(_MACHINE)
# The same patterns over many newline-joined values: one C-level match for
# a whole ledger column instead of one Python call per slot.
_COLUMN_RES = dict((body, re.compile(r'(?:%s)(?:\n(?:%s))*' % (body, body)))
                   for body in (_SLOT_NAME, _IFNAME, _MACHINE))


class CellIdentityError(Exception):
    """Base class of every error raised here."""


class LedgerError(CellIdentityError):
    """The ledger file is unreadable, corrupt or not in the expected format."""

    def __init__(self, msg, path=None):
        super(LedgerError, self).__init__(msg)
        self.path = path


class AllocationError(CellIdentityError):
    """A parameter is invalid or the identities cannot be placed."""

    def __init__(self, param, msg):
        super(AllocationError, self).__init__(msg)
        self.param = param


class LockTimeout(CellIdentityError):
    """The ledger lock could not be taken in time."""


class RunningCellError(CellIdentityError):
    """The run would release or change slots whose cells are running.

    ``cells`` is the list of ``RunningCell``; ``param`` is ``force``."""

    def __init__(self, msg, cells):
        super(RunningCellError, self).__init__(msg)
        self.param = 'force'
        self.cells = cells


# ---------------------------------------------------------------------------
# Fast, strict IPv4 helpers (ipaddress is ~10x slower per call; a 4000-slot
# ledger is validated on every run).

def _ip_to_int(text):
    """Canonical dotted-quad string -> int; ValueError on anything else."""
    if not isinstance(text, str):
        raise ValueError('not a string')
    try:
        packed = socket.inet_aton(text)
    except (OSError, ValueError):
        raise ValueError('not an IPv4 address')
    if socket.inet_ntoa(packed) != text:
        raise ValueError('not a canonical dotted-quad IPv4 address')
    return struct.unpack('!I', packed)[0]


def _int_to_ip(value):
    return socket.inet_ntoa(struct.pack('!I', value))


def _parse_cidr(text):
    """Canonical 'a.b.c.d/n' network -> (network int, prefix length)."""
    if not isinstance(text, str) or text.count('/') != 1:
        raise ValueError('not in a.b.c.d/n form')
    addr, plen_text = text.split('/')
    if not plen_text.isdigit() or str(int(plen_text)) != plen_text:
        raise ValueError('bad prefix length')
    plen = int(plen_text)
    if plen > 32:
        raise ValueError('prefix length above 32')
    net = _ip_to_int(addr)
    if net & ((1 << (32 - plen)) - 1):
        raise ValueError('host bits set')
    return net, plen


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def valid_ifname(name):
    """True when ``name`` is a usable Linux interface name (<= 15 bytes)."""
    return (isinstance(name, str) and IFNAME_RE.fullmatch(name) is not None
            and len(name.encode('utf-8')) <= IFNAMSIZ_MAX)


# ---------------------------------------------------------------------------
# Inputs

class Settings:
    """Validated operator choices.  Every error names the parameter."""

    def __init__(self, pool=DEFAULT_POOL, prefix=DEFAULT_PREFIX,
                 uid_mode='per_slot', shared_uid=DEFAULT_SHARED_UID,
                 ifname_prefix=DEFAULT_IFNAME_PREFIX,
                 cell_ifname=DEFAULT_CELL_IFNAME,
                 machine_prefix=DEFAULT_MACHINE_PREFIX):
        try:
            net = ipaddress.IPv4Network(str(pool), strict=True)
        except ValueError as exc:
            raise AllocationError('pool', 'pool %r is not an IPv4 network in a.b.c.d/n form '
                                  'with the host bits clear: %s' % (pool, exc))
        for unusable, kind in UNUSABLE_POOL_NETS:
            if net.overlaps(unusable):
                raise AllocationError('pool', 'pool %r overlaps %s, the %s range: chv-cell refuses a '
                                      'cell subnet there; take the pool from private address space '
                                      '(such as the default %s)' % (pool, unusable, kind, DEFAULT_POOL))
        self.pool = net.with_prefixlen
        self.pool_start = int(net.network_address)
        self.pool_prefix = net.prefixlen

        if not _is_int(prefix):
            raise AllocationError('prefix', 'prefix %r is not an integer' % (prefix,))
        if prefix > MAX_PREFIX:
            raise AllocationError('prefix', 'prefix %d is too long: a cell subnet needs a network, '
                                  'a gateway, the cell address and a broadcast address, so the '
                                  'longest is /%d' % (prefix, MAX_PREFIX))
        if prefix < self.pool_prefix:
            raise AllocationError('prefix', 'prefix %d does not fit pool %s: cell subnets must be '
                                  '/%d or longer' % (prefix, self.pool, self.pool_prefix))
        self.prefix = prefix
        self.step = 1 << (32 - prefix)
        self.subnet_count = 1 << (prefix - self.pool_prefix)

        if uid_mode not in UID_MODES:
            raise AllocationError('uid_mode', 'uid_mode %r is not one of %s'
                                  % (uid_mode, ', '.join(UID_MODES)))
        self.uid_mode = uid_mode
        if not _is_int(shared_uid) or shared_uid < 0 or shared_uid + UID_RANGE_SIZE - 1 > UID_MAX:
            raise AllocationError('shared_uid', 'shared_uid %r must be an integer from 0 to %d so '
                                  'that the %d-UID range fits below UID %d'
                                  % (shared_uid, UID_MAX - UID_RANGE_SIZE + 1, UID_RANGE_SIZE,
                                     UID_MAX))
        if uid_mode == 'shared' and shared_uid == 0:
            raise AllocationError('shared_uid', 'shared_uid 0 with uid_mode shared would map every '
                                  'cell\'s root to host root: it must be at least 1')
        self.shared_uid = shared_uid

        if (not isinstance(ifname_prefix, str) or not IFNAME_PREFIX_RE.fullmatch(ifname_prefix)
                or len(ifname_prefix) > IFNAME_PREFIX_MAX):
            raise AllocationError('ifname_prefix', 'ifname_prefix %r must match %s and be at most '
                                  '%d bytes, so that slot indexes up to %d fit in the %d-byte '
                                  'interface name limit' % (ifname_prefix, IFNAME_PREFIX_RE.pattern,
                                                            IFNAME_PREFIX_MAX,
                                                            10 ** (IFNAMSIZ_MAX - IFNAME_PREFIX_MAX) - 1,
                                                            IFNAMSIZ_MAX))
        self.ifname_prefix = ifname_prefix
        # Highest index whose interface name still fits in 15 bytes, plus one.
        self.index_limit = 10 ** (IFNAMSIZ_MAX - len(ifname_prefix))

        if not valid_ifname(cell_ifname):
            raise AllocationError('cell_ifname', 'cell_ifname %r is not a valid interface name '
                                  '(letters, digits, "_", ".", "-", at most %d bytes)'
                                  % (cell_ifname, IFNAMSIZ_MAX))
        if cell_ifname == 'lo':
            raise AllocationError('cell_ifname', 'cell_ifname %r is the cell\'s loopback interface: '
                                  'chv-cell refuses it, name the cell end of the veth otherwise '
                                  '(default %s)' % (cell_ifname, DEFAULT_CELL_IFNAME))
        self.cell_ifname = cell_ifname

        if not isinstance(machine_prefix, str) or not MACHINE_PREFIX_RE.fullmatch(machine_prefix):
            raise AllocationError('machine_prefix', 'machine_prefix %r must match %s'
                                  % (machine_prefix, MACHINE_PREFIX_RE.pattern))
        self.machine_prefix = machine_prefix

    def host_ifname(self, index):
        return '%s%d' % (self.ifname_prefix, index)

    def machine(self, name):
        machine = self.machine_prefix + name
        if len(machine) > MACHINE_NAME_MAX:
            raise AllocationError('machine_prefix', 'machine name %r (machine_prefix %r + slot name) '
                                  'is longer than %d characters'
                                  % (machine, self.machine_prefix, MACHINE_NAME_MAX))
        return machine

    def uid_ok(self, uid_base):
        """Does a recorded uid_base belong to this uid_mode?"""
        if self.uid_mode == 'shared':
            return uid_base == self.shared_uid
        return (UID_PER_SLOT_MIN <= uid_base <= UID_PER_SLOT_MAX_BASE
                and uid_base % UID_RANGE_SIZE == 0)


def _network_span(value):
    """'a.b.c.d/n' (host bits allowed) or an IPv4Network -> (start, end) ints.

    Returns None for IPv6 and for default routes (prefix length 0)."""
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv4Interface)):
        net = value if isinstance(value, ipaddress.IPv4Network) else value.network
    else:
        text = str(value)
        if ':' in text:
            return None
        if '/' not in text:
            text += '/32'
        net = ipaddress.IPv4Network(text, strict=False)
    if net.prefixlen == 0:
        return None
    start = int(net.network_address)
    return start, start + net.num_addresses - 1


class HostFacts:
    """What the live host already uses.

    ifnames:   interface names present (/sys/class/net).
    networks:  (network, dev) pairs from addresses and routes of every
               table; dev is None for routes without a device (blackhole,
               unreachable, multipath).  Default routes are ignored, their
               gateways are kept as /32.
    addresses: (ifname, 'a.b.c.d/n') interface addresses (for recovery).
    ids:       passwd UIDs and group GIDs.
    id_ranges: (start, count) from /etc/subuid and /etc/subgid.
    userns_ranges: (start, count) outside ranges of running user namespaces.
    """

    def __init__(self, ifnames=(), networks=(), addresses=(), ids=(), id_ranges=(),
                 userns_ranges=()):
        self.ifnames = frozenset(ifnames)
        spans = []
        for value, dev in networks:
            span = _network_span(value)
            if span is not None:
                spans.append((span[0], span[1], dev))
        self.networks = spans
        self.addresses = list(addresses)
        self.ids = sorted(set(i for i in ids if _is_int(i) and i >= 0))
        self.id_ranges = [(s, c) for s, c in id_ranges if _is_int(s) and _is_int(c) and c > 0]
        self.userns_ranges = [(s, c) for s, c in userns_ranges
                              if _is_int(s) and _is_int(c) and c > 0]


# ---------------------------------------------------------------------------
# Host fact parsers (pure: text in, values out)

def parse_ip_addr_json(text):
    """Output of ``ip -j addr show`` -> (ifnames, networks, addresses)."""
    ifnames, networks, addresses = [], [], []
    for link in json.loads(text or '[]'):
        ifname = link.get('ifname')
        if not ifname:
            continue
        ifnames.append(ifname)
        for info in link.get('addr_info', ()):
            if info.get('family') != 'inet' or 'local' not in info:
                continue
            cidr = '%s/%s' % (info['local'], info.get('prefixlen', 32))
            addresses.append((ifname, cidr))
            networks.append((cidr, ifname))
            peer = info.get('address')
            if peer and peer != info['local']:
                networks.append(('%s/%s' % (peer, info.get('prefixlen', 32)), ifname))
    return ifnames, networks, addresses


def parse_ip_route_json(text):
    """Output of ``ip -j route show table all`` -> networks.

    Every destination counts (main, local and policy tables alike) except
    default routes; gateways and preferred sources count as /32."""
    networks = []
    for route in json.loads(text or '[]'):
        dst = route.get('dst', '')
        nexthops = route.get('nexthops') or []
        devs = set(h.get('dev') for h in nexthops if h.get('dev'))
        if route.get('dev'):
            devs.add(route['dev'])
        dev = devs.pop() if len(devs) == 1 else None
        if dst and dst != 'default' and ':' not in dst:
            networks.append((dst, dev))
        for hop in [route] + list(nexthops):
            gateway = hop.get('gateway')
            if gateway and ':' not in gateway:
                networks.append((gateway + '/32', hop.get('dev') or dev))
        prefsrc = route.get('prefsrc')
        if prefsrc and ':' not in prefsrc:
            networks.append((prefsrc + '/32', dev))
    return networks


def _colon_lines(text, min_fields):
    for line in (text or '').splitlines():
        line = line.strip()
        if not line or line.startswith(('#', '+', '-')):
            continue
        fields = line.split(':')
        if len(fields) >= min_fields:
            yield fields


def parse_passwd(text):
    """/etc/passwd (or /etc/group) text -> list of numeric ids (3rd field)."""
    ids = []
    for fields in _colon_lines(text, 3):
        if fields[2].isdigit():
            ids.append(int(fields[2]))
    return ids


parse_group = parse_passwd


def passwd_id(text, name):
    """The numeric id (3rd field) of ``name`` in /etc/passwd (or /etc/group) text, or None."""
    for fields in _colon_lines(text, 3):
        if fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    return None


def parse_subid(text):
    """/etc/subuid or /etc/subgid text -> list of (start, count)."""
    ranges = []
    for fields in _colon_lines(text, 3):
        if fields[1].isdigit() and fields[2].isdigit():
            ranges.append((int(fields[1]), int(fields[2])))
    return ranges


def parse_id_map(text):
    """/proc/PID/uid_map or gid_map text -> outside (start, count) ranges.

    Identity lines (inside == outside, as in the initial namespace) are
    skipped: only shifted ranges are in use by a container."""
    ranges = []
    for line in (text or '').splitlines():
        fields = line.split()
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            continue
        inside, outside, count = (int(f) for f in fields)
        if inside != outside:
            ranges.append((outside, count))
    return ranges


def _read_text(path):
    try:
        with open(path, 'r', encoding='utf-8', errors='replace') as handle:
            return handle.read()
    except (IOError, OSError):
        return ''


def gather_host_facts(run, root='/'):
    """Read the live host.  ``run(argv) -> stdout`` runs ``ip``; ``root``
    prefixes every file path (tests point it at a fake tree)."""
    def path(*parts):
        return os.path.join(root, *parts)

    ifnames, networks, addresses = parse_ip_addr_json(run(['ip', '-j', 'addr', 'show']))
    networks += parse_ip_route_json(run(['ip', '-j', 'route', 'show', 'table', 'all']))
    try:
        ifnames += os.listdir(path('sys', 'class', 'net'))
    except OSError:
        pass
    ids = parse_passwd(_read_text(path('etc', 'passwd')))
    ids += parse_group(_read_text(path('etc', 'group')))
    id_ranges = parse_subid(_read_text(path('etc', 'subuid')))
    id_ranges += parse_subid(_read_text(path('etc', 'subgid')))
    userns = []
    try:
        pids = [p for p in os.listdir(path('proc')) if p.isdigit()]
    except OSError:
        pids = []
    seen = set()
    for pid in pids:
        for name in ('uid_map', 'gid_map'):
            for rng in parse_id_map(_read_text(path('proc', pid, name))):
                if rng not in seen:
                    seen.add(rng)
                    userns.append(rng)
    return HostFacts(ifnames=ifnames, networks=networks, addresses=addresses, ids=ids,
                     id_ranges=id_ranges, userns_ranges=userns)


# ---------------------------------------------------------------------------
# Ledger format

def empty_ledger(settings):
    return {'version': LEDGER_VERSION, 'pool': settings.pool, 'prefix': settings.prefix,
            'uid_mode': settings.uid_mode, 'slots': {}}


def validate_ledger(data, path=None):
    """Check a parsed ledger completely; raise LedgerError naming the file.

    Returns ``data`` unchanged."""
    _validate(data, path)
    return data


_UNPACK_I = struct.Struct('!I').unpack
_PACK_I = struct.Struct('!I').pack
_PLENS = dict((str(n), n) for n in range(33))


def _validate(data, path, settings=None):
    # Returns ({slot name: subnet network as int}, [names of slots whose
    # identity differs from what ``settings`` would give]) for the
    # allocator.  This runs on every module run over every slot, so the loop
    # avoids function calls where it can (see bench/bench_cell_identity.py).
    where = path or 'ledger'

    def bad(msg):
        raise LedgerError('%s: %s' % (where, msg), path)

    if not isinstance(data, dict):
        bad('top level is not a JSON object')
    keys = set(data)
    if keys != set(LEDGER_KEYS):
        missing = sorted(set(LEDGER_KEYS) - keys)
        extra = sorted(str(k) for k in keys - set(LEDGER_KEYS))
        bad('keys do not match the version %d format (missing: %s; unknown: %s)'
            % (LEDGER_VERSION, ', '.join(missing) or 'none', ', '.join(extra) or 'none'))
    if data['version'] != LEDGER_VERSION or not _is_int(data['version']):
        bad('unsupported ledger version %r (this code reads version %d)'
            % (data['version'], LEDGER_VERSION))
    try:
        pool_start, pool_prefix = _parse_cidr(data['pool'])
    except ValueError as exc:
        bad('pool %r is not a canonical IPv4 network: %s' % (data['pool'], exc))
    prefix = data['prefix']
    if not _is_int(prefix) or not pool_prefix <= prefix <= MAX_PREFIX:
        bad('prefix %r is not an integer between %d and %d' % (prefix, pool_prefix, MAX_PREFIX))
    uid_mode = data['uid_mode']
    if uid_mode not in UID_MODES:
        bad('uid_mode %r is not one of %s' % (uid_mode, ', '.join(UID_MODES)))
    slots = data['slots']
    if not isinstance(slots, dict):
        bad('"slots" is not a JSON object')
    per_slot = uid_mode == 'per_slot'
    pool_end = pool_start + (1 << (32 - pool_prefix)) - 1
    plen_text = str(prefix)
    seen = ({}, {}, {}, {}, {})
    by_index, by_host_ifname, by_machine, by_subnet, by_uid = seen
    shared_base = None
    fields = frozenset(RECORD_FIELDS)
    ok_cell_ifnames = set()
    slot_match, machine_match = SLOT_NAME_RE.fullmatch, MACHINE_RE.fullmatch
    ifname_match = IFNAME_RE.fullmatch
    inet_aton, inet_ntoa, unpack, pack = socket.inet_aton, socket.inet_ntoa, _UNPACK_I, _PACK_I
    nets, mismatched = {}, []
    check = settings is not None
    if check:
        s_ifp, s_mp, s_cell = settings.ifname_prefix, settings.machine_prefix, settings.cell_ifname
        s_lo = settings.pool_start
        s_hi = s_lo + settings.subnet_count * settings.step - 1
        s_plen = str(settings.prefix)
        s_uid_all = settings.uid_mode != uid_mode
        s_shared = None if settings.uid_mode != 'shared' else settings.shared_uid
    for key, rec in slots.items():
        if rec.__class__ is not dict or rec.keys() != fields:
            bad('slot %r is not an object with exactly the fields %s'
                % (key, ', '.join(RECORD_FIELDS)))
        name = rec['name']
        if name != key:
            bad('slot %r: name %r does not match its key' % (key, name))
        index = rec['index']
        if index.__class__ is not int or index < 0:  # exact int: no bool
            bad('slot %r: index %r is not a non-negative integer' % (key, index))
        machine = rec['machine']
        host_ifname = rec['host_ifname']
        if machine.__class__ is not str or host_ifname.__class__ is not str:
            bad('slot %r: machine %r / host_ifname %r are not strings' % (key, machine, host_ifname))
        cell_ifname = rec['cell_ifname']
        if cell_ifname not in ok_cell_ifnames:
            if not valid_ifname(cell_ifname):
                bad('slot %r: cell_ifname %r is not an interface name of at most %d bytes'
                    % (key, cell_ifname, IFNAMSIZ_MAX))
            ok_cell_ifnames.add(cell_ifname)
        subnet = rec['subnet']
        addr, _sep, plen = subnet.partition('/') if isinstance(subnet, str) else ('', '', '')
        try:
            packed = inet_aton(addr)
        except (OSError, ValueError):
            packed = None
        if packed is None or plen not in _PLENS or inet_ntoa(packed) != addr \
                or unpack(packed)[0] & ((1 << (32 - _PLENS[plen])) - 1):
            bad('slot %r: subnet %r is not a canonical IPv4 network' % (key, subnet))
        net = unpack(packed)[0]
        if plen != plen_text or rec['prefixlen'] != prefix or rec['prefixlen'].__class__ is not int:
            bad('slot %r: subnet %s / prefixlen %r differ from the ledger prefix /%d'
                % (key, subnet, rec['prefixlen'], prefix))
        if not pool_start <= net <= pool_end:
            bad('slot %r: subnet %s is outside the ledger pool %s' % (key, subnet, data['pool']))
        if rec['gateway'] != inet_ntoa(pack(net + 1)) or rec['address'] != inet_ntoa(pack(net + 2)):
            bad('slot %r: gateway %r / address %r are not the first two host addresses of %s'
                % (key, rec['gateway'], rec['address'], subnet))
        base, size = rec['uid_base'], rec['uid_size']
        if base.__class__ is not int or size != UID_RANGE_SIZE or size.__class__ is not int \
                or base < 0 or base + size - 1 > UID_MAX:
            bad('slot %r: uid_base %r / uid_size %r are not a %d-UID range'
                % (key, base, size, UID_RANGE_SIZE))
        if per_slot:
            if base % UID_RANGE_SIZE or not UID_PER_SLOT_MIN <= base <= UID_PER_SLOT_MAX_BASE:
                bad('slot %r: uid_base %d is not a %d-aligned base between %d and %d'
                    % (key, base, UID_RANGE_SIZE, UID_PER_SLOT_MIN, UID_PER_SLOT_MAX_BASE))
            by_uid[base] = key
        elif shared_base is None:
            shared_base = base
        elif base != shared_base:
            bad('slot %r: uid_base %d differs from the other slots in uid_mode shared (%d)'
                % (key, base, shared_base))
        by_index[index] = by_host_ifname[host_ifname] = by_machine[machine] = key
        by_subnet[net] = key
        nets[key] = net
        if check and (host_ifname != s_ifp + str(index) or plen != s_plen or not s_lo <= net <= s_hi
                      or machine != s_mp + name or cell_ifname != s_cell or s_uid_all
                      or (s_shared is not None and base != s_shared)):
            mismatched.append(key)
    # Names, machines and host interface names, checked a column at a time.
    if not _column_ok(_SLOT_NAME, list(slots), 31):
        for key in slots:
            if not isinstance(key, str) or not slot_match(key):
                bad('slot %r: the name does not match %s' % (key, SLOT_NAME_RE.pattern))
    if not _column_ok(_MACHINE, list(by_machine), MACHINE_NAME_MAX):
        for machine, key in by_machine.items():
            if not isinstance(machine, str) or len(machine) > MACHINE_NAME_MAX \
                    or not machine_match(machine):
                bad('slot %r: machine %r is not a valid machine name' % (key, machine))
    if not _column_ok(_IFNAME, list(by_host_ifname), IFNAMSIZ_MAX):
        for host_ifname, key in by_host_ifname.items():
            if not isinstance(host_ifname, str) or len(host_ifname) > IFNAMSIZ_MAX \
                    or not ifname_match(host_ifname):
                bad('slot %r: host_ifname %r is not an interface name of at most %d bytes'
                    % (key, host_ifname, IFNAMSIZ_MAX))
    count = len(slots)
    if len(by_index) != count or len(by_host_ifname) != count or len(by_machine) != count \
            or len(by_subnet) != count or (per_slot and len(by_uid) != count):
        _report_duplicate(slots, nets, per_slot, bad)
    return nets, mismatched


def _column_ok(body, values, max_len):
    """Do all ``values`` (strings) match the pattern ``body``, each at most
    ``max_len`` characters?  False on any non-string."""
    if not values:
        return True
    try:
        joined = '\n'.join(values)
    except TypeError:
        return False
    return (joined.count('\n') == len(values) - 1 and max(map(len, values)) <= max_len
            and _COLUMN_RES[body].fullmatch(joined) is not None)


def _report_duplicate(slots, nets, per_slot, bad):
    # Slow path of _validate: name the first two slots sharing a value.
    seen = {}
    fields = ('index', 'host_ifname', 'machine', 'subnet', 'uid_base')
    for key, rec in slots.items():
        for field in fields[:5 if per_slot else 4]:
            value = nets[key] if field == 'subnet' else rec[field]
            other = seen.setdefault((field, value), key)
            if other != key:
                bad('slot %r: %s %r is also used by slot %r' % (key, field, rec[field], other))
    bad('duplicate identities')  # not reached: the fast path found a duplicate


def dump_ledger(ledger):
    """Serialise a ledger: stable, one slot per line (ordered by index), so
    that diffs show one line per changed slot."""
    lines = ['{']
    for key in LEDGER_KEYS[:-1]:
        lines.append('  %s: %s,' % (json.dumps(key), json.dumps(ledger[key])))
    slots = ledger['slots']
    names = sorted(slots, key=lambda n: (slots[n]['index'], n))
    if not names:
        lines.append('  "slots": {}')
    else:
        lines.append('  "slots": {')
        last = len(names) - 1
        for pos, name in enumerate(names):
            rec = slots[name]
            if tuple(rec) != RECORD_FIELDS:
                rec = dict((field, rec[field]) for field in RECORD_FIELDS)
            lines.append('    %s: %s%s' % (json.dumps(name), json.dumps(rec),
                                           ',' if pos < last else ''))
        lines.append('  }')
    lines.append('}')
    return '\n'.join(lines) + '\n'


def parse_ledger(raw, path=None):
    """Bytes or text of a ledger file -> validated ledger dict."""
    return validate_ledger(_decode_ledger(raw, path), path)


def _decode_ledger(raw, path):
    where = path or 'ledger'
    if isinstance(raw, bytes):
        try:
            raw = raw.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise LedgerError('%s is not UTF-8 text (%s); it is corrupt' % (where, exc), path)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise LedgerError('%s is not valid JSON (%s); it is corrupt or truncated. Restore it, or '
                          'run cell_identity with recover: true to rebuild it from the live '
                          'host' % (where, exc), path)
    return data


def read_ledger_bytes(path):
    """The ledger file's bytes, or None when it does not exist."""
    try:
        with open(path, 'rb') as handle:
            return handle.read()
    except (IOError, OSError) as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise LedgerError('%s cannot be read: %s' % (path, exc.strerror), path)


# ---------------------------------------------------------------------------
# Allocation (pure)

def normalize_slot_names(slots):
    """A list of names, a count N (-> slot0..slotN-1), a digit string or a
    comma-separated string -> list of names; None stays None."""
    if slots is None:
        return None
    if isinstance(slots, bool):
        raise AllocationError('slots', 'slots must be a list of names or a count, not %r' % slots)
    if isinstance(slots, str):
        text = slots.strip()
        if text.isdigit():
            slots = int(text)
        else:
            slots = [s.strip() for s in text.split(',') if s.strip()]
    if _is_int(slots):
        # Generated names are valid by construction.
        if not 0 <= slots <= MAX_SLOT_COUNT:
            raise AllocationError('slots', 'slots count %d is not between 0 and %d'
                                  % (slots, MAX_SLOT_COUNT))
        return ['slot%d' % i for i in range(slots)]
    if not isinstance(slots, (list, tuple)):
        raise AllocationError('slots', 'slots must be a list of names or a count, not %r' % (slots,))
    names = list(slots)
    if _column_ok(_SLOT_NAME, names, 31) and len(set(names)) == len(names):
        return names
    names, seen = [], set()
    for name in slots:
        if not isinstance(name, str) or not SLOT_NAME_RE.fullmatch(name):
            raise AllocationError('slots', 'slot name %r is invalid: it must match %s (lowercase '
                                  'letters, digits and "-", at most 31 characters)'
                                  % (name, SLOT_NAME_RE.pattern))
        if name in seen:
            raise AllocationError('slots', 'slots lists %r twice' % name)
        seen.add(name)
        names.append(name)
    return names


class _FreeList:
    """Lowest free integers in [0, limit).

    ``blocked`` holds inclusive (lo, hi) intervals (host facts), ``points``
    a set of single taken values (other slots).  ``take()`` returns
    ascending values, each the lowest still free; values handed out are
    passed by the cursor, so they are never repeated."""

    def __init__(self, blocked, points, limit):
        self._iv = sorted((lo, hi) for lo, hi in blocked if hi >= 0 and lo < limit)
        self._points = points
        self._j = 0
        self._next = 0
        self._limit = limit

    def take(self):
        cand, ivs, j, points = self._next, self._iv, self._j, self._points
        count = len(ivs)
        while True:
            while j < count and ivs[j][0] <= cand:
                if ivs[j][1] >= cand:
                    cand = ivs[j][1] + 1
                j += 1
            if cand not in points:
                break
            cand += 1
        if cand >= self._limit:
            return None
        self._j, self._next = j, cand + 1
        return cand


def _stale_components(rec, name, net, settings):
    """Components of an existing record that differ from what the current
    settings would produce, with the reason."""
    stale = {}
    if rec['host_ifname'] != settings.host_ifname(rec['index']):
        stale['ifname'] = 'host_ifname %s is not ifname_prefix %r + index' % (
            rec['host_ifname'], settings.ifname_prefix)
    if rec['prefixlen'] != settings.prefix or not (
            settings.pool_start <= net < settings.pool_start + settings.subnet_count * settings.step):
        stale['subnet'] = 'subnet %s is not a /%d in pool %s' % (
            rec['subnet'], settings.prefix, settings.pool)
    if not settings.uid_ok(rec['uid_base']):
        if settings.uid_mode == 'shared':
            stale['uid'] = 'uid_base %d is not shared_uid %d' % (rec['uid_base'], settings.shared_uid)
        else:
            stale['uid'] = 'uid_base %d is not a per_slot range' % rec['uid_base']
    if rec['machine'] != settings.machine_prefix + name:
        stale['machine'] = 'machine %s is not machine_prefix %r + name' % (
            rec['machine'], settings.machine_prefix)
    if rec['cell_ifname'] != settings.cell_ifname:
        stale['cell_ifname'] = 'cell_ifname %s is not %s' % (rec['cell_ifname'], settings.cell_ifname)
    return stale


def _overlaps_ids(base, size, ids, id_ranges):
    end = base + size - 1
    for uid in ids:
        if base <= uid <= end:
            return 'UID/GID %d in passwd/group' % uid
    for start, count in id_ranges:
        if start <= end and base <= start + count - 1:
            return 'subuid/subgid range %d+%d' % (start, count)
    return None


def _describe_networks(spans, limit=3):
    """Host networks (start, end, dev) as 'a.b.c.d/n on dev', the first
    ``limit`` of them."""
    kept = []
    for lo, hi, dev in sorted(spans, key=lambda s: (s[0], -s[1])):
        if not any(k[0] <= lo and hi <= k[1] for k in kept):  # within one already named
            kept.append((lo, hi, dev))
    parts = ['%s/%d on %s' % (_int_to_ip(lo), 33 - (hi - lo + 1).bit_length(), dev or 'a device-less route')
             for lo, hi, dev in kept[:limit]]
    if len(kept) > limit:
        parts.append('%d more' % (len(kept) - limit))
    return ', '.join(parts)


def _shared_range_accounts(shared_uid, host, limit=3):
    """What of the host the shared range (shared_uid and the 65535 UIDs
    after it) holds besides shared_uid itself: passwd UIDs and group GIDs,
    subuid/subgid ranges.  OVERFLOW_ID (nobody, nogroup) is left out: the
    kernel shows every unmapped ID as it, it owns nothing of its own.
    Returns a description, or '' when the range is free."""
    end = shared_uid + UID_RANGE_SIZE - 1
    ids = [i for i in host.ids if shared_uid < i <= end and i != OVERFLOW_ID]
    ranges = [(s, c) for s, c in host.id_ranges if s <= end and shared_uid <= s + c - 1]
    parts = []
    if ids:
        parts.append('UID/GID %s in passwd/group' % ', '.join(str(i) for i in ids[:limit])
                     + (' and %d more' % (len(ids) - limit) if len(ids) > limit else ''))
    parts += ['subuid/subgid range %d+%d' % r for r in ranges[:limit]]
    return '; '.join(parts)


def _conflicts(rec, net, settings, networks, ids, id_ranges):
    """Live-host collisions of an existing, otherwise valid record.

    networks/ids/id_ranges are the host facts already narrowed to the pool
    and to the per-slot UID span."""
    found = {}
    if networks:
        start, end = net, net + (1 << (32 - rec['prefixlen'])) - 1
        for lo, hi, dev in networks:
            if lo <= end and start <= hi and dev != rec['host_ifname']:
                found['subnet'] = 'subnet %s overlaps %s/%d on %s' % (
                    rec['subnet'], _int_to_ip(lo), 33 - (hi - lo + 1).bit_length(),
                    dev or 'a device-less route')
                break
    if settings.uid_mode == 'per_slot' and (ids or id_ranges):
        hit = _overlaps_ids(rec['uid_base'], rec['uid_size'], ids, id_ranges)
        if hit:
            found['uid'] = 'UID range %d+%d overlaps %s' % (rec['uid_base'], rec['uid_size'], hit)
    return found


class Allocation:
    """Result of ``allocate``: the new ledger and what happened."""

    def __init__(self, ledger, added, removed, reassigned, conflicts):
        self.ledger = ledger
        # slot names: new, dropped, moved to new identities; conflict messages
        self.added, self.removed, self.reassigned, self.conflicts = added, removed, reassigned, conflicts

    def identities(self):
        slots = self.ledger['slots']
        return [slots[n] for n in sorted(slots, key=lambda n: slots[n]['index'])]


def allocate(ledger, slots, settings=None, host=None, state='present', purge=True,
             reassign=False):
    """Pure allocation: returns an ``Allocation`` with a new ledger dict.

    ledger:   current ledger dict (validated here) or None for none yet.
    slots:    names / count (see ``normalize_slot_names``); None with
              state=absent releases every slot.
    purge:    with state=present, release slots not listed.
    reassign: move existing slots whose identity no longer matches the
              settings or collides with the live host; without it such a
              settings change raises AllocationError and a live collision
              is only reported in ``conflicts``.
    The input ledger is never modified.
    """
    settings = settings or Settings()
    host = host or HostFacts()
    names = normalize_slot_names(slots)
    if state not in ('present', 'absent'):
        raise AllocationError('state', 'state %r is not present or absent' % (state,))
    nets, mismatched = {}, []
    if ledger is None:
        ledger = empty_ledger(settings)
    else:
        nets, mismatched = _validate(ledger, None, settings)
    return _allocate(ledger, names, settings, host, state, purge, reassign, {}, nets, mismatched)


def _allocate(ledger, names, settings, host, state, purge, reassign, partial, nets, mismatched):
    # allocate() without input validation; ``partial`` maps slot names of
    # the (trusted) ledger to components that must be allocated afresh;
    # ``nets`` maps slot names to their subnet as an int; ``mismatched``
    # lists the slots whose records differ from what ``settings`` gives.
    old = ledger['slots']

    if state == 'absent':
        targets = set(old) if names is None else set(names)
        removed = sorted((n for n in old if n in targets), key=lambda n: old[n]['index'])
        new = dict(ledger)
        new['slots'] = dict((n, dict(r)) for n, r in old.items() if n not in targets)
        return Allocation(new, [], removed, [], [])

    if names is None:
        raise AllocationError('slots', 'slots is required with state present')
    wanted = set(names)
    removed = sorted((n for n in old if purge and n not in wanted), key=lambda n: old[n]['index'])
    kept = {n: dict(r) for n, r in old.items() if n in wanted or not purge}
    new_names = [n for n in names if n not in kept]

    # Which parts of existing identities must move?
    redo = dict(partial)
    stale_msgs, conflicts = [], []
    pool_start = settings.pool_start
    pool_end = pool_start + settings.subnet_count * settings.step - 1
    pool_nets = [n for n in host.networks if n[0] <= pool_end and n[1] >= pool_start]
    uid_hi = UID_PER_SLOT_MAX_BASE + UID_RANGE_SIZE - 1
    span_ids = [u for u in host.ids if UID_PER_SLOT_MIN <= u <= uid_hi]
    span_ranges = [(s, c) for s, c in host.id_ranges
                   if s <= uid_hi and s + c - 1 >= UID_PER_SLOT_MIN]
    for name in mismatched:
        if name in kept and name not in redo:
            stale = _stale_components(kept[name], name, nets[name], settings)
            stale_msgs.append('%s (%s)' % (name, '; '.join(stale[c] for c in COMPONENTS
                                                           if c in stale)))
            redo[name] = set(stale)
    if pool_nets or (settings.uid_mode == 'per_slot' and (span_ids or span_ranges)):
        for name, rec in kept.items():
            if name in redo:
                continue
            hits = _conflicts(rec, nets[name], settings, pool_nets, span_ids, span_ranges)
            if hits and reassign:
                redo[name] = set(hits)
            elif hits:
                conflicts.extend('%s: %s' % (name, hits[c]) for c in COMPONENTS if c in hits)
    stale_msgs.sort()
    conflicts.sort()
    if stale_msgs and not reassign:
        changed = ['%s %r -> %r' % (k, ledger[k], getattr(settings, k))
                   for k in ('pool', 'prefix', 'uid_mode') if ledger[k] != getattr(settings, k)]
        raise AllocationError(
            'reassign', 'the requested settings%s would change the identity of existing slots: %s. '
            'Set reassign: true to move them deliberately, or keep the previous settings'
            % (' (%s)' % ', '.join(changed) if changed else '', ', '.join(stale_msgs)))

    # Requests in allocation order: moved parts of existing slots (by index),
    # then new slots in the order given.
    moving = sorted(redo, key=lambda n: kept[n]['index'])
    need_index = [n for n in moving if 'ifname' in redo[n]] + new_names
    need_subnet = [n for n in moving if 'subnet' in redo[n]] + new_names
    need_uid = [n for n in moving if 'uid' in redo[n]] + new_names

    if len(kept) + len(new_names) > settings.subnet_count:
        raise AllocationError('pool', 'pool %s is too small: it holds %d /%d subnets and %d slots '
                              'are requested' % (settings.pool, settings.subnet_count,
                                                 settings.prefix, len(kept) + len(new_names)))

    index_of, subnet_of, uid_of = {}, {}, {}
    if need_index:
        points = {r['index'] for n, r in kept.items() if n not in redo or 'ifname' not in redo[n]}
        blocked = []
        plen = len(settings.ifname_prefix)
        for ifname in host.ifnames:
            digits = ifname[plen:]
            if ifname.startswith(settings.ifname_prefix) and digits.isdigit() \
                    and str(int(digits)) == digits:
                blocked.append((int(digits), int(digits)))
        free = _FreeList(blocked, points, settings.index_limit)
        for name in need_index:
            value = free.take()
            if value is None:
                raise AllocationError('ifname_prefix', 'no free host interface name is left for '
                                      'slot %r: ifname_prefix %r leaves room for indexes below %d '
                                      'within %d bytes' % (name, settings.ifname_prefix,
                                                           settings.index_limit, IFNAMSIZ_MAX))
            index_of[name] = value

    if need_subnet:
        step = settings.step
        # Kept slots are inside the pool with this prefix (else they would
        # be stale), so each takes exactly one candidate.
        points = {(nets[n] - pool_start) // step for n in kept
                  if n not in redo or 'subnet' not in redo[n]}
        blocked = [((max(lo, pool_start) - pool_start) // step,
                    (min(hi, pool_end) - pool_start) // step)
                   for lo, hi, _dev in pool_nets]
        free = _FreeList(blocked, points, settings.subnet_count)
        for name in need_subnet:
            value = free.take()
            if value is None:
                taken = sum(1 for n in kept if 'subnet' not in redo.get(n, ())) + len(subnet_of)
                raise AllocationError('pool', 'pool %s is too small: of its %d /%d subnets, %d are '
                                      'held by other slots and the rest overlap addresses or '
                                      'routes on this host (%s), so slot %r cannot be placed'
                                      % (settings.pool, settings.subnet_count, settings.prefix,
                                         taken, _describe_networks(pool_nets), name))
            subnet_of[name] = pool_start + value * step

    if need_uid:
        if settings.uid_mode == 'shared':
            held = _shared_range_accounts(settings.shared_uid, host)
            if held:
                raise AllocationError('shared_uid', 'shared_uid %d: with uid_mode shared the cells\' UIDs '
                                      'are the host UIDs %d-%d, which hold existing accounts (%s); '
                                      'choose a shared_uid whose %d UIDs hold no account but itself'
                                      % (settings.shared_uid, settings.shared_uid,
                                         settings.shared_uid + UID_RANGE_SIZE - 1, held,
                                         UID_RANGE_SIZE))
            for name in need_uid:
                uid_of[name] = settings.shared_uid
        else:
            lo_uid, size = UID_PER_SLOT_MIN, UID_RANGE_SIZE
            limit = (UID_PER_SLOT_MAX_BASE - lo_uid) // size + 1
            ranges = [(u, 1) for u in span_ids] + host.id_ranges + host.userns_ranges
            blocked = [((max(s, lo_uid) - lo_uid) // size, (s + c - 1 - lo_uid) // size)
                       for s, c in ranges if s + c - 1 >= lo_uid]
            # Kept per_slot ranges are aligned (else they would be stale).
            points = {(r['uid_base'] - lo_uid) // size for n, r in kept.items()
                      if n not in redo or 'uid' not in redo[n]}
            free = _FreeList(blocked, points, limit)
            for name in need_uid:
                value = free.take()
                if value is None:
                    raise AllocationError('uid_mode', 'uid_mode per_slot: no free %d-UID range is '
                                          'left for slot %r between %d and %d (passwd, subuid/'
                                          'subgid, running user namespaces and other slots hold '
                                          'the rest)' % (size, name, UID_PER_SLOT_MIN,
                                                         UID_PER_SLOT_MAX_BASE + size - 1))
                uid_of[name] = lo_uid + value * size

    slots_out = {}
    for name, rec in kept.items():
        if name not in redo:
            slots_out[name] = rec
            continue
        index = index_of.get(name, rec['index'])
        subnet = subnet_of.get(name, nets[name])
        slots_out[name] = _record(name, index, subnet, uid_of.get(name, rec['uid_base']), settings)
    for name in new_names:
        slots_out[name] = _record(name, index_of[name], subnet_of[name], uid_of[name], settings)

    new_ledger = {'version': LEDGER_VERSION, 'pool': settings.pool, 'prefix': settings.prefix,
                  'uid_mode': settings.uid_mode, 'slots': slots_out}
    reassigned = [n for n in moving if slots_out[n] != old.get(n)]
    return Allocation(new_ledger, new_names, removed, reassigned, conflicts)


def _record(name, index, subnet, uid_base, settings):
    return {
        'name': name,
        'index': index,
        'machine': settings.machine(name),
        'host_ifname': settings.host_ifname(index),
        'cell_ifname': settings.cell_ifname,
        'subnet': '%s/%d' % (_int_to_ip(subnet), settings.prefix),
        'gateway': _int_to_ip(subnet + 1),
        'address': _int_to_ip(subnet + 2),
        'prefixlen': settings.prefix,
        'uid_base': uid_base,
        'uid_size': UID_RANGE_SIZE,
    }


def recover_ledger(slots, settings, host):
    """Rebuild identities from the live host after the ledger was lost.

    Interfaces named ``ifname_prefix`` + N carrying an IPv4 address whose
    network is a /prefix inside the pool give index N and that subnet.
    Index N goes to the N-th requested slot (the layout ``allocate`` gives a
    fresh host); identities left over go to the remaining requested slots in
    order.  UID ranges, and everything for slots without a live interface,
    are allocated afresh by ``allocate`` (running user namespaces stay
    blocked).  Returns (Allocation, recovered slot names)."""
    names = normalize_slot_names(slots) or []
    plen = len(settings.ifname_prefix)
    pool_end = settings.pool_start + settings.subnet_count * settings.step - 1
    found, used_subnets = {}, set()
    for ifname, cidr in sorted(host.addresses):
        digits = ifname[plen:]
        if not ifname.startswith(settings.ifname_prefix) or not digits.isdigit() \
                or str(int(digits)) != digits or int(digits) in found:
            continue
        try:
            net = ipaddress.IPv4Network(cidr, strict=False)
        except ValueError:
            continue
        start = int(net.network_address)
        if net.prefixlen != settings.prefix or not settings.pool_start <= start <= pool_end \
                or start in used_subnets:
            continue
        found[int(digits)] = start
        used_subnets.add(start)

    assignment = {}
    for index in sorted(found):
        if index < len(names) and names[index] not in assignment:
            assignment[names[index]] = index
    leftovers = [i for i in sorted(found) if i not in assignment.values()]
    for name in names:
        if not leftovers:
            break
        if name not in assignment:
            assignment[name] = leftovers.pop(0)

    slots_out, partial = {}, {}
    for name, index in assignment.items():
        # uid_base 0 is a placeholder: 'uid' is always allocated afresh.
        slots_out[name] = _record(name, index, found[index], 0, settings)
        partial[name] = set(['uid'])
    seed = empty_ledger(settings)
    seed['slots'] = slots_out
    nets = dict((name, found[index]) for name, index in assignment.items())
    result = _allocate(seed, names, settings, host, 'present', True, False, partial, nets, [])
    result.reassigned = []
    return result, sorted(assignment, key=lambda n: assignment[n])


# ---------------------------------------------------------------------------
# Running cells: a slot must not be released or changed under a live cell
#
# The chv-cell launcher holds flock(LOCK_EX) on <state_dir>/locks/<slot>.lock
# for its whole run and writes <state_dir>/cells/<slot>.json with the cell's
# leader pid; a cell with its own network has the slot's host-side veth.  A
# cell whose slot is released or moved keeps running with the old identity,
# outside the firewall's set of cell interfaces.

class RunningCell:
    """Evidence that a slot's cell is running.

    slot:   slot name.
    pid:    leader pid from the launcher's record, or None (unreadable).
    lock:   path of the slot lock when another process holds it, else None.
    ifname: the slot's host-side interface when it exists, else None.
    error:  why the slot lock could not be checked, else None (the cell may
            be running: treated as running).
    action: 'release' or 'reassign', set by ``find_running``."""

    def __init__(self, slot, pid=None, lock=None, ifname=None, error=None, action=None):
        self.slot = slot
        self.pid = pid
        self.lock = lock
        self.ifname = ifname
        self.error = error
        self.action = action

    def evidence(self):
        parts = ['pid %d' % self.pid if self.pid is not None else 'pid unknown']
        if self.lock:
            parts.append('lock %s' % self.lock)
        elif self.ifname:
            parts.append('interface %s' % self.ifname)
        elif self.error:
            parts.append(self.error)
        verb = 'may have' if not (self.lock or self.ifname) else 'has'
        return 'slot %s %s a running cell (%s)' % (self.slot, verb, ', '.join(parts))

    def as_dict(self):
        return {'slot': self.slot, 'action': self.action, 'pid': self.pid, 'lock': self.lock,
                'ifname': self.ifname, 'error': self.error}

    def __repr__(self):
        return 'RunningCell(%r)' % (self.as_dict(),)


def lock_is_held(path):
    """Does another process hold flock on ``path``?

    Opens the file read-only without following a symlink and never creates
    or unlinks it; a missing file is not held.  When the lock is free it is
    taken, released and closed at once.  OSError for anything else (a
    symlink gives ELOOP)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def read_cell_pid(path):
    """The ``pid`` of a launcher record (a positive integer), or None when
    the record is missing, not a regular file or not readable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, 65536)
        pid = json.loads(data.decode('utf-8')).get('pid')
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        os.close(fd)
    return pid if _is_int(pid) and pid > 0 else None


class CellProbe:
    """Detects a slot's running cell from the launcher's runtime state.

    ``probe(name, record)`` -> ``RunningCell`` or None.  ``record`` is the
    slot's ledger record before the change (its ``host_ifname`` is the veth
    a running cell has).  Tests point ``state_dir`` and ``sys_class_net``
    at temporary directories."""

    def __init__(self, state_dir=DEFAULT_STATE_DIR, sys_class_net=SYS_CLASS_NET):
        self.state_dir = state_dir
        self.sys_class_net = sys_class_net

    def lock_path(self, name):
        return os.path.join(self.state_dir, 'locks', name + '.lock')

    def record_path(self, name):
        return os.path.join(self.state_dir, 'cells', name + '.json')

    def __call__(self, name, record):
        lock_path = self.lock_path(name)
        held, error = False, None
        try:
            held = lock_is_held(lock_path)
        except OSError as exc:
            reason = 'it is a symlink' if exc.errno == errno.ELOOP else exc.strerror
            error = 'cannot check lock %s: %s' % (lock_path, reason)
        ifname = (record or {}).get('host_ifname')
        if not (ifname and valid_ifname(ifname)
                and os.path.lexists(os.path.join(self.sys_class_net, ifname))):
            ifname = None
        if not (held or ifname or error):
            return None
        return RunningCell(name, pid=read_cell_pid(self.record_path(name)),
                           lock=lock_path if held else None, ifname=ifname, error=error)


def changed_slots(before, after):
    """Slots of ledger ``before`` that ledger ``after`` releases or changes:
    [(name, 'release' or 'reassign', old record)], ordered by old index."""
    old, new = before['slots'], after['slots']
    out = []
    for name in sorted(old, key=lambda n: (old[n]['index'], n)):
        if name not in new:
            out.append((name, 'release', old[name]))
        elif new[name] != old[name]:
            out.append((name, 'reassign', old[name]))
    return out


def find_running(before, after, probe):
    """``RunningCell`` for every slot that ``after`` releases or changes and
    whose cell ``probe(name, old record)`` finds running.  ``before`` None
    (no valid ledger yet) changes nothing."""
    if before is None:
        return []
    found = []
    for name, action, record in changed_slots(before, after):
        cell = probe(name, record)
        if cell is not None:
            cell.action = action
            found.append(cell)
    return found


def running_message(cells):
    """The refusal: every slot with its evidence, then what to do."""
    parts = ['%s: refusing to %s it' % (cell.evidence(), cell.action) for cell in cells]
    return '%s; stop the cell%s or %s' % ('; '.join(parts), 's' if len(cells) > 1 else '',
                                          FORCE_HINT)


def running_warning(cell):
    """The warning when ``force`` overrides the refusal for ``cell``."""
    if cell.action == 'release':
        done = 'released anyway (force: true); the cell keeps running outside the firewall\'s ' \
               'set of cell interfaces: stop it'
    else:
        done = 'its identity changed anyway (force: true); the cell keeps running with the old ' \
               'one, outside the firewall\'s set of cell interfaces: restart it'
    return '%s: %s' % (cell.evidence(), done)


# ---------------------------------------------------------------------------
# Locked, atomic ledger I/O

class LedgerLock:
    """flock on ``<ledger>.lock`` beside the ledger (never on the ledger
    itself, which is replaced by rename).

    exclusive: creates the directory (0700) and lock file (0600) if needed.
    shared (check mode): takes a shared lock only when the lock file
    already exists, and creates nothing."""

    def __init__(self, path, timeout=DEFAULT_LOCK_TIMEOUT, shared=False):
        self.path = path
        self.lock_path = path + '.lock'
        self.timeout = timeout
        self.shared = shared
        self._fd = None

    def __enter__(self):
        if self.shared:
            try:
                self._fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return self
                raise
            op = fcntl.LOCK_SH
        else:
            directory = os.path.dirname(self.path) or '.'
            if not os.path.isdir(directory):
                # exist_ok: a concurrent run may create it between the two calls.
                os.makedirs(directory, 0o700, exist_ok=True)
            self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            op = fcntl.LOCK_EX
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(self._fd, op | fcntl.LOCK_NB)
                return self
            except (IOError, OSError) as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    self._close()
                    raise
            if time.monotonic() >= deadline:
                self._close()
                raise LockTimeout('could not lock %s within %s seconds: another cell_identity run '
                                  'holds it' % (self.lock_path, self.timeout))
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __exit__(self, *exc_info):
        self._close()  # closing the descriptor releases the flock
        return False


def write_ledger_text(path, data, mode=0o600):
    """Atomically replace ``path``: temp file in the same directory, fsync,
    rename, fsync of the directory."""
    directory = os.path.dirname(path) or '.'
    if isinstance(data, str):
        data = data.encode('utf-8')
    fd, tmp = tempfile.mkstemp(prefix='.%s.' % os.path.basename(path), suffix='.tmp', dir=directory)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = None
        os.replace(tmp, path)
    except BaseException as exc:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and not exc.filename:
            # os.write/fsync name no file: a full file system would read "[Errno 28] No space left on device"
            raise OSError(exc.errno, 'writing the ledger failed: %s' % exc.strerror, path) from exc
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def update_ledger(path, slots, settings, host, state='present', purge=True, reassign=False,
                  recover=False, check_mode=False, lock_timeout=DEFAULT_LOCK_TIMEOUT,
                  force=False, probe=None):
    """Locked read-modify-write of the ledger at ``path``.

    Before anything is written (and in check mode alike), every slot the new
    ledger releases or changes is checked with ``probe(name, old record)``
    (default ``CellProbe()``: the launcher's state in /run/chv-fleet and
    /sys/class/net); slots with a running cell raise RunningCellError unless
    ``force``, with ``force`` they are returned in ``running``.

    Returns a dict: changed, before, after (ledger texts for diff), ledger,
    identities, added, removed, reassigned, conflicts, recovered,
    backup_file, running (list of RunningCell).  Raises LedgerError /
    AllocationError / RunningCellError / LockTimeout before writing
    anything."""
    names = normalize_slot_names(slots)
    if state not in ('present', 'absent'):
        raise AllocationError('state', 'state %r is not present or absent' % (state,))
    with LedgerLock(path, lock_timeout, shared=check_mode):
        raw = read_ledger_bytes(path)
        ledger, corrupt, recovered = None, False, []
        nets, mismatched = {}, []
        if raw is not None:
            try:
                ledger = _decode_ledger(raw, path)
                nets, mismatched = _validate(ledger, path, settings)
            except LedgerError:
                if not recover:
                    raise
                ledger, corrupt = None, True
        if ledger is None and recover and state == 'present':
            result, recovered = recover_ledger(names, settings, host)
        else:
            result = _allocate(ledger or empty_ledger(settings), names, settings, host, state,
                               purge, reassign, {}, nets, mismatched)
        after = dump_ledger(result.ledger)
        before = None if raw is None else raw.decode('utf-8', 'replace')
        changed = before != after
        if raw is None and state == 'absent':
            changed = False  # nothing to release, do not create a ledger
        running = []
        if changed:
            running = find_running(ledger, result.ledger, probe or CellProbe())
            if running and not force:
                raise RunningCellError(running_message(running), running)
        backup = None
        if changed and not check_mode:
            if corrupt:
                backup = '%s.corrupt-%s' % (path, time.strftime('%Y%m%dT%H%M%S'))
                write_ledger_text(backup, raw)
            write_ledger_text(path, after)
    return {
        'changed': changed,
        'before': before or '',
        'after': after if changed or raw is not None else '',
        'ledger': result.ledger,
        'identities': result.identities(),
        'added': result.added,
        'removed': result.removed,
        'reassigned': result.reassigned,
        'conflicts': result.conflicts,
        'recovered': recovered,
        'backup_file': backup,
        'running': running,
    }
