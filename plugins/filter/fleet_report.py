# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet audit report of playbooks/audit.yml (chv.fleet.audit), and the
check of its settings. The logic is module_utils/fleet_report.py.
Documentation lives beside this file (fleet_report.yml, audit_settings_errors.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

from collections.abc import Mapping, Sequence

from ansible.errors import AnsibleFilterError


def _report():
    """module_utils/fleet_report, imported when a filter runs (see the note in pools.py)."""
    from ansible_collections.chv.fleet.plugins.module_utils import fleet_report  # pylint: disable=import-outside-toplevel
    return fleet_report


def fleet_report(hosts, report_dir, allowed_skips=None, labels=None):
    """{verdict, failed_hosts, message, json, markdown, junit} of the audit
    reports fetched under ``report_dir``/hosts/<host>/audit.json."""
    report = _report()
    allowed_skips = {} if allowed_skips is None else allowed_skips
    if not isinstance(allowed_skips, Mapping):
        raise AnsibleFilterError('chv.fleet.fleet_report: allowed_skips must be {host: {case ID: reason}}, got %r'
                                 % (allowed_skips,))
    errors = ['%s: %s' % (host, e) for host, skips in sorted(allowed_skips.items())
              for e in report.check_allowed_skips(skips)]
    if errors:
        raise AnsibleFilterError('chv.fleet.fleet_report: ' + '; '.join(errors))
    if isinstance(hosts, (str, bytes)) or not isinstance(hosts, Sequence):
        raise AnsibleFilterError('chv.fleet.fleet_report: expects the list of the audited hosts, got %r' % (hosts,))
    if not isinstance(report_dir, str) or not report_dir:
        raise AnsibleFilterError('chv.fleet.fleet_report: report_dir must be a directory path, got %r' % (report_dir,))
    if labels is not None and not isinstance(labels, Mapping):
        raise AnsibleFilterError('chv.fleet.fleet_report: labels must be a dict, got %r' % (labels,))
    fleet = report.build(list(hosts), report.read_reports(list(hosts), report_dir), dict(allowed_skips),
                         dict(labels or {}))
    return {"verdict": fleet["verdict"], "failed_hosts": fleet["failed_hosts"],
            "message": report.failure_message(fleet), "json": report.to_json(fleet),
            "markdown": report.to_markdown(fleet), "junit": report.to_junit(fleet)}


def audit_settings_errors(settings):
    """The errors of the fleet audit's settings ({variable: value}; [] when all are good)."""
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError('chv.fleet.audit_settings_errors: expects {variable: value}, got %r' % (settings,))
    return _report().check_settings(dict(settings))


class FilterModule(object):
    def filters(self):
        return {'fleet_report': fleet_report, 'audit_settings_errors': audit_settings_errors}
