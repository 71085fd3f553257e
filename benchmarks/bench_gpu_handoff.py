#!/usr/bin/env python3
"""Weight handoff on one GPU: vlaunch share / copy / copy-release against safetensors.

    python benchmarks/bench_gpu_handoff.py [--device cuda:0] [--dir DIR] [--gib 16] [--reps 5]
                                           [--copy-release-reps 5] [--json FILE]

1. Writes (once; reused when present) a random Llama-shaped bf16 checkpoint of about --gib GiB
   (hidden 4096, intermediate 14336, 32 heads / 8 kv heads, vocab 128256; the layer count is
   what reaches the size: 35 layers, 318 tensors for 16 GiB) in 4 safetensors shards plus an
   index, with `vlaunch.cache.reference.refmodel.make_checkpoint(..., device=<the GPU>)`.
2. Starts a cache rank (`python -m vlaunch.cache --device ...`, ready fd) after trying to drop
   the checkpoint from the page cache, and reports its first load: time and GB/s.
3. In fresh client processes (each imports torch and initialises CUDA first, then times only
   `vlaunch.cache.load(...)` up to a `torch.cuda.synchronize()`), the median of --reps runs
   of: safetensors `load_file(device=...)` with a warm page cache (one untimed run first),
   vlaunch share, copy and copy-release (copy-release empties the cache, so each of its runs
   gets a fresh cache process, started while no other cache is up).
4. The device-to-device bandwidth of a 16 GiB torch copy in a fresh process of the same run.
5. A profile of the share path in fresh processes: where the milliseconds go (lazy imports,
   fingerprint incl. checkpoint headers, connect, hello, manifest, fd import/map, views...),
   for the first load in a process and for a second one in the same process.

Prints the table last; --json keeps every raw number. Runs from a checkout: when `vlaunch` is
not installed it is made importable through a temporary `vlaunch/cache` link to `cache/`.
`--small` writes a tiny checkpoint with the same tensor count (a dry run, also on `--device
cpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30
SHARDS = 4
REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh process per measurement; argv[1] is a JSON spec. Prints "RESULT {json}".
CHILD = r'''
import json, sys, time
spec = json.loads(sys.argv[1])
t_proc = time.perf_counter()
import torch
dev = spec["device"]
cuda = dev.startswith("cuda")
if cuda:
    torch.cuda.init()
    torch.empty(1, device=dev)
    torch.cuda.synchronize(dev)
out = {"torch_cuda_init_s": time.perf_counter() - t_proc,
       "preloaded": {m: m in sys.modules for m in ("numpy", "cuda.bindings.driver")}}
perf = time.perf_counter


def sync():
    if cuda:
        torch.cuda.synchronize(dev)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check(tensors, files, names):
    """Bit-compare a few tensors with the file's bytes (untimed)."""
    from safetensors import safe_open
    done = 0
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if name in names:
                    ref = fh.get_tensor(name)
                    got = tensors[name].cpu()
                    assert got.dtype == ref.dtype and got.shape == ref.shape, name
                    assert torch.equal(got.reshape(-1).view(torch.uint8),
                                       ref.reshape(-1).view(torch.uint8)), name
                    done += 1
    assert done == len(names), (done, names)
    return done


kind = spec["kind"]
if kind == "safetensors":
    from safetensors.torch import load_file
    tensors = {}
    t0 = perf()
    for f in spec["files"]:
        tensors.update(load_file(f, device=dev))
    sync()
    out["seconds"] = perf() - t0
    out["tensors"], out["bytes"] = len(tensors), nbytes(tensors)

elif kind == "vlaunch":
    t0 = perf()
    import vlaunch.cache.client.loader as loader
    out["import_s"] = perf() - t0
    out["code"] = loader.__file__
    t0 = perf()
    w = loader.load(spec["model"], socket_dir=spec["socket_dir"], mode=spec["mode"],
                    device=dev, fallback=False, timeout=30)
    sync()
    out["seconds"] = perf() - t0
    assert w.source == "cache", w.reason
    out["tensors"], out["bytes"], out["bytes_outside"] = len(w), nbytes(w), w.bytes_outside
    if spec.get("check"):
        out["checked"] = check(w, spec["files"], spec["check"])

