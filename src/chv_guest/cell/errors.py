"""The launcher's exceptions, shared by the Linux and macOS launchers."""

from __future__ import annotations

from typing import Optional


class SetupError(Exception):
    pass


class RuntimeLimit(Exception):
    pass


class Interrupted(Exception):
    """A stop request: signal ``signum`` arrived, or (``reason`` set) the
    launcher's stdout or stderr peer went away, handled like SIGHUP."""

    def __init__(self, signum: int, reason: Optional[str] = None) -> None:
        super().__init__(signum)
        self.signum = signum
        self.reason = reason
