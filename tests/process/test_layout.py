"""The house rules: one import root, settings read in one place, documented in the README."""
from __future__ import annotations

import functools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The folders at the top of the checkout that hold product code (blockflow/core/ is inside blockflow/).
PRODUCT_DIRS = ["blockflow", "blocks", "dispatcher", "manager", "tensormq"]


@functools.cache
def _packages() -> dict[str, str]:
    """Every installed package and its folder, as pyproject.toml's setuptools table says: a package
    in ``package-dir`` has its own folder (blockflow.blocks is blocks/), another one is the folder
    of its name inside its parent's (blockflow.core is blockflow/core/)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]
    dirs = table.get("package-dir", {})
    out = {}
    for pkg in table["packages"]:
        parent, _, leaf = pkg.rpartition(".")
        out[pkg] = dirs[pkg] if pkg in dirs else os.path.join(out[parent], leaf) if parent else pkg
    return out


def _product_files():
    for folder in _packages().values():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_every_setting_is_read_in_settings_py_only():
    offenders = []
    for rel in _product_files():
        if rel == os.path.join("blockflow", "core", "settings.py"):
            continue
        with open(os.path.join(ROOT, rel)) as f:
            for i, line in enumerate(f, 1):
                if re.search(r"environ(\.get)?[\[(]\s*[\"']BLOCKFLOW_", line):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "read BLOCKFLOW_* settings through blockflow.core.settings:\n" + "\n".join(offenders)


def test_readme_settings_table_is_generated_from_settings_py():
    from blockflow.core import settings
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert settings.markdown_table() in readme, "regenerate the README table: python -m blockflow.core.settings"


def test_product_code_imports_through_one_root():
    bad = []
    for rel in _product_files():
        with open(os.path.join(ROOT, rel)) as f:
            for i, line in enumerate(f, 1):
                if re.match(r"\s*(from|import) (blocks|manager|dispatcher|tensormq|experiments|tests)\b", line):
                    bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "product modules import blockflow.* only (never experiments or tests):\n" + "\n".join(bad)


# -- what installs, what imports what ---------------------------------------------------------------

_IMPORT_ALL = r"""
import importlib, json, sys
names = json.loads(sys.argv[1])
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
foreign = sorted(m for m in sys.modules if m.split(".")[0] in ("experiments", "tests", "conftest"))
print(json.dumps({"modules": names, "failed": failed, "foreign": foreign,
                  "path": [p for p in sys.path if p]}))
"""


def test_every_product_module_imports_without_experiments_or_tests(tmp_path):
    """Run from an empty directory, with nothing on PYTHONPATH: the product stands alone."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    names = [_module_of(rel) for rel in _product_files()]
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, json.dumps(names)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "experiments"))
                   for p in result["path"]), result["path"]
    expected = {"blockflow.cli", "blockflow.manager.manager", "blockflow.manager.reconcile",
                "blockflow.blocks.process", "blockflow.dispatcher.process", "blockflow.tensormq.transport"}
    assert expected <= set(result["modules"]), result["modules"]
    assert not result["failed"], result["failed"]
    assert not result["foreign"], f"product modules imported {result['foreign']}"


def test_the_control_plane_imports_no_torch():
    """``blockflow serve`` runs no model: its modules load without torch or numpy (about 2.8 s of
    CPU and 600 MB per server). test_control_plane checks the running server's own mappings. Nor
    does ``blockflow export`` before its worker starts (``blocks/exporter.py``)."""
    import subprocess
    import sys
    code = ("import sys, blockflow.cli, blockflow.server, blockflow.rest, blockflow.metrics, blockflow.openinference, "
            "blockflow.manager.ray_launcher, blockflow.blocks.exporter; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"], f"the control plane imports {out.stdout.strip()}"


def _module_of(rel: str) -> str:
    folder, name = os.path.split(rel)
    pkg = {d: p for p, d in _packages().items()}[folder]
    return pkg if name == "__init__.py" else f"{pkg}.{name[:-3]}"


def test_no_product_module_uses_another_modules_private_names():
    """``from blockflow.x import _y`` or ``x._y`` on a product module couples two modules through
    what one of them promised nobody. Say it in the owner's public API instead."""
    import ast
    import importlib
    import types
    bad = []
    for rel in _product_files():
        me = _module_of(rel)
        package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), rel)
        modules = {}  # local name -> product module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else (node.module or "")
                if not base.startswith("blockflow"):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and base != me:
                        bad.append(f"{rel}:{node.lineno}: from {base} import {alias.name}")
                    try:
                        obj = getattr(importlib.import_module(base), alias.name, None)
                    except ImportError:
                        obj = None
                    if isinstance(obj, types.ModuleType):
                        modules[alias.asname or alias.name] = obj.__name__
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("blockflow") and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and modules[node.value.id] != me
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names used across product modules:\n" + "\n".join(bad)


# -- layers ------------------------------------------------------------------------------------------

#: The packages in layers, bottom first (CONTRIBUTING.md, "Layers"; the README draws them). A
#: module imports from its own package and from the layers below its own, never from one beside
#: it or above it: so a reader can start at the bottom and climb, and a package can be tested with
#: only what is under it.
LAYERS = [
    # settings, protocol, header codec, update schema, CURVE keys, child-process plumbing, tracing:
    # what every process shares
    ("blockflow.core",),
    # the wire format, slots, transports: how tensors travel between processes
    ("blockflow.tensormq",),
    # the two process roles, each on the transport; neither imports the other
    ("blockflow.blocks", "blockflow.dispatcher"),
    # the control plane: starts the roles (through their specs), supervises them, tells them the topology
    ("blockflow.manager",),
    # what a user runs: the CLI, REST, server, metrics, Open Inference Protocol, client, standalone, loadgen
    ("blockflow",),
]


