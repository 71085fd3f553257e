"""The launcher <-> rank <-> engine contract: one definition, read the same way at both ends."""

from __future__ import annotations

import pytest

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.launch import DEFAULT_PLAN, EngineEnv, RankArgs
from vlaunch.cache.store.ranks import Position
from vlaunch.cache.store.target import Target


def test_rank_args_survive_their_command_line_and_keep_the_token_off_it() -> None:
    args = RankArgs(model="/m", rank=3, tensor_parallel_size=2, pipeline_parallel_size=2,
                    plan="replicate", checksum=False, seed_fallback=True, seed_token="secret",
                    ready_fd=7)
    argv = args.to_argv()
    assert "secret" not in " ".join(argv) and args.secret_env() == {"VLAUNCH_SEED_TOKEN": "secret"}
    assert RankArgs.parse(argv) == RankArgs(**{**vars(args), "seed_token": ""})


def test_every_rank_option_is_spelled_out_so_no_inherited_variable_changes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAUNCH_PLAN", "replicate")
    monkeypatch.setenv("VLAUNCH_THREADS", "1")
    assert RankArgs.parse(["--model", "/m"]).plan == "replicate"  # `vlaunch cache` reads it
    assert RankArgs.parse(RankArgs(model="/m").to_argv()) == RankArgs(model="/m")


def test_a_bad_rank_option_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="tensor-parallel-size"):
        RankArgs.parse(["--model", "/m", "--tensor-parallel-size", "0"])


def test_the_engine_environment_round_trips_and_names_a_malformed_variable() -> None:
    env = EngineEnv(model="/m", socket_dir="/s", tensor_parallel_size=2, ranks=(0, 1),
                    device="cuda", engine_devices=("cuda:GPU-a", "cuda:GPU-b"),
                    plan="replicate", attempt=3, preload=True)
    assert EngineEnv.from_env(env.to_env()) == env
    assert EngineEnv.from_env({}) == EngineEnv() and EngineEnv().plan_or_default == DEFAULT_PLAN
    with pytest.raises(UsageError, match="VLAUNCH_TENSOR_PARALLEL_SIZE='two'"):
        EngineEnv.from_env({"VLAUNCH_TENSOR_PARALLEL_SIZE": "two"})


def test_load_takes_what_the_caller_leaves_out_from_the_launcher_and_explicit_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in EngineEnv(model="/m", tensor_parallel_size=4, pipeline_parallel_size=2,
                                plan="replicate", kernel_backends="fi").to_env().items():
        monkeypatch.setenv(key, value)
    got = Target.resolve(device="cpu")
    assert (got.model, got.position, got.plan, got.kernel_backends) == (
        "/m", Position(4, 0, 2, 0), "replicate", "fi")
    got = Target.resolve("/x", tensor_parallel_size=1, pipeline_parallel_size=1,
                         data_parallel_size=1, plan="llama", kernel_backends="", device="cpu")
    assert (got.model, got.position, got.plan, got.kernel_backends) == (
        "/x", Position(1, 0), "llama", "")


def test_a_target_is_resolved_once_and_refuses_what_it_does_not_know(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("VLAUNCH_SOCKET_DIR", str(tmp_path))
    monkeypatch.setenv("VLAUNCH_QUANTIZATION", "fp8")
    target = Target.resolve("/m", rank=3, tensor_parallel_size=2, pipeline_parallel_size=2,
                            device="cpu")
    assert target.position == Position.from_global(3, 2, 2) and target.rank == 3
    assert target.socket == tmp_path / "rank-3.sock" and target.quantization == "fp8"
    assert Target.resolve("/m", quantization="awq", device="cpu").quantization == "awq"
    with pytest.raises(TypeError, match="tensor_parallel"):
        Target.resolve("/m", tensor_parallel=2)  # type: ignore[call-arg]
    from vlaunch.cache.store.target import as_target

    assert as_target(target, {}) is target
    with pytest.raises(TypeError, match="not both"):
        as_target(target, {"rank": 1})


def test_every_component_defaults_to_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """vlaunch run, vlaunch cache, load() and the vLLM load format, outside vlaunch run."""
    from vlaunch.cache.integrations.kit import LoaderOptions
    from vlaunch.launcher.cli import run

    monkeypatch.delenv("VLAUNCH_PLAN", raising=False)
    launcher = next(p.default for p in run.params if p.name == "plan")
    rank = RankArgs(model="/m", socket_dir="/s", rank=0).plan
    engine = Target.resolve("/m", device="cpu").plan
    vllm = Target.resolve("/m", plan=LoaderOptions().plan or None, device="cpu").plan
    assert launcher == rank == engine == vllm == DEFAULT_PLAN


def test_load_without_a_model_anywhere_says_how_to_give_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLAUNCH_MODEL", raising=False)
    with pytest.raises(UsageError, match="load\\(\\) has no model"):
        Target.resolve(device="cpu")


def test_the_reference_engine_reads_the_same_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from vlaunch.cache.reference.options import ConfigError, parse_args

    for key, value in EngineEnv(model="/m", tensor_parallel_size=2, socket_dir="/s",
                                device="cpu").to_env().items():
        monkeypatch.setenv(key, value)
    opts = parse_args([])
    assert (opts.model, opts.tp_size, opts.socket_dir, opts.device) == ("/m", 2, "/s", "cpu")
    assert parse_args(["--model", "/x", "--tensor-parallel-size", "1"]).tp_size == 1
    monkeypatch.setenv("VLAUNCH_TENSOR_PARALLEL_SIZE", "-1")
    with pytest.raises(ConfigError, match="VLAUNCH_TENSOR_PARALLEL_SIZE"):
        parse_args([])


def test_the_target_arguments_the_type_checker_sees_are_those_resolve_takes() -> None:
    """TargetArgs is defined for type checkers only; ARGS names the same keys at run time."""
    import ast
    from pathlib import Path

    from vlaunch.cache.store import target

    tree = ast.parse(Path(target.__file__).read_text())
    typed = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                 and n.name == "TargetArgs")
    keys = tuple(s.target.id for s in typed.body if isinstance(s, ast.AnnAssign))
    assert keys == target.ARGS
