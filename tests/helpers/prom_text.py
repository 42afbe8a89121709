"""The Prometheus text format read back, for the tests that read what the
collector wrote (the metrics' unit tests, molecule/shared/tests/test_metrics.py):
each sample as (name, ((label, value), ...)) -> value, labels sorted."""

import math
import re

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{(name, labels): value} of a text exposition; a line that is no sample nor comment is an error."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = SAMPLE.match(line)
            if m is None:
                raise ValueError("not a sample line: %r" % line)
            out[(m.group(1), tuple(sorted(LABEL.findall(m.group(2) or ""))))] = float(m.group(3))
    return out


def key(name, **labels):
    """The key of one series in parse()'s result."""
    return (name, tuple(sorted(labels.items())))


def family(samples, name):
    """{labels: value} of one metric name."""
    return dict((labels, v) for (n, labels), v in samples.items() if n == name)


def input_series(steps, instance="g1", job="node"):
    """promtool test rules' input_series from one parse()-style dict per scrape interval (label
    values as the text has them); a series missing at a step is "_" there (it vanished from the file)."""
    keys = sorted({k for step in steps for k in step})
    out = []
    for name, labels in keys:
        text = ",".join('%s="%s"' % kv for kv in labels + (("instance", instance), ("job", job)))
        values = " ".join(_number(step[(name, labels)]) if (name, labels) in step else "_" for step in steps)
        out.append({"series": "%s{%s}" % (name, text), "values": values})
    return out


def _number(value):
    if math.isnan(value) or math.isinf(value):
        return {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}[repr(value)]
    return "%d" % value if value == int(value) else repr(value)


def alert_annotations(rules, alert, instance):
    """The annotations promtool expects of `alert` (a rule of the loaded rules file `rules`) on `instance`."""
    rule = [r for group in rules["groups"] for r in group["rules"] if r.get("alert") == alert][0]
    return dict((k, v.replace("{{ $labels.instance }}", instance).strip()) for k, v in rule["annotations"].items())
