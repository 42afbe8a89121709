"""One Playwright version: the lab's guests (lab_playwright_version, wheels the
controller downloads) and the unit tests' venv (requirements/browser.lock)."""
import os

import yaml

from testpaths import ROOT


def test_lab_and_test_venv_pin_the_same_playwright():
    with open(os.path.join(ROOT, "roles", "lab", "defaults", "main.yml")) as fh:
        lab = yaml.safe_load(fh)["lab_playwright_version"]
    with open(os.path.join(ROOT, "requirements", "browser.lock")) as fh:
        pins = dict(line.strip().split("==", 1) for line in fh if "==" in line)
    assert pins["playwright"] == lab
