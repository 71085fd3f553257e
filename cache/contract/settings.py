"""Every VLAUNCH_* variable that is not a command-line option: its type, default and meaning.

The one place that reads them: a module asks `get(NAME)` for a typed value (an unset or empty
variable is its default). Three kinds:

- `KNOB`: an operator sets it to tune or compare (the reader, the CPU slabs' pages, timeouts);
- `ENGINE`: `vlaunch run` sets it for its engine (`EngineEnv`, engine_env.py, and the standby
  protocol); an engine started by hand may set it itself;
- `INTERNAL`: vlaunch sets it for its own child processes.

docs/configuration.md lists every entry with its default, and tests/test_settings.py fails on
a VLAUNCH_* variable read anywhere else, or missing from the page. `vlaunch run`'s and `vlaunch
cache`'s options, which click reads from VLAUNCH_<OPTION>, are in the same page's option tables.
Light: no torch, nothing from the rest of `vlaunch.cache`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from vlaunch.cache.contract.errors import UsageError

log = logging.getLogger("vlaunch.cache")

KNOB, ENGINE, INTERNAL = "knob", "engine", "internal"


class Setting:
    """One VLAUNCH_* variable: its name, how its text reads (`parse`: the stripped, non-empty
    text to the value, or the error a malformed value is), its value when unset or empty
    (`default`), that default as docs/configuration.md shows it (`shown`), what it does
    (`doc`) and who sets it (`kind`). A plain class: the registry is built at every engine
    start, where even a NamedTuple's definition is a cost (see vlaunch.cache)."""

    __slots__ = ("default", "doc", "kind", "name", "parse", "shown")

    def __init__(self, name: str, parse: Callable[[str], Any], default: Any, shown: str,
                 doc: str, kind: str = KNOB) -> None:
        self.name, self.parse, self.default, self.shown, self.doc, self.kind = (
            name, parse, default, shown, doc, kind)

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, default={self.default!r}, kind={self.kind!r})"


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of registered variable `name` in `env` (default: this process's)."""
    setting = REGISTRY[name]  # a KeyError here is a variable nobody registered: a bug
    raw = (os.environ if env is None else env).get(name, "").strip()
    return setting.parse(raw) if raw else setting.default


def seconds(default: float, below: float = math.inf) -> Callable[[str], float]:
    """A parser of a positive number of seconds under `below`; anything else is `default`."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            return default
        return value if 0 < value < below else default

    return parse


def _count(raw: str) -> int | None:
    """A positive integer as given, else None (the reader's own bound)."""
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _reader(raw: str) -> str:
    if raw not in READERS:
        log.warning("VLAUNCH_READER=%s is not one of %s; using staging", raw, ", ".join(READERS))
        return "staging"
    return raw


def _pages(raw: str) -> str:
    if raw not in ("auto", "4k"):
        raise UsageError(f"VLAUNCH_CPU_SLAB_PAGES must be auto or 4k, not {raw!r}; unset "
                          "it to let the host's shmem huge-page policy decide")
    return raw


def _slabs(raw: str) -> str:
    if raw not in ("auto", "memfd"):
        raise UsageError("file-backed CPU slabs are no longer supported "
                          "(VLAUNCH_CPU_SLABS): a file cannot be sealed, so an engine could "
                          "write into the cache's weights; unset VLAUNCH_CPU_SLABS (CPU slabs "
                          "are sealed memfds)")
    return raw


def _text(raw: str) -> str:
    return raw


def _positive(name: str, least: int = 1) -> Callable[[str], int]:
    """A parser of an integer >= `least`; UsageError naming the variable otherwise."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = least - 1
        if value < least:
            raise UsageError(f"{name}={raw!r} is malformed; unset it or give a positive "
                             "integer (ranks: a comma list)")
        return value

    return parse


def _ints(name: str) -> Callable[[str], tuple[int, ...]]:
    """A parser of a comma list of integers; UsageError naming the variable otherwise."""

    def parse(raw: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in raw.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"{name}={raw!r} is malformed; unset it or give a positive "
                             "integer (ranks: a comma list)") from None

    return parse


def _words(raw: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in raw.split(",") if x.strip())


def _flag(raw: str) -> bool:
    return raw not in ("0", "false", "no")


READERS = ("staging", "register")
IO_TIMEOUT = 30.0
STARVED_AFTER = 30.0
WATCH_EVERY = 5.0

_ALL = (
    Setting("VLAUNCH_IO_TIMEOUT", seconds(IO_TIMEOUT), IO_TIMEOUT, "`30`",
            "Seconds each step of an engine's handoff (a reply, the slab fds) may take before "
            "the cache counts as stalled (`CacheUnavailableError`); a malformed value or one "
            "<= 0 is the default."),
    Setting("VLAUNCH_QUANTIZATION", _text, "", "config.json's `quant_method`",
            "The engine's quantization method, a fingerprint field (`load(quantization=...)` "
            "wins on the engine side); give the caches the same value."),
    Setting("VLAUNCH_MAX_CONNECTIONS", _count, None,
            "`4096`, at most `RLIMIT_NOFILE` less 64",
            "Client connections a rank keeps open; past it, idle ones are shed, then new ones "
            "refused with `busy`. A positive integer is taken as given."),
    Setting("VLAUNCH_STARVED_AFTER", seconds(STARVED_AFTER), STARVED_AFTER, "`30`",
            "Seconds a rank may go without accepting a connection, shedding included, before "
            "it gives up (exit status of `RankStarvedError`)."),
    Setting("VLAUNCH_WATCH_EVERY", seconds(WATCH_EVERY, 1e6), WATCH_EVERY, "`5`",
            "Seconds between two looks of a serving rank at its checkpoint's files "
            "([Checkpoint integrity](integrity.md))."),
    Setting("VLAUNCH_READER", _reader, "staging", "`staging`",
            "How a CUDA rank moves its slices to the GPU: `staging` (pinned buffers, the copy "
            "engine) or `register` (the page cache registered with the driver, no host copy)."),
    Setting("VLAUNCH_SPLIT_READ", _text, "gather", "`gather`",
            "Narrow dimension-1 splits at TP > 1: `gather` each row's part on the host; any "
            "other value (`span`) reads whole spans and splits them on the device."),
    Setting("VLAUNCH_CPU_SLAB_PAGES", _pages, "auto", "`auto`",
            "`auto`: CPU slabs ask for 2 MiB pages where the host allows them; `4k`: never. "
            "The rank reports what it got as `slab_pages` "
            "([How it works](how-it-works.md#cpu-slabs-sealed-memfds))."),
    Setting("VLAUNCH_CPU_SLABS", _slabs, "auto", "`auto`",
            "Retired (file-backed CPU slabs); any value but `auto` or `memfd` stops the rank."),
    Setting("VLAUNCH_CACHE_DIR", _text, "", "`$XDG_CACHE_HOME/vlaunch` (else `~/.cache/vlaunch`)",
            "Where `vlaunch demo` keeps its generated checkpoint."),
    # what vlaunch run tells its engine (EngineEnv: engine_env.py)
    Setting("VLAUNCH_MODEL", _text, "", "unset",
            "The checkpoint; `load()`'s model when its caller names none.", ENGINE),
    Setting("VLAUNCH_SOCKET_DIR", _text, "", "`$XDG_RUNTIME_DIR/vlaunch` or `/tmp/vlaunch-UID`",
            "The caches' socket directory.", ENGINE),
    Setting("VLAUNCH_TENSOR_PARALLEL_SIZE", _positive("VLAUNCH_TENSOR_PARALLEL_SIZE"), None,
            "unset (1)", "Tensor-parallel ranks.", ENGINE),
    Setting("VLAUNCH_PIPELINE_PARALLEL_SIZE", _positive("VLAUNCH_PIPELINE_PARALLEL_SIZE"), None,
            "unset (1)", "Pipeline stages.", ENGINE),
    Setting("VLAUNCH_DATA_PARALLEL_SIZE", _positive("VLAUNCH_DATA_PARALLEL_SIZE"), None,
            "unset (1)", "Data-parallel replicas.", ENGINE),
    Setting("VLAUNCH_RANKS", _ints("VLAUNCH_RANKS"), (), "unset",
            "The global ranks this node's caches serve, a comma list.", ENGINE),
    Setting("VLAUNCH_DEVICE", _text, "", "unset (cuda when torch sees a GPU, else cpu)",
            "Where the caches hold the weights: `cpu` or `cuda`.", ENGINE),
    Setting("VLAUNCH_ENGINE_DEVICES", _words, (), "unset",
            "Per local rank, the device its cache holds it on: `cpu`, `cuda:N` or "
            "`cuda:GPU-<uuid>`.", ENGINE),
    Setting("VLAUNCH_PLAN", _text, "", "unset (`llama`)", "The shard plan.", ENGINE),
    Setting("VLAUNCH_KERNEL_BACKENDS", _text, "", "unset",
            "The kernel backends fingerprint field.", ENGINE),
    Setting("VLAUNCH_ATTEMPT", _positive("VLAUNCH_ATTEMPT", 0), None, "unset",
            "Which start of the engine this is (1: the first).", ENGINE),
    Setting("VLAUNCH_PRELOAD", _flag, False, "unset",
            "Set in the `--preload-autotune` command's environment.", ENGINE),
    Setting("VLAUNCH_DRAFT_MODEL", _text, "", "unset",
            "A speculative-decoding draft model's checkpoint (its own cache group).", ENGINE),
    Setting("VLAUNCH_DRAFT_PLAN", _text, "", "unset (`replicate`)",
            "The draft group's shard plan.", ENGINE),
    Setting("VLAUNCH_CHECKPOINT_DATA", _words, (), "unset",
            "Per local rank, the identity of the published version it serves, after a "
            "trainer published one ([Changing the weights](swap.md)).", ENGINE),
    Setting("VLAUNCH_ENGINE_STANDBY", _text, "0", "unset",
            "`1` in a standby engine's environment ([Standby engine](standby.md)).", ENGINE),
    Setting("VLAUNCH_PROMOTE_FD", _text, "", "unset",
            "A standby's inherited pipe the launcher promotes it on.", ENGINE),
    Setting("VLAUNCH_STANDBY_PARK", _text, "", "unset",
            "`before-weights`: the standby parks before it maps any weight (an in-place swap "
            "overwrites the cache's slabs before the promotion: [Changing the weights](swap.md)).",
            ENGINE),
    Setting("VLAUNCH_LISTEN_PASS", _text, "", "unset",
            "The keeper's fd numbers of `--listen`'s sockets, which it places at fds 3.. for "
            "the engine with `LISTEN_FDS` ([Health](health.md#in-flight-requests-when-the-"
            "engine-is-replaced)).", INTERNAL),
    Setting("VLAUNCH_LISTEN_NAMES", _text, "", "unset",
            "Their names, the engine's `LISTEN_FDNAMES`.", INTERNAL),
    Setting("VLAUNCH_PROMOTE_PIPE", _text, "", "unset",
            "`pid:fd:dev:inode` of the promote pipe, for a vLLM standby's workers.", INTERNAL),
    Setting("VLAUNCH_REFERENCE_FAULT_FILE", _text, "", "unset",
            "Test only: a file naming a hang the reference engine injects (tests/faults); "
            "never set it in production.", INTERNAL),
)
REGISTRY: dict[str, Setting] = {s.name: s for s in _ALL}
