"""The reference engine's tensor-parallel ranks: join the group, load, decode in lock step.

Rank 0 (the engine process) starts ranks 1..N-1 as its children (`--worker-rank r`) before it
imports torch, so that every rank imports torch and loads its weights at the same time. The
ranks meet in a TCPStore whose listening socket rank 0 binds first, then form a
torch.distributed group (backend.py: nccl on distinct GPUs, gloo on the CPU or when two
ranks share a GPU). Rank 0 broadcasts each request to the workers: a header [op, n_tokens,
max_new_tokens] (op 0: stop, 1: generate, then the tokens; 2: warm up, with n_tokens and a
free flag in place of max_new_tokens: warmup.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.lifetime import die_with_parent
from vlaunch.cache.contract.standby import parks_before_weights
from vlaunch.cache.reference import faults
from vlaunch.cache.reference.options import ConfigError, EngineOptions
from vlaunch.cache.reference.state import RankState

if TYPE_CHECKING:
    from vlaunch.cache.reference.config import ModelConfig

log = logging.getLogger("vlaunch.engine")

OP_STOP, OP_GENERATE, OP_WARMUP = 0, 1, 2
STORE_TIMEOUT = datetime.timedelta(seconds=300)
# Workers wait in a broadcast for the next request, however long the engine idles; a dead
# peer is caught by process monitoring (parent-death signal, rank 0's watcher), not by this.
GROUP_TIMEOUT = datetime.timedelta(days=3650)
LAYOUT_WORDS = {"engine": "mapped from the cache", "handed-back": "built and handed back to the "
                "cache", "own": "built, held by the engine alone"}


def reserve_store() -> socket.socket:
    """Rank 0's store socket, listening before any worker starts (workers connect at once;
    the TCPStore takes the socket over once rank 0 has imported torch)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def open_store(opts: EngineOptions, listener: socket.socket | None) -> Any:
    """The TCPStore of this rank: the server over `listener` on rank 0, else a client."""
    import torch.distributed as dist

    if listener is not None:
        port = listener.getsockname()[1]
        return dist.TCPStore("127.0.0.1", port, opts.tp_size, True, timeout=STORE_TIMEOUT,
                             wait_for_workers=False, master_listen_fd=listener.detach())
    return dist.TCPStore("127.0.0.1", opts.store_port, opts.tp_size, False,
                         timeout=STORE_TIMEOUT)


def device_for(kind: str, rank: int, tp_size: int) -> str:
    """The torch device of `rank`: cpu, or the GPU that $VLAUNCH_ENGINE_DEVICES names.

    The launcher lists each rank's cache GPU by UUID (cuda:GPU-...), so an engine whose
    CUDA_VISIBLE_DEVICES orders the GPUs differently still maps each shard on its own GPU.
    """
    if kind == "cpu":
        return "cpu"
    from vlaunch.cache.contract.engine_env import EngineEnv
    from vlaunch.cache.contract.errors import DeviceError
    from vlaunch.cache.store.slabs import cuda_index

    items = EngineEnv.from_env().engine_devices
    raw = ",".join(items)
    if not items:
        return f"cuda:{rank}"
    if len(items) < tp_size:
        raise ConfigError(f"VLAUNCH_ENGINE_DEVICES={raw!r} lists {len(items)} device(s) for "
                          f"{tp_size} rank(s); list one per rank")
    item = items[rank] if items[rank].startswith("cuda") else f"cuda:{items[rank]}"
    try:
        return f"cuda:{cuda_index(item)}"
    except DeviceError as exc:
        raise ConfigError(f"VLAUNCH_ENGINE_DEVICES entry {item!r}: {exc}") from None


