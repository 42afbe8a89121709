"""Fixtures live in broker_helpers (a unique module name, so the browser tests' helpers never shadow them)."""
from broker_helpers import broker_proc, cell, env, inproc, other_ns, scratch  # noqa: F401  # pylint: disable=unused-import
