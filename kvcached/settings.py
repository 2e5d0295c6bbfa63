"""kvcached's settings, from the environment variables upstream kvcached users already know.

One frozen value, read once, so that every part (allocator, bridge, plugin) agrees and the
startup log can print exactly what is in force. A malformed value is a ``ConfigError`` naming
the variable, not a ``ValueError`` from deep inside.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from .errors import ConfigError
from .ledger.events import Policy


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    enabled: bool = False  # ENABLE_KVCACHED
    page_bytes: int = 2 << 20  # KVCACHED_PAGE_SIZE_MB
    min_reserved_pages: int = 5  # KVCACHED_MIN_RESERVED_PAGES
    max_reserved_pages: int = 10  # KVCACHED_MAX_RESERVED_PAGES
    contiguous_layout: bool = True  # KVCACHED_CONTIGUOUS_LAYOUT
    backend: str = "auto"  # KVCACHED_BACKEND: auto | cuda | host
    policy: Policy = Policy.LEDGER  # KVCACHED_LEDGER_POLICY
    journal: str | None = None  # KVCACHED_LEDGER_JOURNAL
    max_cached_tokens: int | None = None  # KVCACHED_MAX_CACHED_TOKENS: prefix-cached tokens kept; None: no cap

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        try:
            policy = Policy(e.get("KVCACHED_LEDGER_POLICY", "ledger").strip().lower())
        except ValueError:
            raise ConfigError(
                f"KVCACHED_LEDGER_POLICY={e['KVCACHED_LEDGER_POLICY']!r}: use 'ledger' (safe) or 'legacy'"
            ) from None
        mb = _number(e, "KVCACHED_PAGE_SIZE_MB", 2.0)
        page_bytes = int(mb * (1 << 20))
        if page_bytes <= 0 or page_bytes % 4096:
            raise ConfigError(f"KVCACHED_PAGE_SIZE_MB={mb}: use a positive size in whole 4 KiB units (2 on GPUs)")
        s = cls(
            enabled=_flag(e, "ENABLE_KVCACHED", False),
            page_bytes=page_bytes,
            min_reserved_pages=int(_number(e, "KVCACHED_MIN_RESERVED_PAGES", 5)),
            max_reserved_pages=int(_number(e, "KVCACHED_MAX_RESERVED_PAGES", 10)),
            contiguous_layout=_flag(e, "KVCACHED_CONTIGUOUS_LAYOUT", True),
            backend=e.get("KVCACHED_BACKEND", "auto").strip().lower(),
            policy=policy,
            journal=e.get("KVCACHED_LEDGER_JOURNAL") or None,
            max_cached_tokens=_cap(e, "KVCACHED_MAX_CACHED_TOKENS"),
        )
        if s.backend not in ("auto", "cuda", "host"):
            raise ConfigError(f"KVCACHED_BACKEND={s.backend!r}: use auto, cuda or host")
        if s.min_reserved_pages > s.max_reserved_pages:
            raise ConfigError(
                f"KVCACHED_MIN_RESERVED_PAGES={s.min_reserved_pages} is above "
                f"KVCACHED_MAX_RESERVED_PAGES={s.max_reserved_pages}"
            )
        return s


def _cap(env: Mapping[str, str], name: str) -> int | None:
    """A count that is unlimited (None) when the variable is unset or empty."""
    return int(_number(env, name, 0)) if env.get(name, "").strip() else None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: use 1/true or 0/false")


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: not a number") from None
    if v < 0:
        raise ConfigError(f"{name}={raw!r}: must not be negative")
    return v
