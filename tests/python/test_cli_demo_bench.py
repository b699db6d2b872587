"""End-to-end tests of `layerstream demo` and `layerstream bench` (and the
command dispatcher).

Runs the built binary at $LS_BUILD_DIR/layerstream (default <repo>/build).
Without a GPU the demo runs on the simulated device.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("LS_BUILD_DIR", REPO / "build"))
if not BUILD_DIR.is_absolute():
    BUILD_DIR = REPO / BUILD_DIR
BINARY = BUILD_DIR / "layerstream"

pytestmark = pytest.mark.skipif(
    not BINARY.is_file(),
    reason=f"layerstream binary not built at {BINARY} (run tools/setup.sh or set LS_BUILD_DIR)",
)


def run(*args, timeout=120, env=None):
    return subprocess.run([str(BINARY), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def built_with_torch():
    r = run("demo", "--help")
    return r.returncode == 0 and "LibTorch" in r.stdout and "without LibTorch" not in r.stderr


def assert_one_line_usage_error(r, command):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"layerstream {command}: error: "), lines[0]
    return lines[0]


# ---- dispatcher ----

def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for name in ("demo", "bench", "plan"):
        assert f"  {name} " in r.stdout, r.stdout


def test_unknown_subcommand_exits_2():
    r = run("no-such-command")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown command" in r.stderr


# ---- demo ----

@pytest.fixture(scope="module")
def demo_run():
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the sim device, even on a GPU machine
    return run("demo", "--steps", "3", timeout=300, env=env)


def test_demo_short_run(demo_run):
    r = demo_run
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "simulated device" in out
    assert "no GPU visible" in out
    assert "loss resident" in out and "loss streamed" in out and "|diff|" in out
    rows = [line for line in out.splitlines() if " step " in line and line.startswith("[")]
    assert len(rows) == 3, out
    for line in rows:
        resident, streamed, diff = line.split()[-3:]
        assert abs(float(resident) - float(streamed)) <= 1e-5, line
        assert float(diff) <= 1e-5, line
    for key in ("peak device bytes", "host->device", "device->host", "stall", "prefetch hit rate",
                "within budget"):
        assert key in out, (key, out)


def test_demo_peak_within_printed_budget(demo_run):
    line = next(l for l in demo_run.stdout.splitlines() if l.startswith("peak device bytes"))
    words = line.split()
    peak = int(words[3])
    budget = int(words[words.index("budget") + 1])
    assert 0 < peak <= budget, line


@pytest.mark.parametrize("args", [
    ["--steps", "zero"],
    ["--steps", "0"],
    ["--bogus"],
    ["--device", "tpu"],
    ["--budget", "lots"],
    ["--layers"],
])
def test_demo_bad_option_exits_2(args):
    r = run("demo", *args)
    assert_one_line_usage_error(r, "demo")


def test_demo_budget_too_small_exits_2():
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    r = run("demo", "--steps", "1", "--budget", "1000", "--device", "sim")
    line = assert_one_line_usage_error(r, "demo")
    assert "slots" in line


def test_demo_help():
    r = run("demo", "--help")
    assert r.returncode == 0
    for opt in ("--steps", "--device", "--budget", "--layers", "--seed"):
        assert opt in r.stdout


# ---- bench ----

@pytest.fixture(scope="module")
def bench_json():
    r = run("bench", "--quick", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_bench_json_keys(bench_json):
    for key in ("overlap", "overhead", "quant"):
        assert isinstance(bench_json[key], list), key


def test_bench_overlap_cases(bench_json):
    cases = bench_json["overlap"]
    assert cases
    for c in cases:
        assert c["overlap_ratio"] > 0, c
        assert c["step_ms"] > 0 and c["ideal_ms"] > 0, c
    assert {c["transfer_over_compute"] for c in cases} == {0.5, 1.0, 2.0}
    assert {c["prefetch"] for c in cases} == {0, 1, 2, 3}
    assert any(c["prefetch"] >= 2 for c in cases)


def test_bench_overhead_rows(bench_json):
    if not bench_json["overhead_available"]:
        assert bench_json["overhead"] == []
        return
    rows = bench_json["overhead"]
    systems = {r["system"] for r in rows}
    assert any("layerstream" in s for s in systems) and any("torch" in s for s in systems)
    for r in rows:
        assert r["forward_us"] > 0 and r["fwd_bwd_us"] > 0, r
        assert r["forward_ratio"] > 0 and r["fwd_bwd_ratio"] > 0, r


def test_bench_quant_rows(bench_json):
    formats = {r["format"] for r in bench_json["quant"]}
    assert formats == {"int8", "fp8", "nf4", "int4"}
    for r in bench_json["quant"]:
        assert r["pack_gbps_f32_src"] > 0 and r["dequant_cpu_gbps_bf16_out"] > 0, r


def test_bench_bad_option_exits_2():
    assert_one_line_usage_error(run("bench", "--bogus"), "bench")
    assert_one_line_usage_error(run("bench", "--only", "nothing"), "bench")