elif kind == "profile":
    import collections, importlib
    t0 = perf()
    import vlaunch.cache.client.loader as L
    out["import_s"] = perf() - t0
    out["code"] = L.__file__
    t0 = perf()
    mods = {m.rpartition(".")[2].replace("connection", "client"):
            importlib.import_module("vlaunch.cache." + m)
            for m in ("store.checkpoint", "store.plan", "store.slabs", "store.slabs_cuda",
                      "store.cudadrv", "store.dtypes", "contract.fingerprint",
                      "client.connection", "store.manifest", "contract.protocol",
                      "store.target")}
    mods["wire_client"] = importlib.import_module("vlaunch.cache.contract.connection")
    with contextlib.suppress(ImportError):  # since issue 38; before, Target.fingerprint
        mods["fingerprints"] = importlib.import_module("vlaunch.cache.store.fingerprints")
    out["lazy_imports_s"] = perf() - t0  # inside load() in a real run; pre-imported here
    stats = collections.OrderedDict()  # label -> [calls, inclusive, exclusive]
    stack = []
    current = [""]

    def wrap(owner, attr, label):
        fn = getattr(owner, attr, None)
        if fn is None:  # older or newer code without this step
            return

        def timed(*a, **k):
            name = label(a) if callable(label) else label
            stack.append(0.0)
            t = perf()
            try:
                return fn(*a, **k)
            finally:
                dt = perf() - t
                child = stack.pop()
                s = stats.setdefault(name, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += dt
                s[2] += dt - child
                if stack:
                    stack[-1] += dt
        setattr(owner, attr, timed)

    def op_label(a):
        current[0] = a[1].get("op", "?")
        return "request " + current[0] + " (round trip)"

    C, SC, M = mods["client"], mods["slabs_cuda"], mods["manifest"]
    wrap(mods["target"].Target, "fingerprint", "fingerprint: Target.fingerprint (own code)")
    if "fingerprints" in mods:
        wrap(mods["fingerprints"], "fingerprint",
             "fingerprint: fingerprints.fingerprint (own code)")
    wrap(mods["checkpoint"], "checkpoint_identity",
         "fingerprint: checkpoint identity (raw headers + sha256)")
    wrap(mods["checkpoint"], "open_checkpoint", "fingerprint: open_checkpoint (validates all)")
    wrap(mods["plan"], "load_plan", "fingerprint: load_plan")
    wrap(mods["slabs"], "get_backend", "get_backend (own code)")
    wrap(SC.CudaBackend, "__init__", "CudaBackend() init")
    wrap(mods["cudadrv"], "_load", "libcuda.so.1 load + cuInit (first call)")
    wrap(SC.CudaBackend, "device_info", "fingerprint: device_info")
    wrap(mods["fingerprint"], "build", "fingerprint: build")
    wrap(mods["wire_client"], "connect", "connect (+ socket dir and peer checks)")
    wrap(C.CacheClient, "request", op_label)
    wrap(C.CacheClient, "_send", "send a request")
    wrap(C.CacheClient, "_recv", "receive a reply (waits for the cache)")
    wrap(C.CacheClient, "handoff", "handoff (own code)")
    wrap(C, "import_slabs", "fd import + map, all slabs (own code)")
    wrap(mods["protocol"], "decode_body",
         lambda a: f"json decode of reply ({current[0]})" if current[0] else "json decode")
    wrap(M.Manifest, "from_wire", "manifest validate (from_wire)")
    wrap(C.CacheClient, "map", "map (own code: fd close, clone in copy mode)")
    wrap(SC.CudaBackend, "import_fd", "fd import: cuMemImport + props + release (own)")
    wrap(SC.CudaBackend, "_map", "map: cuMemAddressReserve + cuMemMap + cuMemSetAccess")
    wrap(SC._Mapping, "tensor", "map: torch.as_tensor over the mapping")
    wrap(mods["slabs"].CpuBackend, "import_fd", "fd import + mmap (cpu)")
    wrap(SC, "_unmap", "unmap (sync + cuMemUnmap; copy mode)")
    wrap(C, "views", "views (as_strided per tensor)")
    wrap(C.CacheClient, "watch", "lease watcher thread start")
    if spec["mode"] != "share":
        wrap(torch.Tensor, "clone", "copy: clone = allocate + launch the copy")
    import gc
    import resource
    gcs = []

    def on_gc(phase, info):
        gcs.append((phase, info["generation"], perf()))

    gc.callbacks.append(on_gc)
    loads, keep = [], []
    for i in range(spec["loads"]):
        stats.clear()
        gcs.clear()
        flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = perf()
        w = L.load(spec["model"], socket_dir=spec["socket_dir"], mode=spec["mode"],
                   device=dev, fallback=False, timeout=30)
        t1 = perf()
        sync()
        t2 = perf()
        assert w.source == "cache", w.reason
        keep.append(w)
        rows = [[k, v[0], v[1], v[2]] for k, v in stats.items()]
        rows.append(["torch.cuda.synchronize after load", 1, t2 - t1, t2 - t1])
        other = (t2 - t0) - sum(r[3] for r in rows)
        rows.append(["other (load/map glue, Position, Weights)", 1, other, other])
        starts = [t for ph, g, t in gcs if ph == "start"]
        stops = [t for ph, g, t in gcs if ph == "stop"]
        loads.append({"total": t2 - t0, "rows": rows,
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0,
                      "gc": [g for ph, g, t in gcs if ph == "start"],
                      "gc_s": sum(b - a for a, b in zip(starts, stops))})
    out["loads"] = loads
    out["tensors"] = len(keep[0])

elif kind == "d2d":
    n = spec["bytes"]
    t0 = perf()
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    sync()
    out["alloc_first_s"] = perf() - t0
    src.fill_(7)
    sync()
    t0 = perf()
    dst = src.clone()  # what copy mode does: a fresh allocation and one copy
    sync()
    out["clone_first_s"] = perf() - t0
    dst.copy_(src)
    sync()
    times, events = [], []
    for _ in range(spec["reps"]):
        t0 = perf()
        dst.copy_(src)
        sync()
        times.append(perf() - t0)
    if cuda:
        for _ in range(spec["reps"]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            events.append(a.elapsed_time(b) / 1e3)
        props = torch.cuda.get_device_properties(dev)
        out["device_name"] = props.name
        out["device_mem"] = props.total_memory
    out["copy_s"], out["copy_event_s"] = times, events
    out["torch"], out["cuda"] = torch.__version__, torch.version.cuda

print("RESULT " + json.dumps(out), flush=True)
'''


def ensure_importable() -> dict[str, str]:
    """Make `vlaunch.cache` importable here and in children; returns the children's env."""
    env = dict(os.environ)
    try:
        import vlaunch.cache.client.loader  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="vlaunch-shim-"))
        (shim / "vlaunch").mkdir()
        (shim / "vlaunch" / "cache").symlink_to(REPO / "cache")
        (shim / "vlaunch" / "launcher").symlink_to(REPO / "launcher")
        sys.path.insert(0, str(shim))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH")) if p)
    return env


def pick_dir(explicit: str | None, need: int) -> Path:
    """--dir, else the first of a few places with room for the checkpoint."""
    if explicit:
        return Path(explicit)
    for cand in (os.environ.get("VLAUNCH_BENCH_DIR"), "/tmp", str(Path.home()), str(REPO)):
        if cand and os.path.isdir(cand) and shutil.disk_usage(cand).free > need * 1.3:
            return Path(cand) / "vlaunch-bench"
    raise SystemExit(f"no directory with {need * 1.3 / 1e9:.0f} GB free; pass --dir")


def make_ckpt(root: Path, gib: float, device: str, small: bool,
              env: dict[str, str]) -> tuple[Path, float]:
    """The checkpoint (written once); returns its path and the seconds spent writing it."""
    gen = "cuda" if device.startswith("cuda") else "cpu"
    if small:  # same tensor count (35 layers), tiny shapes: a dry run of the plumbing
        path, kw = root / "llama-small-35l", ("hidden=256, layers=35, heads=8, kv_heads=4, "
                                              "intermediate=512, vocab=1024")
    else:
        path = root / f"llama8b-shapes-{gib:g}gib"
        kw = f"**LLAMA_8B_SHAPES, target_bytes={int(gib * GiB)}"
    code = ("from vlaunch.cache.reference.refmodel import LLAMA_8B_SHAPES, make_checkpoint\n"
            f"make_checkpoint({str(path)!r}, {kw}, shards={SHARDS}, device={gen!r})")
    t0 = time.perf_counter()  # in a child: this process stays without a CUDA context
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=1800)
    return path, time.perf_counter() - t0


def drop_page_cache(files: list[str]) -> str:
    """Try to evict the checkpoint from the page cache; says what worked."""
    done = []
    os.sync()
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        done.append("fadvise DONTNEED ok")
    except OSError as e:
        done.append(f"fadvise failed ({e.strerror})")
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        done.append("drop_caches ok")
    except OSError as e:
        done.append(f"drop_caches failed ({e.strerror})")
    return ", ".join(done)


class Cache:
    """One cache rank process with its log file."""

    LOADED = re.compile(r"loaded (\d+) tensors, ([\d.]+) GB in (\d+) slab\(s\) on (\S+) in "
                        r"([\d.]+)s \(([\d.]+) GB/s\)")

    def __init__(self, model: str, device: str, log: Path, env: dict[str, str],
                 threads: int) -> None:
        from vlaunch.cache.contract import wire

        self.sockdir = tempfile.mkdtemp(prefix="vlb-")  # mode 0700
        self.log = log
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "vlaunch.cache", "--model", model, "--socket-dir",
               self.sockdir, "--rank", "0", "--device", device, "--threads", str(threads),
               "--ready-fd", str(theirs.fileno())]
        t0 = time.perf_counter()
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdout=fh,
                                         stderr=fh, env=env)
        theirs.close()
        ours.settimeout(900)
        try:
            self.ready, fds = wire.recv_frame(ours)
        except (EOFError, OSError) as e:
            self.proc.kill()
            raise RuntimeError(f"cache did not come up ({e}); log:\n"
                               f"{log.read_text()[-3000:]}") from None
        finally:
            ours.close()
        self.ready_s = time.perf_counter() - t0
        for fd in fds:  # no escrow here: copy-release must really free the cache's copy
            os.close(fd)
        found = self.LOADED.findall(log.read_text())
        n, gb, slabs, _, secs, rate = found[-1]
        self.tensors, self.gb, self.slabs = int(n), float(gb), int(slabs)
        self.load_s, self.rate = float(secs), float(rate)

    def status(self) -> dict[str, Any]:
        from vlaunch.cache.client.connection import CacheClient
        from vlaunch.cache.contract.sockdir import socket_path

        c = CacheClient(socket_path(self.sockdir, 0))
        try:
            return c.status()
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(120)
        shutil.rmtree(self.sockdir, ignore_errors=True)


def child(spec: dict[str, Any], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run one measurement in a fresh process; its stderr goes to `log`."""
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    with open(log, "a") as fh:
        fh.write(f"--- {spec['kind']} {spec.get('mode', '')} rc={r.returncode}\n{r.stderr}"
                 + "".join(ln + "\n" for ln in lines))
    if r.returncode or not lines:
        raise RuntimeError(f"child {spec['kind']} {spec.get('mode', '')} failed "
                           f"(rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def gpu_mem_used() -> str:
    """nvidia-smi's memory.used, or '?'."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0]
    return "?"


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dir", help="where the checkpoint lives (default: /tmp/vlaunch-bench)")
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-release-reps", type=int, default=5)
    ap.add_argument("--profile-procs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="cache reader threads")
    ap.add_argument("--d2d-gib", type=float, default=16.0)
    ap.add_argument("--baseline-cache", help="a directory holding vlaunch/cache of other (older) "
                    "code: its client side is measured too, against the same cache process")
    ap.add_argument("--baseline-reps", type=int, default=3)
    ap.add_argument("--json", help="write every raw number here")
    ap.add_argument("--logs", help="directory for the cache and child logs (default: a tmp dir)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, same tensor count")
    args = ap.parse_args()

    env = ensure_importable()
    benv = None
    if args.baseline_cache:
        benv = dict(env, PYTHONPATH=str(Path(args.baseline_cache).resolve()))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="vlaunch-bench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    clog = logs / "children.log"
    res: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                               timespec="seconds"),
                           "host": platform.node(), "python": platform.python_version()}
    print(f"# {res['command']}\n# {res['date']} python {res['python']}", flush=True)

    root = pick_dir(args.dir, 0 if args.small else int(args.gib * GiB * 1.1))
    model, wrote = make_ckpt(root, args.gib, args.device, args.small, env)
    from vlaunch.cache.store.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    files = [str(f) for f in ckpt.files]
    res["checkpoint"] = {"path": str(model), "files": len(files), "tensors": len(ckpt.tensors),
                         "bytes": ckpt.nbytes, "prepare_s": wrote}
    print(f"checkpoint {model}: {len(ckpt.tensors)} tensors, {ckpt.nbytes / GiB:.2f} GiB in "
          f"{len(files)} files (ready in {wrote:.1f} s)", flush=True)
    largest = sorted(ckpt.tensors.values(), key=lambda e: -e.nbytes)
    check_names = [largest[0].name, largest[-1].name, largest[len(largest) // 2].name]

    # -- first load of a cache rank, after trying to drop the page cache
    res["page_cache"] = drop_page_cache(files)
    print(f"page cache: {res['page_cache']}; GPU memory used before: {gpu_mem_used()}",
          flush=True)
    cache = Cache(str(model), args.device, logs / "cache-main.log", env, args.threads)
    res["first_load"] = {"ready_s": cache.ready_s, "load_s": cache.load_s, "gbps": cache.rate,
                         "gb": cache.gb, "slabs": cache.slabs, "tensors": cache.tensors}
    print(f"cache first load: {cache.load_s:.2f} s, {cache.rate:.2f} GB/s ({cache.gb:.2f} GB, "
          f"{cache.slabs} slab(s)); start to ready {cache.ready_s:.2f} s; GPU memory used: "
          f"{gpu_mem_used()}", flush=True)

    base = {"device": args.device, "model": str(model), "files": files}
    vl = dict(base, kind="vlaunch", socket_dir=cache.sockdir)
    runs: dict[str, list[dict[str, Any]]] = {}
    warm_loads: list[dict[str, Any]] = []
    released: list[dict[str, Any]] = []
    res["runs"], res["warm_first_loads"], res["released"] = runs, warm_loads, released

    def save() -> None:  # after every step: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    def series(name: str, spec: dict[str, Any], reps: int, env_: dict[str, str],
               check_first: bool = True) -> None:
        runs[name] = []
        for i in range(reps):
            runs[name].append(child(dict(spec, check=check_names if i == 0 and check_first
                                         else None), env_, clog))
            save()
        print(f"{name}: " + " ".join(fmt_s(r["seconds"]) for r in runs[name]), flush=True)

    try:
        child(dict(base, kind="safetensors"), env, clog)  # warms the page cache
        series("safetensors warm", dict(base, kind="safetensors"), args.reps, env, False)
        series("share", dict(vl, mode="share"), args.reps, env)
        series("copy", dict(vl, mode="copy"), args.reps, env)
        if benv:
            series("share (baseline)", dict(vl, mode="share"), args.baseline_reps, benv)
            series("copy (baseline)", dict(vl, mode="copy"), args.baseline_reps, benv)
        prof = dict(vl, kind="profile", loads=2)
        runs["profile share"] = [child(dict(prof, mode="share"), env, clog)
                                 for _ in range(args.profile_procs)]
        runs["profile copy"] = [child(dict(prof, mode="copy", loads=1), env, clog)]
        if benv:
            runs["profile share (baseline)"] = [child(dict(prof, mode="share"), benv, clog)
                                                for _ in range(max(1, args.profile_procs - 1))]
        save()
        res["status_after"] = {k: v for k, v in cache.status().items()
                               if k in ("state", "bytes_held", "tensors", "slabs")}
    finally:
        cache.stop()
    runs["d2d"] = [child(dict(base, kind="d2d", bytes=int(args.d2d_gib * GiB),
                              reps=args.reps), env, clog)]
    print("d2d: " + " ".join(fmt_s(s) for s in runs["d2d"][0]["copy_s"]), flush=True)
    save()

    # -- copy-release: a fresh cache per repetition (the cache is empty afterwards)
    runs["copy-release"] = []
    for i in range(args.copy_release_reps):
        c = Cache(str(model), args.device, logs / f"cache-cr{i}.log", env, args.threads)
        try:
            warm_loads.append({"load_s": c.load_s, "gbps": c.rate, "ready_s": c.ready_s})
            used_before = gpu_mem_used()
            runs["copy-release"].append(child(dict(vl, mode="copy-release",
                                                   socket_dir=c.sockdir,
                                                   check=check_names if i == 0 else None),
                                              env, clog))
            st = c.status()
            released.append({"state": st["state"], "bytes_held": st["bytes_held"],
                             "gpu_used_with_cache": used_before,
                             "gpu_used_after_release": gpu_mem_used()})
            save()
        finally:
            c.stop()
    print("copy-release: " + " ".join(fmt_s(r["seconds"]) for r in runs["copy-release"]),
          flush=True)
    save()
    report(res, args)
    save()
    return 0


def print_profile(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Exclusive ms per step: this code's 1st and 2nd load in a process, and the baseline's."""
    cols = [("profile share", 0, "1st load"), ("profile share", 1, "2nd load"),
            ("profile share (baseline)", 0, "baseline 1st")]
    cols = [c for c in cols if c[0] in runs]
    labels: list[str] = []
    for name, _, _ in cols:
        for p in runs[name]:
            for ld in p["loads"]:
                labels += [r[0] for r in ld["rows"] if r[0] not in labels]

    def cell(name: str, which: int, label: str, field: int = 3) -> float:
        vals = []
        for p in runs[name]:
            rows = {r[0]: r for r in p["loads"][which]["rows"]}
            vals.append(rows[label][field] if label in rows else 0.0)
        return med(vals)

    n = len(runs["profile share"])
    print(f"\n## profile of the share path: exclusive ms per step, median over {n} fresh "
          "processes (baseline: the --baseline-cache client code)")
    print(f"{'step':60} {'calls':>5}" + "".join(f" {c[2]:>12}" for c in cols))
    lazy = [med([p["lazy_imports_s"] for p in runs[c[0]]]) if c[1] == 0 else 0.0 for c in cols]
    print(f"{'module imports load() does itself (pre-imported here)':60} {'':>5}"
          + "".join(f" {x * 1e3:12.3f}" for x in lazy))
    for label in labels:
        calls = max(int(cell(c[0], c[1], label, 1)) for c in cols)
        print(f"{label:60} {calls:5d}" + "".join(f" {cell(c[0], c[1], label) * 1e3:12.3f}"
                                                 for c in cols))
    for key, what in (("minor_faults", "minor page faults during the load"),
                      ("gc_s", "of which: garbage collection (ms)")):
        vals = [med([p["loads"][c[1]].get(key, 0) for p in runs[c[0]]]) for c in cols]
        scale = 1e3 if key == "gc_s" else 1
        print(f"{what:60} {'':>5}" + "".join(f" {v * scale:12.3f}" for v in vals))
    tot = [med([p["loads"][c[1]]["total"] for p in runs[c[0]]]) for c in cols]
    print(f"{'total (profiled load + sync)':60} {'':>5}" + "".join(f" {x * 1e3:12.3f}"
                                                                  for x in tot))
    print(f"{'total + those module imports':60} {'':>5}"
          + "".join(f" {(x + y) * 1e3:12.3f}" for x, y in zip(tot, lazy, strict=True)))
    pc = runs["profile copy"][0]["loads"][0]
    print("\n## profile of the copy path (one fresh process; exclusive ms, steps > 0.05 ms)")
    for r in pc["rows"]:
        if r[3] > 5e-5:
            print(f"{r[0]:60} {r[1]:5d} {r[3] * 1e3:12.3f}")
    print(f"{'total':60} {'':5} {pc['total'] * 1e3:12.3f}")


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    runs = res["runs"]
    nbytes = runs["share"][0]["bytes"]
    d2d = runs["d2d"][0]
    d2d_n = int(args.d2d_gib * GiB)
    d2d_s = med(d2d["copy_s"])
    d2d_rw = 2 * d2d_n / d2d_s  # bytes read + written per second
    clone_rw = 2 * d2d_n / d2d["clone_first_s"]

    def m(name: str) -> float:
        return med([r["seconds"] for r in runs[name]])

    st, share, copy, crel = m("safetensors warm"), m("share"), m("copy"), m("copy-release")

    def bw(s: float) -> str:
        return f"{2 * nbytes / s / 1e12:.2f} TB/s r+w ({nbytes / s / 1e12:.2f} copied)"

    first = res["first_load"]
    warm = res["warm_first_loads"]
    res["summary"] = s = {"share_s": share, "copy_s": copy, "copy_release_s": crel,
                          "safetensors_warm_s": st, "d2d_s": d2d_s, "d2d_rw_Bps": d2d_rw,
                          "share_ratio": st / share, "copy_frac": (2 * nbytes / copy) / d2d_rw,
                          "copy_release_frac": (2 * nbytes / crel) / d2d_rw}
    n, ncr = args.reps, len(runs["copy-release"])
    imp = med([r["import_s"] for r in runs["share"]])
    rows = [
        (f"share handoff (connect->usable), median of {n}", fmt_s(share),
         f"safetensors warm {fmt_s(st)}", f"{s['share_ratio']:.0f}x",
         "<=5 ms and >=400x", "PASS" if share <= 5e-3 and s["share_ratio"] >= 400 else "MISS"),
        (f"copy handoff, median of {n}", f"{fmt_s(copy)} = {bw(copy)}",
         f"D2D copy_ {fmt_s(d2d_s)} = {d2d_rw / 1e12:.2f} TB/s r+w "
         f"({d2d_rw / 2e12:.2f} copied)", f"{s['copy_frac'] * 100:.0f}%", ">=80% of D2D",
         "PASS" if s["copy_frac"] >= 0.8 else "MISS"),
        (f"copy-release handoff, median of {ncr} (fresh cache each)",
         f"{fmt_s(crel)} = {bw(crel)}", f"D2D {d2d_rw / 1e12:.2f} TB/s r+w",
         f"{s['copy_release_frac'] * 100:.0f}%", "(info)", ""),
        ("copy vs a fresh process's first clone (alloc + copy)", fmt_s(copy),
         f"clone {fmt_s(d2d['clone_first_s'])} = {clone_rw / 1e12:.2f} TB/s r+w",
         f"{(2 * nbytes / copy) / clone_rw * 100:.0f}%", "(info)", ""),
        ("cache first load (page cache: see above)", f"{first['load_s']:.2f} s, "
         f"{first['gbps']:.2f} GB/s", f"safetensors warm {st:.2f} s, "
         f"{nbytes / st / 1e9:.2f} GB/s", f"{st / first['load_s']:.2f}x", "(info)", ""),
        (f"cache load, page cache warm, median of {len(warm)}",
         f"{med([w['load_s'] for w in warm]):.2f} s, "
         f"{med([w['gbps'] for w in warm]):.2f} GB/s",
         f"safetensors warm {nbytes / st / 1e9:.2f} GB/s",
         f"{st / med([w['load_s'] for w in warm]):.2f}x", "(info)", ""),
        ("cache process start -> ready (first / warm median)", f"{first['ready_s']:.2f} s / "
         f"{med([w['ready_s'] for w in warm]):.2f} s", "", "", "(info)", ""),
        ("import vlaunch.cache.client.loader (engine start, untimed above)", fmt_s(imp), "", "",
         "(info)", ""),
        ("fresh process: import torch + CUDA init (median)",
         fmt_s(med([r["torch_cuda_init_s"] for r in runs["share"]])), "", "", "(floor)", ""),
    ]
    if "share (baseline)" in runs:
        bs, bc = m("share (baseline)"), m("copy (baseline)")
        bimp = med([r["import_s"] for r in runs["share (baseline)"]])
        nb = len(runs["share (baseline)"])
        rows[2:2] = [
            (f"  before the fix: share, median of {nb}", fmt_s(bs), f"safetensors warm "
             f"{fmt_s(st)}", f"{st / bs:.0f}x", "<=5 ms and >=400x",
             "PASS" if bs <= 5e-3 and st / bs >= 400 else "MISS"),
            (f"  before the fix: copy, median of {nb}", f"{fmt_s(bc)} = {bw(bc)}",
             f"D2D {d2d_rw / 1e12:.2f} TB/s r+w", f"{(2 * nbytes / bc) / d2d_rw * 100:.0f}%",
             ">=80% of D2D", "PASS" if (2 * nbytes / bc) / d2d_rw >= 0.8 else "MISS"),
        ]
        rows.append(("  before the fix: import vlaunch.cache.client.loader", fmt_s(bimp), "", "",
                     "(info)", ""))
    print_profile(runs)
    print("\n## copy-release: cache state after each handoff")
    for r in res["released"]:
        print(f"  state={r['state']} bytes_held={r['bytes_held']} GPU used with cache "
              f"{r['gpu_used_with_cache']} -> after release {r['gpu_used_after_release']}")
    pre = runs["share"][0].get("preloaded", {})
    print(f"  after `import torch` + CUDA init, already imported: {pre}")
    dev = d2d.get("device_name", args.device)
    print(f"\n## weight handoff on {dev} (torch {d2d['torch']}, CUDA {d2d['cuda']}); "
          f"{res['checkpoint']['tensors']} tensors, {nbytes / GiB:.2f} GiB bf16 in "
          f"{res['checkpoint']['files']} shards; page cache before the first load: "
          f"{res['page_cache']}")
    print("copy bandwidth = 2 x bytes / (connect -> synchronized): bytes read + written, as "
          "the D2D figure (torch copy_ of 16 GiB into a preallocated tensor, median of "
          f"{len(d2d['copy_s'])}, wall clock with synchronize; CUDA-event median "
          f"{fmt_s(med(d2d['copy_event_s'])) if d2d['copy_event_s'] else 'n/a'}); "
          f"first 16 GiB allocation in a fresh process {fmt_s(d2d['alloc_first_s'])}")
    w = [max(len(str(r[i])) for r in rows) for i in range(6)]
    head = ("figure", "vlaunch", "baseline", "ratio", "target", "verdict")
    print(" | ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("-|-".join("-" * x for x in w))
    for r in rows:
        print(" | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))


if __name__ == "__main__":
    sys.exit(main())
