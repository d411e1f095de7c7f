"""The package's layers (docs/DESIGN.md §7, "Layers"): every import of ``malleus_ds/`` parsed,
function-level and ``TYPE_CHECKING`` ones included, and checked against the rules:

1. no import cycle between modules;
2. the bottom layer imports only the bottom layer (and third-party packages);
3. nothing in the core (bottom layer, ``engine/``, ``migrate/``, ``planner/``, ``models/`` and the
   adaptive loop) imports the app (``runners/``, ``config``, ``data/``, ``reference``,
   ``export/``, ``cli``, ``plot``, ``compare``, ``api``) or Hydra / OmegaConf;
4. the planner and the simulator never import ``engine/``.

A failure names the arrow (``a -> b``) or the cycle. The parser itself is checked on a small
package written to a temporary folder, so a rule cannot pass by parsing nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "malleus_ds"

#: the bottom layer: pure contracts and models every other layer stands on
BOTTOM = {"job_layout", "plan", "problem", "cost", "layout", "schedule", "views", "samples",
          "optim", "files", "simulate"}
#: the core above it (packages or modules, relative to malleus_ds)
CORE = BOTTOM | {"engine", "migrate", "planner", "models", "adaptive", "clock", "resilience",
                 "emulation", "ds_compat",
                 "device"}
#: the app: what the core must never import
APP = {"runners", "config", "run_config", "data", "reference", "export", "cli", "report", "api"}
THIRD_PARTY_APP = {"hydra", "omegaconf"}


def modules(root: Path, name: str) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules (ours: the longest known prefix) and top-level third-party packages
    it imports anywhere in its file."""
    edges: dict[str, set[str]] = {}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module or ""
                subs = [f"{b}.{a.name}" for a in node.names if f"{b}.{a.name}" in mods]
                names = subs + ([b] if len(subs) < len(node.names) else [])
            for x in names:
                cand = x
                while cand not in mods and "." in cand:
                    cand = cand.rsplit(".", 1)[0]
                if cand in mods:
                    if cand != m:
                        found.add(cand)
                else:
                    found.add(x.split(".")[0])
        edges[m] = found
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def _in(m: str, group: set[str], pkg: str) -> bool:
    rel = m[len(pkg) + 1:] if m.startswith(pkg + ".") else None
    return rel is not None and rel.split(".")[0] in group


def violations(edges: dict[str, set[str]], pkg: str = "malleus_ds") -> list[str]:
    out = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            ours = t.startswith(pkg + ".")
            if _in(m, BOTTOM, pkg) and ours and not _in(t, BOTTOM, pkg):
                out.append(f"{m} -> {t} (the bottom layer imports only the bottom layer)")
            if _in(m, CORE, pkg) and (_in(t, APP, pkg) or t in THIRD_PARTY_APP):
                out.append(f"{m} -> {t} (the core imports no app code, Hydra or OmegaConf)")
            if (_in(m, {"planner", "simulate"}, pkg)) and _in(t, {"engine"}, pkg):
                out.append(f"{m} -> {t} (the planner and the simulator never import engine/)")
    return out


def test_the_package_has_no_import_cycle():
    found = cycles(imports(modules(PKG, "malleus_ds")))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_crosses_a_layer():
    bad = violations(imports(modules(PKG, "malleus_ds")))
    assert bad == [], "forbidden imports:\n" + "\n".join(bad)


def test_every_layer_named_exists():
    names = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    missing = sorted((BOTTOM | CORE | APP) - names)
    assert missing == [], f"layer lists name modules that do not exist: {missing}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_the_checker_finds_cycles_and_forbidden_arrows(tmp_path):
    """A toy package: a cycle through a function-level import, a TYPE_CHECKING import from the
    core into the app, the bottom importing the engine, and the planner importing engine/."""
    _write(tmp_path, {
        "malleus_ds/__init__.py": "",
        "malleus_ds/plan.py": "def f():\n    from .engine import run\n",
        "malleus_ds/engine/__init__.py": "from typing import TYPE_CHECKING\n"
                                         "if TYPE_CHECKING:\n    from ..config import X\n",
        "malleus_ds/engine/run.py": "from ..plan import f\nimport omegaconf\n",
        "malleus_ds/config.py": "import malleus_ds.planner.search\n",
        "malleus_ds/planner/__init__.py": "",
        "malleus_ds/planner/search.py": "from ..engine import run\nfrom . import genetic\n",
        "malleus_ds/planner/genetic.py": "def g():\n    from .search import x\n",
    })
    edges = imports(modules(tmp_path / "malleus_ds", "malleus_ds"))
    assert edges["malleus_ds.plan"] == {"malleus_ds.engine.run"}
    assert edges["malleus_ds.engine"] == {"malleus_ds.config", "typing"}
    assert edges["malleus_ds.engine.run"] == {"malleus_ds.plan", "omegaconf"}
    found = cycles(edges)
    assert ["malleus_ds.engine.run", "malleus_ds.plan"] in found
    assert ["malleus_ds.planner.genetic", "malleus_ds.planner.search"] in found
    bad = violations(edges)
    assert any(b.startswith("malleus_ds.plan -> malleus_ds.engine.run (the bottom") for b in bad)
    assert any(b.startswith("malleus_ds.engine -> malleus_ds.config (the core") for b in bad)
    assert any(b.startswith("malleus_ds.engine.run -> omegaconf") for b in bad)
    assert any(b.startswith("malleus_ds.planner.search -> malleus_ds.engine.run (the planner")
               for b in bad)


@pytest.mark.parametrize("layer", sorted(BOTTOM))
def test_bottom_modules_parse(layer):
    p = PKG / f"{layer}.py"
    if not p.is_file():
        p = PKG / layer / "__init__.py"
    assert p.is_file(), f"bottom-layer module or package {layer} is missing"


def _names_from_malleus(files):
    """(file, module, name) for every ``from malleus_ds... import name`` in ``files`` (any depth
    in the file: the benches import inside functions)."""
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] == "malleus_ds":
                for a in node.names:
                    yield f, node.module, a.name


def test_every_name_the_scripts_import_from_the_package_exists():
    """bench/, launch/, scripts/ and tests import names from malleus_ds inside functions, where
    a rename only shows when that branch runs (bench_adaptive's oracle once imported a name
    that had been renamed): each one must resolve."""
    import importlib

    root = PKG.parent
    files = [p for d in ("bench", "launch", "scripts", "tests") for p in (root / d).rglob("*.py")]
    missing = []
    for f, mod, name in _names_from_malleus(files):
        m = importlib.import_module(mod)
        if name != "*" and not hasattr(m, name):
            try:
                importlib.import_module(f"{mod}.{name}")
            except ImportError:
                missing.append(f"{f.relative_to(root)}: from {mod} import {name}")
    assert not missing, missing
