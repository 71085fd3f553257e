"""sd_notify never blocks and never raises: real AF_UNIX datagram readers that do not read."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from vlaunch.cache.contract.notify import SdNotify, parse_fields


@pytest.fixture
def reader(notify_reader: socket.socket) -> socket.socket:
    return notify_reader


def fill(path: str) -> int:
    """Fill the reader's queue until the kernel refuses more; returns how many went in."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as s:
        n = 0
        while True:
            try:
                s.sendto(b"X=1", path)
            except BlockingIOError:
                return n
            n += 1


def test_messages_arrive_as_assignments(reader: socket.socket) -> None:
    out = SdNotify({"NOTIFY_SOCKET": reader.getsockname()})
    assert out.send({"READY": "1", "STATUS": "serving"})
    assert parse_fields(reader.recv(4096)) == {"READY": "1", "STATUS": "serving"}
    out.close()


def test_a_reader_that_never_reads_costs_dropped_messages_and_one_warning(
        reader: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "vlaunch.notify")
    assert fill(reader.getsockname()) > 0
    out = SdNotify({"NOTIFY_SOCKET": reader.getsockname()})
    assert [out.send({"WATCHDOG": "1"}) for _ in range(50)] == [False] * 50  # none blocked
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "not keeping up" in caplog.text
    reader.recv(4096)  # room for one again: it gets through
    assert out.send({"READY": "1"})
    out.close()


@pytest.mark.parametrize("target", ["missing", "dead", "@vlaunch-test-nobody-listens"])
def test_a_stale_variable_logs_once_and_carries_on(tmp_path: Path, target: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "vlaunch.notify")
    path = target if target.startswith("@") else str(tmp_path / "gone.sock")
    if target == "dead":  # a socket file whose reader is gone
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(path)
        s.close()
    out = SdNotify({"NOTIFY_SOCKET": path})
    assert not any(out.send({"STATUS": f"step {i}"}) for i in range(5))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sd_notify to" in warnings[0].message
    assert "systemd will not see our state" in warnings[0].message


def test_without_the_variable_nothing_is_sent() -> None:
    out = SdNotify({})
    assert not out.enabled and not out.send({"READY": "1"})
