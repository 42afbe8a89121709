# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What chv.fleet.directories and chv.fleet.files share in their documentation."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type


class ModuleDocFragment(object):
    """The author, the default owner and group of the entries; full check and diff mode."""

    DOCUMENTATION = r'''
options:
  owner:
    description: The owner of entries that set none (in M(chv.fleet.files), of file entries).
    type: str
    default: root
  group:
    description: The group of entries that set none (in M(chv.fleet.files), of file entries).
    type: str
    default: root
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
author:
  - chv.fleet maintainers (@chv-fleet)
'''
