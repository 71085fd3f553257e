"""Framing and validation are pure functions; the daemon survives whatever a client sends."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlaunch.cache import CacheClient
from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import ProtocolError
from vlaunch.cache.contract.sockdir import socket_path

from .conftest import spawn_cache

REQUESTS = [{"op": "hello", "fingerprint": {"a": "b"}, "client": "x", "pid": 3},
            {"op": "manifest"}, {"op": "open", "mode": "share"}, {"op": "status"},
            {"op": "mapped", "mode": "copy", "bytes": 5}, {"op": "memory"}, {"op": "copied"}]


def test_encode_decode_round_trip() -> None:
    for msg in REQUESTS:
        frame = protocol.encode(msg)
        header = protocol.decode_header(frame[:protocol.HEADER_SIZE])
        assert header.length == len(frame) - protocol.HEADER_SIZE and header.nfds == 0
        body = protocol.decode_body(frame[protocol.HEADER_SIZE:])
        assert body == msg
        assert protocol.validate_request(body)[0] == msg["op"]


@pytest.mark.parametrize(("header", "words"), [
    (b"XXXX" + bytes(12), "bad magic"),
    (protocol.HEADER.pack(b"VLCH", 2, 0, 0, 0, 0, 1), "version 2"),
    (protocol.HEADER.pack(b"VLCH", 1, 7, 0, 0, 0, 1), "codec"),
    (protocol.HEADER.pack(b"VLCH", 1, 0, 0, 65, 0, 1), "too large"),
    (protocol.HEADER.pack(b"VLCH", 1, 0, 0, 0, 0, protocol.MAX_BODY + 1), "too large"),
    (b"VLCH", "short header"),
])
def test_bad_headers_are_refused_with_their_reason(header: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        protocol.decode_header(header)


@pytest.mark.parametrize(("msg", "words"), [
    ({"op": "nope"}, "unknown request"),
    ({"op": "open"}, "missing field"),
    ({"op": "open", "mode": "steal"}, "mode must be"),
    ({"op": "manifest", "x": 1}, "unknown field"),
    ({"op": "mapped", "mode": "share", "bytes": -1}, "out of range"),
    ({"op": "mapped", "mode": "share", "bytes": True}, "expected int"),
    ({"op": "hello", "fingerprint": {"k": "v" * 5000}}, "too long"),
    ({"op": "hello", "fingerprint": {"k": [1]}}, "short scalar"),
    ({"op": "hello", "fingerprint": {str(i): i for i in range(300)}}, "too many"),
])
def test_bad_requests_are_refused_with_their_reason(msg: dict, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        protocol.validate_request(msg)


def test_bodies_must_be_json_objects() -> None:
    for body in (b"[1]", b"\xff", b"{", b'{"a": NaN}', b"[" * 100000):
        with pytest.raises(ProtocolError):
            protocol.decode_body(body)


@given(st.binary(max_size=64))
def test_any_header_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        h = protocol.decode_header(data[:protocol.HEADER_SIZE])
    except ProtocolError:
        return
    assert 0 <= h.nfds <= protocol.MAX_FDS and 0 <= h.length <= protocol.MAX_BODY


@given(st.sampled_from(REQUESTS), st.data())
def test_mutated_frames_decode_or_raise_protocol_error(msg: dict, data: st.DataObject) -> None:
    frame = bytearray(protocol.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    try:
        header = protocol.decode_header(bytes(frame[:protocol.HEADER_SIZE]))
        body = protocol.decode_body(bytes(frame[protocol.HEADER_SIZE:][:header.length]))
        protocol.validate_request(body)
    except ProtocolError:
        pass


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) |
                           st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)


@given(st.dictionaries(st.sampled_from(["op", "mode", "bytes", "fingerprint", "kind", "zz"]),
                       json_values, max_size=4))
def test_random_messages_validate_or_raise_protocol_error(msg: dict) -> None:
    try:
        op, _ = protocol.validate_request(msg)
    except ProtocolError:
        return
    assert op in protocol.REQUESTS


@pytest.fixture(scope="module")
def live(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("fuzz") / "s"
    d.mkdir(mode=0o700)
    c = spawn_cache(llama_ckpt, d)
    yield socket_path(d, 0)
    c.stop()


def _raw(path: Path, payload: bytes) -> dict | None:
    """Send raw bytes; return the error reply, or None if the daemon just dropped us."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    s.connect(str(path))
    try:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        reply, fds = wire.recv_frame(s)
        for fd in fds:  # a mutation that left a valid "open" gets its slab fds
            os.close(fd)
        return reply
    except (EOFError, ConnectionError):
        return None
    finally:
        s.close()


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(REQUESTS), st.data())
def test_daemon_answers_mutated_frames_and_keeps_serving(live: Path, msg: dict,
                                                          data: st.DataObject) -> None:
    frame = bytearray(protocol.encode(msg))
    for _ in range(data.draw(st.integers(1, 3))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    reply = _raw(live, bytes(frame))
    assert reply is None or isinstance(reply.get("ok"), bool)
    assert CacheClient(live).status()["state"] == "serving"


def test_daemon_drops_a_stalled_client_without_stalling_others(live: Path) -> None:
    staller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staller.connect(str(live))
    staller.sendall(protocol.HEADER.pack(b"VLCH", 1, 0, 0, 0, 0, 100) + b"{")  # then nothing
    assert CacheClient(live).status()["state"] == "serving"  # others are served meanwhile
    staller.close()


def test_daemon_refuses_oversized_and_fd_carrying_requests(live: Path) -> None:
    big = protocol.HEADER.pack(b"VLCH", 1, 0, 0, 0, 0, protocol.MAX_REQUEST_BODY + 1)
    assert _raw(live, big)["error"] == "protocol"  # type: ignore[index]
    fds = protocol.HEADER.pack(b"VLCH", 1, 0, 0, 1, 0, 2) + b"{}"
    assert "file descriptors" in _raw(live, fds)["message"]  # type: ignore[index]
    garbage = struct.pack("!16s", b"GET / HTTP/1.1\r\n")
    assert "bad magic" in _raw(live, garbage)["message"]  # type: ignore[index]
    assert CacheClient(live).status()["state"] == "serving"


def test_a_pre_encoded_reply_goes_out_as_the_same_frame() -> None:
    import asyncio

    reply = {"ok": True, "manifest": {"backend": "cpu", "slab_sizes": [1], "tensors": []}}
    a, b = socket.socketpair()
    try:
        a.setblocking(False)

        async def send() -> None:
            loop = asyncio.get_running_loop()
            await wire.write_frame(loop, a, protocol.encode(reply))
            with pytest.raises(ProtocolError, match="carries no fds"):
                await wire.write_frame(loop, a, protocol.encode(reply), [b.fileno()])

        asyncio.run(send())
        assert wire.recv_frame(b) == (reply, [])
    finally:
        a.close()
        b.close()
