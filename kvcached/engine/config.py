"""The core's configuration, the same under every engine: one struct each wing's config extends.

What a served engine reads from the settings (``kvcached.settings.Settings``) and what tests and
benchmarks choose, for the parts both wings build alike: the policy, the reserve, the placement
rule, the shared budget and how long a starting engine waits on it, and the journal. A wing adds
only what its engine alone has (vLLM's prefix-cache cap and its pool's baseline switch; SGLang's
page and backend, which under vLLM the workers choose). ``core_fields`` is the one reading of
those settings both plugins use, so a setting honoured under one engine is honoured under both.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ConfigError
from ..kv_cache_manager import Placement
from ..ledger.events import Policy
from ..service.config import ServiceConfig
from ..settings import Settings
from .reserve import reserve_pages


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What differs between the engines kvcached builds, under any engine."""

    policy: Policy = Policy.LEDGER
    # KVCACHED_MIN_RESERVED_PAGES, KVCACHED_MAX_RESERVED_PAGES, KVCACHED_MAX_RESERVED_BYTES: the
    # empty pages kept mapped (``reserve_pages``); a page is one page in every layer, region and
    # replica, so the byte bound keeps a large model's reserve from holding a neighbour's share.
    min_reserved_pages: int = 0
    max_reserved_pages: int = 0
    max_reserved_bytes: int = 0
    placement: Placement = Placement.WHOLE_PAGES  # KVCACHED_PLACEMENT
    # KVCACHED_BUDGET, KVCACHED_BUDGET_BYTES: map only within the named budget the engines of this
    # machine share (kvcached.budget), vLLM's and SGLang's alike; bytes 0: the size it has.
    budget: str | None = None
    budget_bytes: int = 0
    budget_dir: str | None = None  # where budgets live (None: kvcached.budget.budget_dir(); tests)
    # KVCACHED_JOIN_WAIT_S: how long a starting engine waits on a full budget for its floor.
    join_wait_s: float = 0.0
    # At most one journal. Inline: framed every 256 events on the engine's thread, so that the
    # same run gives the same bytes (the golden traces). Service: written by the ledger service's
    # thread, off the engine's path, with the live socket for kvctl (a server).
    journal_path: str | None = None
    journal_service: ServiceConfig | None = None
    # Build boundaries carry the time (kvreplay show --at): a served engine's do. Off elsewhere,
    # because a scenario or a kvsim seed must give the same journal bytes on every run.
    clock: bool = False

    def __post_init__(self) -> None:
        if self.journal_path is not None and self.journal_service is not None:
            raise ConfigError("engine: a journal is written inline (journal_path) or by the service, not both")
        if self.min_reserved_pages < 0 or self.max_reserved_pages < 0:
            raise ConfigError(
                f"engine: reserved pages must be >= 0, got {self.min_reserved_pages}..{self.max_reserved_pages}"
            )
        if self.max_reserved_bytes < 0 or self.budget_bytes < 0:
            raise ConfigError(
                f"engine: byte bounds must be >= 0, got reserve {self.max_reserved_bytes}, budget {self.budget_bytes}"
            )
        if self.join_wait_s < 0:
            raise ConfigError(f"engine: join_wait_s must be >= 0, got {self.join_wait_s}")

    def reserve_pages(self, page_cost: int) -> tuple[int, int]:
        """The reserve's bounds in pages, the byte bound applied (a page costs ``page_cost``)."""
        return reserve_pages(self.min_reserved_pages, self.max_reserved_pages, self.max_reserved_bytes, page_cost)


def core_fields(settings: Settings, journal_service: ServiceConfig | None) -> dict[str, Any]:
    """A served engine's ``CoreConfig`` fields from its settings, for either wing's config."""
    return {
        "policy": settings.policy,
        "min_reserved_pages": settings.min_reserved_pages,
        "max_reserved_pages": settings.max_reserved_pages,
        "max_reserved_bytes": settings.max_reserved_bytes,
        "placement": Placement(settings.placement),
        "budget": settings.budget,
        "budget_bytes": settings.budget_bytes,
        "join_wait_s": settings.join_wait_s,
        "journal_service": journal_service,
        "clock": True,
    }
