"""The house's structure: no import circle in the package, no module reaching into another
module's class privates, and every cache type speaking the one protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nbkv
from nbkv import protocol

PACKAGE = Path(nbkv.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in it (function bodies included)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return {t for t in found if t in known and t != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> modules it imports; packages' __init__ (re-exports) are left out."""
    modules = _modules()
    faces = {n for n, p in modules.items() if p.name == "__init__.py"}
    known = set(modules) - faces
    return {n: _imports(n, p, known) for n, p in modules.items() if n not in faces}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "nbkv.cache" in graph and "nbkv.base" in graph["nbkv.cache"]  # the parse works
    assert cycles(graph) == []


def _cache_privates() -> dict[str, set[str]]:
    """Underscore members each cache class's module defines on ``self``, or as methods."""
    out = {}
    for name in (
        "base",
        "appending",
        "state",
        "cache",
        "rotating",
        "quantized",
        "quant_appending",
        "quant_state",
        "kvcache",
    ):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        members = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                members.add(node.name)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
            ):
                members.add(node.attr)
        out[f"nbkv/{name}.py"] = {m for m in members if not m.startswith("__")}
    return out


def test_no_module_touches_a_cache_class_privates_from_outside():
    privates = _cache_privates()
    every = set().union(*privates.values())
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = f"nbkv/{path.relative_to(PACKAGE).as_posix()}"
        own = privates.get(rel, set())
        if rel in privates:
            # base.py and its subclasses share one object: self._x there is the class's own
            allowed = every
        else:
            allowed = own
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in every - allowed
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offences.append(f"{rel}:{node.lineno} .{node.attr}")
    assert offences == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: nbkv.LayerKVCache(8),
        lambda: nbkv.RotatingKVCache(8, sinks=2),
    ],
    ids=["LayerKVCache", "RotatingKVCache"],
)
def test_every_layer_cache_speaks_the_protocol(make):
    cache = make()
    assert isinstance(cache, protocol.LayerCache) and protocol.is_layer_cache(cache)
    assert isinstance(cache, nbkv.BaseKVCache)
    assert protocol.cache_type_of(cache) == type(cache).__name__


def test_a_ring_and_a_layer_cache_are_siblings_not_parent_and_child():
    ring = nbkv.RotatingKVCache(4)
    assert not isinstance(ring, nbkv.LayerKVCache)
    assert issubclass(nbkv.RotatingKVCache, nbkv.BaseKVCache)
    assert issubclass(nbkv.LayerKVCache, nbkv.BaseKVCache)


def test_the_protocol_is_documented_in_one_place():
    doc = protocol.__doc__
    for name in (
        "prepare_append",
        "stage_append",
        "commit_append",
        "check_room",
        "attention_view",
        "export_state",
        "from_state",
        "import_state",
        "register_cache_type",
    ):
        assert name in doc, name
