"""What one entry of the mutation catalogue says (tools/mutations/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Mutation:
    name: str
    file: str            # path in the repository
    anchor: str          # exact snippet, must occur once
    replacement: str
    tests: list          # "py:tests/python/x.py::test_y" or "gtest:binary:Filter.*"
    why: str             # the bug it plants, and the issue item it stands for
    survived_before: bool = False  # survived the audit of issue 29 (before its tests)
    extra_targets: list = field(default_factory=list)


P = "py:tests/python/"  # a pytest test's prefix in Mutation.tests
