"""The reference engine's tensor-parallel backend (issue 30, item 6): nccl on distinct GPUs,
gloo on the CPU or where two ranks share a GPU (NCCL refuses them), a clear configuration
error where the requested backend cannot work."""

from __future__ import annotations

import pytest

from vlaunch.cache.reference.backend import choose_backend, shared_devices
from vlaunch.cache.reference.options import ConfigError


def test_distinct_gpus_use_nccl() -> None:
    assert choose_backend(["cuda:0", "cuda:1"]).backend == "nccl"
    assert choose_backend(["cuda:0", "cuda:1"], "nccl").backend == "nccl"
    assert choose_backend(["cuda:3", "cuda:1", "cuda:0", "cuda:2"]).backend == "nccl"


def test_ranks_on_one_gpu_use_gloo_and_say_why() -> None:
    choice = choose_backend(["cuda:0", "cuda:0"])
    assert choice.backend == "gloo"
    assert choice.reason.startswith("ranks 0 and 1 share cuda:0, and NCCL refuses")
    # one pair is enough, even among distinct ones
    assert choose_backend(["cuda:0", "cuda:1", "cuda:1", "cuda:2"]).backend == "gloo"
    assert shared_devices(["cuda:0", "cuda:1", "cuda:1", "cuda:0", "cuda:2"]) == {
        "cuda:0": [0, 3], "cuda:1": [1, 2]}


def test_cpu_ranks_use_gloo() -> None:
    assert choose_backend(["cpu", "cpu"]) == choose_backend(["cpu", "cpu"], "gloo")
    assert choose_backend(["cpu", "cpu"]).backend == "gloo"
    assert shared_devices(["cpu", "cpu"]) == {}


def test_gloo_on_request() -> None:
    assert choose_backend(["cuda:0", "cuda:1"], "gloo").backend == "gloo"


def test_backends_that_cannot_work_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="ranks 0 and 1 share cuda:0, and NCCL refuses two "
                                          "ranks of one group on one GPU"):
        choose_backend(["cuda:0", "cuda:0"], "nccl")
    with pytest.raises(ConfigError, match="--tp-backend nccl needs CUDA devices"):
        choose_backend(["cpu", "cpu"], "nccl")
    with pytest.raises(ConfigError, match="mix CPU and CUDA"):
        choose_backend(["cpu", "cuda:0"])
    with pytest.raises(ConfigError, match="--tp-backend must be one of auto, nccl, gloo"):
        choose_backend(["cpu", "cpu"], "mpi")
