"""Imports flow one way (DESIGN.md): leaf types <- model <- speculation <- engine <- entrypoints <-
cli, server, bench. A module never imports a layer above its own, not even inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specserve

ROOT = Path(specserve.__file__).parent
LAYERS = ["leaf", "model", "speculation", "engine", "entrypoints", "user"]


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "specserve":
        return "user"  # the package itself (specserve/__init__) sits on top
    head = parts[1]
    if head in ("model", "speculation", "engine", "entrypoints"):
        return head
    if head in ("cli", "server", "bench", "train"):
        return "user"
    return "leaf"


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m.startswith("specserve")]


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_points_up(path: Path) -> None:
    module = "specserve." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    own = LAYERS.index(layer(module))
    up = [m for m in imports(path) if LAYERS.index(layer(m)) > own]
    assert not up, f"{module} ({LAYERS[own]}) imports from above its layer: {up}"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from specserve.engine.engine import LLMEngine\n")
    assert [m for m in imports(bad) if LAYERS.index(layer(m)) > LAYERS.index("speculation")]
