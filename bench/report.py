"""Collect the benchmarks' Markdown fragments into docs/performance.md.

Each bench/bench_*.py writes a fragment build/bench/NAME.md. This script
puts them, in a fixed order (rollout, cells, metrics, identity, then any others by
name), between the markers `<!-- bench:begin -->` and `<!-- bench:end -->`
of docs/performance.md, under a line naming the machine and the commit.
Everything outside the markers is left byte for byte as it was; when the
markers are missing they are added at the end of the file, under a
"## make bench" header. Run by `make bench` after the benchmarks.
"""

import datetime
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAGMENTS = os.path.join(ROOT, 'build', 'bench')
DOC = os.path.join(ROOT, 'docs', 'performance.md')
ORDER = ('rollout', 'cells', 'metrics', 'identity')
BEGIN = '<!-- bench:begin -->'
END = '<!-- bench:end -->'
SECTION = ('\n## make bench\n\n'
           'What the last `make bench` measured, written by bench/report.py from the fragments the benchmarks\n'
           'write (build/bench/*.md); everything between the two markers below is replaced on each run.\n\n')


def output(argv):
    try:
        r = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    except OSError:
        return 'unknown'
    lines = r.stdout.decode(errors='replace').strip().splitlines()
    return lines[0] if r.returncode == 0 and lines else 'unknown'


def fragments(directory=FRAGMENTS):
    """The fragment files in report order."""
    found = {os.path.splitext(os.path.basename(p))[0]: p for p in glob.glob(os.path.join(directory, '*.md'))}
    names = [n for n in ORDER if n in found] + sorted(n for n in found if n not in ORDER)
    return [found[n] for n in names]


def machine_line():
    commit = output(['git', 'rev-parse', '--short', 'HEAD'])
    changed = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, check=False).stdout.strip()
    if changed:
        commit += ' (the working tree had uncommitted changes)'
    return ('Machine: %d CPUs (nproc), kernel %s, %s; %s; git commit %s. Command: `make bench`.'
            % (os.cpu_count(), os.uname().release, output(['systemd', '--version']),
               datetime.datetime.now().strftime('%Y-%m-%d %H:%M'), commit))


def block(paths):
    parts = [machine_line()]
    for path in paths:
        with open(path) as fh:
            parts.append(fh.read().strip())
    if not paths:
        parts.append('No fragments in build/bench: no benchmark wrote one.')
    return BEGIN + '\n' + '\n\n'.join(parts) + '\n' + END


def splice(text, new_block):
    """``text`` with the marked block replaced by ``new_block`` (appended under SECTION when absent)."""
    start, end = text.find(BEGIN), text.find(END)
    if start == -1 and end == -1:
        sep = '' if text.endswith('\n') else '\n'
        return text + sep + SECTION + new_block + '\n'
    if start == -1 or end == -1 or end < start:
        raise ValueError('%s: the markers %s and %s are not a pair in this order' % (DOC, BEGIN, END))
    return text[:start] + new_block + text[end + len(END):]


def main():
    paths = fragments()
    with open(DOC, newline='') as fh:
        text = fh.read()
    new = splice(text, block(paths))
    with open(DOC, 'w', newline='') as fh:
        fh.write(new)
    print('report: %s <- %s' % (os.path.relpath(DOC, ROOT),
                                ', '.join(os.path.relpath(p, ROOT) for p in paths) or 'no fragments'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
