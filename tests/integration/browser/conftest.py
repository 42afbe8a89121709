"""Fixtures live in browser_helpers (a unique module name, so the broker tests' helpers never shadow them)."""
from browser_helpers import browser, site  # noqa: F401  # pylint: disable=unused-import
