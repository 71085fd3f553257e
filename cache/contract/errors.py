"""One error type per failure a user can act on; each carries its process exit status."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlaunch.cache.contract.exitcodes import ExitStatus


class exit_status:
    """An error class's exit status by name (`status = exit_status("USAGE")`), an
    `ExitStatus` when read.

    Every engine start imports this module, and most never raise: building the exit-status
    enum and its table was a large part of the loader's import (benchmarks/results/
    figures.md). Looked up on first read instead.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> ExitStatus:
        from vlaunch.cache.contract.exitcodes import ExitStatus

        return ExitStatus[self.name]


class VlaunchError(Exception):
    """Base of vlaunch's errors; `status` is the exit status a process ends with."""

    status = exit_status("INTERNAL")


class UsageError(VlaunchError):
    """A bad option, environment variable or config value."""

    status = exit_status("USAGE")


class ModelNotFoundError(VlaunchError):
    """The model path does not exist or holds no safetensors file."""

    status = exit_status("NO_MODEL")


class CheckpointError(VlaunchError):
    """A checkpoint file failed validation; names the file and, where known, the tensor."""

    status = exit_status("BAD_CHECKPOINT")

    def __init__(self, file: object, reason: str, tensor: str | None = None) -> None:
        where = f"{file}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"bad checkpoint: {where}: {reason}; re-download or re-save the file")
        self.file = str(file)
        self.tensor = tensor
        self.reason = reason


class PlanError(VlaunchError):
    """The shard plan does not fit the checkpoint or the rank layout."""

    status = exit_status("BAD_PLAN")


class DeviceError(VlaunchError):
    """The requested device is missing or unusable."""

    status = exit_status("NO_DEVICE")


class SocketDirError(VlaunchError):
    """The socket directory is unsafe or cannot be used."""

    status = exit_status("SOCKET_DIR")


class CacheBusyError(VlaunchError):
    """Another cache process holds this rank's lock."""

    status = exit_status("CACHE_BUSY")


class ProtocolError(VlaunchError):
    """A frame or message broke the wire protocol; the connection is dropped."""


class CacheUnavailableError(VlaunchError):
    """No cache answered on the rank's socket in time; `code` is "busy" when it answered
    that it serves no more clients now."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class CacheBrokenError(VlaunchError):
    """The cache answered, but with an error or with data that failed validation; `code` is
    the error the rank sent ("released", "changed", ...), empty for data that failed."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class FingerprintMismatchError(VlaunchError):
    """The cache holds weights for a different configuration; lists every differing field."""

    def __init__(self, mismatches: list[tuple[str, object, object]]) -> None:
        fields = "; ".join(f"{f}: cache={c!r} engine={e!r}" for f, c, e in mismatches)
        roles = [(c, e) for f, c, e in mismatches if f == "role"]
        head = (f"cache role mismatch: this socket serves the {roles[0][0]} model's cache "
                f"group, the engine asked for the {roles[0][1]} model's; load the draft "
                "model with role='draft' and the target with role='target'; "
                if roles else "")
        super().__init__(f"{head}fingerprint mismatch: {fields}; restart the cache with the "
                         "engine's model and layout, or start the engine with the cache's")
        self.mismatches = mismatches


class SeedError(VlaunchError):
    """Seeding a rank from a running replica failed; the rank ends with SEED_FAILED."""

    status = exit_status("SEED_FAILED")


class ArtifactError(VlaunchError):
    """An artifact was refused (too large, bad key) or could not be read back."""


class CheckpointChangedError(VlaunchError):
    """A checkpoint file changed while a cache rank read it; nothing was served."""

    status = exit_status("CHECKPOINT_CHANGED")


class VerifyError(VlaunchError):
    """A full check found bytes in a cache that differ from the checkpoint files."""

    status = exit_status("VERIFY_FAILED")


class RankStarvedError(VlaunchError):
    """A serving rank could accept no client for too long (out of file descriptors)."""

    status = exit_status("RANK_STARVED")
