"""Builds layerstream's C++ extension and its `layerstream` command with CMake,
against the torch installed in this environment:

    pip install torch==<version>                 # first: the extension is built for it
    pip install -v --no-build-isolation .        # -v shows the build's progress

The wheel requires that torch version (install_requires), and importing
layerstream with another torch is an error naming both. No C++ tests are built
(no GoogleTest needed). LS_CUDA_ARCHS="80;90" builds fewer GPU architectures.
"""
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _torch():
    try:
        import torch
        import torch.utils
    except ModuleNotFoundError:
        sys.exit(
            "\nlayerstream: torch is not installed in the Python that builds this package.\n"
            "layerstream's C++ extension is compiled against the torch you will run it with, so\n"
            "install torch first, then build without pip's isolated build environment:\n\n"
            "    pip install torch\n"
            "    pip install --no-build-isolation .\n")
    return torch


def _torch_requirement():
    try:
        import torch
    except ModuleNotFoundError:  # metadata only (e.g. sdist); building needs torch
        return []
    return [f"torch=={torch.__version__.split('+')[0]}"]


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        torch = _torch()
        dest = os.path.abspath(self.get_ext_fullpath(ext.name))
        build_dir = os.environ.get("LS_BUILD_DIR", os.path.join(ROOT, "build-pip"))
        args = [
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLS_BUILD_TESTS=OFF",  # tests need GoogleTest; the package does not
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]  # the CUDA settings LibTorch needs: cmake/layerstream_torch.cmake
        if os.environ.get("LS_CUDA_ARCHS"):
            args.append(f"-DLS_CUDA_ARCHS={os.environ['LS_CUDA_ARCHS']}")
        print(f"layerstream: configuring {build_dir} (torch {torch.__version__})", flush=True)
        subprocess.check_call(args)
        env = dict(os.environ, NINJA_STATUS="layerstream build [%f/%t] ")
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C", "layerstream"], env=env)
        pkg = os.path.join(ROOT, "python", "layerstream")
        built = sorted(f for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so"))
        if not built:
            raise RuntimeError("the CMake build produced no layerstream/_C*.so")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        self.copy_file(os.path.join(pkg, built[-1]), dest)
        out_pkg = os.path.dirname(dest)
        self.copy_file(os.path.join(pkg, "_build_info.py"), os.path.join(out_pkg, "_build_info.py"))
        # The command-line tool, run by the `layerstream` console script (layerstream/_cli.py).
        os.makedirs(os.path.join(out_pkg, "bin"), exist_ok=True)
        self.copy_file(os.path.join(build_dir, "layerstream"), os.path.join(out_pkg, "bin", "layerstream"))


if __name__ == "__main__":  # pip's backend runs this file as __main__; the tests import its functions
    setup(
        packages=["layerstream"],
        package_dir={"": "python"},
        ext_modules=[Extension("layerstream._C", sources=[])],
        cmdclass={"build_ext": CMakeBuild},
        install_requires=_torch_requirement(),
    )
