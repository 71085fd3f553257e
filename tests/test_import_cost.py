"""What an engine's first handoff imports: only what the share path needs.

Every engine start pays `import vlaunch.cache` + `load()` (benchmarks/bench_import.py times
it). The shard-plan machinery, the checkpoint reader, the CUDA slab backend and the rank's
command line are imported where they are used, never on the share path, and the share path
defines no dataclass; a fresh interpreter shows whether that still holds, so the gain cannot
regress unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import CacheProc, spawn_cache

NOT_ON_THE_SHARE_PATH = (
    "vlaunch.cache.store.plan",  # rules compiled, plan files read: builtin_plans.py suffices
    "vlaunch.cache.store.checkpoint",  # headers parsed: the rank's identity memo suffices
    "vlaunch.cache.store.reader",
    "vlaunch.cache.store.shard",
    "vlaunch.cache.store.slabs_cuda",  # a CPU handoff needs no CUDA backend
    "vlaunch.cache.store.cudadrv",
    "vlaunch.cache.contract.launch",  # the rank's command line (click)
    "vlaunch.cache.contract.exitcodes",  # an error's status is looked up when it is read
    "click",
    "tomllib",
)


# Records every dataclass a vlaunch module defines from here on (`@dataclass` in either form).
NO_DATACLASS = """
import dataclasses
_dataclass, DEFINED = dataclasses.dataclass, []
def _spy(cls=None, /, **kw):
    def wrap(c):
        if c.__module__.startswith("vlaunch"):
            DEFINED.append(f"{c.__module__}.{c.__qualname__}")
        return _dataclass(c, **kw)
    return wrap if cls is None else wrap(cls)
dataclasses.dataclass = _spy
"""


def imported_after(code: str) -> list[str]:
    """The vlaunch modules, and those of NOT_ON_THE_SHARE_PATH, that a fresh interpreter
    holds after running `code`."""
    probe = (f"import sys\n{code}\nprint('MODULES', __import__('json').dumps(sorted(m for m in "
             "sys.modules if m.startswith('vlaunch') or m in "
             f"{NOT_ON_THE_SHARE_PATH!r})))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("MODULES "))
    return json.loads(line[len("MODULES "):])


def test_the_package_import_loads_only_its_version() -> None:
    mods = imported_after("import vlaunch.cache")
    assert set(mods) <= {"vlaunch", "vlaunch.cache", "vlaunch.cache.contract",
                         "vlaunch.cache.contract.version"}, mods


def test_the_loader_imports_nothing_the_share_path_does_not_need() -> None:
    mods = imported_after("import vlaunch.cache\nvlaunch.cache.load")
    assert "vlaunch.cache.client.loader" in mods  # the probe would pass vacuously otherwise
    assert not set(mods) & set(NOT_ON_THE_SHARE_PATH), mods


def test_a_share_handoff_from_a_cpu_rank_stays_on_the_light_path(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir))
    # Defining a (frozen) dataclass costs several times what a NamedTuple does: the share
    # path defines none (its records, layout and headers are NamedTuples).
    code = (NO_DATACLASS + "import vlaunch.cache\n"
            f"w = vlaunch.cache.load({str(llama_ckpt)!r}, socket_dir={str(sockdir)!r}, "
            "fallback=False, device='cpu')\n"
            "assert w.source == 'cache' and len(w) > 10, (w.source, w.reason)\n"
            "assert not DEFINED, f'dataclasses defined on the share path: {DEFINED}'")
    mods = imported_after(code)
    assert "vlaunch.cache.store.identity" in mods  # the memo was checked
    assert not set(mods) & set(NOT_ON_THE_SHARE_PATH), mods


def test_the_light_plan_identity_is_the_plans_own() -> None:
    """The engine's fingerprint takes a built-in plan's identity from builtin_plans.py without
    building the plan; the cache's comes from the plan: they must agree for every plan."""
    from vlaunch.cache.store.fingerprints import plan_identity
    from vlaunch.cache.store.plan import BUILTIN_PLANS

    for name, plan in BUILTIN_PLANS.items():
        assert plan_identity(name) == plan.identity, name
    assert len({p.identity for p in BUILTIN_PLANS.values()}) == len(BUILTIN_PLANS)
