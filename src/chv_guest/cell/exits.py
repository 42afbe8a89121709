"""The launcher's exit codes: what the executor sees besides the payload's own."""

from __future__ import annotations

EXIT_SETUP = 125  # the launcher could not start the cell (payload did not run)
EXIT_BUSY = 75  # EX_TEMPFAIL: every candidate slot stayed busy until the timeout
EXIT_CONFIG = 78  # EX_CONFIG: the policy file is unusable, or forbids what the run asked for
EXIT_RUNTIME = 124  # the cell reached its wall-clock limit (runtime_max) and was stopped
EXIT_CORDONED = 69  # EX_UNAVAILABLE: the guest is cordoned (chv-cell cordon); retry on another guest
EXIT_NO_TASK = 67  # no such task, or not the caller's (one answer for both): nothing was started
EXIT_TASK_EXPIRED = 68  # the task expired (unused for longer than its ttl) and was torn down: nothing was started
