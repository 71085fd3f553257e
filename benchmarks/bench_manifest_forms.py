"""A manifest's two forms against one running CPU rank, alternated in one process: the request,
its parse and checks, and the engine's tensors (views over the already mapped slabs), per
tensor, in rows (the JSON form every earlier client asks for) and in columns (what `load()`
asks for now), beside a bare loop of `torch.as_strided` calls (the floor: one tensor object
each) and the same tensors made by one C++ call (`unbind` of one strided view: whether making
them in bulk lowers that floor).

    python benchmarks/bench_manifest_forms.py [--count 100000] [--repeats 5]

The collector is off while timing (load() pauses it too). Prints medians (and the best).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_tensor_count import write

from vlaunch.cache import CacheClient
from vlaunch.cache.client.mapping import Opened, import_slabs
from vlaunch.cache.contract.progress import recv_ready
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store import columns
from vlaunch.cache.store.manifest import Manifest, views


def main() -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="vl-forms-") as tmp:
        model, sockdir = Path(tmp) / "m.safetensors", Path(tmp) / "s"
        write(model, args.count, 256)
        sockdir.mkdir(mode=0o700)
        ours, theirs = socket.socketpair()
        rank = subprocess.Popen([sys.executable, "-m", "vlaunch.cache", "--model", str(model),
                                 "--socket-dir", str(sockdir), "--plan", "replicate",
                                 "--ready-fd", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL)
        theirs.close()
        _, fds = recv_ready(ours)
        for fd in fds:
            os.close(fd)
        client = CacheClient(socket_path(sockdir, 0))
        reply, fds = client.request({"op": "open", "mode": "share"})
        slabs = import_slabs(fds, Opened(tuple(reply["sizes"])), "cpu")

        def rows() -> None:
            got = client.request({"op": "manifest"})[0]
            views(Manifest.from_wire(got["manifest"]), slabs)

        def cols() -> None:
            got = client.request({"op": "manifest", "form": "columns"})[0]
            columns.views(columns.from_wire(got["manifest"], got.get("tail")), slabs)

        def floor() -> None:
            strided, base = torch.as_strided, slabs[0]
            [strided(base, (8, 16), (16, 1), i) for i in range(args.count)]

        def bulk() -> None:
            slabs[0].as_strided((args.count, 8, 16), (1, 16, 1)).unbind(0)

        fns: dict[str, Callable[[], None]] = {"rows": rows, "columns": cols,
                                              "as_strided alone": floor, "unbind, one call": bulk}
        times: dict[str, list[float]] = {name: [] for name in fns}
        gc.disable()
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
                gc.collect()
        client.close()
        rank.terminate()
        rank.wait(60)
    us = 1e6 / args.count
    print(f"{args.count} tensors, median (best) of {args.repeats}, microseconds a tensor; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, secs in times.items():
        print(f"{name:<18} {statistics.median(secs) * us:7.2f} ({min(secs) * us:.2f})")
    ratio = statistics.median(times["rows"]) / statistics.median(times["columns"])
    print(f"rows / columns: {ratio:.2f}x")


if __name__ == "__main__":
    main()
