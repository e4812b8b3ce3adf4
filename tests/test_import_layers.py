"""The package's import graph follows docs/design.md's layer table.

Imports are read with `ast` (module level and inside functions, nothing is imported), so a
lazy `from ..x import y` counts like a top-level one. A "unit" is a top-level module or
subpackage of transformer_engine_proto (`recipe`, `tensor`, `module`, ...).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import transformer_engine_proto

PKG = "transformer_engine_proto"
ROOT = Path(transformer_engine_proto.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"


def _modules():
    """Dotted module name -> path, for every .py file of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = [PKG] + list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports():
    """(importer, target module, imported name or None, line) for every import inside the package,
    plus (importer, module alias, attribute, line) for `alias._x` reads of an imported module."""
    imports, attrs = [], []
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        bound = {}  # local name -> package module it names
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PKG:
                        imports.append((mod, a.name, None, node.lineno))
                        if a.asname:
                            bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
                    base = ".".join(base)
                else:
                    base = node.module or ""
                if base.split(".")[0] != PKG:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in MODULES:  # `from .. import recipe`: the module itself
                        imports.append((mod, sub, None, node.lineno))
                        bound[a.asname or a.name] = sub
                    else:
                        imports.append((mod, base, a.name, node.lineno))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                attrs.append((mod, bound[node.value.id], node.attr, node.lineno))
    return imports, attrs


IMPORTS, ATTRS = _imports()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer_table():
    """Unit -> row index of design.md's "Layers" table (row 0 is imported by all the others)."""
    text = DESIGN.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    layers = {}
    for i, row in enumerate(rows):
        for path in re.findall(r"`([^`]+)`", row.split("|")[2]):
            layers[path.rstrip("/").removesuffix(".py")] = i
    return layers


def _find_cycle(graph):
    """One cycle of `graph` (node -> set of nodes) as a list of nodes, or None."""
    state = {}

    def visit(v, stack):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w, stack)
                if found:
                    return found
        stack.pop()
        state[v] = "done"
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v, [])
            if found:
                return found
    return None


def _where(mod, line):
    return f"{MODULES[mod].relative_to(ROOT.parent)}:{line}"


def test_every_unit_has_one_layer():
    layers = layer_table()
    units = {unit(m) for m in MODULES}
    missing = sorted(units - set(layers))
    assert not missing, f"add these to docs/design.md's layer table: {missing}"


def test_imports_follow_the_layer_table():
    layers = layer_table()
    bad = sorted({f"{_where(m, line)} ({unit(m)}) imports {t} ({unit(t)})" for m, t, _, line in IMPORTS
                  if unit(m) != unit(t) and layers.get(unit(t), -1) > layers.get(unit(m), -1)})
    assert not bad, "imports of a later layer of docs/design.md's table:\n" + "\n".join(bad)


def test_no_cycle_between_units():
    graph = defaultdict(set)
    for m, t, _, _ in IMPORTS:
        if unit(m) != unit(t):
            graph[unit(m)].add(unit(t))
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle between units: " + " -> ".join(cycle)


def test_no_cycle_between_modules():
    """Also inside a unit (debug/state <-> debug/config_check). A module reading the package that
    contains it (a kernel registering itself with `from .. import register_kernel`) is not counted."""
    graph = defaultdict(set)
    for m, t, _, _ in IMPORTS:
        if t in MODULES and t != m and not m.startswith(t + "."):
            graph[m].add(t)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def subpackage(mod: str) -> str:
    """The subpackage of `mod`; the package root's own modules (recipe.py, autocast.py, ...) are one."""
    return unit(mod) if MODULES[mod].parent != ROOT else ""


def test_no_private_names_across_subpackages():
    bad = [f"{_where(m, line)} imports {t}{'.' + name if name else ''}" for m, t, name, line in IMPORTS
           if subpackage(m) != subpackage(t) and (any(_private(p) for p in t.split(".")) or (name and _private(name)))]
    bad += [f"{_where(m, line)} reads {t}.{attr}" for m, t, attr, line in ATTRS
            if subpackage(m) != subpackage(t) and _private(attr)]
    assert not bad, "private names used from another subpackage (make them public or add a hook):\n" + "\n".join(bad)


def test_the_checks_see_function_level_imports():
    """The parser must count lazy imports (the kind that hid the module <-> distributed cycle)."""
    lazy = [(m, t) for m, t, _, _ in IMPORTS if m == f"{PKG}.debug.state" and t.endswith("config_check")]
    assert lazy, "debug/state.py imports config_check inside layer_plan"
    assert any(t == f"{PKG}.distributed.tp" and a == "group_by_name" for _, t, a, _ in ATTRS)
