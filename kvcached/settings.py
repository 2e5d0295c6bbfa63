"""kvcached's settings, from the environment variables upstream kvcached users already know.

One frozen value, read once, so that every part (allocator, bridge, plugin) agrees and the
startup log can print exactly what is in force. Every variable is read by one function
(``_read``) under one rule; a value it cannot take is refused with a ``ConfigError`` of one line
naming the variable, the value and what to set. Where a name is upstream kvcached's, its meaning
and default are upstream's (``KVCACHED_MAX_CACHED_TOKENS``: 16,000 by default, negative for no cap).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Final, Literal

import msgspec

from .errors import ConfigError
from .ledger.events import Policy

# Upstream kvcached's settings, as read in ovg-project/kvcached (snapshot e8e64063):
# kvcached/utils.py `_get_page_size` (KVCACHED_PAGE_SIZE_MB: whole MB, a positive multiple of 2,
# default 2), MIN_RESERVED_PAGES (5), MAX_RESERVED_PAGES (10), MAX_CACHED_TOKENS (16000; < 0 no
# cap, 0 nothing kept), `_default_contiguous_layout` (KVCACHED_CONTIGUOUS_LAYOUT, true on CUDA);
# kvcached/integration/patch_base.py reads ENABLE_KVCACHED ("true" or "1"), and
# kvcached/integration/vllm/patches.py turns tokens into blocks as max(1, tokens // block_size).
UPSTREAM_MAX_CACHED_TOKENS: Final = 16_000

_KiB4: Final = 4096
_MiB: Final = 1 << 20
MAX_PAGE_MIB: Final = 1024
MAX_RESERVED: Final = 1_000_000
MAX_TOKENS: Final = 1_000_000_000
_LONGEST: Final = 32  # characters: no number kvcached takes is longer; beyond, it is a typo or worse

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")
# The one syntax of a whole number that cannot be negative (a count from 0, whole MiB): digits
# alone, no sign, as the sizes refuse one (``-0`` would read as a negative number let through).
_DIGITS = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"[+-]?[0-9]+")  # a count that may be negative: upstream's int() (MAX_CACHED_TOKENS)
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")

Kind = Literal["flag", "count", "mib", "word", "path", "size"]

# Sizes as operators type them (upstream kvcached's ``kvctl limit`` takes ``512M``, ``2G``):
# a number, an optional unit, binary multiples either way (``G``, ``GB``, ``GiB`` are all 2**30),
# since KV memory is counted in 2 MiB pages and nobody means 10**9 bytes of it.
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
BUDGET_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # KVCACHED_BUDGET, kvctl budget NAME
_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_SIZE: Final = 1 << 50  # a PiB: no machine kvcached serves on has more KV memory


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``4096``, ``512M``, ``1.5GiB``); ``ValueError`` saying what is wrong
    (without the text, which the caller names)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or len(text) > _LONGEST:
        raise ValueError("not a size (a number with an optional unit: 4096, 512M, 2G, 1.5GiB)")
    size = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    if size.denominator != 1:
        raise ValueError("not a whole number of bytes")
    if size.numerator > MAX_SIZE:
        raise ValueError(f"more than {MAX_SIZE >> 40} TiB")
    return size.numerator


# What ``kvctl limit`` (and the HTTP route, ``api_server.http``) read as no limit at all.
NO_LIMIT: Final = ("none", "max", "off", "unlimited")


def parse_limit(text: str) -> int | None:
    """A memory limit as ``kvctl limit`` takes it: bytes (``parse_size``), or None for a word of
    ``NO_LIMIT``; a negative size is a ``ValueError`` like any other (without the text)."""
    text = text.strip()
    if text.lower() in NO_LIMIT:
        return None
    if text.startswith("-"):
        raise ValueError("a negative size; give bytes with an optional unit (512M, 2G) or none")
    return parse_size(text)


def format_size(n: int) -> str:
    """``n`` bytes as a person reads them: 16 MiB, 1.5 GiB, 4096 B."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:.0f} {unit}"
    return f"{n} B"


class Var(msgspec.Struct, frozen=True, kw_only=True):
    """One variable: how it is read, its default (as text, read by the same rule) and its bounds."""

    name: str
    kind: Kind
    default: str
    low: int = 0  # counts: the smallest value; sizes: the fewest bytes
    high: int = 0  # counts: the largest value; sizes: the most bytes
    words: tuple[str, ...] = ()
    # MiB: whole MiB only (``_DIGITS``), where upstream reads the variable with int(); else an
    # exact decimal of whole 4 KiB units (a page: 0.25 serves the host backend).
    whole: bool = False
    hint: str = ""  # what to set, after "set ..."


