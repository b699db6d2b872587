# The GPU proof's build, sourced by bench/gpu/run.sh (on the GPU machine) and
# bench/gpu/prebuild.sh (here, ahead of a device call). Run from the checkout's root.

# The GPU machine's versions, as measured there (docs/benchmarks.md, run 5):
# prebuild.sh builds for them, tools/other_torch.sh tests against them.
LS_GPU_PYTHON=3.12
LS_GPU_TORCH=2.11.0
LS_GPU_TORCHVISION=0.26.0
LS_GPU_CUDA_ARCH=90        # CMake's spelling
LS_GPU_TORCH_ARCH=9.0      # torch's (TORCH_CUDA_ARCH_LIST)

# What a build for the GPU depends on, as one line: the contents of every file CMake
# reads for the targets gpu_build makes and of this file (its flags), the Python minor
# version, torch's version and the CUDA architecture. Equal lines on two machines: a
# build made on one serves the other (bench/gpu/prebuild.sh, run.sh). Needs no git (the
# device's copy has none).
gpu_build_stamp() {  # PY
  local src
  src=$(find CMakeLists.txt cmake csrc bench tests/cpp tools/cli examples python/layerstream/_build_info.py.in \
          -type f \( ! -path 'bench/gpu/*' -o -path bench/gpu/build_lib.sh \) ! -name '*.py' ! -name '*.md' \
          ! -path '*/__pycache__/*' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
  # torch's version as torch.__version__ says it, read from torch/version.py: importing
  # torch takes seconds, and this runs several times a proof run.
  echo "sources $src; $("$1" -c 'import importlib.util, os, runpy, sys
v = runpy.run_path(os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "version.py"))
print("python %d.%d; torch %s" % (sys.version_info[0], sys.version_info[1], v["__version__"]))'); CUDA arch $LS_GPU_CUDA_ARCH"
}

