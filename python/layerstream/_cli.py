"""The `layerstream` console script of the pip package: runs the C++
command-line tool the wheel carries (layerstream/bin/layerstream) with the
same arguments and exit status."""
from __future__ import annotations

import os
import sys


def main() -> None:
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "layerstream")
    if not os.path.exists(exe):
        sys.exit(f"layerstream: the command-line tool is not installed at {exe} (it comes with the wheel; "
                 f"in a source tree run build/layerstream after tools/setup.sh)")
    import torch  # noqa: F401  (the tool links LibTorch, whose libraries this import locates)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    env.setdefault("LS_PYTHON", sys.executable)  # `bench --plot` draws with this Python
    os.execve(exe, [exe] + sys.argv[1:], env)
