"""The warm standby (issue 30, item 5): the reference engine warms up before it parks, reading
the cache's mapped weights and writing none of them, and gives back what it need not keep."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from vlaunch.cache.contract.standby import PROMOTE, standby_env
from vlaunch.cache.reference.http import MAX_PROMPT_TOKENS
from vlaunch.cache.reference.options import MAX_WARMUP_TOKENS, ConfigError, parse_args
from vlaunch.cache.reference.refmodel import make_checkpoint
from vlaunch.cache.reference.warmup import dummy_prompt

from .conftest import eventually
from .test_launcher import launch  # noqa: F401  (a fixture)
from .test_standby import generate


def slab_digests(pids: list[int]) -> dict[int, str]:
    """blake2b of every CPU slab (a sealed memfd: cpubacking.py) these processes hold open, by
    inode."""
    out: dict[int, str] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(link)
                if not target.startswith("/memfd:vlaunch-slab"):
                    continue
                inode = os.stat(link).st_ino
                with open(link, "rb") as f:  # reopens the same slab
                    out[inode] = hashlib.file_digest(f, "blake2b").hexdigest()
            except FileNotFoundError:  # an fd closed meanwhile
                continue
    return out


def serving(port_file: Path) -> list[int] | None:
    """generate() once the engine serves (its port file comes before its weights); else None."""
    try:
        return generate(port_file)
    except (OSError, ValueError):
        return None


def stats(port_file: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port_file.read_text().strip()}/stats"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def first_engine(la: Any, model: Path, tmp_path: Path) -> tuple[list[str], list[int], Any]:
    """A first engine against the launcher's cache hands the engine layout back, answers once
    and stops: the engine command, its answer and the engines' log file."""
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--model", str(model),
              "--socket-dir", str(la.sockdir), "--no-fallback"]
    log = (tmp_path / "engines.log").open("ab")
    first = subprocess.Popen([*engine, "--port-file", str(tmp_path / "port1")], stderr=log)
    try:
        expected = eventually(lambda: serving(tmp_path / "port1"), 120,
                              what=lambda: (tmp_path / "engines.log").read_text())
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    return engine, expected, log


