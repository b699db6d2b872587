"""Bugs planted in the Python layer (python/layerstream), continued: python.py holds the
earlier entries (at ~900 lines it is full), python_optim.py the optimizers' and the
several-process wiring's."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS: list = [
]
