"""The vLLM standby's promote pipe across vLLM's processes, without vLLM: real pipes, real
children started the way spawn starts them (no inherited fds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlaunch.cache.contract.standby import PROMOTE, standby_env
from vlaunch.cache.integrations.standby import (
    PROMOTE_PIPE_ENV,
    PromotePipeError,
    export_promote_pipe,
    open_pipe,
)

# a worker started by spawn: opens the pipe it was told about, prints what the launcher wrote
WORKER = ("import os, sys\n"
          "from vlaunch.cache.integrations.standby import open_pipe\n"
          "fd = open_pipe()\n"
          "sys.stdout.write(os.read(fd, 64).decode())\n")


def test_the_process_holding_the_fd_names_the_pipe_and_only_then() -> None:
    r, w = os.pipe()
    try:
        env = standby_env(r)
        export_promote_pipe(env)
        st = os.fstat(r)
        assert env[PROMOTE_PIPE_ENV] == f"{os.getpid()}:{r}:{st.st_dev}:{st.st_ino}"
        again = {**env, PROMOTE_PIPE_ENV: "1:2:3:4"}
        export_promote_pipe(again)  # a child that inherited the name keeps it
        assert again[PROMOTE_PIPE_ENV] == "1:2:3:4"
        plain: dict[str, str] = {}
        export_promote_pipe(plain)  # not a standby
        assert plain == {}
    finally:
        os.close(r)
        os.close(w)


def test_a_regular_file_on_the_promote_fd_is_not_named(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        env = standby_env(fd)
        export_promote_pipe(env)
        assert PROMOTE_PIPE_ENV not in env
    finally:
        os.close(fd)


def test_a_worker_without_the_fd_reopens_the_pipe_and_reads_the_promotion() -> None:
    r, w = os.pipe()
    env = {**os.environ, **standby_env(r)}
    export_promote_pipe(env)
    try:
        proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # close_fds: r not inherited
        os.write(w, PROMOTE)
    finally:
        os.close(w)
    out, err = proc.communicate(timeout=60)
    os.close(r)
    assert proc.returncode == 0, err
    assert out == PROMOTE.decode()


def test_a_worker_whose_pipe_holder_is_gone_is_told_so() -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    env = {**os.environ, **standby_env(3), PROMOTE_PIPE_ENV: f"{gone.stdout.strip()}:3:1:1"}
    r = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "cannot open its promote" in r.stderr


def test_a_worker_with_neither_fd_nor_name_is_told_so() -> None:
    env = standby_env(987)  # not open here, and no name
    with pytest.raises(PromotePipeError, match="cannot find its promote"):
        open_pipe(env)