def start_rank(opts: EngineOptions, rank: int, cfg: ModelConfig, store: Any,
               before_load: Callable[[], None] | None = None) -> RankState:
    """Join the process group (tp > 1), load the rank's weights and build its model;
    `before_load` runs once the group is up (a standby parked before its weights)."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache.reference.refmodel import SingleRank, TorchDistributed, TPLlama
    from vlaunch.cache.reference.weights import load_weights

    device = device_for(opts.device, rank, opts.tp_size)
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        if torch.device(device).index >= count:
            raise ConfigError(f"rank {rank} needs {device}, but torch sees {count} CUDA "
                              "device(s); set VLAUNCH_ENGINE_DEVICES or CUDA_VISIBLE_DEVICES, "
                              "or use --device cpu")
        torch.cuda.set_device(torch.device(device))
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.tp_size))
    if opts.tp_size > 1:
        dist.init_process_group(group_backend(opts, rank), store=store, rank=rank,
                                world_size=opts.tp_size, timeout=GROUP_TIMEOUT)
    scratch = None
    if before_load is not None:  # an in-place swap's standby: warm up before it parks
        scratch = warm_up_on_scratch(opts, rank, cfg, device)
        before_load()
    start = time.perf_counter()
    loaded = load_weights(opts, rank, device, cfg)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1000
    nbytes = sum(t.nbytes for t in loaded.tensors.values())
    log.info("rank %d: weights from %s in %.1f ms (%.2f GB)", rank, loaded.source, ms,
             nbytes / 1e9)
    log.info("rank %d: engine layout %s", rank, LAYOUT_WORDS[loaded.layout])
    comm = TorchDistributed() if opts.tp_size > 1 else SingleRank()
    model = TPLlama(loaded.tensors, cfg, comm)
    draft = None
    if opts.draft_model:
        from vlaunch.cache.reference.speculative import load_draft

        draft = load_draft(opts, rank, device, comm)
    return RankState(rank=rank, tp_size=opts.tp_size, device=device,
                     comm_device=device if device.startswith("cuda") else "cpu", model=model,
                     weights_ms=ms, source=loaded.source, nbytes=nbytes, layout=loaded.layout,
                     draft=draft, speculative_tokens=opts.speculative_tokens,
                     scratch_warmup=scratch)


def warm_up_on_scratch(opts: EngineOptions, rank: int, cfg: ModelConfig, device: str) -> Any:
    """The warm-up of a standby that parks before its weights, on scratch weights of the
    served shapes (warmup.py), every rank at once; its WarmupReport (None: --warmup-tokens
    0). The scratch goes before it parks; what the passes cached goes too, unless
    --standby-keep-memory."""
    from vlaunch.cache.reference.refmodel import SingleRank, TorchDistributed, TPLlama
    from vlaunch.cache.reference.warmup import give_back, scratch_weights, served_dtype, warm_up

    if opts.warmup_tokens == 0:
        return None
    comm = TorchDistributed() if opts.tp_size > 1 else SingleRank()
    weights = scratch_weights(cfg, opts.tp_size, device, served_dtype(opts.model))
    state = RankState(rank=rank, tp_size=opts.tp_size, device=device,
                      comm_device=device if device.startswith("cuda") else "cpu",
                      model=TPLlama(weights, cfg, comm), weights_ms=0.0, source="scratch",
                      nbytes=sum(t.nbytes for t in {id(t): t for t in weights.values()}.values()))
    log.info("rank %d: warming up on scratch weights (%.2f GB, every layer sharing one "
             "layer's) before parking", rank, state.nbytes / 1e9)
    report = warm_up(state, opts.warmup_tokens, decode, free=False)
    del state, weights
    if not opts.standby_keep_memory:
        give_back(device)
    if device.startswith("cuda"):
        import torch

        log.info("rank %d: scratch weights dropped%s: torch reserved %.2f GB", rank,
                 "" if opts.standby_keep_memory else " and the warm-up's cached blocks given "
                 "back", torch.cuda.memory_reserved(device) / 1e9)
    return report


def group_barrier() -> None:
    """Wait for every rank of the group (without one: return at once)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def group_backend(opts: EngineOptions, rank: int) -> str:
    """The group's backend, from every rank's device (the same on each rank); rank 0 logs it."""
    from vlaunch.cache.reference.backend import choose_backend

    devices = [device_for(opts.device, r, opts.tp_size) for r in range(opts.tp_size)]
    choice = choose_backend(devices, opts.tp_backend)
    if rank == 0:
        log.info("tensor-parallel backend %s (%s)", choice.backend, choice.reason)
    return choice.backend


