"""Imports run one way: down the layers the README's layout section names.

A module may import its own layer and the layers below it, never one above (a lazy import inside
a function counts too: it is the same dependency, paid later). training/ sits just above replicas/
and data/, so a draft can be trained on a machine without the serving stack's layers.
"""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top to bottom, as in the README.
LAYERS = ("cli", "bench", "cluster", "ingress", "router", "policies", "training", "replicas", "data")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, specserve layer) of every import of a specserve module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "specserve" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def test_every_package_folder_is_a_layer():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tops = {folder.split("/")[0] for folder in package_dir.values()}
    assert tops == set(LAYERS), f"pyproject packages {sorted(tops)}; the layers here are {LAYERS}"


def test_no_module_imports_a_layer_above_its_own():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [f"{path.relative_to(ROOT)}:{line} imports specserve.{layer}"
              for own in LAYERS for path in sorted((ROOT / own).rglob("*.py"))
              for line, layer in _imports(path) if layer in rank and rank[layer] < rank[own]]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_model_room_imports_nothing_else_of_replicas():
    """``replicas/model/`` (the forward, the caches, the kernels) sits below the step, the
    scheduler, the drafts and the deployments: it imports only itself from ``replicas``."""
    room = ROOT / "replicas" / "model"
    upward = []
    for path in sorted(room.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            upward += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                       if name.startswith("specserve.replicas") and not name.startswith("specserve.replicas.model")]
    assert not upward, "imports out of the model room:\n" + "\n".join(upward)
