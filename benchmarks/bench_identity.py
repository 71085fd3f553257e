"""What the checkpoint identity costs, next to a full read of the same files.

For one checkpoint (--model, or one of --make-gb GB written under --dir), page cache warm and
cold (`posix_fadvise(DONTNEED)` on every file before each cold run: no root needed, but only
clean pages of files nobody maps are dropped), the median of --repeat runs of:

- memo hit: what a restarted engine pays when its files' stats match the rank's memo (stats);
- header identity: the header-only hash (the `checkpoint` field alone);
- sampled identity: open + validate the headers, stat, read the samples (`checkpoint_data`):
  what a rank pays before its load and an engine pays on a memo miss;
- full read: every byte of every file, 64 MiB preads on --threads threads (a lower bound of
  a load; the cache's own loader reads about this fast);
- full digest: the same read, hashed per tensor with blake2b (what `vlaunch verify` does on the
  file side).

Ratios are against the full read measured in the same run. Usage:

    python benchmarks/bench_identity.py --make-gb 1.5 --dir /tmp/vlaunch-bench-identity
    python benchmarks/bench_identity.py --model /models/llama-8b --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import fmt_s, machine_name, record_figures

from vlaunch.cache.store import identity
from vlaunch.cache.store.checkpoint import checkpoint_identity, open_checkpoint
from vlaunch.cache.store.plan import Position

CHUNK = 64 << 20


def make_checkpoint(root: Path, gb: float) -> Path:
    """A Llama-shaped bf16 checkpoint of about `gb` GB in files of at most 1 GB (random bytes)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab = 2048, 8192, 32000
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 2
    layers = max(1, int((gb * 1e9 - 2 * vocab * hidden * 2) // per_layer))
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape[:-1], shape[-1] * 2), dtype=torch.uint8,
                             generator=g).view(torch.bfloat16)

    root.mkdir(parents=True, exist_ok=True)
    part: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t(vocab, hidden)}
    size, n = 0, 0

    def flush() -> None:
        nonlocal part, size, n
        if part:
            n += 1
            save_file(part, str(root / f"model-{n:05d}.safetensors"))
            part, size = {}, 0

    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (hidden, hidden)),
                            ("self_attn.k_proj", (hidden, hidden)),
                            ("self_attn.v_proj", (hidden, hidden)),
                            ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            part[p + name + ".weight"] = t(*shape)
            size += shape[0] * shape[1] * 2
        part[p + "input_layernorm.weight"] = t(hidden)
        part[p + "post_attention_layernorm.weight"] = t(hidden)
        if size >= 1 << 30:
            flush()
    part["model.norm.weight"] = t(hidden)
    part["lm_head.weight"] = t(vocab, hidden)
    flush()
    return root


def drop_cache(files: list[Path]) -> None:
    """Ask the kernel to drop the files' clean pages."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def full_read(files: list[Path], threads: int) -> None:
    """Every byte, CHUNK-sized preads spread over threads."""
    jobs = [(f, off, min(CHUNK, os.stat(f).st_size - off))
            for f in files for off in range(0, os.stat(f).st_size, CHUNK)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    local = threading.local()

    def one(job: tuple[Path, int, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = bytearray(CHUNK)
        f, off, n = job
        os.preadv(fds[f], [memoryview(local.buf)[:n]], off)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def timed(fn: Callable[[], object], repeat: int, cold: list[Path] | None) -> float:
    """Median seconds of `repeat` runs (page cache dropped before each when `cold`)."""
    runs = []
    for _ in range(repeat):
        if cold is not None:
            drop_cache(cold)
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="an existing checkpoint (file or directory)")
    ap.add_argument("--make-gb", type=float, default=0.0, help="write a checkpoint of this size")
    ap.add_argument("--dir", default="", help="where --make-gb writes (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    if args.make_gb:
        root = Path(args.dir or tempfile.mkdtemp(prefix="vlaunch-bench-identity-"))
        if not any(root.glob("*.safetensors")):
            make_checkpoint(root, args.make_gb)
        model = str(root)
    elif args.model:
        model = args.model
    else:
        ap.error("pass --model or --make-gb")
    ckpt = open_checkpoint(model)
    files = list(ckpt.files)
    total = sum(os.stat(f).st_size for f in files)
    rec, _ = identity.record(model)
    memo = Path(tempfile.mkdtemp(prefix="vlaunch-memo-")) / "rank-0.identity.json"
    identity.write_memo(memo, rec)

    def memo_hit() -> None:
        identity._SEEN.clear()
        assert identity.identities(model, memo) == (rec.header, rec.data)

    def digest() -> None:
        identity.expected_digests(model, "replicate", Position(1, 0), threads=args.threads)

    regions = identity.sample_regions(ckpt)
    print(f"checkpoint {model}: {len(files)} file(s), {total / 1e9:.2f} GB, "
          f"{len(ckpt.tensors)} tensors; samples: {len(regions)} regions, "
          f"{sum(n for _, _, n in regions) / 1e6:.2f} MB; {os.cpu_count()} CPUs, "
          f"{args.threads} threads, median of {args.repeat}")
    print(f"{'':<18} {'warm':>10} {'cold':>10} {'warm/read':>10} {'cold/read':>10}")
    cases = [("memo hit", memo_hit), ("header identity", lambda: checkpoint_identity(model)),
             ("sampled identity", lambda: identity.record(model)),
             ("full read", lambda: full_read(files, args.threads)), ("full digest", digest)]
    results = {}
    for name, fn in cases:
        fn()  # warm up (and fill the page cache for the warm runs)
        results[name] = (timed(fn, args.repeat, None), timed(fn, args.repeat, files))
    read_warm, read_cold = results["full read"]
    for name, (warm, cold) in results.items():
        print(f"{name:<18} {warm * 1e3:>8.2f}ms {cold * 1e3:>8.2f}ms "
              f"{warm / read_warm:>10.5f} {cold / read_cold:>10.5f}")
    print(f"full read: {total / 1e9 / read_warm:.2f} GB/s warm, {total / 1e9 / read_cold:.2f} "
          "GB/s cold")
    ms = {name: (f"{warm * 1e3:.2f} ms", f"{cold * 1e3:.2f} ms")
          for name, (warm, cold) in results.items()}
    record_figures({"identity.cpu.memo_hit": ms["memo hit"][0],
                    "identity.cpu.sampled": ms["sampled identity"][0],
                    "identity.cpu.sampled_cold": ms["sampled identity"][1],
                    "identity.cpu.full_read": fmt_s(read_warm)},
                   machine=machine_name("cpu"),
                   source=f"identity.md: bench_identity.py (a {total / 1e9:.2f} GB checkpoint, "
                          f"--repeat {args.repeat} --threads {args.threads}), medians")
    return 0


if __name__ == "__main__":
    sys.exit(main())