# The files a build leaves that the proof uses, relative to the checkout: the Python
# module (python/layerstream/) and, in build-gpu/, the C++ CUDA tests and bench_quant.
gpu_build_outputs() {  # PY
  local ext
  ext=$("$1" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  echo "python/layerstream/_C$ext python/layerstream/_build_info.py build-gpu/bench/bench_quant" \
       "build-gpu/tests/cpp/test_cuda_dequant build-gpu/tests/cpp/test_cuda_lossless build-gpu/tests/cpp/test_cuda_backend"
}

# gpu_build PY LOG: configures build-gpu/ against PY's torch (Release, kernels for
# LS_GPU_CUDA_ARCH only) and builds _C (it lands in python/layerstream/), bench_quant and,
# when GoogleTest is found (.shared/googletest or /usr/src/googletest), the C++ CUDA
# tests; checks that layerstream imports. Output into LOG. Sets build_status (ok or
# failed), build_detail and cpp_tests_built (1 or 0).
gpu_build() {
  local PY=$1 LOG=$2 pyinc TORCH_PREFIX nvrtc g cfg_rc
  local cuda_args=() gen=() gtest_args=() targets=()
  pyinc=$("$PY" -c 'import sysconfig;print(sysconfig.get_paths()["include"])')
  [ -f "$pyinc/Python.h" ] || echo "[gpu-proof] warning: $pyinc/Python.h not found: the Python module may not build"
  TORCH_PREFIX=$("$PY" -c 'import torch.utils;print(torch.utils.cmake_prefix_path)')
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    cuda_args+=(-DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  fi
  # A CUDA torch wheel's config wants libnvrtc; take the one its nvidia packages carry.
  nvrtc=$("$PY" - <<'EOF'
import glob, os, site
roots = list(site.getsitepackages()) + [site.getusersitepackages()]
for r in roots:
    for pat in ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
        hits = sorted(glob.glob(os.path.join(r, pat)))
        hits = [h for h in hits if "builtins" not in h and "alt" not in os.path.basename(h)]
        if hits:
            print(hits[0]); raise SystemExit
EOF
)
  [ -n "$nvrtc" ] && cuda_args+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  [ -f build-gpu/CMakeCache.txt ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" build-gpu/CMakeCache.txt && gen=()
  # GoogleTest for the C++ CUDA tests: installed, or built from sources.
  for g in "$PWD/.shared/googletest" /usr/src/googletest; do
    if [ -f "$g/CMakeLists.txt" ]; then gtest_args=(-DLS_GTEST_SOURCE_DIR="$g"); break; fi
  done
  _gpu_configure() {
    cmake -S . -B build-gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" \
      -DLS_CUDA_ARCHS=$LS_GPU_CUDA_ARCH -DCMAKE_CUDA_ARCHITECTURES=$LS_GPU_CUDA_ARCH \
      -DTORCH_CUDA_ARCH_LIST=$LS_GPU_TORCH_ARCH \
      -DLS_WITH_TORCH=ON "${cuda_args[@]}" "$@"
  }
  echo "[gpu-proof] configuring build-gpu"
  cpp_tests_built=1
  _gpu_configure -DLS_BUILD_TESTS=ON "${gtest_args[@]}" >"$LOG" 2>&1; cfg_rc=$?
  if [ $cfg_rc != 0 ] && grep -q "GoogleTest not found" "$LOG"; then
    echo "[gpu-proof] GoogleTest not found: configuring without the C++ tests (carry /usr/src/googletest as .shared/googletest)"
    cpp_tests_built=0
    _gpu_configure -DLS_BUILD_TESTS=OFF >>"$LOG" 2>&1; cfg_rc=$?
  fi
  if [ $cfg_rc = 0 ]; then
    grep -E "layerstream: (CUDA|LibTorch)" "$LOG" | sed 's/^/[gpu-proof]   /'
    targets=(_C bench_quant)
    [ $cpp_tests_built = 1 ] && targets+=(test_cuda_dequant test_cuda_lossless test_cuda_backend)
    echo "[gpu-proof] building ${targets[*]} ($(nproc) jobs)"
    if cmake --build build-gpu --target "${targets[@]}" -j "$(nproc)" >>"$LOG" 2>&1; then
      build_status=ok
      build_detail="cmake Release, build-gpu, targets ${targets[*]}, CUDA arch $LS_GPU_CUDA_ARCH; $(grep -E 'layerstream: (CUDA|LibTorch)' "$LOG" | sed 's/.*layerstream: //' | tr '\n' ';' | sed 's/;$//')"
    else
      build_status=failed; build_detail="cmake --build failed (see build.log)"
    fi
  else
    build_status=failed; build_detail="cmake configure failed (see build.log)"
  fi
  [ "$build_status" = failed ] && tail -40 "$LOG"
  if [ "$build_status" = ok ] && ! gpu_module_loads "$PY" 2>>"$LOG"; then
    build_status=failed; build_detail="built, but 'import layerstream' fails (see build.log)"
  fi
}

# gpu_module_loads PY: status 0 when the checkout's layerstream imports with its _C.
gpu_module_loads() {
  PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$1" -c 'import layerstream, torch; e = layerstream._C'
}

# gpu_use_prebuilt PY LOG: a build made ahead of the call (bench/gpu/prebuild.sh,
# carried as .prebuilt/) serves when its stamp is this checkout's and PY's: its
# outputs are copied into place and checked (the module imports, a C++ test binary
# starts; output into LOG). Status 0 when it serves; otherwise 1, it says why, and
# nothing of it is left in place (the caller builds).
gpu_use_prebuilt() {
  local PY=$1 LOG=$2 want have f outs
  [ -f .prebuilt/stamp ] || return 1
  want=$(cat .prebuilt/stamp); have=$(gpu_build_stamp "$PY"); outs=$(gpu_build_outputs "$PY")
  if [ "$want" != "$have" ]; then
    echo "[gpu-proof] prebuilt not used: it was made for \"$want\"; this run needs \"$have\""; return 1
  fi
  for f in $outs; do
    [ -f ".prebuilt/$f" ] || { echo "[gpu-proof] prebuilt not used: .prebuilt/$f is missing"; return 1; }
  done
  for f in $outs; do mkdir -p "$(dirname "$f")" && cp -p ".prebuilt/$f" "$f"; done
  gpu_runtime_path "$PY"
  if gpu_module_loads "$PY" >"$LOG" 2>&1 && build-gpu/tests/cpp/test_cuda_backend --gtest_list_tests >>"$LOG" 2>&1; then
    return 0
  fi
  echo "[gpu-proof] prebuilt not used: it does not load here (see build.log); building"
  for f in $outs; do rm -f "$f"; done
  return 1
}

# gpu_runtime_path PY: puts the CUDA runtime torch loads (its nvidia/*/lib folders; the
# toolkit's lib64 when torch has none) on LD_LIBRARY_PATH, for the C++ binaries: their
# run path names the runtime where they were built, which a prebuilt one's machine may
# not have. The Python processes load the same libraries as without it. Once a run.
gpu_runtime_path() {
  local dirs
  [ -z "${_gpu_runtime_path_set:-}" ] || return 0
  _gpu_runtime_path_set=1
  dirs=$("$1" -c 'import glob, importlib.util, os; torch = importlib.util.find_spec("torch").submodule_search_locations[0]; print(":".join(sorted({os.path.dirname(p) for p in glob.glob(os.path.join(torch, "..", "nvidia", "*", "lib", "libcudart.so.*"))})))')
  [ -n "$dirs" ] || dirs=/usr/local/cuda/lib64
  case ":${LD_LIBRARY_PATH:-}:" in *":$dirs:"*) ;; *) export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
}

# gpu_sync_tree DEST: the working tree as a device call sends it (tracked files and
# untracked ones git does not ignore) into DEST, kept between runs so that a build
# there is incremental: a file whose content differs is copied with a new time (the
# build remakes what uses it, also when it went back to an older version, which a
# copy keeping times would hide), a file gone from the tree goes from DEST too (CMake's
# globs would still compile it). DEST/.tree-files lists what was copied.
gpu_sync_tree() {
  local dest=$1 f
  mkdir -p "$dest"
  git ls-files -z --cached --others --exclude-standard | LC_ALL=C sort -z >"$dest/.tree-files.new"
  while IFS= read -r -d '' f; do
    [ -f "$f" ] || continue  # listed but deleted in the working tree
    if ! cmp -s "$f" "$dest/$f"; then
      mkdir -p "$dest/$(dirname "$f")" && rm -f "$dest/$f" && cp -P "$f" "$dest/$f"
    fi
  done <"$dest/.tree-files.new"
  if [ -f "$dest/.tree-files" ]; then
    LC_ALL=C comm -z -23 "$dest/.tree-files" "$dest/.tree-files.new" | while IFS= read -r -d '' f; do
      rm -f "$dest/$f"
    done
  fi
  mv "$dest/.tree-files.new" "$dest/.tree-files"
}
