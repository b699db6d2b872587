"""Builds layerstream's C++ extension with CMake against the installed torch.

Offline / with your own torch: pip install --no-build-isolation .
"""
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch.utils

        dest = os.path.abspath(self.get_ext_fullpath(ext.name))
        build_dir = os.environ.get("LS_BUILD_DIR", os.path.join(ROOT, "build-pip"))
        args = [
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        if os.path.exists("/usr/local/cuda/bin/nvcc"):
            args += ["-DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda",
                     "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"]
        import glob
        nvrtc = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib",
                                       "libnvrtc.so.*"))
        if nvrtc:
            args.append(f"-DCUDA_nvrtc_LIBRARY={os.path.abspath(nvrtc[0])}")
        subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C"])
        pkg = os.path.join(ROOT, "python", "layerstream")
        built = sorted(f for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so"))
        if not built:
            raise RuntimeError("the CMake build produced no layerstream/_C*.so")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        self.copy_file(os.path.join(pkg, built[-1]), dest)


setup(
    packages=["layerstream"],
    package_dir={"": "python"},
    ext_modules=[Extension("layerstream._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
