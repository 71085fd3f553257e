"""Which way should seeding move a shard across hosts? The candidates, measured on loopback
for the same bytes in the same run, against a plain multi-stream socket copy.

Every buffer is a memfd mapping under MADV_HUGEPAGE, as a rank's slabs are.

- raw: the baseline. A sender process writes the bytes of a memfd (filled with the shard) on
  --streams TCP connections, 1/N each (`socket.sendall` of the mapping; `sendfile` too, and
  the faster of the two is the baseline); the receiver `recv_into`s a fresh mapping.
- vlaunch: `seed_tcp` from a real source rank (`vlaunch cache --seed-listen-port`), the token
  checked, on 1 and on --streams connections, into fresh slabs of this process.
- gloo: `torch.distributed` with gloo, isend/irecv of the bytes in --streams parts between two
  processes (a TCPStore rendezvous).
- nixl: NIXL's UCX backend (UCX_TLS=tcp: what reaches another host without RDMA), one READ of
  the bytes in --streams descriptors from a registered memfd mapping into another; needs
  --nixl-python, an interpreter that can `import nixl_cu12` (or `nixl`), and is skipped
  without it.

    python benchmarks/bench_seed_engines.py [--size-mb 512] [--streams 4] [--repeats 5]
        [--nixl-python /path/to/venv/bin/python] [--json FILE]

Each repeat runs every candidate once, in turn; the table shows medians (and the best) in
GB/s, and each candidate's ratio to the baseline's median. The receiving side's pages are
fresh each time (their first touch is part of every candidate's cost, as in a seeding rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import free_port, machine_name, record_figures

TOKEN = "bench-token-0123456789abcdef"
GB = 1e9


def memfd_with(path: str, size: int) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes holding the start of the checkpoint at `path` (a file, or a
    directory's .safetensors files one after another; zeros past their end)."""
    fd = os.memfd_create("bench-src")
    os.ftruncate(fd, size)
    buf = huge(mmap.mmap(fd, size))
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    at = 0
    for file in files:
        with open(file, "rb") as fh:
            while at < size and (data := fh.read(min(64 << 20, size - at))):
                buf[at:at + len(data)] = data
                at += len(data)
    return fd, buf


def fresh(size: int) -> mmap.mmap:
    """A fresh shared mapping of a memfd (no page touched yet)."""
    fd = os.memfd_create("bench-dst")
    os.ftruncate(fd, size)
    buf = huge(mmap.mmap(fd, size))
    os.close(fd)
    return buf


