"""The one patch record both wings extend (``kvcached.engine.targets``) and its one checker.

A toy engine's table over the standard library: a row holds for its releases only, an optional
row's absent target is skipped, a required one is refused naming the target, a ``loaded_only``
row is looked for only where its module is imported, and a wing's ``checked`` decides which
attributes must be there. Both wings' tables are instances of it.
"""

from __future__ import annotations

import re
import sys
from typing import ClassVar

import msgspec
import pytest

from kvcached.engine.releases import Releases
from kvcached.engine.targets import Target, present
from kvcached.errors import ConfigError

TOY = Releases("Toy", ("1.0.0", "2.0.0"))


class Row(Target, frozen=True, kw_only=True):
    RELEASES: ClassVar[Releases] = TOY

    since: str = TOY.oldest
    added: bool = False

    def checked(self) -> tuple[str, ...]:
        return () if self.added else self.attrs


def _refuse(row: Row, target: str) -> ConfigError:
    return ConfigError(f"{target} is missing (known for Toy {row.range})")


DUMPS = Row(module="json", owner=None, attrs=("dumps", "loads"), why="the codec")
DECODER = Row(module="json", owner="JSONDecoder", attrs=("decode",), why="its class")


def test_each_row_that_holds_is_found_with_its_owner() -> None:
    import json

    found = present((DUMPS, DECODER), "1.0.0", _refuse)
    assert found == [(DUMPS, json), (DECODER, json.JSONDecoder)]


def test_a_row_outside_its_releases_is_not_looked_for() -> None:
    gone = msgspec.structs.replace(DUMPS, attrs=("not_there",), until="1.5.0")
    assert present((gone,), "2.0.0", _refuse) == []
    with pytest.raises(ConfigError, match=r"^json\.not_there is missing \(known for Toy 1\.0\.0 to 1\.4\.x\)$"):
        present((gone,), "1.0.0", _refuse)


def test_what_is_missing_is_refused_naming_the_target_unless_optional() -> None:
    for row, target in (
        (msgspec.structs.replace(DECODER, attrs=("decode", "not_there")), "json.JSONDecoder.not_there"),
        (msgspec.structs.replace(DECODER, owner="NoSuchClass"), "json.NoSuchClass"),
        (msgspec.structs.replace(DECODER, module="no_such_module_here"), "no_such_module_here"),
    ):
        with pytest.raises(ConfigError, match="^" + re.escape(f"{target} is missing")):
            present((row,), "1.0.0", _refuse)
        assert present((msgspec.structs.replace(row, optional=True),), "1.0.0", _refuse) == []


def test_a_loaded_only_row_is_looked_for_where_its_module_is_imported() -> None:
    row = Row(module="kvcached_toy_never_imported", owner=None, attrs=("x",), why="a runner", loaded_only=True)
    assert "kvcached_toy_never_imported" not in sys.modules
    assert present((row,), "1.0.0", _refuse) == []


def test_a_wings_record_says_which_attributes_must_be_there() -> None:
    added = msgspec.structs.replace(DECODER, attrs=("kvcached_engine",), added=True)
    assert [r for r, _ in present((added,), "1.0.0", _refuse)] == [added]


def test_an_unreadable_version_is_the_newest() -> None:
    old = msgspec.structs.replace(DUMPS, until="2.0.0")
    assert not old.holds_for("dev-build") and DUMPS.holds_for("dev-build")


def test_vllms_table_is_rows_of_the_one_record() -> None:
    from kvcached.vllm import patches

    assert all(isinstance(p, Target) for p in (*patches.PATCHES, *patches.RELIED_ON))
    assert patches.Patch.RELEASES is patches.VLLM
    # SGLang's: tests/sglang_engine/test_releases.py (its own environment)
