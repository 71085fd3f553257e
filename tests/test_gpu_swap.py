"""`vlaunch swap` and a published version on one CUDA GPU (docs/swap.md): a caches-only
launcher at TP 2 (both ranks on GPU 0) swapped double-buffered, in place (pinned staging,
host-to-device copy into the served VMM slabs) and back, then a version published device to
device; after each, a share-mode load equals the checkpoint's bytes. Run with `pytest -m gpu`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vlaunch.cache.contract.exitcodes import ExitStatus  # noqa: E402
from vlaunch.cache.reference.refmodel import make_checkpoint  # noqa: E402

from .test_launcher import launch, serving  # noqa: E402,F401  (launch is a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 512,
         "vocab": 1024}
CHECK = r"""
import json, sys, torch
import vlaunch.cache as vc
from vlaunch.cache.client.loader import load_from_disk
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target
served, files, sockdir = sys.argv[1:4]
out = []
for rank in (0, 1):
    w = vc.load(served, rank=rank, tensor_parallel_size=2, socket_dir=sockdir,
                fallback=False, device="cuda:0")
    disk = load_from_disk(Target(files, Position.from_global(rank, 2), "cpu"))
    out.append(w.source == "cache" and all(torch.equal(w[k].cpu(), disk[k]) for k in disk))
print(json.dumps(out))
"""
PUBLISH = r"""
import sys, torch
import vlaunch.cache as vc
from vlaunch.cache.client.loader import load_from_disk
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target
files, sockdir, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
shard = {k: v.to("cuda:0") for k, v in
         load_from_disk(Target(files, Position.from_global(rank, 2), "cpu")).items()}
print(vc.publish(shard, label="step-1", rank=rank, socket_dir=sockdir, mode="double",
                 device="cuda:0", margin_gib=0))
"""


def _check(la, served: Path, files: Path, env: dict[str, str] | None = None) -> list[bool]:
    r = subprocess.run([sys.executable, "-c", CHECK, str(served), str(files), str(la.sockdir)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _swap(la, model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap", "--socket-dir",
                           str(la.sockdir), "--model", str(model), *args],
                          capture_output=True, text=True, timeout=600)


def test_swaps_and_a_publish_on_one_gpu(launch, tmp_path: Path) -> None:  # noqa: F811
    a = make_checkpoint(tmp_path / "a", seed=0, **SHAPE)
    b = make_checkpoint(tmp_path / "b", seed=1, **SHAPE)
    la = launch(a, "--device", "cuda", "--devices", "0,0", "--stop-timeout", "30", tp=2)
    la.wait_for(serving, timeout=300)
    assert _check(la, a, a) == [True, True]
    for model, mode in ((b, "double"), (a, "in-place"), (b, "in-place"), (a, "double")):
        r = _swap(la, model, "--mode", mode, "--margin-gib", "0")
        assert r.returncode == 0, r.stderr + la.text()
        assert _check(la, model, model) == [True, True], mode
    trainers = [subprocess.Popen([sys.executable, "-c", PUBLISH, str(b), str(la.sockdir),
                                  str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for rank in (0, 1)]
    for t in trainers:
        out, err = t.communicate(timeout=300)
        assert t.returncode == 0 and "version=5" in out, err + la.text()
    snap = la.wait_for(lambda s: s["swap"]["label"] == "step-1" and all(
        (r["checkpoint"] or {}).get("published") for r in s["ranks"].values()))
    identities = ",".join(snap["ranks"][str(r)]["checkpoint"]["identity"] for r in (0, 1))
    env = {"VLAUNCH_CHECKPOINT_DATA": identities, "VLAUNCH_RANKS": "0,1"}
    assert _check(la, a, b, env) == [True, True]  # B's bytes, published device to device
    r = _swap(la, tmp_path / "missing")
    assert r.returncode == ExitStatus.NO_MODEL
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit(120) == 0
