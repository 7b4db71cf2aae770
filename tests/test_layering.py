"""The dependency rule: the folders stand in layers, runtime at the bottom, then passes, then
exporter, and no module imports from a layer above its own; no import cycle between modules.
Checked over every module of every sub-package, with imports inside functions counted too (a
late import does not make a cycle go away). The rule has no exceptions."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import networkx as nx

from paths import ROOT

ROOT_PACKAGE = "b12x_toolchain"
FOLDERS = {"exporter": f"{ROOT_PACKAGE}.exporter", "passes": f"{ROOT_PACKAGE}.passes",
           "runtime": f"{ROOT_PACKAGE}.runtime", "b12x-toolchain": ROOT_PACKAGE}
# Lowest first: a module may import its own layer and the layers before it, never one after.
LAYERS = ("runtime", "passes", "exporter")


def layer_of(name: str) -> str:
    """The layer a module belongs to ("" for the root package, which imports nothing)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def above(layer: str) -> tuple:
    """The layers a module of `layer` must not import."""
    return LAYERS[LAYERS.index(layer) + 1:] if layer else LAYERS


def under(target: str, layers: tuple) -> bool:
    return any(target == f"{ROOT_PACKAGE}.{layer}" or target.startswith(f"{ROOT_PACKAGE}.{layer}.") for layer in layers)


def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module under the mapped folders."""
    found = {}
    for folder, dotted in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([dotted, *parts])] = path
    return found


def imported_names(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file may load (`from a import b`: a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph(known: dict[str, Path]) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        graph.add_edges_from((name, target) for target in imported_names(path) if target in known and target != name)
    return graph


def test_every_sub_package_is_scanned_and_packaged():
    # A sub-package missing from pyproject's list would be left out of a wheel.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages - {f"{ROOT_PACKAGE}.recipes"} <= listed and f"{ROOT_PACKAGE}.runtime.serving" in packages
    assert len(packages) > 10  # the sub-packages are really walked, not only the folder roots


def test_no_import_reaches_a_higher_layer():
    offenders = []
    for name, path in modules().items():
        offenders += [f"{path.relative_to(ROOT)}: {target}" for target in imported_names(path)
                      if under(target, above(layer_of(name)))]
    assert offenders == []


def test_the_layers_are_ordered_and_exact():
    # The rewrite kit is runtime: the runtime lowers graphs with it and the exporter's rewrites
    # build on it, so it sits below both.
    assert layer_of(f"{ROOT_PACKAGE}.runtime.rewrite.manager") == "runtime"
    assert layer_of(f"{ROOT_PACKAGE}.passes.fuse_window_snapshot") == "passes"
    assert above("runtime") == ("passes", "exporter") and above("passes") == ("exporter",) and above("exporter") == ()
    assert under(f"{ROOT_PACKAGE}.passes.pipeline", above("runtime"))
    assert not under(f"{ROOT_PACKAGE}.passesx", above("runtime"))  # a prefix of a name is not the layer
    assert not under(f"{ROOT_PACKAGE}.runtime.rewrite", above("passes"))


def test_no_import_cycle_between_modules():
    cycles = [" -> ".join(cycle) for cycle in nx.simple_cycles(import_graph(modules()))]
    assert cycles == []


def test_a_late_import_still_makes_a_cycle(tmp_path):
    # The scanner itself: an import inside a function is an edge like any other.
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import g\n")
    graph = import_graph({"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"})
    assert list(nx.simple_cycles(graph)) and "pkg.a.g" in imported_names(tmp_path / "b.py")


def test_loading_a_package_pulls_in_no_exporter_code(fused_path):
    code = (
        "import sys; from b12x_toolchain.runtime import load, Decoder;"
        f"Decoder(load({str(fused_path)!r}).session(slots=1)).generate([[1, 2]], 2);"
        "bad = sorted(m for m in sys.modules if m.startswith(('b12x_toolchain.exporter', 'b12x_toolchain.passes')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
