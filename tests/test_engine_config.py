"""One configuration of the core under both engines (``kvcached.engine.config``).

Each wing's config extends ``CoreConfig``, and both plugins read the shared settings through
``core_fields``: a setting of the core that one engine honours, the other does too.
"""

from __future__ import annotations

import msgspec
import pytest

from kvcached.engine.config import CoreConfig, core_fields
from kvcached.errors import ConfigError
from kvcached.kv_cache_manager import Placement
from kvcached.ledger.events import Policy
from kvcached.settings import Settings

# Chosen by tests and benchmarks only: a served engine's journal goes through the service, and
# its budgets live where kvcached.budget.budget_dir() says.
NOT_A_SETTING = {"journal_path", "budget_dir"}


def _unread(fields: dict[str, object]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(CoreConfig)} - NOT_A_SETTING - set(fields)


def test_every_setting_of_the_core_is_read_for_both_engines() -> None:
    env = {
        "ENABLE_KVCACHED": "1",
        "KVCACHED_LEDGER_POLICY": "legacy",
        "KVCACHED_MIN_RESERVED_PAGES": "2",
        "KVCACHED_MAX_RESERVED_PAGES": "7",
        "KVCACHED_MAX_RESERVED_BYTES": "64M",
        "KVCACHED_PLACEMENT": "best-fit",
        "KVCACHED_BUDGET": "gpu0",
        "KVCACHED_BUDGET_BYTES": "8G",
        "KVCACHED_JOIN_WAIT_S": "30",
    }
    fields = core_fields(Settings.from_env(env), None)
    assert _unread(fields) == set()
    config = CoreConfig(**fields)
    assert config.policy is Policy.LEGACY and config.placement is Placement.BEST_FIT
    assert (config.min_reserved_pages, config.max_reserved_pages, config.max_reserved_bytes) == (2, 7, 64 << 20)
    assert (config.budget, config.budget_bytes, config.join_wait_s, config.clock) == ("gpu0", 8 << 30, 30.0, True)
    assert config.reserve_pages(16 << 20) == (2, 4)  # 64 MiB of 16 MiB pages bounds the high mark


def test_a_setting_left_out_of_the_shared_reading_is_found() -> None:
    fields = core_fields(Settings.from_env({"ENABLE_KVCACHED": "1"}), None)
    del fields["join_wait_s"]
    assert _unread(fields) == {"join_wait_s"}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"journal_path": "/tmp/x.kvj", "journal_service": object()}, r"inline \(journal_path\) or by the service"),
        ({"min_reserved_pages": -1}, "reserved pages must be >= 0"),
        ({"budget_bytes": -1}, "byte bounds must be >= 0"),
        ({"join_wait_s": -1.0}, "join_wait_s must be >= 0"),
    ],
)
def test_the_core_config_refuses_what_cannot_be(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        CoreConfig(**fields)  # type: ignore[arg-type]
