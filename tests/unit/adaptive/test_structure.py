"""The adaptive loop's shape (issue 49): no class in ``adaptive/`` keeps more than
:data:`MAX_ATTRIBUTES` attributes of its own, and ``adaptive/`` imports no torch (the broadcast
is a hook the app passes in; the device's memory comes with the job)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ADAPTIVE = Path(__file__).resolve().parents[3] / "malleus_ds" / "adaptive"
MAX_ATTRIBUTES = 20


def _attributes(cls: ast.ClassDef) -> set[str]:
    """The names ``self.X`` that the class's methods assign (plain, annotated, augmented or
    unpacked)."""
    out: set[str] = set()

    def targets(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                and t.value.id == "self":
            yield t.attr

    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                out.update(targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            out.update(targets(node.target))
    return out


def test_no_class_in_adaptive_sets_more_than_twenty_attributes():
    counts = {}
    for f in sorted(ADAPTIVE.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ClassDef):
                counts[f"{f.name}:{node.name}"] = len(_attributes(node))
    assert counts, "no class found: the walk parsed nothing"
    over = {k: n for k, n in counts.items() if n > MAX_ATTRIBUTES}
    assert over == {}, f"classes over {MAX_ATTRIBUTES} attributes: {over}"


def test_the_counter_counts_every_form_of_assignment():
    cls = ast.parse("class A:\n def f(self):\n  self.a = 1\n  self.b, (self.c, x) = 1, (2, 3)\n"
                    "  self.d: int = 0\n  self.a += 1\n  other.e = 2\n").body[0]
    assert _attributes(cls) == {"a", "b", "c", "d"}


def test_adaptive_imports_no_torch():
    found = []
    for f in sorted(ADAPTIVE.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{f.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert found == []
    code = ("import sys, pkgutil, importlib, malleus_ds.adaptive as a\n"
            "for m in pkgutil.iter_modules(a.__path__):\n"
            "    importlib.import_module(f'malleus_ds.adaptive.{m.name}')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing adaptive/ loads torch"