@functools.cache
def _imports() -> dict[str, list[tuple[str, int, str]]]:
    """Every product module's imports of product modules, at module level and inside functions
    alike: module -> [(file, line, imported module)]. ``from P import name`` imports module
    ``P.name`` when that is one, else ``P``; relative imports are resolved from the package the
    file installs as (pyproject.toml's package-dir: blocks/x.py is blockflow.blocks.x)."""
    import ast
    modules = {_module_of(rel): rel for rel in _product_files()}
    out = {}
    for me, rel in modules.items():
        package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), rel)
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve("." * node.level + (node.module or ""), package) if node.level else node.module
                found += [(rel, node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
                          for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(rel, node.lineno, a.name) for a in node.names]
        out[me] = [(r, line, name) for r, line, name in found if name.split(".")[0] == "blockflow"]
    return out


def _package_of(module: str) -> str:
    """The installed package a module belongs to: the longest one its name starts with."""
    return max((p for p in _packages() if module == p or module.startswith(p + ".")), key=len)


def test_every_package_has_a_layer():
    placed = [p for layer in LAYERS for p in layer]
    assert sorted(placed) == sorted(_packages()), "place each package of pyproject.toml in LAYERS, once"


def test_no_package_imports_a_layer_beside_or_above_it():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    bad = []
    for me, imports in _imports().items():
        mine = _package_of(me)
        for rel, line, name in imports:
            theirs = _package_of(name)
            if theirs != mine and rank[theirs] >= rank[mine]:
                where = "beside" if rank[theirs] == rank[mine] else "above"
                bad.append(f"{rel}:{line}: {me} ({mine}) imports {name} ({theirs}), a layer {where} it")
    assert not bad, ("a package imports a layer beside or above it (LAYERS, bottom first: "
                     + " < ".join("/".join(layer) for layer in LAYERS) + "):\n" + "\n".join(bad))


def test_no_import_cycle_between_packages():
    """Independently of LAYERS: the packages' import graph (an edge where any module of one imports
    any module of another) has no cycle."""
    edges: dict[str, dict[str, str]] = {}  # package -> imported package -> one place that does it
    for me, imports in _imports().items():
        for rel, line, name in imports:
            a, b = _package_of(me), _package_of(name)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, f"{rel}:{line} imports {name}")
    cycles = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            loop = path[path.index(node):] + [node]
            cycles.append(" -> ".join(loop) + "\n    " + "\n    ".join(edges[a][b] for a, b in zip(loop, loop[1:])))
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, {})):
            visit(nxt, path + [node])
        done.add(node)

    for package in sorted(_packages()):
        visit(package, [])
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def test_the_root_package_imports_nothing_when_loaded():
    """Importing any module of BlockFlow, blockflow.core.settings included, first runs
    blockflow/__init__.py (and the __init__.py of its own package): they import nothing at module
    level (the root loads its client on first use), so the bottom layer stays the bottom."""
    import ast
    bad = []
    for package, folder in _packages().items():
        rel = os.path.join(folder, "__init__.py")
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), rel)
        bad += [f"{rel}:{node.lineno}" for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert not bad, "a package's __init__.py imports at module level:\n" + "\n".join(bad)


def test_the_layer_check_sees_function_level_and_relative_imports():
    """The checks above are not vacuous: the graph holds an import made inside a function
    (blocks/process.py imports outalloc where it is needed) and a relative one resolved through
    the package-dir mapping (blocks/manifest.py's ``from . import split``)."""
    imports = _imports()
    assert ("blockflow.tensormq.outalloc" in {n for _, _, n in imports["blockflow.blocks.process"]})
    assert ("blockflow.blocks.split" in {n for _, _, n in imports["blockflow.blocks.manifest"]})


def _resolve(name: str, package: str) -> str:
    import importlib.util
    return importlib.util.resolve_name(name, package)


def test_pip_install_adds_only_blockflow(tmp_path):
    """`pip install .` puts one top-level package (and its metadata, and the console script)
    into site-packages: no blocks/, manager/, experiments/ beside other distributions."""
    import re
    import shutil
    import subprocess
    import sys
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *PRODUCT_DIRS):  # a clean copy: no build/ in the worktree
        (shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy)(
            os.path.join(ROOT, name), src / name)
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    top = sorted(os.listdir(target))
    others = [n for n in top if n not in ("blockflow", "bin") and not re.fullmatch(r"blockflow-[^/]+\.dist-info", n)]
    assert "blockflow" in top and not others, top
    installed = {p for p in os.listdir(target / "blockflow")}
    assert {"core", "blocks", "dispatcher", "manager", "tensormq", "cli.py"} <= installed, installed
    assert "experiments" not in installed and "tests" not in installed


def test_bench_lists_exactly_the_experiments_of_the_checkout():
    from blockflow.cli import EXPERIMENT_NAMES
    from experiments import EXPERIMENTS
    assert sorted(EXPERIMENT_NAMES) == sorted(EXPERIMENTS)
