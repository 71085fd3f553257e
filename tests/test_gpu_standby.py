"""Issue 30 items 5-7 on one CUDA GPU, through the real launcher and the reference engine.

Two ranks on one GPU (`--devices 0,0`) serve through gloo instead of crash-looping on NCCL's
refusal; a warm standby parks with its warm-up done and is promoted; the launcher reports each
child's device memory as NVML counts it (and the GPU's used memory) in /status and /metrics.
Run on a GPU machine with `pytest -m gpu tests/test_gpu_standby.py` (needs nvidia-ml-py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vlaunch.cache.reference.refmodel import make_checkpoint  # noqa: E402

from .conftest import eventually  # noqa: E402
from .test_launcher import launch, serving  # noqa: E402, F401  (launch is a fixture)
from .test_standby import generate  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_tp2_on_one_gpu_warm_standby_and_device_memory(launch, tmp_path: Path) -> None:  # noqa: F811
    pytest.importorskip("pynvml")
    model = make_checkpoint(tmp_path / "m", hidden=1024, layers=4, heads=8, kv_heads=4,
                            intermediate=4096, vocab=4096)
    port_file = tmp_path / "port"
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
              str(port_file), "--device", "cuda"]
    la = launch(model, "--device", "cuda", "--devices", "0,0", "--standby", "--engine-ready",
                "notify", engine=engine, tp=2)
    snap = la.wait_for(lambda s: serving(s) and (s.get("standby") or {}).get("state")
                       == "parked", timeout=300)
    assert snap["engine"]["attempt"] == 1 and snap["engine"]["restarts"] == 0
    text = la.text()
    assert "tensor-parallel backend gloo (ranks 0 and 1 share cuda:0" in text
    assert "NCCL error" not in text
    before = generate(port_file)
    standby_pid = snap["standby"]["pid"]

    # NVML's figures: each rank holds at least its slabs, every child has a figure
    mem = la.wait_for(lambda s: ((s["memory"] or {}).get("standby") or {}).get("pid")
                      == standby_pid, timeout=60)["memory"]
    assert mem["device_absent"] is None
    for slot, rank in snap["ranks"].items():
        assert mem["ranks"][slot]["device_bytes"] >= rank["bytes"]
    assert mem["engine"]["device_bytes"] > 0 and mem["standby"]["device_bytes"] > 0
    (gpu,) = [d for d in mem["devices"] if d["vlaunch_bytes"]]
    held = sum(e["device_bytes"] for e in (*mem["ranks"].values(), mem["engine"],
                                           mem["standby"]))
    assert gpu["vlaunch_bytes"] == held <= gpu["used_bytes"] <= gpu["total_bytes"]
    with urllib.request.urlopen(la.url + "/metrics", timeout=5) as r:
        names = {s.name for f in text_string_to_metric_families(r.read().decode())
                 for s in f.samples}
    assert {"vlaunch_process_device_bytes", "vlaunch_device_used_bytes"} <= names

    # kill -> the warm standby serves the same tokens
    port_file.unlink()
    os.killpg(snap["engine"]["pid"], signal.SIGKILL)
    la.wait_for(lambda s: serving(s) and s["engine"]["pid"] == standby_pid, timeout=60)
    eventually(lambda: port_file.exists() or None, 30, what=la.text)
    assert generate(port_file) == before
    assert la.text().count("warm-up (prefill 8 tokens + 1 decode step)") >= 4
    # the standby gave back what its warm-up left cached before it parked
    url = f"http://127.0.0.1:{port_file.read_text().strip()}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        warm = json.loads(r.read())["warmup"]
    assert warm["freed"] and warm["warm"]["torch_reserved"] > warm["kept"]["torch_reserved"]
    assert warm["warm"]["device_bytes"] > warm["kept"]["device_bytes"]
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
