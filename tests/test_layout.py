"""The layout's promises: what a server imports, a pure ledger core, an engine-agnostic core with
one package per serving engine, no import cycles."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from kvcached.vllm.patches import VLLM

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

# Declared by extras, not by the package's own dependencies: a served engine must not need them.
OPTIONAL = {"rich", "matplotlib", "psutil", "hypothesis", "pytest"}
PURE_CORE = (
    "kvcached.ledger",
    "kvcached.ledger.events",
    "kvcached.ledger.ledger",
    "kvcached.ledger.checks",
    "kvcached.ledger.tables",
    "kvcached.ledger.queries",
    "kvcached.ledger.state",
    "kvcached.ledger.findings",
    "kvcached.ledger.journal",
    "kvcached.ledger.files",
)


def test_a_served_engine_reaches_no_scaffolding_and_no_optional_dependency() -> None:
    served = import_graph.reachable(import_graph.graph(), import_graph.SERVED_ROOTS)
    assert "kvcached.vllm.plugin" in served and "kvcached.vllm.engine_core.bridge" in served
    assert {"kvcached.vllm.engine_core.served", "kvcached.vllm.worker.hooks"} <= served  # the table's factories
    scaffolding = ("kvcached.testing", "kvcached.vllm.testing", "kvreplay", "kvctl", "kvsim", "kvvalidate", "kvcli")
    assert not {m for m in served if m.startswith(scaffolding) or m in scaffolding}
    assert not served & OPTIONAL


ENGINES = {"vllm": "kvcached.vllm", "sglang": "kvcached.sglang"}
# An engine is imported by its wing, and by kvsim's room for that engine (a tool), nowhere else.
ENGINE_ROOMS = {"vllm": (ENGINES["vllm"], "kvsim.on_vllm"), "sglang": (ENGINES["sglang"], "kvsim.on_sglang")}


def test_only_an_engines_package_imports_that_engine() -> None:
    edges = import_graph.graph(typing=True)
    for engine, packages in ENGINE_ROOMS.items():
        importers = {m for m, deps in edges.items() if engine in deps}
        strays = {m for m in importers if not any(m == p or m.startswith(p + ".") for p in packages)}
        assert not strays, f"{sorted(strays)} import {engine} outside {packages}"
    assert any("vllm" in deps for deps in edges.values())  # the rule looks at real imports


def test_the_core_imports_no_engine_package() -> None:
    edges = import_graph.graph(typing=True)
    engine_packages = tuple(ENGINES.values())
    core = [m for m in edges if m.startswith("kvcached") and not m.startswith(engine_packages)]
    assert "kvcached.ledger.ledger" in core and "kvcached.page_allocator" in core
    for m in core:
        bad = {d for d in edges[m] if d.startswith(engine_packages) or d in ENGINES}
        assert not bad, f"{m} imports {sorted(bad)}: the core must stay engine-agnostic"


def test_the_wings_import_the_core_never_each_other() -> None:
    """One engine-neutral core, one wing per engine: what SGLang's wing needs of vLLM's (or the
    reverse) belongs in the core (``kvcached.engine``). Scaffolding (``testing``) is aside: a
    mixed-engine test drives both."""
    edges = import_graph.graph(typing=True)
    for name, package in ENGINES.items():
        others = tuple(p for n, p in ENGINES.items() if n != name)
        for m, deps in edges.items():
            if (m == package or m.startswith(package + ".")) and ".testing" not in m:
                bad = {d for d in deps if d.startswith(others)}
                assert not bad, f"{m} imports {sorted(bad)}: a wing imports the core, never another wing"
    assert any(d.startswith("kvcached.engine") for d in edges["kvcached.sglang.hooks"])
    assert any(d.startswith("kvcached.engine") for d in edges["kvcached.vllm.patches"])


def _modules_by_stem() -> dict[str, set[Path]]:
    found: dict[str, set[Path]] = {}
    for p in [*ROOT.glob("kvcached/**/*.py"), *ROOT.glob("tools/**/*.py")]:
        found.setdefault(p.stem, set()).add(p.parent)
    return found


def _package_docs() -> list[tuple[Path, str, set[str]]]:
    """Each package's ``__init__``: its path, its docstring, the modules and packages in it."""
    import ast

    out = []
    for init in [*ROOT.glob("kvcached/**/__init__.py"), *ROOT.glob("tools/**/__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        here = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        out.append((init, doc, here))
    return out


def test_a_package_docstring_names_only_modules_it_has() -> None:
    """A package's docstring describes today's layout: a module it names as ``name`` is one of
    its own, not one that moved to another package (written with its package there)."""
    stems = _modules_by_stem()
    stray = [
        f"{init.relative_to(ROOT)} names ``{tok}``, which is in {sorted(str(d.relative_to(ROOT)) for d in stems[tok])}"
        for init, doc, here in _package_docs()
        for tok in re.findall(r"``([a-z_][a-z0-9_]*)``", doc)
        if tok in stems and tok not in here
    ]
    assert not stray, stray


def test_each_testing_package_has_a_face_naming_what_is_there() -> None:
    """``__all__`` in each scaffolding package, every name in it a module there or defined there."""
    for init, _, here in _package_docs():
        if init.parent.name != "testing":
            continue
        module = importlib.import_module(".".join(init.parent.relative_to(ROOT).parts))
        face = getattr(module, "__all__", None)
        assert face, f"{init.relative_to(ROOT)} has no __all__"
        missing = [n for n in face if n not in here and not hasattr(module, n)]
        assert not missing, (init, missing)


def test_the_ledger_core_imports_only_msgspec_and_the_standard_library() -> None:
    edges = import_graph.graph(typing=True)
    core = import_graph.reachable(edges, PURE_CORE)
    ours = {m for m in core if m in edges}
    assert ours <= set(PURE_CORE) | {"kvcached", "kvcached.errors", "kvcached.version"}, ours - set(PURE_CORE)
    third_party = {m for m in core if m not in edges} - set(sys.stdlib_module_names)
    assert third_party == {"msgspec"}


def test_the_ledger_core_stands_alone_in_a_process_without_anyio_torch_or_vllm() -> None:
    code = (
        "import sys; sys.modules.update(anyio=None, torch=None, vllm=None, rich=None);"
        "import kvcached.ledger; kvcached.ledger.Ledger;"
        "from kvcached.ledger import journal, state, checks, findings, events"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_package_has_no_import_cycle_even_through_type_checking_imports() -> None:
    assert import_graph.cycles(import_graph.graph()) == []
    assert import_graph.cycles(import_graph.graph(typing=True)) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]


# Which parts may import each optional dependency: the ones whose extra declares it (pyproject's
# `replay` and `testing` extras), and kvctl, which prints plain text when rich is missing.
OPTIONAL_USERS = {
    "rich": ("kvreplay", "kvcached.vllm.testing", "kvctl.render", "kvctl.engines"),
    # kvcached.vllm.testing.elastic: the main job's timeline plot, imported lazily (no plot without it);
    # the demo's .venv-cpu gets it from the `test` extra.
    "matplotlib": ("kvreplay.plot", "kvcached.vllm.testing.elastic"),
    "psutil": ("kvcached.testing", "kvcached.vllm.testing", "kvcached.sglang.testing"),
}


def test_optional_dependencies_are_imported_only_by_the_parts_that_declare_them() -> None:
    edges = import_graph.graph()
    for dep, users in OPTIONAL_USERS.items():
        importers = {m for m, deps in edges.items() if dep in deps}
        assert importers, f"nothing imports {dep}: drop it from OPTIONAL_USERS"
        strays = {m for m in importers if not m.startswith(users)}
        assert not strays, f"{dep} is imported by {sorted(strays)}, which do not declare it"


def test_the_public_face_is_small_and_loads_nothing_until_asked() -> None:
    code = (
        "import sys, kvcached, kvcached.ledger;"
        "assert 'kvcached.kv_cache_manager' not in sys.modules and 'kvcached.settings' not in sys.modules;"
        "assert sorted(dir(kvcached)) == sorted(kvcached.__all__);"
        "from kvcached import KVCacheManager, KVGeometry, KvcachedError, Ledger, Settings, __version__;"
        "assert KVCacheManager.__module__ == 'kvcached.kv_cache_manager' and Ledger is kvcached.ledger.Ledger;"
        "import importlib.metadata as md; assert __version__ == md.version('kvcached');"
        "from kvcached.errors import ConfigError; assert issubclass(ConfigError, KvcachedError)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_version_is_written_once() -> None:
    """pyproject.toml names it; everything else reads the installed metadata (kvcached.version)."""
    literal = '"0.1.0.dev0"'
    holders = [p for p in (ROOT / "kvcached").rglob("*.py") if literal in p.read_text()]
    assert holders == [], holders


def test_what_the_gpu_checks_import_stands_without_anyio_or_vllm() -> None:
    """scripts/gpu_check.sh runs tests/gpu on a machine with torch and msgspec only."""
    code = (
        "import sys; sys.modules.update(anyio=None, vllm=None, rich=None);"
        "from kvcached.vllm import kv_layout, step_channel;"
        "from kvcached.vllm.engine_core import step_sender;"
        "from kvcached.vllm.worker import kv_memory, step_receiver;"
        "import kvcached.kv_cache_manager, kvcached.backends"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_sglang_engine_imports_without_sglang() -> None:
    """tests/gpu/test_sglang_cuda.py runs kvcached's SGLang engine on a GPU image without SGLang:
    the engine, its bridge and its control import neither SGLang nor vLLM (the hooks and the
    allocator, which subclass or patch SGLang's classes, do)."""
    code = "import sys; sys.modules.update(sglang=None, vllm=None, rich=None); import kvcached.sglang.engine"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_kvsim_without_vllm_says_what_to_install_in_one_line() -> None:
    code = "import sys; sys.modules['vllm'] = None; from kvsim.cli import main; sys.exit(main(['run', '--seeds', '1']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"install vLLM {VLLM.newest}" in done.stderr


TOOLS = ("kvreplay", "kvctl", "kvsim", "kvvalidate", "kvcli")


def _cross_tool_cli_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (m, t) for m, ts in edges.items() for t in ts if t.endswith(".cli") and t.split(".")[0] != m.split(".")[0]
    )


def test_a_tool_calls_another_tools_functions_never_its_command_line() -> None:
    """kvsim writes a golden trace's check report with kvreplay's ``run_check``, not by running
    ``kvreplay check --json`` and reading its stdout; and the package imports no tool at all."""
    edges = import_graph.graph(typing=True)
    assert _cross_tool_cli_imports(edges) == []
    assert _cross_tool_cli_imports({"kvsim.on_vllm.shrink": {"kvreplay.cli"}}) == [
        ("kvsim.on_vllm.shrink", "kvreplay.cli")
    ]
    upward = sorted((m, t) for m, ts in edges.items() if m.startswith("kvcached") for t in ts if t.startswith(TOOLS))
    assert upward == []


def _private_reads(source: str) -> list[str]:
    """``x._name`` on anything but ``self`` or ``cls`` (dunders aside)."""
    import ast

    return [
        f"{ast.unparse(node.value)}.{node.attr} (line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def test_kvsim_reaches_the_harness_and_the_stacks_through_their_public_faces() -> None:
    found = {
        str(p.relative_to(ROOT)): reads
        for p in sorted((ROOT / "tools" / "kvsim").rglob("*.py"))
        if (reads := _private_reads(p.read_text()))
    }
    assert found == {}
    assert _private_reads("step = self.h._executing\nself._x = 1\n") == ["self.h._executing (line 1)"]


def test_a_planted_bug_is_chosen_by_a_name_the_registry_has() -> None:
    from kvcached.testing import plants

    assert {"no-poll", "no-hold", "evict-on-free", "zero-loads", "foreign-store"} <= set(plants.PLANTS)
    try:
        with plants.planted("no-pol"):
            raise AssertionError("planted an unknown bug")
    except ValueError as e:
        assert str(e).startswith("no planted bug 'no-pol'; one of no-poll, ")


def test_the_sglang_wing_loads_no_vllm_module_when_it_runs() -> None:
    """The static rule above misses an import made by name at run time (``importlib``): the
    check of which modules are compiled must ask the engine-neutral ones alone under SGLang."""
    code = (
        "import sys; from kvcached.sglang.control import engine_info;"
        "engine_info(socket='s', policy='ledger', sglang='0.5.23', budget=None, backend='host', page_size=1);"
        "loaded = sorted(m for m in sys.modules if m.startswith('kvcached.vllm'));"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
