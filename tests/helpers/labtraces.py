"""What a lab may leave on the lab host (tests/lab): its nspawn processes,
veths, cgroups, propagate entries, mounts and directory."""

import glob
import os

import procs

LAB_ROOT = "/var/lib/chv-fleet-lab"


def lab_traces(lab):
    """Everything of a lab that may exist on the host."""
    traces = []
    prefix = ("%s/%s/" % (LAB_ROOT, lab)).encode()
    for pid, argv in procs.cmdlines():
        if argv[0].endswith(b"systemd-nspawn") and any(a.startswith(prefix) for a in argv):
            traces.append("process %s" % pid)
    traces += ["veth " + p for p in glob.glob("/sys/class/net/ve-%s*" % lab)]
    traces += ["cgroup " + p for p in glob.glob("/sys/fs/cgroup/*/chv-lab/%s-*" % lab)]
    traces += ["cgroup " + p for p in glob.glob("/sys/fs/cgroup/chv-lab/%s-*" % lab)]
    traces += ["propagate " + p for p in glob.glob("/run/systemd/nspawn/propagate/%s*" % lab)]
    with open("/proc/self/mountinfo") as f:
        traces += ["mount " + line.split()[4] for line in f if "%s/%s" % (LAB_ROOT, lab) in line.split()[4]]
    if os.path.exists(os.path.join(LAB_ROOT, lab)):
        traces.append("directory " + os.path.join(LAB_ROOT, lab))
    return traces
