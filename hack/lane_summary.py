"""make test's last lines: one per lane, the tests it passed, failed and
skipped, then each failed test (pytest's -rfE lines: a CI report that shows
only the last lines still names what failed) and every skip's reason
(pytest's -rs lines), so that a green run
whose parts were skipped cannot be read as a run where they passed.

usage: lane_summary.py LOG_DIR   (one <lane>.log per lane, as make test tees them)
"""

import os
import re
import sys

# pytest's final line ("== 3 failed, 61 passed, 7 skipped in 12.3s ==", or -q's bare form)
FINAL = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)"
                   r"(?:, )?)+) in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
# -rs: "SKIPPED [2] path/test_x.py:12: reason"
SKIP = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.*)$")
# -rfE: "FAILED path::test[param] - message" and "ERROR path::test - message"
FAIL = re.compile(r"^(FAILED|ERROR) (\S+\.py(?:::\S+)?)(?: - (.*))?$")
STAGE = re.compile(r"^make test: (\S+) (passed|FAILED)")
# lines of lane logs carry the lane's prefix ("[host] ") and, in Molecule's verify, ansible's own
PREFIX = re.compile(r"^(\[[a-z0-9]+\] )?(\s*)")


def summarize(text):
    """{"passed", "failed", "skipped", "errors", "skips": {reason: count}, "stages": [(stage, verdict)],
    "failures": ["FAILED test-id - message", ...]}
    of one lane's output."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "skips": {}, "stages": [], "failures": []}
    for raw in text.splitlines():
        line = PREFIX.sub("", raw, count=1).rstrip()
        m = FINAL.match(line)
        if m:
            for n, what in COUNT.findall(m.group(1)):
                key = "errors" if what.startswith("error") else what
                if key in out:
                    out[key] += int(n)
            continue
        m = SKIP.match(line)
        if m:
            reason = "%s: %s" % (os.path.basename(m.group(2)), m.group(3))
            out["skips"][reason] = out["skips"].get(reason, 0) + int(m.group(1))
            continue
        m = FAIL.match(line)
        if m:
            out["failures"].append("%s %s%s" % (m.group(1), m.group(2), " - " + m.group(3)[:160] if m.group(3) else ""))
            continue
        m = STAGE.match(line)
        if m:
            out["stages"].append((m.group(1), m.group(2)))
    return out


def lines(lane, s):
    failed = [st for st, verdict in s["stages"] if verdict == "FAILED"]
    head = "make test: lane %s: %d passed, %d failed, %d errors, %d skipped%s" % (
        lane, s["passed"], s["failed"], s["errors"], s["skipped"],
        "; stage FAILED: %s" % ", ".join(failed) if failed else "")
    return ([head] + ["  " + f for f in s["failures"]]
            + ["  skipped %d: %s" % (n, reason) for reason, n in sorted(s["skips"].items())])


def main(argv):
    log_dir = argv[1]
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as fh:
                print("\n".join(lines(name[:-4], summarize(fh.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