ENABLE: Final = Var(
    name="ENABLE_KVCACHED", kind="flag", default="0", hint="1 to turn kvcached on, 0 (or unset) for off"
)
PAGE_SIZE: Final = Var(
    name="KVCACHED_PAGE_SIZE_MB",
    kind="mib",
    default="2",
    low=_KiB4,
    high=MAX_PAGE_MIB * _MiB,
    # A page is what is mapped and unmapped: whole 4 KiB OS pages at the least (the host
    # backend); the CUDA backend further needs its allocation granularity (2 MiB), and checks it.
    hint=f"a size in MiB of whole 4 KiB units up to {MAX_PAGE_MIB}, such as 2 (the default; a multiple of 2 on GPUs)",
)
MIN_RESERVED: Final = Var(
    name="KVCACHED_MIN_RESERVED_PAGES",
    kind="count",
    default="5",
    high=MAX_RESERVED,
    hint=f"a whole number of pages from 0 to {MAX_RESERVED:,}, such as 5 (the default)",
)
MAX_RESERVED_VAR: Final = Var(
    name="KVCACHED_MAX_RESERVED_PAGES",
    kind="count",
    default="10",
    high=MAX_RESERVED,
    hint=f"a whole number of pages from 0 to {MAX_RESERVED:,}, such as 10 (the default)",
)
CONTIGUOUS: Final = Var(name="KVCACHED_CONTIGUOUS_LAYOUT", kind="flag", default="1", hint="true or false")
BACKEND: Final = Var(
    name="KVCACHED_BACKEND", kind="word", default="auto", words=("auto", "cuda", "host"), hint="auto, cuda or host"
)
POLICY: Final = Var(
    name="KVCACHED_LEDGER_POLICY",
    kind="word",
    default="ledger",
    words=tuple(p.value for p in Policy),
    hint="'ledger' (safe) or 'legacy'",
)
JOURNAL: Final = Var(name="KVCACHED_LEDGER_JOURNAL", kind="path", default="", hint="a file path, or leave it unset")
MAX_CACHED_TOKENS: Final = Var(
    name="KVCACHED_MAX_CACHED_TOKENS",
    kind="count",
    default=str(UPSTREAM_MAX_CACHED_TOKENS),
    low=-MAX_TOKENS,
    high=MAX_TOKENS,
    hint=f"a whole number of tokens up to {MAX_TOKENS:,} ({UPSTREAM_MAX_CACHED_TOKENS} by default, "
    "0 to keep none, -1 for no cap)",
)
FLIGHT_EVENTS: Final = Var(
    name="KVCACHED_FLIGHT_RECORDER_EVENTS",
    kind="count",
    default="65536",
    high=1 << 24,
    hint="a whole number of events up to 16,777,216 (65536 by default, 0 for off)",
)
DUMP_DIR: Final = Var(
    name="KVCACHED_DUMP_DIR",
    kind="path",
    default="",
    hint="a directory for flight-recorder dumps, or leave it unset ($XDG_STATE_HOME/kvcached)",
)
BUDGET: Final = Var(
    name="KVCACHED_BUDGET", kind="path", default="", hint="a budget name shared by engines, or leave it unset"
)
BUDGET_BYTES: Final = Var(
    name="KVCACHED_BUDGET_BYTES",
    kind="size",
    default="0",
    high=MAX_SIZE,
    hint="a size such as 8G or 512M (0 or unset: the budget's size is set by kvctl budget)",
)
MAX_RESERVED_BYTES: Final = Var(
    name="KVCACHED_MAX_RESERVED_BYTES",
    kind="size",
    default="0",
    high=MAX_SIZE,
    hint="a size such as 64M (0 or unset: KVCACHED_MAX_RESERVED_PAGES alone bounds the reserve)",
)
# The journal's disk, for a server that runs for weeks (kvcached/service/retention.py). The names
# follow upstream's KVCACHED_MAX_<WHAT> (MAX_CACHED_TOKENS, MAX_RESERVED_PAGES) and this kvcached's
# *_BYTES sizes. The bound is on by default: a journal is asked for with KVCACHED_LEDGER_JOURNAL,
# and a busy engine writes a few GiB of it a day, so an unbounded default fills a disk in the
# weeks nobody looks. 4 GiB holds hours of a busy engine's events (16 segments of the default
# 256 MiB; each earlier run kept, KVCACHED_JOURNAL_KEEP_RUNS, is at most as large).
MAX_JOURNAL_BYTES: Final = Var(
    name="KVCACHED_MAX_JOURNAL_BYTES",
    kind="size",
    default="4G",
    high=MAX_SIZE,
    hint="a size such as 4G or 512M for the journal's files of one run (4G by default, 0 for no bound)",
)
JOURNAL_SEGMENT_BYTES: Final = Var(
    name="KVCACHED_JOURNAL_SEGMENT_BYTES",
    kind="size",
    default="256M",
    low=64 << 10,
    high=1 << 40,
    hint="a size from 64K to 1T at which the journal starts its next segment, such as 256M (the default)",
)
JOURNAL_KEEP_RUNS: Final = Var(
    name="KVCACHED_JOURNAL_KEEP_RUNS",
    kind="count",
    default="3",
    high=1000,
    hint="a whole number of earlier runs' journals to keep, from 0 to 1000 (3 by default)",
)
JOURNAL_DURABILITY: Final = Var(
    name="KVCACHED_JOURNAL_DURABILITY",
    kind="word",
    default="interval",
    words=("none", "interval", "batch"),
    hint="none (never fsync), interval (fsync every second, the default) or batch (fsync every frame)",
)
MAX_DUMPS: Final = Var(
    name="KVCACHED_MAX_DUMPS",
    kind="count",
    default="20",
    low=1,
    high=100_000,
    hint="a whole number of flight-recorder dumps an engine keeps, from 1 to 100,000 (20 by default)",
)
# Where the manager puts a run of new blocks (kv_cache_manager.Placement's values; kept here as
# words so that the API server reads settings without importing the manager).
PLACEMENT: Final = Var(
    name="KVCACHED_PLACEMENT",
    kind="word",
    default="whole-pages",
    words=("whole-pages", "best-fit", "fullest", "lowest"),
    hint="whole-pages (the default: a request's whole pages of its own, the fewest pages mapped), best-fit "
    "(upstream kvcached's rule, vLLM's own block ids on a fresh pool), fullest or lowest",
)
# Upstream kvcached's name for the least KV memory an engine may be limited to: a limit below the
# floor (what one request of max_model_len needs, or this if larger) is refused unless forced
# (kvctl limit --force), so that a typo cannot leave a server that admits no request.
# Whole MB, as upstream's router reads it (``int(os.getenv("KVCACHED_MIN_KV_CACHE_MB", ...))``).
MIN_KV_CACHE: Final = Var(
    name="KVCACHED_MIN_KV_CACHE_MB",
    kind="mib",
    default="0",
    high=MAX_SIZE,
    whole=True,
    hint="a whole number of MiB (0 or unset: one request of max_model_len is the floor of kvctl limit)",
)
# How long an engine that starts on a full shared budget waits for the others to give back its
# floor (kvcached.budget.Budget.join) before it refuses to start.
JOIN_WAIT: Final = Var(
    name="KVCACHED_JOIN_WAIT_S",
    kind="count",
    default="120",
    high=86_400,
    hint="a whole number of seconds up to 86,400 (120 by default; 0: refuse at once on a full budget)",
)
# A vLLM or SGLang release newer than the newest kvcached was tested on serves, with a warning,
# where every patch target is there; this refuses it instead (a fleet that pins what it runs).
STRICT_VERSIONS: Final = Var(
    name="KVCACHED_STRICT_VERSIONS",
    kind="flag",
    default="0",
    hint="1 to refuse an engine release kvcached was not tested on, 0 (or unset) to serve it with a warning",
)
SETTINGS: Final = (
    ENABLE,
    PAGE_SIZE,
    MIN_RESERVED,
    MAX_RESERVED_VAR,
    CONTIGUOUS,
    BACKEND,
    POLICY,
    JOURNAL,
    MAX_CACHED_TOKENS,
    FLIGHT_EVENTS,
    DUMP_DIR,
    BUDGET,
    BUDGET_BYTES,
    MAX_RESERVED_BYTES,
    MAX_JOURNAL_BYTES,
    JOURNAL_SEGMENT_BYTES,
    JOURNAL_KEEP_RUNS,
    JOURNAL_DURABILITY,
    MAX_DUMPS,
    MIN_KV_CACHE,
    PLACEMENT,
    JOIN_WAIT,
    STRICT_VERSIONS,
)