def start_standby(engine: list[str], tmp_path: Path, log: Any, **env: str
                  ) -> tuple[subprocess.Popen, socket.socket, int, Path]:
    """A standby of `engine` (its promote pipe and notify socket ours): the process, the
    notify socket, the pipe's write end and its port file."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "standby-notify.sock"))
    notify.settimeout(120)
    read_end, write_end = os.pipe()
    port_file = tmp_path / "port2"
    standby = subprocess.Popen(
        [*engine, "--port-file", str(port_file)], stderr=log, pass_fds=[read_end],
        env={**os.environ, **standby_env(read_end), **env,
             "NOTIFY_SOCKET": str(tmp_path / "standby-notify.sock")})
    os.close(read_end)
    return standby, notify, write_end, port_file


def test_dummy_prompt_is_fixed_and_inside_the_vocabulary() -> None:
    assert dummy_prompt(5, 256) == [1, 2, 3, 4, 5]
    assert dummy_prompt(4, 3) == [1, 2, 1, 2]
    assert dummy_prompt(0, 256) == []


def test_warmup_options() -> None:
    opts = parse_args(["--model", "m"])
    assert opts.warmup_tokens == 8 and not opts.standby_keep_memory
    assert parse_args(["--model", "m", "--warmup-tokens", "0"]).warmup_tokens == 0
    for bad in ("-1", str(MAX_PROMPT_TOKENS + 1)):
        with pytest.raises(ConfigError, match=r"--warmup-tokens must be in 0\.\.256 "):
            parse_args(["--model", "m", "--warmup-tokens", bad])
    assert MAX_WARMUP_TOKENS == MAX_PROMPT_TOKENS


def test_a_standby_warms_up_before_parking_and_writes_nothing_to_the_cache(
        launch, tmp_path: Path) -> None:  # noqa: F811
    model = make_checkpoint(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, vocab=256)
    # TP 1 keeps it short: the workers' warm-up is in test_engine's and test_standby's TP 2 runs
    la = launch(model, tp=1)  # the cache alone: engines started here, by hand
    snap = la.wait_for(lambda s: s["caches_ready"])
    ranks = [r["pid"] for r in snap["ranks"].values()]
    # a first engine hands the engine layout back to the cache, then stops
    engine, expected, log = first_engine(la, model, tmp_path)
    before = slab_digests(ranks)
    assert len(before) == 1  # the engine layout (it replaced the raw layout)

    standby, notify, write_end, port_file = start_standby(engine, tmp_path, log)
    try:
        assert b"PARKED=1" in notify.recv(4096)
        text = (tmp_path / "engines.log").read_text()
        assert text.count("warm-up (prefill 8 tokens + 1 decode step)") == 2  # both engines
        # parked and warm: the cache's bytes are those before the standby existed
        assert slab_digests(ranks) == before
        assert not port_file.exists()  # no port while parked
        os.write(write_end, PROMOTE)
        assert b"READY=1" in notify.recv(4096)
        s = stats(port_file)
        assert s["layout"] == "engine"  # its weights are the cache's mappings
        assert all(m["weights_shared"] > 0 and m["weights_own"] == 0 for m in s["memory"])
        assert s["warmup"]["tokens"] == 8 and s["warmup"]["freed"] is True
        assert generate(port_file) == expected
        assert slab_digests(ranks) == before
    finally:
        os.close(write_end)
        notify.close()
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(60) == 0
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


def test_warmup_tokens_0_serves_without_a_warm_up(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, vocab=256)
    port_file, log = tmp_path / "port", tmp_path / "engine.log"
    proc = subprocess.Popen([sys.executable, "-m", "vlaunch.cache.reference.engine", "--model",
                             str(model), "--port-file", str(port_file), "--warmup-tokens", "0",
                             "--socket-dir", str(tmp_path / "none")], stderr=log.open("wb"))
    try:
        assert len(eventually(lambda: serving(port_file), 120, what=log.read_text)) == 6
        assert stats(port_file)["warmup"] is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert "warm-up" not in log.read_text()


def test_a_standby_parked_before_its_weights_warms_up_on_scratch_and_maps_nothing(
        launch, tmp_path: Path) -> None:  # noqa: F811
    """An in-place swap's standby (issue 37): it warms up before it parks, on scratch tensors
    of the served shapes, with no slab of the cache mapped or open; promoted, it maps the
    cache's weights and answers as an engine loaded the ordinary way."""
    model = make_checkpoint(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, vocab=256)
    la = launch(model, tp=1)
    la.wait_for(lambda s: s["caches_ready"])
    log_path = tmp_path / "engines.log"
    engine, expected, log = first_engine(la, model, tmp_path)
    standby, notify, write_end, port_file = start_standby(
        engine, tmp_path, log, VLAUNCH_STANDBY_PARK="before-weights")
    try:
        assert b"PARKED=1" in notify.recv(4096)
        text = log_path.read_text()
        assert "warming up on scratch weights" in text
        parked_at = text.index("parked as a standby")
        assert text.index("warming up on scratch weights") < parked_at
        assert text.count("warm-up (prefill 8 tokens + 1 decode step)") == 2
        assert "weights from cache" not in text[text.index("warming up on scratch"):]
        assert slab_digests([standby.pid]) == {}  # no slab open while parked
        os.write(write_end, PROMOTE)
        assert b"READY=1" in notify.recv(4096)
        s = stats(port_file)
        assert s["layout"] == "engine"
        assert all(m["weights_shared"] > 0 and m["weights_own"] == 0 for m in s["memory"])
        assert generate(port_file) == expected
        # on the CPU the promoted engine warms up once more (its pass faults the mapped pages
        # in); on CUDA the scratch warm-up is its only one
        assert log_path.read_text().count("warm-up (prefill 8 tokens + 1 decode step)") == 3
    finally:
        os.close(write_end)
        notify.close()
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(60) == 0
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
