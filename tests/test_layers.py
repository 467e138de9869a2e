"""The package's import structure: each module imports only modules of a lower layer, and no private name
(``_name``) of one module is used by another.

The layers, lowest first, are the walk of a tuning call bottom-up: what every module may use, then the
parts of a site, the parts of a verdict, the protocol, the pipeline, the tuners, the report and the command.
A new module takes the lowest layer above everything it imports; moving one lower or higher is a
decision, made here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "disttune"

LAYERS = [
    ["env", "errors", "configs", "wire", "files", "phases", "intercept", "jit_launch"],
    ["timing", "graphs", "storeplane", "device", "logs", "sites", "space", "triton_launch", "warmup"],
    ["nodeplane"],
    ["comm"],
    ["objective", "search", "checks", "ending", "store", "compile", "unseen", "diagnostics", "benchmark", "startup"],
    ["agreement", "handlers", "verify", "console", "dist"],
    ["options", "fast_path"],
    ["pipeline", "sweep", "cached_launch"],
    ["contextual", "function"],
    ["report.logs", "report.diagnostics"],
    ["report.sites", "report.verify"],
    ["report.markdown", "report.plots"],
    ["report"],
    ["cli", "report.__main__"],
    ["__init__", "__main__"],
]
LAYER = {name: number for number, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(encoding="utf-8"), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(name: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """``(module imported, names taken from it, line)`` for every relative import, lazy ones included."""
    package = name.split(".")[:-1] if name not in ("report",) else ["report"]
    if name in ("__init__", "__main__"):
        package = []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [alias.name for alias in node.names]
            submodules = [n for n in names if is_module(".".join(target + [n]))]
            if node.module:
                found.append((".".join(target), [n for n in names if n not in submodules], node.lineno))
            for sub in submodules:
                found.append((".".join(target + [sub]), [], node.lineno))
    return found


def test_every_module_has_a_layer():
    assert sorted(set(modules()) - set(LAYER)) == [], "give the new module a layer in LAYERS"
    assert sorted(set(LAYER) - set(modules())) == [], "a module in LAYERS no longer exists"


@pytest.mark.parametrize("name", sorted(LAYER))
def test_a_module_imports_only_lower_layers(name):
    tree = modules()[name]
    upward = [f"line {line}: {target} (layer {LAYER.get(target, '?')})"
              for target, _, line in imports(name, tree)
              if target and LAYER.get(target if target else "__init__", 99) >= LAYER[name]]
    assert upward == [], f"{name} (layer {LAYER[name]}) imports its own layer or above: {upward}"


@pytest.mark.parametrize("name", sorted(LAYER))
def test_no_private_name_crosses_a_module(name):
    tree = modules()[name]
    crossing = [f"line {line}: {target}.{taken}" for target, names, line in imports(name, tree)
                for taken in names if taken.startswith("_") and not taken.startswith("__")]
    aliases = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level for alias in node.names
               if is_module(alias.name) or alias.name in LAYER}
    crossing += [f"line {node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                 and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert crossing == [], f"{name} uses private names of other modules: {crossing}"