# Read elsewhere, so known: the live view's socket (service/live.py), the key the plugin hands its
# child processes (kvcached/vllm/kv_layout.py), and the build's and the tests' switches.
OTHER_NAMES: Final = frozenset(
    {
        "KVCACHED_LEDGER_SOCKET",
        "KVCACHED_SERVER_KEY",
        "KVCACHED_MYPYC",
        "KVCACHED_EXPECT_COMPILED",
        "KVCACHED_REQUIRE_GPU",
        "KVCACHED_CAPTURE_DIR",
        "KVCACHED_WRITE_FIXTURE",
        "KVCACHED_SERVE_PORT",  # set by the plugin in vllm serve's API server for its engine cores
        "KVCACHED_SERVE_PID",  # likewise: the API server's pid, which its /metrics matches engines by
        "KVCACHED_SERVE_DP_SIZE",  # likewise: --data-parallel-size, which an engine core's config forgets
    }
)

# Upstream kvcached's names that this kvcached does not read (same snapshot; the three meminfo
# and engine-core ones from earlier versions of kvcached/utils.py), and why.
_NO_IPC = "the scheduler's page decisions reach every worker with vLLM's own per-step message, no IPC segment"
UPSTREAM_ONLY: Final = {
    "KVCACHED_IPC_NAME": _NO_IPC,
    "KVCACHED_IPC_TIMEOUT": _NO_IPC,
    "KVCACHED_AUTOPATCH": "here ENABLE_KVCACHED=1 alone turns the vLLM plugin on",
    "KVCACHED_GPU_UTILIZATION": "vLLM sizes the KV cache here (--gpu-memory-utilization, --kv-cache-memory-bytes)",
    "KVCACHED_PAGE_PREALLOC_ENABLED": "KVCACHED_MIN_RESERVED_PAGES and KVCACHED_MAX_RESERVED_PAGES set the reserve",
    "KVCACHED_MAX_CACHED_BLOCKS": "use KVCACHED_MAX_CACHED_TOKENS (upstream reads only that one too)",
    "KVCACHED_SANITY_CHECK": "the ledger checks its invariants on every event; replay a journal with kvreplay check",
    "KVCACHED_NIXL_CONTIGUOUS_LAYOUT": "NIXL is not supported here (OffloadingConnector is the only KV connector)",
    "KVCACHED_LOG_LEVEL": "kvcached logs through vLLM's logger here (VLLM_LOGGING_LEVEL)",
    "KVCACHED_LOG_COLOR": "kvcached logs through vLLM's logger here",
    "KVCACHED_LOG_COLOR_CODE": "kvcached logs through vLLM's logger here",
    "KVCACHED_ENGINECORE_NO_CUDA": "the engine core reaches the worker's pages through kvcached's backend here",
    "KVCACHED_MEMINFO_QUERY_TIMEOUT": "there is no memory-info service here",
    "KVCACHED_MEMINFO_REFRESH_INTERVAL": "there is no memory-info service here",
}


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """Where a setting has an effect: the engines that read it (``ENGINES``' keys), and why it
    has none elsewhere."""

    engines: frozenset[str]
    why: str


