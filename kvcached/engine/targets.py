"""One record of an engine attribute kvcached changes or relies on, and one check of a table of them.

Both wings declare what they change in their engine as a table of rows: vLLM's
``kvcached.vllm.patches.PATCHES`` and SGLang's ``kvcached.sglang.hooks.PATCHES``. Each row is a
``Target``, which a wing's own record extends (vLLM's adds how and when it is installed) and
binds to its engine's tested releases. ``present`` finds the owner of every row that holds for the
running release, or refuses in one line naming the target, before anything is changed. The table
is its argument, so this core imports neither wing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

import msgspec

from ..errors import ConfigError
from .releases import Releases


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """``module.owner.attr`` for each of ``attrs``, for the releases from ``since`` up to, not
    including, ``until`` (None: still there in the newest tested).

    NOTE: upstream kvcached's ``integration/patch_base.py`` (``BasePatch``: a library, a target,
    ``can_apply``; ``version_utils.version_range``) kept as data: a frozen record per change in
    one table per engine, so the whole surface is a screen to read before an upgrade. A target
    that moved between releases is two rows, one range each."""

    # The engine's tested releases: each wing's record names its own.
    RELEASES: ClassVar[Releases]

    module: str
    owner: str | None  # the class; None: a module attribute
    attrs: tuple[str, ...]
    why: str  # the engine's function or upstream change it relies on
    since: str = ""  # each wing's record defaults it to its oldest tested release
    until: str | None = None
    optional: bool = False  # a target some builds lack: skipped there, not refused
    loaded_only: bool = False  # looked for only in a process that has imported the module already

    def targets(self) -> list[str]:
        """``module.owner.attr`` for each attribute."""
        where = f"{self.module}.{self.owner}" if self.owner else self.module
        return [f"{where}.{a}" for a in self.attrs]

    def checked(self) -> tuple[str, ...]:
        """The attributes the owner must have (an attribute kvcached adds is not among them)."""
        return self.attrs

    def holds_for(self, version: str) -> bool:
        """Whether the row holds for ``version``; one that cannot be read (a build's own string, a
        stand-in's) is taken as the newest."""
        try:
            return self.RELEASES.holds(self.since, self.until, version)
        except ConfigError:
            return self.until is None

    @property
    def range(self) -> str:
        """``0.32.0 to 0.33.x`` or ``0.34.0 on``: what a refusal names."""
        return self.RELEASES.span(self.since, self.until)


T = TypeVar("T", bound=Target)


def present(rows: Iterable[T], version: str, refuse: Callable[[T, str], Exception]) -> list[tuple[T, Any]]:
    """The rows that hold for ``version`` whose owner (module or class) is there, with it, in
    order; an optional row's absent owner or attribute skips it. Anything else missing raises
    ``refuse(row, target)``. Changes nothing."""
    found = []
    for row in rows:
        if not row.holds_for(version):
            continue
        owner = _owner(row, refuse)
        if owner is None:
            continue
        where = dict(zip(row.attrs, row.targets(), strict=True))
        missing = [where[a] for a in row.checked() if not hasattr(owner, a)]
        if missing and not row.optional:
            raise refuse(row, missing[0])
        if not missing:
            found.append((row, owner))
    return found


def _owner(row: T, refuse: Callable[[T, str], Exception]) -> Any | None:
    if row.loaded_only:
        module = sys.modules.get(row.module)
        if module is None:
            return None
    else:
        try:
            module = importlib.import_module(row.module)
        except ImportError:
            if row.optional:
                return None
            raise refuse(row, row.module) from None
    if row.owner is None:
        return module
    owner = getattr(module, row.owner, None)
    if owner is None and not row.optional:
        raise refuse(row, f"{row.module}.{row.owner}")
    return owner
