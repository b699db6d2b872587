"""The mutation audit's catalogue: each entry plants one plausible bug (an exact source
snippet, the anchor, replaced in one file) and names the tests that must catch it, kept
beside the code it plants in: core.py (csrc/core, the sim backend, the CLI), torch_glue.py
(csrc/torch, the bindings), python.py and python_more.py (python/layerstream) and
python_optim.py (its optimizers and several-process wiring). tools/mutate.py runs them (its
docstring says how); tests/python/test_mutation_entries.py keeps every anchor and test
name in step with the code. Figures and history: docs/mutation-audit.md.
"""
from __future__ import annotations

from . import core, python, python_more, python_optim, torch_glue
from .base import Mutation

MUTATIONS = (core.MUTATIONS + torch_glue.MUTATIONS + python.MUTATIONS + python_more.MUTATIONS +
             python_optim.MUTATIONS)

CONTROL = {"control-harmless-comment"}

__all__ = ["CONTROL", "MUTATIONS", "Mutation"]
