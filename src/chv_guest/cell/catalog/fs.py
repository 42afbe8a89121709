"""FS: what a cell may read and write of the guest's files."""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

from .. import argv as argvmod
from .. import policy as policymod
from .case import Case, Judge, Result, pair, skip
from .facts import SHOTS_DIR, Facts, denied, workspace_written
from .loosen import Context, Loosening, bind, readable_by_others, unless, without_inaccessible


def hidden_paths(pol: policymod.Policy) -> List[str]:
    """The inaccessible paths of FS-05: all but those of FS-01, FS-02 and FS-04."""
    return [p for p in pol["inaccessible"] if p not in ("/etc/chv", SHOTS_DIR) and not p.endswith("/.git-credentials")]


def _prefixed(facts: Dict[str, str], prefix: str) -> Dict[str, str]:
    return dict((key[len(prefix):], v) for key, v in facts.items() if key.startswith(prefix))


def _ws_evidence(facts: Facts) -> str:
    return "cell: %s, guest sees it: %s" % (facts["a"]["write"].get("workspace"),
                                            facts["guest"].get("workspace_write_seen"))


def _fs01(case: Case, facts: Facts) -> Result:
    rd, g = facts["a"]["read"], facts["guest"]
    if "etc_chv" not in rd:
        return skip("/etc/chv on the guest")
    return pair(denied(rd["etc_chv"]), "read: %s" % rd["etc_chv"],
                rd.get("os_release") == "ok" and g.get("etc_chv_readable"),
                "os-release: %s, guest reads it: %s" % (rd.get("os_release"), g.get("etc_chv_readable")))


def _read(probe_key: str, control_key: str, control_words: str, verb: str = "read",
          lacking: Optional[Callable[[Facts], str]] = None) -> Judge:
    """The judge of a read (or listing) of ``probe_key`` that the cell must
    be refused beside one of ``control_key`` that it must get; skipped with
    ``lacking(facts)`` when the guest side did not ask for the first."""
    def judge(case: Case, facts: Facts) -> Result:
        rd = facts["a"]["read"]
        if lacking is not None and probe_key not in rd:
            return skip(lacking(facts))
        return pair(denied(rd[probe_key]), "%s: %s" % (verb, rd[probe_key]), rd[control_key] == "ok",
                    "%s: %s" % (control_words, rd[control_key]))
    return judge


def _fs05(case: Case, facts: Facts) -> Result:
    rd = facts["a"]["read"]
    hidden = _prefixed(rd, "hidden:")
    if not hidden:
        return skip("a path of chv_cell_inaccessible that exists on the guest")
    return pair(all(denied(v) for v in hidden.values()), ", ".join("%s: %s" % kv for kv in sorted(hidden.items())),
                rd.get("env") == "ok", "/usr/bin/env: %s (the guest has each path)" % rd.get("env"))


def _fs07(case: Case, facts: Facts) -> Result:
    wr = facts["a"]["write"]
    return pair(denied(wr["usr"]), "create: %s" % wr["usr"], workspace_written(facts), _ws_evidence(facts))


def _fs08(case: Case, facts: Facts) -> Result:
    seen = facts["guest"].get("etc_write_seen")
    return pair(seen is False, "cell: %s, on the guest: %s" % (facts["a"]["write"]["etc"],
                                                               "present" if seen else "absent"),
                workspace_written(facts), _ws_evidence(facts))


def _fs09(case: Case, facts: Facts) -> Result:
    trusted = _prefixed(facts["a"]["write"], "trusted:")
    changed = facts["guest"].get("trusted_changed", [])
    return pair(all(denied(v) for v in trusted.values()) and not changed,
                ", ".join("%s: %s" % kv for kv in sorted(trusted.items()))
                + "; changed on the guest: %s" % (", ".join(changed) or "none"),
                workspace_written(facts), _ws_evidence(facts))


def _hidden_readable(ctx: Context) -> List[str]:
    """The paths of FS-05 that only the inaccessible list keeps out."""
    return [p for p in hidden_paths(ctx["pol"]) if readable_by_others(p)]


def _credentials(ctx: Context) -> List[str]:
    return [p for p in ctx["pol"]["inaccessible"] if p.endswith("/.git-credentials")]


def _shots_b(ctx: Context) -> str:
    return os.path.join(SHOTS_DIR, ctx["slot_b"]["name"]) if ctx["slot_b"] else ""


