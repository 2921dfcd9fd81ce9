"""The library's layout, read from its source (no jax): imports go one way through the layers, with no
cycle (imports inside functions count) and no `_private` name imported from another module; the engine's
files stay short, and so do functions, unless a comment says why (docs/architecture.md)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "jfsdp"

# Lower layers never import higher ones. Within a layer, imports must not form a cycle.
LAYERS = {
    "config": 0,
    "engine": 1,
    "train": 2,
    "planning": 3, "io": 3,
    "runtime": 4,
    "cli": 5, "plan": 5, "export": 5, "launch": 5,
}
ENGINE_MAX_LINES = 300
LIBRARY_MAX_LINES = 450
FUNCTION_MAX_LINES = 80
LONG_MARK = "# long:"   # on the def line or the line above: why this function stays whole


def _modules() -> dict:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else None
    assert top in LAYERS, f"{module} is in no layer: add it to tests/test_layout.py's LAYERS and to docs/architecture.md"
    return LAYERS[top]


def _imports(module: str, path: Path):
    """(imported jfsdp module, imported name or None, line) for every import in the file, at any depth."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), alias.name, node.lineno


def _edges():
    edges = {}
    for module, path in MODULES.items():
        if module == "jfsdp":
            continue   # the package's lazy public API (PEP 562) depends on everything by design
        for target, name, line in _imports(module, path):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target not in ("jfsdp", module):
                edges.setdefault(module, []).append((target, name, line))
    return edges


EDGES = _edges()


def test_imports_go_down_the_layers():
    wrong = sorted({f"{m}:{line} imports {t} (layer {_layer(t)} above {_layer(m)})"
                    for m, targets in EDGES.items() for t, _, line in targets if _layer(t) > _layer(m)})
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in targets} for m, targets in EDGES.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_crosses_a_module():
    private = [f"{m}:{line} imports {name} from {t}" for m, targets in EDGES.items() for t, name, line in targets
               if name and name.startswith("_") and not name.startswith("__")]
    assert not private, "\n".join(private)


def test_tests_import_no_private_library_name():
    found = []
    for f in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jfsdp"):
                found += [f"{f.name}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in _library_aliases(f)):
                found.append(f"{f.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, "tests reach into private names:\n" + "\n".join(found)


def _library_aliases(test_file: Path) -> set:
    """Names a test file binds to jfsdp modules (`from jfsdp.planning import memory` -> 'memory')."""
    names = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jfsdp"):
            names |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("jfsdp")}
    return names


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_and_functions_stay_short(module):
    path = MODULES[module]
    lines = path.read_text().splitlines()
    limit = ENGINE_MAX_LINES if module.startswith("jfsdp.engine") else LIBRARY_MAX_LINES
    assert len(lines) <= limit, f"{path.relative_to(ROOT.parent)} has {len(lines)} lines (at most {limit})"
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            marked = any(LONG_MARK in lines[i - 1] for i in (first - 1, node.lineno) if i >= 1)
            assert n <= FUNCTION_MAX_LINES or marked, (
                f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} has {n} lines: split it, or say why "
                f"not in a '{LONG_MARK}' comment on the line above")


def test_the_layout_checker_sees_a_cycle_and_a_private_import(tmp_path):
    """The checks above can fail: a module pair that imports each other, one of them a private name."""
    global MODULES, EDGES
    saved = MODULES, EDGES
    pkg = tmp_path / "jfsdp" / "config"
    pkg.mkdir(parents=True)
    (tmp_path / "jfsdp" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jfsdp.config.b import _hidden\n")
    (pkg / "b.py").write_text("def f():\n    from jfsdp.config import a\n")
    (pkg / "c.py").write_text("from jfsdp.engine import x\n")
    (tmp_path / "jfsdp" / "engine").mkdir()
    (tmp_path / "jfsdp" / "engine" / "__init__.py").write_text("")
    (tmp_path / "jfsdp" / "engine" / "x.py").write_text("")
    global ROOT
    old_root, ROOT = ROOT, tmp_path / "jfsdp"
    try:
        MODULES = _modules()
        EDGES = _edges()
        for check in (test_no_import_cycle, test_no_private_name_crosses_a_module, test_imports_go_down_the_layers):
            with pytest.raises(AssertionError):
                check()
    finally:
        ROOT = old_root
        MODULES, EDGES = saved
