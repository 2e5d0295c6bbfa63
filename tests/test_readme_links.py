"""The README's links into the repository lead somewhere.

The docs site (``mkdocs build --strict`` in scripts/test.sh) checks the links between the pages
under ``docs/``; the README is outside that site, so its relative links, and the anchors they
name, are checked here the way MkDocs would: a heading's anchor is its text lowercased, with
punctuation dropped and spaces as hyphens.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            text = re.sub(r"[^\w\s-]", "", text)
            out.add(re.sub(r"\s+", "-", text))
    return out


def broken(readme: Path) -> list[str]:
    bad = []
    for target in LINK.findall(readme.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        page = (readme.parent / path) if path else readme
        if not page.is_file():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(page):
            bad.append(f"{target}: no heading with that anchor")
    return bad


def test_every_relative_link_in_the_readme_resolves() -> None:
    assert broken(ROOT / "README.md") == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "vllm.md").write_text("# Serving with vLLM\n\n## Model kinds\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[a](docs/vllm.md) [b](docs/vllm.md#model-kinds) [c](docs/vlm.md) [d](docs/vllm.md#kinds) [e](https://x.org/y)\n"
    )
    assert broken(readme) == ["docs/vlm.md: no such file", "docs/vllm.md#kinds: no heading with that anchor"]
