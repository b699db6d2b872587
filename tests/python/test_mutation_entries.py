"""tools/mutations/'s entries (the audit tools/mutate.py runs) stay in step with the code: an entry whose anchor moved
away reports "stale" only when someone runs the audit, and until then the bug it stands
for is audited by nothing (on 2026-12-05 seven entries had drifted that way). Each
anchor occurs exactly once in its file, and each test (or script) an entry runs exists."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mutations():
    package = ROOT / "tools" / "mutations"
    spec = importlib.util.spec_from_file_location("layerstream_mutations", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up; its parts import from it
    try:
        spec.loader.exec_module(module)
    finally:
        for name in [n for n in sys.modules if n == spec.name or n.startswith(spec.name + ".")]:
            sys.modules.pop(name, None)
    return module.MUTATIONS


def test_every_anchor_occurs_once_in_its_file():
    mutations = _mutations()
    assert len(mutations) > 50
    bad = []
    for m in mutations:
        n = (ROOT / m.file).read_text().count(m.anchor)
        if n != 1:
            bad.append(f"{m.name}: its anchor occurs {n} times in {m.file}")
    assert not bad, "\n".join(bad)


def test_every_listed_test_exists():
    bad = []
    for m in _mutations():
        for t in m.tests:
            kind, _, what = t.partition(":")
            if kind == "py":
                path, _, func = what.partition("::")
                text = (ROOT / path).read_text() if (ROOT / path).exists() else None
                if text is None or (func and not re.search(rf"^def {re.escape(func.split('[')[0])}\(", text, re.M)):
                    bad.append(f"{m.name}: {t}")
            elif kind == "gtest":
                binary, _, pattern = what.partition(":")
                source = ROOT / "tests" / "cpp" / f"{binary}.cpp"
                name = pattern.strip("*").split(".")[-1].strip("*")
                if not source.exists() or (name and name not in source.read_text()):
                    bad.append(f"{m.name}: {t}")
            elif kind == "cmd":  # a command: the script it runs exists
                scripts = [w for w in what.split() if w.endswith((".py", ".sh"))]
                if not scripts or not all((ROOT / w).exists() for w in scripts):
                    bad.append(f"{m.name}: {t}")
            else:
                bad.append(f"{m.name}: {t} (not py:, gtest: or cmd:)")
    assert not bad, "\n".join(bad)
