"""The package's layers (docs/DESIGN.md §7, "Layers"), derived from its folders: every import
of ``malleus_ds/`` parsed, function-level and ``TYPE_CHECKING`` ones included, and checked:

1. no import cycle between modules;
2. every module sits in a layer: a module at the top of ``malleus_ds/`` is a contract (layer 0;
   at most :data:`MAX_CONTRACTS` of them), a sub-package is in the layer :data:`LAYERS` names
   for it; a package in none fails;
3. a module imports only from its own layer and the layers below it;
4. Hydra and OmegaConf are imported only by ``app/``;
5. the planner and the simulator never import ``engine/``; ``engine/`` and ``adaptive/`` import
   nothing from each other (the engine exposes step hooks, the app attaches the loop);
   ``interop/`` (DeepSpeed's formats) imports nothing from ``engine/`` or ``adaptive/``.

A failure names the arrow (``a -> b``) or the cycle. The parser itself is checked on a small
package written to a temporary folder, so a rule cannot pass by parsing nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "malleus_ds"

#: sub-packages by layer, lowest first; the modules at the top of malleus_ds/ are layer 0
LAYERS = (
    {"files"},                                     # 0: contracts, and what they read and write
    {"resilience", "emulation", "models",          # 1: platform: processes, slowdowns, models,
     "interop"},                                   #    DeepSpeed's formats
    {"planner", "migrate", "engine", "adaptive",   # 2: core
     "dp"},
    {"report", "data", "export", "replay"},        # 3: reading runs, data, exports, replays
    {"app", "chaos", "hf"},                        # 4: the application at the edge, the
                                                   #    fault campaign run against it, the
                                                   #    Hugging Face Trainer
)
#: the contracts at the top of malleus_ds/ stay few (issue 32: "at most about 12")
MAX_CONTRACTS = 12
#: pairs of sub-packages that never import each other, in either direction
APART = (("engine", "adaptive"), ("dp", "adaptive"))
#: (a, b): sub-package a never imports b (b may import a)
BELOW = (("interop", "engine"), ("interop", "adaptive"))
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


def layer_of(m: str, pkg: str = "malleus_ds", packages: set[str] | None = None) -> int | None:
    """The layer of module ``m`` (a dotted name under ``pkg``): 0 for a module at the top, the
    index in :data:`LAYERS` of its sub-package, None for a sub-package in no layer."""
    parts = m.split(".")
    if parts[0] != pkg:
        return None
    if len(parts) == 1:
        return 0                                  # the package's own __init__
    top = parts[1]
    if packages is not None and top not in packages:
        return 0                                  # a module at the top: a contract
    for k, group in enumerate(LAYERS):
        if top in group:
            return k
    return 0 if packages is None and len(parts) == 2 else None


def _top(m: str) -> str | None:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 else None


def violations(edges: dict[str, set[str]], pkg: str = "malleus_ds",
               packages: set[str] | None = None) -> list[str]:
    """Every forbidden arrow in ``edges``. ``packages``: the sub-package names (a dotted name's
    second part that is not one is a module at the top)."""
    out = []
    for m, targets in sorted(edges.items()):
        lm = layer_of(m, pkg, packages)
        for t in sorted(targets):
            if not t.startswith(pkg + ".") and t != pkg:
                if t in THIRD_PARTY_APP and _top(m) != "app":
                    out.append(f"{m} -> {t} (only app/ imports Hydra or OmegaConf)")
                continue
            lt = layer_of(t, pkg, packages)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} -> {t} (layer {lm} imports layer {lt}: only its own layer and "
                           f"the ones below)")
            if (_top(m) in ("planner", "simulate")) and _top(t) == "engine":
                out.append(f"{m} -> {t} (the planner and the simulator never import engine/)")
            for a, b in APART:
                if {_top(m), _top(t)} == {a, b}:
                    out.append(f"{m} -> {t} ({a}/ and {b}/ import nothing from each other)")
            if (_top(m), _top(t)) in BELOW:
                out.append(f"{m} -> {t} ({_top(m)}/ imports nothing from {_top(t)}/)")
    return out


def _packages(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_the_package_has_no_import_cycle():
    found = cycles(imports(modules(PKG, "malleus_ds")))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


#: arrows between engine/ and adaptive/ still to remove (none: the engine exposes step hooks and
#: the app attaches the loop, issue 32 part 1); the list may only shrink
KNOWN_CROSSINGS: set[str] = set()


def test_no_import_crosses_a_layer():
    bad = violations(imports(modules(PKG, "malleus_ds")), packages=_packages(PKG))
    arrows = {b.split(" (")[0] for b in bad}
    new = [b for b in bad if b.split(" (")[0] not in KNOWN_CROSSINGS]
    assert new == [], "forbidden imports:\n" + "\n".join(new)
    gone = sorted(KNOWN_CROSSINGS - arrows)
    assert gone == [], f"these crossings are gone: take them off KNOWN_CROSSINGS: {gone}"


def test_every_package_is_in_a_layer_and_the_contracts_stay_few():
    named = set().union(*LAYERS)
    packages = _packages(PKG)
    assert sorted(packages - named) == [], "sub-packages in no layer (add them to LAYERS)"
    assert sorted(named - packages) == [], "LAYERS names packages that do not exist"
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
    assert len(top) <= MAX_CONTRACTS, f"{len(top)} modules at the top of malleus_ds/: {top}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_the_checker_finds_cycles_and_forbidden_arrows(tmp_path):
    """A toy package: a cycle through a function-level import, a TYPE_CHECKING import from the
    core into the app, a contract importing the engine, the planner importing engine/, the
    engine and the loop importing each other, interop/ importing the engine, OmegaConf outside
    app/, a package in no layer."""
    _write(tmp_path, {
        "malleus_ds/__init__.py": "",
        "malleus_ds/plan.py": "def f():\n    from .engine import run\n",
        "malleus_ds/engine/__init__.py": "from typing import TYPE_CHECKING\n"
                                         "if TYPE_CHECKING:\n    from ..app.config import X\n",
        "malleus_ds/engine/run.py": "from ..plan import f\nimport omegaconf\n"
                                    "from ..adaptive import loop\n",
        "malleus_ds/adaptive/__init__.py": "",
        "malleus_ds/adaptive/loop.py": "X = 1\n",
        "malleus_ds/app/__init__.py": "",
        "malleus_ds/app/config.py": "import malleus_ds.planner.search\nimport hydra\n",
        "malleus_ds/planner/__init__.py": "",
        "malleus_ds/planner/search.py": "from ..engine import run\nfrom . import genetic\n",
        "malleus_ds/planner/genetic.py": "def g():\n    from .search import x\n",
        "malleus_ds/odd/__init__.py": "from ..plan import f\n",
        "malleus_ds/interop/__init__.py": "",
        "malleus_ds/interop/keys.py": "from ..engine import run\n",
    })
    root = tmp_path / "malleus_ds"
    edges = imports(modules(root, "malleus_ds"))
    assert edges["malleus_ds.plan"] == {"malleus_ds.engine.run"}
    assert edges["malleus_ds.engine"] == {"malleus_ds.app.config", "typing"}
    assert edges["malleus_ds.engine.run"] == {"malleus_ds.plan", "omegaconf",
                                              "malleus_ds.adaptive.loop"}
    found = cycles(edges)
    assert ["malleus_ds.engine.run", "malleus_ds.plan"] in found
    assert ["malleus_ds.planner.genetic", "malleus_ds.planner.search"] in found
    bad = violations(edges, packages=_packages(root))
    want = ["malleus_ds.plan -> malleus_ds.engine.run (layer 0 imports layer 2",
            "malleus_ds.engine -> malleus_ds.app.config (layer 2 imports layer 4",
            "malleus_ds.engine.run -> omegaconf (only app/",
            "malleus_ds.engine.run -> malleus_ds.adaptive.loop (engine/ and adaptive/",
            "malleus_ds.planner.search -> malleus_ds.engine.run (the planner",
            "malleus_ds.interop.keys -> malleus_ds.engine.run (interop/ imports nothing from "
            "engine/"]
    for w in want:
        assert any(b.startswith(w) for b in bad), (w, bad)
    assert not any(b.startswith("malleus_ds.app.config -> hydra") for b in bad)
    assert layer_of("malleus_ds.odd", packages=_packages(root)) is None   # in no layer


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
