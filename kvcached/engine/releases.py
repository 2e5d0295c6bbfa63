"""Engine releases: which ones kvcached was tested on, and which a patch target holds for.

Both wings declare every change they make to their engine as rows of a table (vLLM's
``kvcached.vllm.patches.PATCHES``, SGLang's ``kvcached.sglang.hooks.PATCHES``). A target that moved
between releases is two rows, each with the range of releases it holds for, from ``since`` up to
(not including) ``until``: upstream kvcached's ``version_utils.version_range`` kept as data, so
the code asks the table which row holds rather than comparing versions itself. ``Releases`` is
one engine's tested list; ``Releases.check`` is what a starting engine asks of its own release:
older than the oldest tested is refused, an untested one serves with one warning line, or is
refused under ``KVCACHED_STRICT_VERSIONS=1``.
"""

from __future__ import annotations

import msgspec

from ..errors import ConfigError

Release = tuple[int, int, int]


class Releases(msgspec.Struct, frozen=True):
    """The releases of ``engine`` kvcached was tested on, oldest first."""

    engine: str  # what messages call it: "vLLM", "SGLang"
    tested: tuple[str, ...]

    @property
    def oldest(self) -> str:
        return self.tested[0]

    @property
    def newest(self) -> str:
        return self.tested[-1]

    def parse(self, version: str) -> Release:
        """``"0.34.0+cpu"`` -> ``(0, 34, 0)``: the release a version string names (a local or a
        pre-release suffix is that release); ``ConfigError`` for what names none."""
        parts = []
        for piece in version.split("+")[0].split(".")[:3]:
            digits = ""
            for ch in piece:
                if not ch.isdigit():
                    break
                digits += ch
            if not digits:
                raise ConfigError(f"kvcached cannot read {self.engine}'s version {version!r} (not like {self.newest})")
            parts.append(int(digits))
        while len(parts) < 3:
            parts.append(0)
        return (parts[0], parts[1], parts[2])

    def is_tested(self, version: str) -> bool:
        return ".".join(map(str, self.parse(version))) in self.tested

    def holds(self, since: str, until: str | None, version: str) -> bool:
        """Whether ``version`` is in ``since`` up to, not including, ``until`` (None: no end)."""
        r = self.parse(version)
        return self.parse(since) <= r and (until is None or r < self.parse(until))

    def span(self, since: str, until: str | None) -> str:
        """``0.32.0 to 0.33.x`` or ``0.34.0 on``: how a refusal names a row's range."""
        if until is None:
            return f"{since} on"
        u = self.parse(until)
        last = f"{u[0]}.{u[1] - 1}.x" if u[2] == 0 and u[1] else until
        return f"{since} to {last}"

    def check(self, version: str, *, strict: bool = False) -> str | None:
        """Refuse a release older than the oldest tested, and under ``strict`` any untested one;
        for an untested one otherwise, the warning to log (its patch targets are checked where
        they are installed: a missing one is refused there in one line). None: a tested release."""
        known = f"{self.oldest} to {self.newest} (tested: {', '.join(self.tested)})"
        r = self.parse(version)
        if r < self.parse(self.oldest):
            raise ConfigError(
                f"kvcached supports {self.engine} {known}; this is {version}: install one of those or disable "
                "kvcached (ENABLE_KVCACHED=0)"
            )
        if self.is_tested(version):
            return None
        if strict:
            raise ConfigError(
                f"kvcached was not tested on {self.engine} {version} and KVCACHED_STRICT_VERSIONS=1: install one of "
                f"{', '.join(self.tested)}, or unset KVCACHED_STRICT_VERSIONS"
            )
        which = "newer than" if r > self.parse(self.newest) else "a release between those"
        return (
            f"{self.engine} {version} is {which} kvcached was tested on ({', '.join(self.tested)}; newest "
            f"{self.newest}); every patch target is checked as it is installed (KVCACHED_STRICT_VERSIONS=1 "
            "refuses untested releases)"
        )
