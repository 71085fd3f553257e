"""The multi-node recipe run on one machine: docs/examples/lws-tp8-pp2.yaml's node command,
scaled down to TP 2 x PP 2 on the CPU, for two replicas of two "nodes", each node a network
namespace joined to the other by a veth pair (distinct loopback addresses where namespaces
cannot be made). The second replica seeds every rank across the link from the first."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from vlaunch.cache import load
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path

from .conftest import eventually

RECIPE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "lws-tp8-pp2.yaml"
TOKEN = "n" * 32


def node_script() -> str:
    """The recipe's node command, as its ConfigMap holds it."""
    docs = list(yaml.safe_load_all(RECIPE.read_text()))
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]["node.sh"]


class Nodes:
    """Two nodes: network namespaces joined by a veth pair, or loopback addresses."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.names = [f"vl{tag}n0", f"vl{tag}n1"]
        self.addresses = [f"10.231.{tag % 250}.1", f"10.231.{tag % 250}.2"]
        self.namespaces = self._make(tag)
        if not self.namespaces:
            self.addresses = ["127.0.0.2", "127.0.0.3"]

    def _make(self, tag: int) -> bool:
        if os.geteuid() != 0 or not shutil.which("ip"):
            return False
        a, b = self.names
        steps = [["netns", "add", a], ["netns", "add", b],
                 ["link", "add", f"vl{tag}a", "type", "veth", "peer", "name", f"vl{tag}b"],
                 ["link", "set", f"vl{tag}a", "netns", a],
                 ["link", "set", f"vl{tag}b", "netns", b]]
        for ns, dev, addr in ((a, f"vl{tag}a", self.addresses[0]),
                              (b, f"vl{tag}b", self.addresses[1])):
            steps += [["-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                      ["-n", ns, "link", "set", dev, "up"], ["-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            if subprocess.run(["ip", *step], capture_output=True).returncode:
                self.close()
                return False
        return True

    def prefix(self, node: int) -> list[str]:
        """What runs a command on `node`."""
        return ["ip", "netns", "exec", self.names[node]] if self.namespaces else []

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    made = Nodes()
    yield made
    if made.namespaces:
        made.close()


def start(nodes: Nodes, where: int, group: int, index: int, model: Path, tmp: Path,
          seed_from: int | None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """One pod of the recipe: replica `group`, node `index`, run on machine `where`."""
    sockets, log = tmp / f"g{group}n{index}", tmp / f"g{group}n{index}.log"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "MODEL": str(model), "TP": "2", "PP": "2", "DEVICE": "cpu", "SEED_PORT": "29400",
           "LWS_NAME": "llama", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index),
           "GROUP_INDEX": str(group), "POD_IP": nodes.addresses[where],
           "SOCKET_DIR": str(sockets), "HEALTH_HOST": "127.0.0.1", "HEALTH_PORT": "0",
           "VLAUNCH_SEED_TOKEN": TOKEN}
    if seed_from is not None:
        env["SEED_HOST"] = nodes.addresses[seed_from]  # no cluster DNS here
    proc = subprocess.Popen([*nodes.prefix(where), "sh", "-c", node_script(), "node.sh"],
                            env=env, stderr=log.open("wb"), stdout=subprocess.DEVNULL)
    return proc, sockets, log


def serving(proc: subprocess.Popen[bytes], sockets: Path, ranks: range, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"node exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return all(os.path.exists(socket_path(sockets, r)) for r in ranks)


def tensors(sockets: Path, model: Path, rank: int) -> dict[str, torch.Tensor]:
    return dict(load(str(model), rank=rank, tensor_parallel_size=2, pipeline_parallel_size=2,
                     socket_dir=str(sockets), mode="copy", fallback=False, timeout=10,
                     device="cpu"))


@pytest.mark.slow
def test_the_recipe_on_two_nodes_seeds_the_second_replica_across_the_link(
        nodes: Nodes, llama_ckpt: Path, tmp_path: Path) -> None:
    pods: dict[tuple[int, int], tuple[subprocess.Popen[bytes], Path, Path]] = {}
    try:
        # replica 0: node 0 on machine 0, node 1 on machine 1, from disk
        for index in (0, 1):
            pods[0, index] = start(nodes, index, 0, index, llama_ckpt, tmp_path, None)
        # replica 1 on the other machines: each node seeds from its peer across the link
        for (_, index), (proc, sockets, log) in list(pods.items()):
            eventually(lambda p=proc, s=sockets, i=index, g=log: serving(
                p, s, range(2 * i, 2 * i + 2), g), 120, what="replica 0 serving")
        for index in (0, 1):
            pods[1, index] = start(nodes, 1 - index, 1, index, llama_ckpt, tmp_path, index)
        for index in (0, 1):
            proc, sockets, log = pods[1, index]
            eventually(lambda p=proc, s=sockets, i=index, g=log: serving(
                p, s, range(2 * i, 2 * i + 2), g), 120, what="replica 1 serving")
        for rank in range(4):
            node = rank // 2
            want, got = (tensors(pods[g, node][1], llama_ckpt, rank) for g in (0, 1))
            assert set(got) == set(want)
            for name, ref in want.items():
                assert got[name].view(torch.uint8).equal(ref.view(torch.uint8)), (rank, name)
        for index in (0, 1):
            text = pods[1, index][2].read_text()
            assert text.count("seeded ") == 2 and "loading from disk instead" not in text, text
            peer = nodes.addresses[1 - index]  # replica 1's node `index` runs there
            assert f"seed client ('{peer}'" in pods[0, index][2].read_text()
        # a dead rank ends its own node's launcher (69); the other node's keeps serving: in
        # the cluster, the group's restart policy recreates both pods
        ranks = [c for c in psutil.Process(pods[1, 1][0].pid).children()
                 if "vlaunch.cache" in " ".join(c.cmdline())]
        assert len(ranks) == 2
        ranks[0].send_signal(signal.SIGKILL)
        assert pods[1, 1][0].wait(60) == ExitStatus.RANK_EXITED
        assert pods[1, 0][0].poll() is None
        assert tensors(pods[1, 0][1], llama_ckpt, 0)
    finally:
        for proc, _, _ in pods.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc, _, _ in pods.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
