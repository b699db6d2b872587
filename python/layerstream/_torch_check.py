"""The torch the extension was built against, checked before ``_C`` is loaded.

A C++ extension works only with the torch it was compiled and linked against
(LibTorch has no stable ABI): another version fails to load with an undefined
symbol, or worse, loads. ``_build_info.py`` (written by the CMake build) names
that torch; ``check_torch()`` compares the installed one with it (release
numbers; the local tag such as ``+cu130`` is not compared).
"""
from __future__ import annotations


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def check_torch() -> None:
    import torch
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        raise ImportError(
            "layerstream's C++ extension is not built (python/layerstream/_build_info.py is missing): "
            "build it with `bash tools/setup.sh` (then PYTHONPATH=python), or install the package with "
            "`pip install --no-build-isolation .` in an environment that has torch") from None
    if _release(torch.__version__) != _release(TORCH_VERSION):
        raise ImportError(
            f"layerstream was built against torch {TORCH_VERSION}, but torch {torch.__version__} is installed: "
            f"install torch=={_release(TORCH_VERSION)}, or rebuild layerstream for this torch "
            f"(`pip install --no-build-isolation .` in its source tree; README, 'Install with pip')")
