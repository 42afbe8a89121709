"""promtool for the metrics' tests: $CHV_PROMTOOL (the Makefile unpacks Debian's
prometheus package under build/, without installing its server), else PATH."""

import os
import shutil

import pytest


def promtool():
    path = os.environ.get("CHV_PROMTOOL") or shutil.which("promtool")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("promtool is not installed (make units unpacks it: Debian package prometheus)")
    return path
