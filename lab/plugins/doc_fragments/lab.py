# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What every module of the test lab shares in its documentation."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type


class ModuleDocFragment(object):
    """The lab modules' author and attributes: check mode, no diff, run on the lab host."""

    DOCUMENTATION = r'''
author:
  - chv.fleet maintainers (@chv-fleet)
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: posix
'''