ENGINES: Final = {"vllm": "vLLM", "sglang": "SGLang"}

# The settings that do not apply under every engine kvcached serves (any other applies under all).
# Given where it has no effect, a setting is named in one line, as an unknown name is: whoever set
# it expects it to change something, and otherwise would not learn that it did not.
SCOPES: Final[Mapping[str, Scope]] = {
    # Upstream's switch between one virtual range for all layers and one per layer; here the layout
    # is read from the tensors the engine allocates (vLLM: kv_layout.plan from its KVCacheConfig;
    # SGLang: sglang.engine.pool_geometry from its pool), and nothing reads the setting.
    CONTIGUOUS.name: Scope(
        engines=frozenset(),
        why="upstream's switch between one range for all layers and one per layer; here kvcached follows "
        "the layout of the KV tensors the engine allocates",
    ),
}


def ignored_settings(engine: str, env: Mapping[str, str] | None = None) -> list[str]:
    """One line (without a prefix) per setting given in ``env`` that ``engine`` (``"vllm"`` or
    ``"sglang"``) does not read, saying why.

    NOTE: these are the settings kvcached reads that the running engine has no use for
    (``SCOPES``); ``unknown_settings`` names those it does not read at all."""
    e = os.environ if env is None else env
    lines = [
        f"{name}={_show(e[name])} does not apply under {ENGINES[engine]} ({scope.why}); ignored"
        for name, scope in SCOPES.items()
        if engine not in scope.engines and e.get(name, "").strip()
    ]
    # A budget's size without its name: the engine joins no budget, and whoever sized it expects
    # the engine to stay within it.
    if e.get(BUDGET_BYTES.name, "").strip() and not e.get(BUDGET.name, "").strip():
        lines.append(
            f"{BUDGET_BYTES.name}={_show(e[BUDGET_BYTES.name])} sizes the budget {BUDGET.name} names, and none "
            f"is named: this engine joins no budget; set {BUDGET.name} too; ignored"
        )
    return lines


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    enabled: bool = False  # ENABLE_KVCACHED
    page_bytes: int = 2 << 20  # KVCACHED_PAGE_SIZE_MB
    # Whether KVCACHED_PAGE_SIZE_MB was set (not blank): if not, kvcached may choose another page
    # for a block that does not divide the default one (kvcached/page_size.py).
    page_bytes_set: bool = False
    min_reserved_pages: int = 5  # KVCACHED_MIN_RESERVED_PAGES
    max_reserved_pages: int = 10  # KVCACHED_MAX_RESERVED_PAGES
    contiguous_layout: bool = True  # KVCACHED_CONTIGUOUS_LAYOUT
    backend: str = "auto"  # KVCACHED_BACKEND: auto | cuda | host
    policy: Policy = Policy.LEDGER  # KVCACHED_LEDGER_POLICY
    journal: str | None = None  # KVCACHED_LEDGER_JOURNAL
    # KVCACHED_MAX_CACHED_TOKENS: prefix-cached tokens kept on pages (upstream's default); None: no cap
    max_cached_tokens: int | None = UPSTREAM_MAX_CACHED_TOKENS
    flight_recorder_events: int = 65536  # KVCACHED_FLIGHT_RECORDER_EVENTS; 0: off
    dump_dir: str | None = None  # KVCACHED_DUMP_DIR; None: $XDG_STATE_HOME/kvcached
    budget: str | None = None  # KVCACHED_BUDGET: the shared budget's name; None: this engine alone
    budget_bytes: int = 0  # KVCACHED_BUDGET_BYTES; 0: as kvctl budget set it
    max_reserved_bytes: int = 0  # KVCACHED_MAX_RESERVED_BYTES; 0: the page count alone bounds it
    max_journal_bytes: int = 4 << 30  # KVCACHED_MAX_JOURNAL_BYTES; 0: unbounded
    journal_segment_bytes: int = 256 << 20  # KVCACHED_JOURNAL_SEGMENT_BYTES
    journal_keep_runs: int = 3  # KVCACHED_JOURNAL_KEEP_RUNS
    journal_durability: str = "interval"  # KVCACHED_JOURNAL_DURABILITY: none | interval | batch
    max_dumps: int = 20  # KVCACHED_MAX_DUMPS
    min_kv_cache_bytes: int = 0  # KVCACHED_MIN_KV_CACHE_MB: the least a limit may be, beside one request
    placement: str = "whole-pages"  # KVCACHED_PLACEMENT: a kv_cache_manager.Placement value
    join_wait_s: int = 120  # KVCACHED_JOIN_WAIT_S
    strict_versions: bool = False  # KVCACHED_STRICT_VERSIONS
    # What from_env changed of a default to fit a value the user gave, one phrase each, for the
    # startup line ("min reserved pages 2 (default 5 lowered to the given max)"); () if nothing.
    notes: tuple[str, ...] = ()

    @staticmethod
    def enabled_in(env: Mapping[str, str] | None = None) -> bool:
        """``ENABLE_KVCACHED`` alone: with kvcached off, its other settings are not kvcached's to
        judge, and a malformed one must not keep plain vLLM from starting."""
        return _flag(os.environ if env is None else env, ENABLE)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        tokens = _count(e, MAX_CACHED_TOKENS)
        min_pages, max_pages, notes = _reserve(e)
        s = cls(
            enabled=_flag(e, ENABLE),
            page_bytes=_count(e, PAGE_SIZE),
            page_bytes_set=_given(e, PAGE_SIZE),
            min_reserved_pages=min_pages,
            max_reserved_pages=max_pages,
            contiguous_layout=_flag(e, CONTIGUOUS),
            backend=_text(e, BACKEND),
            policy=Policy(_text(e, POLICY)),
            journal=_text(e, JOURNAL) or None,
            max_cached_tokens=None if tokens < 0 else tokens,  # upstream: negative is no cap
            flight_recorder_events=_count(e, FLIGHT_EVENTS),
            dump_dir=_text(e, DUMP_DIR) or None,
            budget=_text(e, BUDGET).strip() or None,
            budget_bytes=_count(e, BUDGET_BYTES),
            max_reserved_bytes=_count(e, MAX_RESERVED_BYTES),
            max_journal_bytes=_count(e, MAX_JOURNAL_BYTES),
            journal_segment_bytes=_count(e, JOURNAL_SEGMENT_BYTES),
            journal_keep_runs=_count(e, JOURNAL_KEEP_RUNS),
            journal_durability=_text(e, JOURNAL_DURABILITY),
            max_dumps=_count(e, MAX_DUMPS),
            min_kv_cache_bytes=_count(e, MIN_KV_CACHE),
            placement=_text(e, PLACEMENT),
            join_wait_s=_count(e, JOIN_WAIT),
            strict_versions=_flag(e, STRICT_VERSIONS),
            notes=notes,
        )
        if s.budget is not None and not BUDGET_NAME.fullmatch(s.budget):
            raise ConfigError(
                f"KVCACHED_BUDGET={_show(s.budget)}: not a budget name; set letters, digits, '.', '_' or '-' "
                "(at most 64, starting with a letter or digit)"
            )
        bound, segment = s.max_journal_bytes, s.journal_segment_bytes
        if bound and bound < 2 * segment:
            # One segment is being written; the other one's worth is room for the snapshot, whose
            # size depends on the engine's geometry (the service checks it once it knows that).
            raise ConfigError(
                f"KVCACHED_MAX_JOURNAL_BYTES={format_size(bound)} is less than two segments of "
                f"KVCACHED_JOURNAL_SEGMENT_BYTES={format_size(segment)} (the one being written and room for the "
                f"snapshot); set KVCACHED_MAX_JOURNAL_BYTES to at least {format_size(2 * segment)} (0: no bound) "
                "or a smaller KVCACHED_JOURNAL_SEGMENT_BYTES"
            )
        if s.min_reserved_pages > s.max_reserved_pages:
            raise ConfigError(
                f"KVCACHED_MIN_RESERVED_PAGES={s.min_reserved_pages} is above "
                f"KVCACHED_MAX_RESERVED_PAGES={s.max_reserved_pages}; set the minimum at most the maximum"
            )
        return s

    def max_cached_blocks(self, block_size: int) -> int | None:
        """The cap in blocks of ``block_size`` tokens, as upstream counts it: a positive number
        of tokens below one block keeps one block (upstream floors at one, so that a small
        cap does not silently mean none); None is no cap."""
        t = self.max_cached_tokens
        if t is None or t == 0:
            return t
        return max(1, t // block_size)


def _given(env: Mapping[str, str], var: Var) -> bool:
    """Whether the user gave ``var`` (``_read``'s rule: blank is the default, not a value)."""
    return bool(env.get(var.name, "").strip())


def _reserve(env: Mapping[str, str]) -> tuple[int, int, tuple[str, ...]]:
    """The reserve's bounds in pages, and what was changed of a default to fit them. A bound the
    user did not give yields to one they gave: upstream kvcached takes
    ``KVCACHED_MAX_RESERVED_PAGES=2`` alone (its ``PageAllocator.__init__`` takes both bounds as
    they are), so the default minimum of 5 is lowered to it, and a minimum given above the
    default maximum raises that. Two given that contradict are the user's to settle: ``from_env``
    refuses them.

    NOTE: a default the user did not give yields to a value they gave (a reserve maximum below
    the default minimum lowers it), and ``Settings.notes`` says so for the startup line."""
    low, high = _count(env, MIN_RESERVED), _count(env, MAX_RESERVED_VAR)
    if low <= high or _given(env, MIN_RESERVED) == _given(env, MAX_RESERVED_VAR):
        return low, high, ()
    if _given(env, MAX_RESERVED_VAR):
        return high, high, (f"min reserved pages {high} (default {low} lowered to the given max)",)
    return low, low, (f"max reserved pages {low} (default {high} raised to the given min)",)


def _show(raw: str) -> str:
    """The value as the refusal shows it: quoted, escaped onto one line, and not a page long."""
    return repr(raw) if len(raw) <= 40 else repr(raw[:40]) + "..."


def _read(env: Mapping[str, str], var: Var) -> bool | int | str:
    """The one rule: blank is the default; else the exact value of ``var``'s kind within its
    bounds, or a one-line ``ConfigError``: the variable, the value, what is wrong, what to set.

    NOTE: unset, empty or blank means the default; otherwise the value must parse exactly as its
    kind (a flag, a whole count, a size in MiB, one of a few words, a path) and lie within its
    bounds. Nothing is truncated (``2.5`` pages is not 2), nothing non-finite or absurd gets
    through (``nan``, ``inf``, ``1e400``, a page of 1e30 MiB), and the bounds are where a value
    stops describing any machine kvcached could serve."""
    raw = env.get(var.name, "")
    text = raw.strip()
    if not text:
        text = var.default
    elif var.kind == "path":
        return raw  # a path is the user's, spaces and all
    refusal = ""
    if len(text) > _LONGEST and var.kind != "path":
        refusal = "too long"
    elif var.kind == "flag":
        low = text.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        refusal = "not a flag"
    elif var.kind == "word":
        low = text.lower()
        if low in var.words:
            return low
        refusal = "not one of " + ", ".join(var.words)
    elif var.kind == "count":
        if var.low >= 0 and not _DIGITS.fullmatch(text):
            refusal = "not a whole number (plain decimal digits, no sign)"
        elif not _SIGNED.fullmatch(text):
            refusal = "not a whole number"
        elif not var.low <= (n := int(text)) <= var.high:
            refusal = "out of range"
        else:
            return n
    elif var.kind == "mib":
        if var.whole and not _DIGITS.fullmatch(text):
            refusal = "not a whole number of MiB (plain decimal digits)"
        elif not _DECIMAL.fullmatch(text):
            refusal = "not a size in MiB (plain decimal digits)"
        else:
            size = Fraction(text) * _MiB
            if not var.low <= size <= var.high:
                refusal = "out of range"
            elif size.denominator != 1 or size.numerator % _KiB4:
                refusal = "not a whole number of 4 KiB units"
            else:
                return size.numerator
    elif var.kind == "size":
        try:
            n = parse_size(text)
        except ValueError as e:
            refusal = str(e)
        else:
            if var.low <= n <= var.high:
                return n
            refusal = "out of range"
    else:  # path
        return text
    raise ConfigError(f"{var.name}={_show(raw)}: {refusal}; set {var.hint}")


def _flag(env: Mapping[str, str], var: Var) -> bool:
    v = _read(env, var)
    assert isinstance(v, bool)
    return v


def _count(env: Mapping[str, str], var: Var) -> int:
    """A count, or a size in bytes."""
    v = _read(env, var)
    assert isinstance(v, int) and not isinstance(v, bool)
    return v


def _text(env: Mapping[str, str], var: Var) -> str:
    v = _read(env, var)
    assert isinstance(v, str)
    return v


def unknown_settings(env: Mapping[str, str] | None = None) -> list[str]:
    """One warning (one line, without a prefix) per ``KVCACHED_*`` variable this kvcached does not read.

    NOTE: it names them as vLLM does unknown ``VLLM_*`` ones, and says which upstream names do
    not apply here (``UPSTREAM_ONLY``)."""
    e = os.environ if env is None else env
    known = {v.name for v in SETTINGS} | OTHER_NAMES
    lines = []
    for name in sorted(n for n in e if n.startswith("KVCACHED_") and n not in known):
        shown = name if re.fullmatch(r"[A-Z0-9_]+", name) else repr(name)
        why = UPSTREAM_ONLY.get(name)
        if why is not None:
            lines.append(f"{shown} is upstream kvcached's and does not apply here ({why}); ignored")
            continue
        # Compared without the prefix every candidate shares, which would make anything look close.
        tails = {k.removeprefix("KVCACHED_"): k for k in sorted(known)}
        close = difflib.get_close_matches(name.removeprefix("KVCACHED_"), list(tails), n=1, cutoff=0.75)
        guess = f"; did you mean {tails[close[0]]}?" if close else ""
        lines.append(f"unknown kvcached environment variable {shown} (ignored){guess}")
    return lines