def huge(buf: mmap.mmap) -> mmap.mmap:
    """Ask for 2 MiB pages, as a rank's slabs do (CpuSlab): the same page faults on every
    candidate's side."""
    with contextlib.suppress(AttributeError, OSError):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def cuts(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of `parts` near-equal pieces of `size` bytes."""
    step = -(-size // parts)
    return [(at, min(step, size - at)) for at in range(0, size, step)]


# ------------------------------------------------------------------ child processes


def child(argv: list[str]) -> None:
    """Run one side of a candidate in this process (`--child ROLE ...`)."""
    role, path, size, parts, port = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    {"raw-send": raw_send, "raw-sendfile": raw_send, "gloo-send": gloo, "gloo-recv": gloo,
     "nixl-send": nixl, "nixl-recv": nixl}[role](role, path, size, parts, port)


def raw_send(role: str, path: str, size: int, parts: int, port: int) -> None:
    """Accept `parts` connections on `port` and write 1/parts of the bytes on each."""
    fd, buf = memfd_with(path, size)
    listener = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    conns = [listener.accept()[0] for _ in range(parts)]

    def send(conn: socket.socket, at: int, n: int) -> None:
        if role == "raw-sendfile":
            end = at + n
            while at < end:
                at += os.sendfile(conn.fileno(), fd, at, end - at)
        else:
            conn.sendall(memoryview(buf)[at:at + n])
        conn.close()

    threads = [threading.Thread(target=send, args=(c, at, n))
               for c, (at, n) in zip(conns, cuts(size, parts), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def gloo(role: str, path: str, size: int, parts: int, port: int) -> None:
    """One side of a gloo isend/irecv of the bytes in `parts` pieces; the receiver prints
    its seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = 0 if role == "gloo-send" else 1
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=_timedelta(120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 0:
        _, buf = memfd_with(path, size)
        t = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        t = torch.frombuffer(fresh(size), dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    op = dist.isend if rank == 0 else dist.irecv
    for w in [op(t[at:at + n], 1 - rank, tag=i) for i, (at, n) in enumerate(cuts(size, parts))]:
        w.wait()
    seconds = time.perf_counter() - start
    dist.barrier()
    if rank == 1:
        print(json.dumps({"seconds": seconds}), flush=True)
    dist.destroy_process_group()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def nixl(role: str, path: str, size: int, parts: int, port: int) -> None:
    """One side of a NIXL READ over UCX/TCP; metadata crosses a plain socket on `port`; the
    reader prints its seconds."""
    os.environ.setdefault("UCX_TLS", "tcp")
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    if role == "nixl-send":
        _, buf = memfd_with(path, size)
    else:
        buf = fresh(size)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    agent.register_memory([(addr, size, 0, "")], "DRAM")
    ours = struct.pack("!Q", addr) + agent.get_agent_metadata()
    if role == "nixl-send":
        listener = socket.create_server(("127.0.0.1", port))
        print("ready", flush=True)
        conn = listener.accept()[0]
        theirs = _recv_blob(conn)
        agent.add_remote_agent(theirs[8:])
        _send_blob(conn, ours)
        conn.recv(1)  # the reader is done
        return
    conn = socket.create_connection(("127.0.0.1", port))
    _send_blob(conn, ours)
    theirs = _recv_blob(conn)
    remote_addr = struct.unpack("!Q", theirs[:8])[0]
    name = agent.add_remote_agent(theirs[8:])
    pieces = cuts(size, parts)
    start = time.perf_counter()
    local = agent.get_xfer_descs([(addr + at, n, 0) for at, n in pieces], "DRAM")
    remote = agent.get_xfer_descs([(remote_addr + at, n, 0) for at, n in pieces], "DRAM")
    handle = agent.initialize_xfer("READ", local, remote, name)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - start
    if state != "DONE":
        raise SystemExit(f"NIXL transfer ended {state}")
    handle.release()
    conn.send(b"x")
    print(json.dumps({"seconds": seconds}), flush=True)


def _send_blob(conn: socket.socket, data: bytes) -> None:
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv_blob(conn: socket.socket) -> bytes:
    head = _exact(conn, 4)
    return _exact(conn, struct.unpack("!I", head)[0])


def _exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise EOFError("metadata connection closed")
        out += chunk
    return bytes(out)


# ------------------------------------------------------------------------ candidates


def _spawn(python: str, role: str, path: str, size: int, parts: int, port: int
           ) -> subprocess.Popen[str]:
    return subprocess.Popen([python, __file__, "--child", role, path, str(size), str(parts),
                             str(port)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ready(proc: subprocess.Popen[str]) -> None:
    """Wait for a child's "ready" line (libraries may print before it)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return
    raise SystemExit(f"a benchmark child exited {proc.wait()} before it was ready")


def raw(path: str, size: int, parts: int, how: str) -> float:
    """Seconds of the plain multi-stream copy (`how`: raw-send or raw-sendfile)."""
    port = free_port()
    sender = _spawn(sys.executable, how, path, size, parts, port)
    _ready(sender)
    dst = fresh(size)
    start = time.perf_counter()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(parts)]

    def recv(sock: socket.socket, at: int, n: int) -> None:
        view = memoryview(dst)[at:at + n]
        got = 0
        while got < n:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if not k:
                raise EOFError("raw sender closed early")
            got += k

    threads = [threading.Thread(target=recv, args=(s, at, n))
               for s, (at, n) in zip(socks, cuts(size, parts), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for s in socks:
        s.close()
    sender.wait(60)
    return seconds


def pair(python: str, kind: str, path: str, size: int, parts: int) -> float:
    """Seconds a two-process candidate (gloo, nixl) reported for one transfer."""
    port = free_port()
    first = _spawn(python, f"{kind}-send", path, size, parts, port)
    if kind == "nixl":
        _ready(first)
    second = _spawn(python, f"{kind}-recv", path, size, parts, port)
    out, _ = second.communicate(timeout=600)
    first.wait(60)
    if second.returncode:
        raise SystemExit(f"{kind} receiver exited {second.returncode}")
    return float(json.loads(out.strip().splitlines()[-1])["seconds"])


class Source:
    """A real source rank serving seeding on a TCP port, and what seeding it needs."""

    def __init__(self, model: str, tmp: Path) -> None:
        from vlaunch.cache.contract.progress import recv_ready

        sockdir = tmp / "src"
        sockdir.mkdir(mode=0o700)
        self.port = free_port()
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", model, "--plan", "replicate",
             "--socket-dir", str(sockdir), "--no-checksum", "--seed-listen-port",
             str(self.port), "--ready-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env={**os.environ, "VLAUNCH_SEED_TOKEN": TOKEN})
        theirs.close()
        with ours:
            _, fds = recv_ready(ours)
            for fd in fds:
                os.close(fd)
        from vlaunch.cache import CacheClient
        from vlaunch.cache.contract.sockdir import socket_path

        client = CacheClient(socket_path(sockdir, 0))
        self.fingerprint, self.nbytes = client.status()["fingerprint"], client.manifest().nbytes
        client.close()
        self.model = model

    def seed(self, streams: int) -> float:
        """Seconds of one `seed_tcp` into fresh CPU slabs (their move, not the connect)."""
        from vlaunch.cache.rank.seed import seed_tcp
        from vlaunch.cache.store.plan import Position
        from vlaunch.cache.store.shard import empty_shard
        from vlaunch.cache.store.slabs import get_backend

        shard = empty_shard(self.model, "replicate", Position.from_global(0, 1, 1, 1),
                            get_backend("cpu"))
        try:
            got = seed_tcp("127.0.0.1", self.port, TOKEN, self.fingerprint, shard.manifest,
                           shard.tensors, streams=streams)
            return got.seconds
        finally:
            shard.tensors.clear()
            for slab in shard.slabs:
                slab.release()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def measure(model: str, size_mb: int, streams: int, repeats: int, nixl_python: str,
            tmp: Path) -> dict[str, Any]:
    """Every candidate's seconds per repeat, alternated."""
    source = Source(model, tmp)
    size = source.nbytes
    names = ["raw sendall", "raw sendfile", "vlaunch 1 stream", f"vlaunch {streams} streams",
             "gloo"] + (["nixl ucx/tcp"] if nixl_python else [])
    runs: dict[str, list[float]] = {n: [] for n in names}
    try:
        for _ in range(repeats):
            runs["raw sendall"].append(raw(model, size, streams, "raw-send"))
            runs["raw sendfile"].append(raw(model, size, streams, "raw-sendfile"))
            runs["vlaunch 1 stream"].append(source.seed(1))
            runs[f"vlaunch {streams} streams"].append(source.seed(streams))
            runs["gloo"].append(pair(sys.executable, "gloo", model, size, streams))
            if nixl_python:
                runs["nixl ucx/tcp"].append(pair(nixl_python, "nixl", model, size, streams))
    finally:
        source.stop()
    return {"bytes": size, "streams": streams, "repeats": repeats, "seconds": runs,
            "load": os.getloadavg()}


def table(r: dict[str, Any]) -> str:
    """The printed table."""
    gb = r["bytes"] / GB
    rate = {n: gb / statistics.median(s) for n, s in r["seconds"].items()}
    base_name = max(("raw sendall", "raw sendfile"), key=rate.__getitem__)
    base = rate[base_name]
    lines = [f"{gb:.2f} GB over loopback, {r['streams']} streams, median of {r['repeats']} "
             f"(best); baseline: {base_name}; load average at the end "
             f"{r['load'][0]:.1f}",
             f"{'candidate':<22} {'GB/s':>7} {'best':>7} {'vs baseline':>12}"]
    for name, secs in r["seconds"].items():
        lines.append(f"{name:<22} {rate[name]:>7.2f} {gb / min(secs):>7.2f} "
                     f"{rate[name] / base:>11.2f}x")
    return "\n".join(lines)


def main() -> None:
    """Measure and print the table (and --json)."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nixl-python", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vl-engines-") as tmp:
        model = str(Path(tmp) / "model.safetensors")
        import torch
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(0)
        save_file({f"w{i}": torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
                   for i in range(max(1, args.size_mb // 8))}, model)
        result = measure(model, args.size_mb, args.streams, args.repeats, args.nixl_python,
                         Path(tmp))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    rate = {n: 1 / statistics.median(s) for n, s in result["seconds"].items()}
    base = max(rate["raw sendall"], rate["raw sendfile"])
    names = {"vlaunch": f"vlaunch {args.streams} streams", "gloo": "gloo", "nixl": "nixl ucx/tcp"}
    record_figures({f"seed.cpu.engines.{k}": f"{rate[n] / base:.2f}x" for k, n in names.items()
                    if n in rate}, machine=machine_name("cpu"),
                   source=f"seed_engines.md: bench_seed_engines.py --size-mb {args.size_mb} "
                          f"--repeats {args.repeats} --streams {args.streams}, GB/s medians "
                          f"against the faster plain {args.streams}-stream socket copy")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
