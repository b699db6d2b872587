"""What users of the package, the command line and the docs meet (issue 23):
versions, the torch check, the sim fallback warning, counts that must agree,
the plan's times and host RAM, and docs that stay inside the repository."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import layerstream
from layerstream import _C, _build_info
from layerstream import _offload as offload_mod

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("LS_BUILD_DIR", REPO / "build"))
if not BUILD_DIR.is_absolute():
    BUILD_DIR = REPO / BUILD_DIR
BINARY = BUILD_DIR / "layerstream"
needs_cli = pytest.mark.skipif(not BINARY.is_file(), reason=f"layerstream binary not built at {BINARY}")


def cli(*args, timeout=120):
    return subprocess.run([str(BINARY), *map(str, args)], capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ versions

def test_one_version_in_cmake_pyproject_and_the_package():
    cmake = re.search(r"project\(layerstream VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
    pyproject = re.search(r'^version = "([0-9.]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert cmake == pyproject == layerstream.__version__ == _build_info.VERSION


def test_built_against_this_torch():
    assert _build_info.TORCH_VERSION == torch.__version__.split("+")[0]


def test_another_torch_is_refused_naming_both(monkeypatch):
    from layerstream import _torch_check
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu999")
    with pytest.raises(ImportError) as e:
        _torch_check.check_torch()
    msg = str(e.value)
    assert f"built against torch {_build_info.TORCH_VERSION}" in msg and "torch 2.99.0+cu999 is installed" in msg
    assert "--no-build-isolation" in msg


def test_setup_py_without_torch_says_what_to_do(tmp_path):
    # A Python whose `import torch` fails: setup.py's build step must explain, not
    # end in a bare ModuleNotFoundError.
    (tmp_path / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    code = ("import sys; sys.argv = ['setup.py']; sys.path.insert(0, sys.argv[0]);"
            "import runpy; g = runpy.run_path(%r, run_name='not_main'); g['_torch']()" % str(REPO / "setup.py"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode != 0
    assert "install torch first" in r.stderr and "pip install --no-build-isolation ." in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_pip_build_builds_no_tests_and_declares_torch():
    setup = (REPO / "setup.py").read_text()
    assert "-DLS_BUILD_TESTS=OFF" in setup
    assert '"--target", "_C", "layerstream"' in setup  # the wheel carries the command
    assert 'layerstream = "layerstream._cli:main"' in (REPO / "pyproject.toml").read_text()


def test_a_build_without_cuda_configures_again(tmp_path):
    """A build without the CUDA backend (LS_WITH_CUDA=OFF, as tools/sanitize.sh's) whose
    configuration runs again (a source file added, CMakeLists.txt changed) still
    configures: the CUDA compiler torch's CMake enabled and cached then may be a wrapper
    script outside the toolkit (/usr/local/bin/nvcc on these machines), whose folder is
    not the toolkit's root (cmake/layerstream_torch.cmake)."""
    bin_dir = Path(sys.executable).parent
    cmake = shutil.which("cmake", path=str(bin_dir)) or shutil.which("cmake")
    if cmake is None or not (shutil.which("ninja", path=str(bin_dir)) or shutil.which("ninja")):
        pytest.skip("cmake and ninja are needed")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("LD_PRELOAD", None)  # tools/sanitize.sh's sanitizer runtime: not for cmake and nvcc
    build = tmp_path / "build"
    first = subprocess.run([cmake, "-S", str(REPO), "-B", str(build), "-G", "Ninja", "-DLS_WITH_CUDA=OFF",
                            "-DLS_BUILD_TESTS=OFF", f"-DPython3_EXECUTABLE={sys.executable}",
                            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run([cmake, str(build)], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]


# ------------------------------------------------------------- command line

@needs_cli
def test_no_arguments_prints_usage_and_exits_2():
    r = cli()
    assert r.returncode == 2 and "usage: layerstream" in r.stderr, r


@needs_cli
def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"layerstream {layerstream.__version__}", r


@needs_cli
def test_cuda_error_names_the_cli_option():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    r = cli("demo", "--device", "cuda", "--steps", "1")
    assert r.returncode == 1, r
    assert "--device sim" in r.stderr and "device='sim'" not in r.stderr, r.stderr


@needs_cli
def test_plan_calls_a_step_transfer_bound_only_when_copies_outweigh_compute():
    # The case of the issue: compute 3.16 s, transfer 1.42 s, with stalls.
    out = cli("plan", "--model", "llama-13b", "--budget", "8GiB", "--train").stdout
    line = next(l for l in out.splitlines() if l.startswith("predicted step time:"))
    compute, transfer = (float(v) for v in re.search(r"compute ([0-9.]+) s, transfer ([0-9.]+) s", line).groups())
    assert compute > transfer and "-> compute-bound" in line, line
    assert "stalls" in line
    out = cli("plan", "--model", "llama-13b", "--budget", "8GiB", "--train", "--tflops", "5000").stdout
    line = next(l for l in out.splitlines() if l.startswith("predicted step time:"))
    compute, transfer = (float(v) for v in re.search(r"compute ([0-9.]+) m?s, transfer ([0-9.]+) m?s", line).groups())
    assert "-> transfer-bound" in line, line


@needs_cli
def test_plan_warns_when_its_host_ram_exceeds_this_machine():
    mem = _C.host_memory()
    assert 0 < mem["available_bytes"] <= mem["total_bytes"]
    r = cli("plan", "--model", "llama-70b", "--budget", "8GiB", "--json")
    assert r.returncode == 0, r.stderr
    import json
    needed = json.loads(r.stdout)["plan"]["host_pinned_bytes"]
    warned = "more than this machine has available" in r.stderr
    assert warned == (needed > mem["available_bytes"]), (needed, mem, r.stderr)


# -------------------------------------------------------- Python, sim device

def test_offload_without_device_warns_once_why_cuda_was_not_used():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: offload() uses it")
    offload_mod._warn_sim_fallback.cache_clear()
    m = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(RuntimeWarning, match=r"runs on the simulated device .* because (this torch|torch\.cuda is "
                                            r"not available: .+|torch sees a GPU)"):
        h = layerstream.offload(m)
    h.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layerstream.offload(m).detach()  # once per process
        layerstream.offload(m, device="sim").detach()


def test_handle_plan_on_sim_shows_the_modelled_link_and_copy_times():
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    h = layerstream.offload(m, device="sim", budget=6 * 257 * 1024)
    text = h.plan
    assert "no link bandwidth" not in text, text
    assert "over the 25 GB/s link" in text, text
    copy = float(re.search(r"predicted copy time: +([0-9.]+) (m|u|µ)?s", text).group(1))
    assert copy > 0, text
    h.detach()


def test_steps_count_every_training_step_and_slots_are_prefetch_plus_one():
    m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    h = layerstream.offload(m, device="sim", prefetch=2)
    x = torch.randn(2, 32)
    for _ in range(3):
        m(x).sum().backward()
    s = h.stats()
    assert s["steps"] == 3, s
    assert s["slots"] == 2 + 1, s  # no budget, no slots=: prefetch + 1
    h.detach()


# --------------------------------------------------------------------- docs

def _docs():
    """The repository's tracked text files (README, docs, sources, scripts)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in files if f.endswith((".md", ".h", ".cpp", ".cu", ".py", ".sh", ".cmake", ".txt", ".in"))
            and (REPO / f).is_file()]


def test_docs_point_only_inside_the_repository():
    bad = []
    docs = _docs()
    names = {p.name for p in docs}
    for p in docs:
        text = p.read_text(errors="replace")
        for m in re.finditer(r"(?<![\w/.])(\.\./[\w./-]+)", text):
            target = (p.parent / m.group(1)).resolve()
            if REPO not in target.parents and target != REPO:
                bad.append(f"{p.relative_to(REPO)}: {m.group(1)}")
        for m in re.finditer(r"\b([A-Z][A-Z_]+\.md)\b", text):
            if m.group(1) not in names:
                bad.append(f"{p.relative_to(REPO)}: {m.group(1)} (no such file)")
    assert not bad, bad
