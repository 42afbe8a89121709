"""One Playwright version: the browser role's default (what a fleet gets), the
lab's guests (lab_playwright_version, wheels the controller downloads) and
the integration tests' venv (requirements/browser.lock)."""
import os

import yaml

from testpaths import LAB_ROLE, ROOT


def test_lab_and_test_venv_pin_the_same_playwright():
    with open(os.path.join(LAB_ROLE, "defaults", "main.yml")) as fh:
        lab = yaml.safe_load(fh)["lab_playwright_version"]
    with open(os.path.join(ROOT, "requirements", "browser.lock")) as fh:
        pins = dict(line.strip().split("==", 1) for line in fh if "==" in line)
    assert pins["playwright"] == lab


def test_the_browser_role_installs_the_version_the_tests_ran_with():
    with open(os.path.join(ROOT, "roles", "browser", "defaults", "main.yml")) as fh:
        default = yaml.safe_load(fh)["chv_browser_playwright_version"]
    with open(os.path.join(ROOT, "roles", "browser", "meta", "argument_specs.yml")) as fh:
        specs = yaml.safe_load(fh)["argument_specs"]
    with open(os.path.join(ROOT, "requirements", "browser.lock")) as fh:
        pins = dict(line.strip().split("==", 1) for line in fh if "==" in line)
    assert default == pins["playwright"]
    assert specs["main"]["options"]["chv_browser_playwright_version"]["default"] == default
    # the one entry point with options (validate checks main's)
    assert [name for name, spec in specs.items() if "options" in spec] == ["main"]
