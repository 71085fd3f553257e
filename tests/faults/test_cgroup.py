"""Containing the launcher's children in a cgroup v2 of its own: detection, the fallback,
and the cgroup file protocol (against a stand-in directory: real cgroups need delegation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlaunch.launcher import children
from vlaunch.launcher.children import ChildCgroup, contain_children, own_cgroup

MOUNTINFO = ("29 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
             "30 1 0:27 / /proc rw - proc proc rw\n")


def _files(tmp: Path, mountinfo: str, cgroup: str) -> tuple[str, str]:
    (tmp / "mountinfo").write_text(mountinfo)
    (tmp / "cgroup").write_text(cgroup)
    return str(tmp / "mountinfo"), str(tmp / "cgroup")


@pytest.mark.parametrize("mountinfo,cgroup,expected", [
    (MOUNTINFO, "0::/user.slice/vlaunch@a.service\n",
     "/sys/fs/cgroup/user.slice/vlaunch@a.service"),
    (MOUNTINFO, "0::/\n", None),  # the hierarchy's root is the host's, not ours
    ("30 1 0:27 / /proc rw - proc proc rw\n", "0::/x\n", None),  # no cgroup2 mounted
    (MOUNTINFO, "4:memory:/x\n", None),  # cgroup v1 only
])
def test_own_cgroup(tmp_path: Path, mountinfo: str, cgroup: str, expected: str | None) -> None:
    got = own_cgroup(*_files(tmp_path, mountinfo, cgroup))
    assert (str(got) if got else None) == expected


def _fake_cgroup(path: Path, populated: bool = False) -> Path:
    path.mkdir(parents=True)
    for name in ("cgroup.procs", "cgroup.kill"):
        (path / name).write_text("")
    (path / "cgroup.events").write_text(f"populated {int(populated)}\nfrozen 0\n")
    return path


def test_a_child_joins_in_its_preexec_and_kill_writes_cgroup_kill(tmp_path: Path) -> None:
    group = ChildCgroup(_fake_cgroup(tmp_path / "vlaunch-1"))
    subprocess.run([sys.executable, "-c", "pass"], preexec_fn=group.join, check=True)
    assert (group.path / "cgroup.procs").read_text() == "0"  # the kernel reads 0 as "me"
    group.kill(timeout=0.1)
    assert (group.path / "cgroup.kill").read_text() == "1"


def test_stale_cgroups_of_killed_launchers_are_killed_and_fallback_is_none(
        tmp_path: Path, monkeypatch) -> None:
    stale = _fake_cgroup(tmp_path / "vlaunch-999999999")
    live = _fake_cgroup(tmp_path / "vlaunch-1")  # pid 1 lives: not ours to touch
    monkeypatch.setattr(children, "_CGROUP", None)
    got = contain_children(tmp_path)  # a plain directory: mkdir works, no cgroup files
    assert got is None and children._CGROUP is None
    assert (stale / "cgroup.kill").read_text() == "1"
    assert (live / "cgroup.kill").read_text() == ""


def test_this_machine_either_contains_children_or_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setattr(children, "_CGROUP", None)
    caplog.set_level("INFO", "vlaunch.launcher")
    base = own_cgroup()
    got = contain_children()
    try:
        if got is None:
            assert base is not None or "no delegated cgroup" in caplog.text
        else:
            assert got.path.parent == base and (got.path / "cgroup.kill").exists()
    finally:
        if got is not None:
            got.kill()
        monkeypatch.setattr(children, "_CGROUP", None)
