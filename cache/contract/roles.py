"""Cache groups: the target model's, and a speculative-decoding draft model's beside it.

A draft group has the same ranks as the target's; its sockets, locks, artifact directories and
fingerprints carry the role, and its seeding ports (and the launcher's slots) follow the
target's block of `world` ranks. Light: no torch, nothing from the rest of `vlaunch.cache`.
"""

from __future__ import annotations

from vlaunch.cache.contract.errors import UsageError

TARGET = "target"
DRAFT = "draft"
ROLES = (TARGET, DRAFT)


def check_role(role: str) -> str:
    """`role` if it is a known group; UsageError naming the choices otherwise."""
    if role not in ROLES:
        raise UsageError(f"cache role {role!r} is unknown; use one of {', '.join(ROLES)}")
    return role


def stem(role: str, rank: int) -> str:
    """The file name stem of a rank's socket and lock: rank-N, or draft-rank-N."""
    return f"rank-{rank}" if role == TARGET else f"{check_role(role)}-rank-{rank}"


def seat(role: str, rank: int, world: int) -> int:
    """A rank's index over both groups: the draft's block of `world` follows the target's."""
    return rank + (world if check_role(role) == DRAFT else 0)


def unseat(seat_: int, world: int) -> tuple[str, int]:
    """(role, rank) of a seat: the inverse of `seat`."""
    return (TARGET, seat_) if seat_ < world else (DRAFT, seat_ - world)
