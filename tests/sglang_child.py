"""Run by tests/test_sglang.py in SGLang's venv (VLAUNCH_SGLANG_PYTHON): real SGLang, CPU.

    sglang_child.py make DIR                  a tiny Qwen2 checkpoint (transformers, bf16)
    sglang_child.py compare DIR [--mode M]    SGLang's default loader, then vlaunch's twice
                                              (raw layout + hand-back, then the engine
                                              layout); prints RESULT {json}

Each load is SGLang's own dispatch: `get_model_loader(LoadConfig(load_format=...))` then
`load_model(model_config=..., device_config=...)`, in one process whose parallel runtime is
set up as SGLang's one-batch benchmark does (tensor-parallel size 1, gloo on CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def make(root: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root)


def runtime(root: Path) -> tuple[object, object]:
    """SGLang's process-wide runtime for one CPU rank; its ModelConfig and DeviceConfig."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=str(root), device="cpu", skip_tokenizer_init=True,
                      dtype="bfloat16")
    args.resolve_once()
    publish(args, role="scheduler", ranks=SpawnRanks(
        world_rank=spawn_world_rank(args, tp_rank=0, pp_rank=0), gpu_id=0))
    model_config = ModelConfig.from_server_args(args)
    bootstrap.init_parallel_runtime(server_args=args, device=get_device().device,
                                    dist_port=PortArgs.init_new(args).nccl_port)
    bootstrap.init_layer_runtime(model_config=model_config)
    return model_config, DeviceConfig("cpu")


def loaded(load_format: object, model_config: object, device_config: object,
           extra: dict[str, object]) -> torch.nn.Module:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    config = LoadConfig(load_format=load_format, model_loader_extra_config=extra)
    loader = get_model_loader(config, model_config)
    return loader.load_model(model_config=model_config, device_config=device_config)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def differ(ref: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Names whose dtype, shape or bytes differ from the reference (or that either lacks)."""
    got = dict(model.named_parameters())
    out = sorted(set(ref) ^ set(got))
    for name in set(ref) & set(got):
        a, b = ref[name], got[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            out.append(name)
    return out


def compare(root: Path, mode: str) -> dict[str, object]:
    from vlaunch.cache.integrations.sglang_loader import loader_class

    model_config, device_config = runtime(root)
    default = loaded("auto", model_config, device_config, {})
    ref = {n: p.detach().clone() for n, p in default.named_parameters()}
    del default
    vlaunch = loader_class()
    out: dict[str, object] = {"parameters": len(ref), "names": sorted(ref)}
    for run in ("first", "second"):
        model = loaded(vlaunch, model_config, device_config, {"mode": mode, "fallback": False})
        out[run] = {"differ": differ(ref, model),
                    "mapped": sum(_is_mapped(p) for p in model.parameters())}
        del model
    return out


def _is_mapped(p: torch.Tensor) -> bool:
    """True for a tensor over a cache's slab (a memfd this process mapped)."""
    addr = p.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, rest = line.partition(" ")
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return "memfd:" in rest
    return False


def main() -> None:
    what, root = sys.argv[1], Path(sys.argv[2])
    if what == "make":
        make(root)
        return
    mode = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "share"
    print("RESULT " + json.dumps(compare(root, mode)), flush=True)


if __name__ == "__main__":
    main()
