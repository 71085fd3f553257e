"""Frames on real sockets: blocking helpers for clients, asyncio helpers for the daemon."""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from typing import Any

from vlaunch.cache.contract import protocol
from vlaunch.cache.contract.errors import ProtocolError

_CMSG_SPACE = socket.CMSG_SPACE(protocol.MAX_FDS * 4)


def _ancillary(fds: list[int]) -> list[tuple[int, int, bytes]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []


def send_frame(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    """Send one frame; fds ride on its first byte."""
    data = protocol.encode(message, len(fds))
    sent = sock.sendmsg([data], _ancillary(list(fds)))
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket, *, max_body: int = protocol.MAX_BODY,
               ) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame and the fds it announces (close-on-exec); EOF raises EOFError."""
    head = bytearray()
    fds: list[int] = []
    while len(head) < protocol.HEADER_SIZE:
        data, anc, flags, _ = sock.recvmsg(protocol.HEADER_SIZE - len(head), _CMSG_SPACE,
                                           socket.MSG_CMSG_CLOEXEC)
        fds.extend(_fds_from(anc))
        if flags & socket.MSG_CTRUNC:
            close_fds(fds)
            raise ProtocolError("too many file descriptors in one frame")
        if not data:
            close_fds(fds)
            raise EOFError("connection closed")
        head += data
    try:
        header = protocol.decode_header(bytes(head), max_body=max_body, tails=True)
        if header.nfds != len(fds):
            raise ProtocolError(f"frame announces {header.nfds} fds but carries {len(fds)}")
        return protocol.decode_body(_recv_exact(sock, header.length), header.codec), fds
    except BaseException:
        close_fds(fds)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError("connection closed in the middle of a frame")
        got += k
    return buf


def _fds_from(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def close_fds(fds: list[int]) -> None:
    """Close every fd of a frame that is not kept (an error reply's, a refused frame's)."""
    for fd in fds:
        os.close(fd)


async def read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, *,
                     max_body: int, frame_timeout: float,
                     idle_timeout: float | None = None) -> dict[str, Any]:
    """Read one fd-less frame; a peer that stalls mid-frame is cut off after frame_timeout
    (and one that sends nothing, after idle_timeout when given)."""
    head = await _read_exact(loop, sock, protocol.HEADER_SIZE, idle_timeout)
    header = protocol.decode_header(head, max_body=max_body)
    if header.nfds:
        raise ProtocolError("requests may not carry file descriptors")
    body = await _read_exact(loop, sock, header.length, frame_timeout)
    return protocol.decode_body(body)


async def read_request(loop: asyncio.AbstractEventLoop, sock: socket.socket, *,
                       frame_timeout: float, idle_timeout: float | None = None,
                       ) -> tuple[str, dict[str, Any]]:
    """Read and validate one request: (op, fields). Only a FLAG_LARGE frame (an artifact_put)
    may exceed MAX_REQUEST_BODY; a header is refused before any of its body is read."""
    head = await _read_exact(loop, sock, protocol.HEADER_SIZE, idle_timeout)
    header = protocol.decode_header(head, max_body=protocol.MAX_REQUEST_BODY,
                                    large_body=protocol.MAX_ARTIFACT_BODY)
    if header.nfds:
        raise ProtocolError("requests may not carry file descriptors")
    body = await _read_exact(loop, sock, header.length, frame_timeout)
    op, fields = protocol.validate_request(protocol.decode_body(body))
    protocol.check_large(op, header)
    return op, fields


async def _read_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int,
                      timeout: float | None) -> bytes:
    """n bytes from a non-blocking socket. What has arrived already is taken without a trip
    through the event loop (a request's body comes with its header, and a handoff's three
    requests arrive at once); only a read that must wait is awaited, and bounded."""
    try:
        data = sock.recv(n)
    except (BlockingIOError, InterruptedError):
        data = None
    if data is not None:
        if not data:
            raise EOFError("connection closed")
        if len(data) == n:
            return data
        timeout = timeout or 10.0  # the frame has started: it must finish promptly
    buf = bytearray(data or b"")
    while len(buf) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(buf)), timeout)
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
        timeout = timeout or 10.0  # once a frame has started, it must finish promptly
    return bytes(buf)


async def write_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                      message: dict[str, Any] | bytes,
                      fds: list[int] = (), *,  # type: ignore[assignment]
                      timeout: float | None = None) -> None:
    """Send one frame (with fds) on a non-blocking socket; `message` may be a frame that
    protocol.encode already made (without fds), for a reply sent many times, or what is left
    of one to send (nothing, when it is empty). A frame the socket takes at once is sent
    without a trip through the event loop; a peer that leaves the rest unread for `timeout`
    seconds raises TimeoutError."""
    if isinstance(message, bytes):
        if fds:
            raise ProtocolError("a pre-encoded frame carries no fds")
        if not message:  # the frame was sent already (a reply a rank's thread sent)
            return
        data = message
    else:
        data = protocol.encode(message, len(fds))
    try:
        sent = sock.sendmsg([data], _ancillary(list(fds)))
    except (BlockingIOError, InterruptedError):
        sent = -1
    if 0 <= sent == len(data):
        return
    await asyncio.wait_for(_send_rest(loop, sock, data, fds, sent), timeout)


async def _send_rest(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes,
                     fds: list[int], sent: int) -> None:
    """The slow path of write_frame: wait until the socket takes the frame (its fds ride on
    the first byte sent), then the rest of its bytes."""
    while sent < 0:
        await _writable(loop, sock)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            sent = sock.sendmsg([data], _ancillary(list(fds)))
    if sent < len(data):
        await loop.sock_sendall(sock, data[sent:])


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_writer(sock.fileno())