def _ws_b(ctx: Context) -> str:
    return argvmod.cell_paths(ctx["pol"], ctx["slot_b"])["workspace"] if ctx["slot_b"] else ""


# the section of cell A's report these cases read (Case.probes)
READ = ("read",)
WRITE = ("write",)

CASES = [
    Case("FS-01", READ, "Guest secrets in /etc/chv cannot be read",
         "read a file readable by every guest user that the audit puts in /etc/chv",
         "the cell reads /etc/os-release; the guest reads the file", _fs01,
         Loosening("take /etc/chv out of the policy's inaccessible list",
                   edit=without_inaccessible(lambda ctx: ["/etc/chv"]),
                   needs=unless("/etc/chv is not readable by other users on this guest: its permissions keep every "
                                "cell out as well", lambda ctx: readable_by_others("/etc/chv")))),
    Case("FS-02", READ, "The agent's credentials file is hidden",
         "read $HOME/.git-credentials (0644 in the slot's home)",
         "read another 0644 file of the same directory", _read("credentials", "ordinary", "the other file"),
         Loosening("take the .git-credentials paths out of the policy's inaccessible list",
                   edit=without_inaccessible(_credentials),
                   needs=unless("the policy's inaccessible list has no .git-credentials path", _credentials))),
    Case("FS-03", READ, "Another slot's workspace is out of reach",
         "read a file of slot B's workspace by its guest path",
         "read the audit's file in the cell's own /workspace",
         _read("other_workspace", "own_workspace", "own /workspace file", lacking=lambda facts: "a second slot"),
         Loosening("bind workspace_root read-only into the cell",
                   edit=bind(lambda ctx: ctx["pol"]["workspace_root"]),
                   needs=unless("no second slot, or its workspace is not readable by other users (its permissions "
                                "keep every cell out as well)",
                                lambda ctx: ctx["slot_b"] and readable_by_others(_ws_b(ctx))))),
    Case("FS-04", READ, "Another slot's screenshots are out of reach",
         "read a file of slot B's screenshot directory",
         "read the audit's file in the cell's own /run/chv/shots",
         _read("other_shots", "own_shots", "own /run/chv/shots file",
               lacking=lambda facts: facts.get("shots_skip", "chv-browser's screenshots directory")),
         Loosening("bind %s read-only into the cell and take it out of inaccessible" % SHOTS_DIR,
                   edit=bind(lambda ctx: SHOTS_DIR, also_accessible=True),
                   needs=unless("no second slot, or its screenshot directory is not readable by other users",
                                lambda ctx: ctx["slot_b"] and readable_by_others(_shots_b(ctx))))),
    Case("FS-05", READ, "chv-browser's and Playwright's files are out of reach",
         "read or list each path of chv_cell_inaccessible that exists on the guest",
         "the guest has each path; the cell reads /usr/bin/env", _fs05,
         Loosening("take the hidden paths that other users can read out of inaccessible",
                   edit=without_inaccessible(_hidden_readable),
                   needs=unless("no path of chv_cell_inaccessible on this guest is readable by other users (their "
                                "permissions keep every cell out as well)", _hidden_readable))),
    Case("FS-06", READ, "The launcher's state (/run/chv-fleet) is not visible",
         "list the launcher's state directory",
         "list /run/chv, the cells' bind", _read("state_dir", "run_chv", "list /run/chv", verb="list"),
         "the launcher refuses a bind of its state directory (policy check: a bind would expose /run/chv-fleet)"),
    Case("FS-07", WRITE, "/usr is read-only", "create a file in /usr",
         "create a file in /workspace, which the guest then sees", _fs07,
         "two layers: the read-only /usr and the user namespace (guest root's files are not the cell root's); "
         "a writable bind leaves /usr unwritable, so no single loosening opens it"),
    Case("FS-08", WRITE, "A write to /etc never reaches the guest", "create a file in /etc; the guest looks for it",
         "the workspace write reached the guest", _fs08,
         "as FS-07: /etc is a read-only bind of the guest's own, and guest root's files are not the cell root's"),
    Case("FS-09", WRITE, "What the launcher, broker and ruleset trust is not writable",
         "open the policy, the launcher, the broker and the ruleset for writing; the guest compares their hashes",
         "the workspace write reached the guest", _fs09, "as FS-07, for every trusted file"),
]
