"""layerstream: stream layer weights from host RAM to the GPU, ahead of use.

Quick use::

    import layerstream
    handle = layerstream.offload(model, budget="8GiB", prefetch=2)
    loss = model(x).sum(); loss.backward()     # param.grad complete on return
    print(handle.stats())
    handle.detach()                             # weights back, bit-identical

The engine is C++ (``layerstream._C``). This package only finds the layers, hands
them to the engine and swaps their ``forward``; one module per concern (the map:
docs/design/README.md):

    _offload    offload(): the steps, in order          _handle    Handle
    _attach     offload()'s step 5: the layers attached   _calls     the model's call hooks
    _discovery  which modules stream, and as what       _forward   the installed forwards
    _prequant   already-quantized weights, quantize=     _guards    .to() / load_state_dict()
    _packed     the stand-in of a weight offload() packed _standin  what stand-ins refuse
    _gguf       load_gguf() and GgufWeight               compat     the original API
    _safetensors load_safetensors() (FileWeight: _file_weight; shared: _loading)
    optim       AdamW, Adafactor: host optimizers in C++ (csrc/core/optim/)
"""
from __future__ import annotations

from ._torch_check import check_torch as _check_torch

_check_torch()  # before _C loads: an extension built for another torch fails obscurely

from . import _C, _ops, optim  # noqa: E402,F401 (_ops: the operators' fake kernels)
from ._file_weight import FileWeight  # noqa: E402
from ._gguf import GgufLoad, GgufWeight, load_gguf  # noqa: E402
from ._guards import _StreamedApply  # noqa: F401,E402 - read by tests that inject failures
from ._handle import Handle  # noqa: E402
from ._loading import LoadReport  # noqa: E402
from ._offload import SIM_DEVICE_MEMORY, offload, parse_bytes  # noqa: E402
from ._safetensors import load_safetensors  # noqa: E402

__all__ = ["offload", "Handle", "LayerstreamError", "parse_bytes", "load_gguf", "GgufLoad", "GgufWeight",
           "load_safetensors", "LoadReport", "FileWeight", "SIM_DEVICE_MEMORY", "optim", "__version__"]
from ._build_info import VERSION as __version__  # noqa: E402 (CMake's project version)

LayerstreamError = _C.LayerstreamError
