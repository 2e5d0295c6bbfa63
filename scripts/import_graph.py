"""The import graph of kvcached and kvreplay, read from the source (ast), and its cycles.

Run it to see the package's structure: ``python scripts/import_graph.py`` prints the modules,
the import cycles (counting imports inside functions, which run as surely as the ones at the
top, and ignoring ``if TYPE_CHECKING:`` blocks, which never run) and, with ``--served``, every
module and third-party package that a ``vllm serve`` process can reach from kvcached's plugin.
``tests/test_layout.py`` uses the same functions to hold the layout's promises.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kvcached": ROOT / "kvcached",
    "kvreplay": ROOT / "tools" / "kvreplay",
    "kvctl": ROOT / "tools" / "kvctl",
    "kvsim": ROOT / "tools" / "kvsim",
    "kvvalidate": ROOT / "tools" / "kvvalidate",
}
# What vLLM imports in a served process: the plugin entry point, and the offloading spec that
# `--kv-transfer-config` names by module path on vLLM's CPU build.
# The patch table names the modules of its replacements as strings (``factory="module:function"``),
# imported when the patch is installed: they are served roots too.
PATCH_TABLE = ROOT / "kvcached" / "vllm" / "patches.py"


def patch_factories() -> tuple[str, ...]:
    tree = ast.parse(PATCH_TABLE.read_text())
    found = {
        kw.value.value.partition(":")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "factory" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
    }
    return tuple(sorted(found))


SERVED_ROOTS = ("kvcached.vllm.plugin", "kvcached.vllm.offload.cpu", *patch_factories())


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _targets(mod: str, node: ast.Import | ast.ImportFrom, is_pkg: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [f"{name}.{a.name}" if f"{name}.{a.name}" in known else name for a in node.names]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, typing: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> what it imports: our modules by name, third-party ones by top-level package.

    ``typing=True`` counts the imports under ``if TYPE_CHECKING:`` too: they never run, but a
    cycle through them still says that two modules know each other's insides.
    """
    known = modules()
    edges: dict[str, set[str]] = {}
    for mod, path in known.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), typing):
            for target in _targets(mod, node, path.name == "__init__.py", known):
                name = target
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
                elif not name:
                    deps.add(target.split(".")[0])
        edges[mod] = deps
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start] & edges.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w] & edges.keys()))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def reachable(edges: dict[str, set[str]], roots: Iterable[str]) -> set[str]:
    """Every module and third-party package that importing ``roots`` can load (packages' __init__ too)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in edges)
        todo.extend(edges.get(mod, ()))
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="print every module's imports")
    ap.add_argument("--served", action="store_true", help="list what a vllm serve process can import")
    ap.add_argument("--typing", action="store_true", help="count imports under `if TYPE_CHECKING:` too")
    args = ap.parse_args(argv)
    edges = graph(typing=args.typing)
    ours = [m for m in edges]
    print(f"{len(ours)} modules, {sum(len(d & edges.keys()) for d in edges.values())} imports between them")
    found = cycles(edges)
    print(f"{len(found)} import cycle(s)")
    for comp in found:
        print("  cycle:", " <-> ".join(comp))
    if args.verbose:
        for mod in sorted(edges):
            print(f"{mod} -> {', '.join(sorted(edges[mod])) or '-'}")
    if args.served:
        served = reachable(edges, SERVED_ROOTS)
        print("served:", ", ".join(sorted(served)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