def gather_stats(state: RankState) -> tuple[float, str, int]:
    """(slowest rank's load ms, source over all ranks, bytes over all ranks)."""
    import torch
    import torch.distributed as dist

    flags = torch.tensor([state.weights_ms, state.source == "disk", state.source == "cache"],
                         dtype=torch.float64, device=state.comm_device)
    nbytes = torch.tensor([state.nbytes], dtype=torch.float64, device=state.comm_device)
    if state.tp_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        dist.all_reduce(nbytes)
    ms, disk, cache = flags.tolist()
    source = "mixed" if disk and cache else "disk" if disk else "cache"
    return ms, source, int(nbytes.item())


def run_generate(state: RankState, tokens: list[int], max_new: int) -> list[int]:
    """Send the request to the workers (tp > 1), then decode it on this rank."""
    import torch
    import torch.distributed as dist

    if state.tp_size > 1:
        dist.broadcast(torch.tensor([OP_GENERATE, len(tokens), max_new], dtype=torch.int64,
                                    device=state.comm_device), src=0)
        dist.broadcast(torch.tensor(tokens, dtype=torch.int64, device=state.comm_device), src=0)
    return decode(state, tokens, max_new)


def decode(state: RankState, tokens: list[int], max_new: int) -> list[int]:
    """This rank's part of greedy decoding: speculative when a draft model is loaded (the
    same tokens; every rank runs the same target passes)."""
    from vlaunch.cache.reference.refmodel import greedy

    if state.draft is None:
        return greedy(state.model, tokens, max_new)
    from vlaunch.cache.reference.speculative import speculative_greedy

    return speculative_greedy(state.model, state.draft, tokens, max_new,
                              state.speculative_tokens)[0]


def run_warmup(state: RankState, n_tokens: int, *, free: bool) -> Any:
    """Tell the workers to warm up (tp > 1), then warm up this rank; its WarmupReport."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache.reference.warmup import warm_up

    if state.tp_size > 1:
        dist.broadcast(torch.tensor([OP_WARMUP, n_tokens, int(free)], dtype=torch.int64,
                                    device=state.comm_device), src=0)
    return warm_up(state, n_tokens, decode, free=free)


def broadcast_stop(state: RankState) -> None:
    """Tell the workers to leave their loop."""
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.tensor([OP_STOP, 0, 0], dtype=torch.int64, device=state.comm_device),
                   src=0)


def run_worker(opts: EngineOptions) -> int:
    """A worker rank: load, then decode what rank 0 broadcasts until op 0."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache.reference.config import ModelConfig
    from vlaunch.cache.reference.memory import gather_memory
    from vlaunch.cache.reference.warmup import warm_up

    _die_with_parent(opts.parent_pid)
    # the launcher signals the whole process group; rank 0 alone decides when workers stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = opts.worker_rank or 0
    cfg = ModelConfig.from_dir(opts.model)
    # a standby parked before its weights: rank 0 waits for its promotion, the workers for
    # rank 0 (then the whole group maps the weights the cache holds by then)
    early = group_barrier if parks_before_weights() else None
    state = start_rank(opts, rank, cfg, open_store(opts, None), before_load=early)
    gather_stats(state)
    gather_memory(state, log_it=True)
    header = torch.empty(3, dtype=torch.int64, device=state.comm_device)
    while True:
        dist.broadcast(header, src=0)
        op, n_tokens, max_new = header.tolist()
        if op == OP_STOP:
            break
        if op == OP_WARMUP:
            warm_up(state, n_tokens, decode, free=bool(max_new))
            gather_memory(state)
            continue
        tokens = torch.empty(n_tokens, dtype=torch.int64, device=state.comm_device)
        dist.broadcast(tokens, src=0)
        if faults.take(rank) == "worker-stall":
            faults.stall_in_collective()
        decode(state, tokens.tolist(), max_new)
        gather_memory(state)  # rank 0 reports every rank's memory after each request
    dist.destroy_process_group()
    log.info("stopped")
    return 0


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when rank 0 dies."""
    die_with_parent()
    if parent_pid and os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        raise RuntimeError(f"rank 0 (pid {parent_pid}) is gone; exiting")
