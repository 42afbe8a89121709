# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether a package task failed only because the package manager does not
know a package it was asked to install: what apt reports in check mode on a
host that has never fetched its package lists (a fresh minimal image), where
a real run would fetch them first. The roles' package tasks report such a
result as an install to do in check mode instead of failing. Documentation
lives beside this file (package_unresolved.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import re

from ansible.errors import AnsibleFilterError

# apt ("No package matching 'x' is available"), dnf ("No package x available.")
UNRESOLVED = re.compile(r"No package matching '[^']+' is available|No package \S+ available")


def package_unresolved(result):
    if not isinstance(result, dict):
        raise AnsibleFilterError("package_unresolved tests a registered task result, not %r" % (result,))
    return bool(result.get("failed")) and bool(UNRESOLVED.search(str(result.get("msg", ""))))


class TestModule(object):
    def tests(self):
        return {"package_unresolved": package_unresolved}
