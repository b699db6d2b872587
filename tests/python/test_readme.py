"""The README's Python snippets run as written, on the sim device.

Each ```python block of README.md runs in a fresh namespace, in order. A block
may only be skipped when its first line says it needs a file the repository
does not have ("# needs a GGUF file ..."), and there are at most two such.
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks():
    text = README.read_text()
    return [textwrap.dedent(m.group(1)) for m in re.finditer(r"^ *```python\n(.*?)^ *```", text, re.M | re.S)]


BLOCKS = _blocks()
NEEDS_FILE = [i for i, b in enumerate(BLOCKS) if b.lstrip().startswith("# needs a GGUF file")]


def test_snippets_found_and_few_need_a_file():
    assert len(BLOCKS) >= 3
    assert len(NEEDS_FILE) <= 2
    for i in NEEDS_FILE:
        assert ".gguf" in BLOCKS[i]


@pytest.mark.parametrize("index", [i for i in range(len(BLOCKS)) if i not in NEEDS_FILE])
def test_snippet_runs(index, capsys):
    code = BLOCKS[index]
    namespace = {"__name__": f"readme_snippet_{index}"}
    if not code.lstrip().startswith("import"):
        exec("import torch, layerstream", namespace)  # the README's first lines, for the later blocks
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)


def test_the_usage_example_streams_more_layers_than_its_slots_hold(capsys):
    """The first example's budget ("12MiB") held its whole 6 MiB model resident: it
    streamed nothing, and its stats() showed no copies."""
    exec(compile(BLOCKS[0], "README.md python block 0", "exec"), {"__name__": "readme_snippet_0"})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{'steps'")]
    assert len(printed) == 1, printed
    stats = ast.literal_eval(printed[0])
    assert stats["steps"] == 1 and stats["h2d_bytes"] > 0, stats
    assert stats["layers"] > stats["slots"], stats  # streaming saves device memory
    assert stats["peak_device_bytes"] <= stats["budget_bytes"], stats
