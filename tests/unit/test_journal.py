"""Journal entries by the native protocol (chv_guest/journal.py), the
doors' audit lines sent as entries on a service's journal stream
(wire/protocol.py audit), and the launcher's run entry (cell/launcher.py)."""

import io
import json
import os
import socket
import struct

import pytest

from chv_guest import journal
from chv_guest.cell import launcher
from chv_guest.cell.status import status_record
from chv_guest.wire import protocol


@pytest.fixture
def listener(tmp_path, monkeypatch):
    """A datagram socket standing in for journald's; returns a function reading one datagram."""
    path = str(tmp_path / "journal.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    monkeypatch.setattr(journal, "SOCKET", path)
    yield lambda: decode(sock.recv(65536))
    sock.close()


def decode(data):
    """The fields of a native-protocol datagram (the test's own reading of the format)."""
    out = {}
    while data:
        line, _, rest = data.partition(b"\n")
        if b"=" in line:
            name, _, value = line.partition(b"=")
            out[name.decode()] = value.decode()
            data = rest
        else:
            size = struct.unpack("<Q", rest[:8])[0]
            out[line.decode()] = rest[8:8 + size].decode()
            data = rest[8 + size + 1:]
    return out


def test_fields_are_chv_prefixed_scalars_and_the_message_keeps_everything():
    got = journal.entry('{"x": 1}', "chv-broker", "chv-broker.audit",
                        {"slot": "slot3", "op": "sync", "duration_ms": 1.5, "ok": True, "peer_pid": None,
                         "mounts": ["a"], "bad key!": "v"})
    assert got == {"MESSAGE": '{"x": 1}', "PRIORITY": "6", "SYSLOG_IDENTIFIER": "chv-broker",
                   "CHV_EVENT": "chv-broker.audit", "CHV_SLOT": "slot3", "CHV_OP": "sync", "CHV_DURATION_MS": "1.5",
                   "CHV_OK": "true", "CHV_PEER_PID": "", "CHV_BAD_KEY_": "v"}
    assert journal.field_name("event") == "CHV_EVENT" and journal.field_name("") == "CHV_"
    assert journal.field_name("x" * 80) is None


def test_a_multi_line_value_is_length_prefixed():
    data = journal.encode({"MESSAGE": "one\ntwo", "CHV_SLOT": "slot0"})
    assert data == b"MESSAGE\n" + struct.pack("<Q", 7) + b"one\ntwo\n" + b"CHV_SLOT=slot0\n"
    assert decode(data) == {"MESSAGE": "one\ntwo", "CHV_SLOT": "slot0"}
    with pytest.raises(ValueError):
        journal.encode({"lower": "x"})


def test_send_reaches_the_socket_and_says_when_none_listens(listener, tmp_path):
    assert journal.send({"MESSAGE": "hello", "CHV_SLOT": "slot1"})
    assert listener() == {"MESSAGE": "hello", "CHV_SLOT": "slot1"}
    assert not journal.send({"MESSAGE": "x"}, path=str(tmp_path / "nobody"))


def test_an_audit_line_on_the_journal_stream_becomes_an_entry_elsewhere_stays_a_line(listener, tmp_path, monkeypatch):
    with open(str(tmp_path / "stderr"), "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", "%d:%d" % (st.st_dev, st.st_ino))
        protocol.audit(stream, "chv-broker.audit", slot="slot2", op="ping", verdict="ok")
        got = listener()
        assert got["CHV_SLOT"] == "slot2" and got["CHV_VERDICT"] == "ok" and got["SYSLOG_IDENTIFIER"] == "chv-broker"
        assert json.loads(got["MESSAGE"]) == {"event": "chv-broker.audit", "slot": "slot2", "op": "ping",
                                              "verdict": "ok"}
        stream.flush()
        assert os.path.getsize(str(tmp_path / "stderr")) == 0  # the entry instead of the line
        # control: another stream (not the journal's) gets the line
        other = io.StringIO()
        protocol.audit(other, "chv-broker.audit", slot="slot2", op="ping", verdict="ok")
        assert json.loads(other.getvalue())["verdict"] == "ok"
    # the journal stream, but no journal listening: the line is written, not lost
    monkeypatch.setattr(journal, "SOCKET", str(tmp_path / "nobody"))
    with open(str(tmp_path / "stderr2"), "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", "%d:%d" % (st.st_dev, st.st_ino))
        protocol.audit(stream, "chv-browser", action="open", verdict="ok")
    assert json.loads(open(str(tmp_path / "stderr2")).read())["action"] == "open"


def test_the_run_entry_carries_the_verdict_the_latency_and_the_task():
    ran = launcher.run_event(status_record(0, "claimed", "slot1", True, 0), 0.4321, "a" * 32)
    assert ran["CHV_EVENT"] == launcher.RUN_EVENT and ran["SYSLOG_IDENTIFIER"] == "chv-cell"
    assert (ran["CHV_SLOT"], ran["CHV_VERDICT"], ran["CHV_EXIT"], ran["CHV_PAYLOAD_EXIT"]) == ("slot1", "ran", "0", "0")
    assert ran["CHV_START_MS"] == "432.1" and ran["CHV_TASK"] == "a" * 32
    assert ran["MESSAGE"] == "slot1: ran, exit 0, payload started after 0.432s"
    busy = launcher.run_event(status_record(75, "busy"), None, None)
    assert (busy["CHV_SLOT"], busy["CHV_VERDICT"], busy["CHV_START_MS"]) == ("", "busy", "")
    assert busy["MESSAGE"] == "no slot: busy, exit 75"
