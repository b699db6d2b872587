"""End-to-end tests of `layerstream demo` and `layerstream bench` (and the
command dispatcher).

Runs the built binary at $LS_BUILD_DIR/layerstream (default <repo>/build).
Without a GPU the demo runs on the simulated device.
"""
import json
import os
import re
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


def _demo_losses(out):
    rows = [line for line in out.splitlines() if " step " in line and line.startswith("[")]
    return [tuple(float(v) for v in line.split()[-3:]) for line in rows]


def test_demo_short_run(demo_run):
    r = demo_run
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "simulated device" in out
    assert "no GPU visible" in out
    assert "loss resident" in out and "loss streamed" in out and "|diff|" in out
    losses = _demo_losses(out)
    assert len(losses) == 3, out
    for resident, streamed, diff in losses:
        assert abs(resident - streamed) <= 1e-5, losses
        assert diff <= 1e-5, losses
    for key in ("peak device bytes", "host->device", "device->host", "stall", "prefetch hit rate",
                "within budget"):
        assert key in out, (key, out)


def test_demo_numbers_checked_independently(demo_run):
    """What the demo prints is checked against values derived here, not taken from it:
    the first loss of a GPT-2-initialised model (weights N(0, 0.02), zero biases) is about
    ln(vocabulary) (its logits are nearly uniform); AdamW then lowers it in 3 steps (the
    printed numbers are real training losses); the model holds the Linear layers the
    demo's fixed shape has (4 blocks of q, k, v, o, fc, proj, and the head), whose bytes
    every step streams host-to-device at least once (the budget holds a quarter)."""
    import math
    out = demo_run.stdout
    assert demo_run.returncode == 0, out + demo_run.stderr
    vocab = int(out.split("vocabulary ")[1].split(")")[0])
    losses = _demo_losses(out)
    first = losses[0][0]
    assert abs(first - math.log(vocab)) < 0.3, (first, math.log(vocab))
    assert losses[-1][0] < first - 0.05 and losses[-1][1] < losses[0][1] - 0.05, losses
    d, blocks = 192, 4
    block = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    streamed = 4 * (blocks * block + d * vocab + vocab)  # fp32 bytes of every Linear
    line = next(l for l in out.splitlines() if l.startswith("streamed "))
    assert line.split()[1] == str(blocks * 6 + 1), line
    assert abs(float(line.split(", ")[1].split(" MiB")[0].split()[-1]) - streamed / 2**20) < 0.006, line
    h2d = next(l for l in out.splitlines() if l.startswith("host->device"))
    total = int(h2d.split("(")[1].split(" bytes")[0])
    assert total >= 3 * streamed, (total, streamed)


def test_demo_default_budget_holds_the_resident_tensors_and_three_slots(demo_run):
    """The default budget counts the resident tensors (embeddings, norms) as offload()
    does: it was 3 slots with nothing for them, so the demo ran with 2 slots, prefetch 1."""
    out = demo_run.stdout
    assert "then room for 3 slots" in out, out
    slots = next(l for l in out.splitlines() if l.startswith("slots "))
    assert slots.split()[1] == "3" and slots.endswith("prefetch 2"), slots


def test_demo_peak_within_printed_budget(demo_run):
    line = next(l for l in demo_run.stdout.splitlines() if l.startswith("peak device bytes"))
    words = line.split()
    peak = int(words[3])
    budget = int(words[words.index("budget") + 1])
    assert 0 < peak <= budget, line


def test_demo_full_fine_tune_with_the_host_optimizer():
    """`demo --full`: the streamed model steps with layerstream::optim::AdamW (C++
    kernels, clipping to norm 1), the resident one with clip_grad_norm_ +
    torch::optim::AdamW; their losses agree to the mode's 1e-4 and fall."""
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = run("demo", "--full", "--steps", "4", timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "layerstream::optim::AdamW (host C++ kernels" in out, out
    assert "tolerance 1e-04" in out, out
    losses = _demo_losses(out)
    assert len(losses) == 4, out
    for resident, streamed, diff in losses:
        assert abs(resident - streamed) <= 1e-4 and diff <= 1e-4, losses
    assert losses[-1][1] < losses[0][1] - 0.05, losses
    line = next(l for l in out.splitlines() if l.startswith("optimizer step"))
    assert "layerstream::optim::AdamW, clipping included" in line, line


@pytest.mark.parametrize("args", [
    ["--steps", "zero"],
    ["--steps", "0"],
    ["--bogus"],
    ["--device", "tpu"],
    ["--budget", "lots"],
    ["--budget", "12GB"],  # holds every weight: nothing would stream (it printed "0.0x smaller" and "OK")
    ["--layers"],
])
def test_demo_bad_option_exits_2(args):
    r = run("demo", *args)
    assert_one_line_usage_error(r, "demo")


def test_demo_budget_bounds_count_the_resident_tensors():
    """--layers 1 (documented 1 to 64) refused its own default budget ("holds every
    weight"): that bound compared a budget holding the resident tensors with the
    streamed weights alone. And the floor that "--budget 1" named was then refused by
    offload() (it left out the resident tensors). Both count them now: --layers 1 runs,
    and the floor named runs."""
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    r = run("demo", "--layers", "1", "--steps", "1", "--device", "sim", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = assert_one_line_usage_error(run("demo", "--budget", "1"), "demo")
    floor = re.search(r"plus the tensors that stay resident \((\d+) bytes\)", line)
    assert floor, line
    r = run("demo", "--budget", floor.group(1), "--steps", "1", "--device", "sim", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_demo_prints_the_prefetch_depth_its_slots_allow(demo_run):
    """It printed the requested depth (2) beside 2 slots, which allow 1."""
    line = next(l for l in demo_run.stdout.splitlines() if l.startswith("slots "))
    slots, depth = int(line.split()[1]), int(line.split("prefetch ")[1])
    assert depth == min(2, slots - 1), line


@pytest.mark.parametrize("chars", [0, 64])
def test_demo_text_shorter_than_a_window_exits_2(tmp_path, chars):
    """A --text file of at most the context length (64) crashed the demo (SIGSEGV)."""
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    text = tmp_path / "short.txt"
    text.write_text("a" * chars)
    r = run("demo", "--steps", "1", "--device", "sim", "--text", str(text))
    line = assert_one_line_usage_error(r, "demo")
    assert f"has {chars} characters" in line and "windows of 65" in line


def test_demo_text_that_is_a_directory_says_so(tmp_path):
    """A --text directory was reported as "has 0 characters"."""
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    r = run("demo", "--steps", "1", "--device", "sim", "--text", str(tmp_path))
    line = assert_one_line_usage_error(r, "demo")
    assert "is a directory" in line and "characters" not in line, line


@pytest.mark.parametrize("budget", ["50%", "auto", "AUTO"])
def test_demo_budget_share_says_a_byte_count_is_needed(budget):
    """--budget 50% / auto said "unknown unit (use B, KB, ...)": the demo takes a
    byte count, and says so (and how to write one)."""
    r = run("demo", "--steps", "1", "--device", "sim", "--budget", budget)
    line = assert_one_line_usage_error(r, "demo")
    assert "needs a byte count" in line and "2MiB" in line and "unknown unit" not in line, line


def test_demo_cuda_without_a_gpu_names_the_cli_option():
    """The advice for --device cuda without a GPU names --device sim, not the Python API."""
    if not built_with_torch():
        pytest.skip("layerstream was built without LibTorch: no demo")
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = run("demo", "--steps", "1", "--device", "cuda", env=env)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerstream demo: error: "), r.stderr
    assert "--device sim" in lines[0] and "device='sim'" not in lines[0] and "torch.cuda" not in lines[0], lines[0]


@pytest.mark.parametrize("path,says", [("/nonexistent/dir/x.png", "cannot write into /nonexistent/dir"),
                                        ("out.txt", "must end in .png, .pdf or .svg")])
def test_bench_plot_path_is_checked_before_the_benchmark_runs(path, says):
    """A --plot path matplotlib cannot write failed after the whole benchmark, with a
    traceback and advice about the Python setup."""
    r = run("bench", "--quick", "--only", "quant", "--plot", path, timeout=30)
    line = assert_one_line_usage_error(r, "bench")
    assert says in line and "running" not in r.stdout


def test_bench_plot_into_a_directory_is_refused_before_the_benchmark_runs(tmp_path):
    """--plot naming an existing directory (out.png/) ran the whole benchmark, then
    blamed the Python setup (matplotlib and LS_PYTHON) for matplotlib's IsADirectoryError."""
    target = tmp_path / "out.png"
    target.mkdir()
    r = run("bench", "--quick", "--only", "quant", "--plot", target, timeout=30)
    line = assert_one_line_usage_error(r, "bench")
    assert "is a directory" in line and "LS_PYTHON" not in line and "running" not in r.stdout, line


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
    """Every case against the model it was run on (bench/overlap.h): ideal = max(total
    compute, total transfer) of the configured stack, overlap_ratio = step / ideal, and a
    step can never beat the ideal (the compute sleeps run one after another on one
    stream, the copies one after another on one link)."""
    cases = bench_json["overlap"]
    cfg = bench_json["overlap_config"]
    assert cases
    compute_ms = cfg["layers"] * cfg["compute_ms"]
    for c in cases:
        ideal = compute_ms * max(1.0, c["transfer_over_compute"])
        assert c["ideal_ms"] == pytest.approx(ideal, rel=1e-4), c
        assert c["overlap_ratio"] == pytest.approx(c["step_ms"] / c["ideal_ms"], rel=1e-4), c
        assert c["step_ms"] >= 0.99 * c["ideal_ms"], c
        assert 0.0 <= c["hit_rate"] <= 1.0, c
    assert {c["transfer_over_compute"] for c in cases} == {0.5, 1.0, 2.0}
    assert {c["prefetch"] for c in cases} == {0, 1, 2, 3}
    assert len(cases) == 12


def test_bench_overhead_rows(bench_json):
    if not bench_json["overhead_available"]:
        assert bench_json["overhead"] == []
        return
    rows = bench_json["overhead"]
    systems = {r["system"] for r in rows}
    assert any("layerstream" in s for s in systems) and any("torch" in s for s in systems)
    for r in rows:
        assert r["forward_us"] > 0 and r["fwd_bwd_us"] > 0, r
    # Each layerstream row follows its torch baseline (same layer count); its ratios are
    # its time over the baseline's.
    for base, ls in zip(rows[::2], rows[1::2]):
        assert "torch" in base["system"] and "layerstream" in ls["system"], (base, ls)
        assert ls["forward_ratio"] == pytest.approx(ls["forward_us"] / base["forward_us"], rel=1e-3)
        assert ls["fwd_bwd_ratio"] == pytest.approx(ls["fwd_bwd_us"] / base["fwd_bwd_us"], rel=1e-3)


def _packed_bytes(fmt, rows, cols):
    """The packed layout's size from docs/design/quant-formats.md (sections 256-aligned)."""
    a = lambda b: (b + 255) // 256 * 256  # noqa: E731
    n = rows * cols
    data, scales, zeros = {"int8": (n, rows * 4, 0), "fp8": (n, rows * 4, 0),
                           "nf4": ((n + 1) // 2, (n + 63) // 64 * 4, 0),
                           "int4": (n // 2, n // 128 * 4, n // 128 * 4)}[fmt]
    return a(a(a(data) + scales) + zeros)


def test_bench_quant_rows(bench_json):
    formats = {r["format"] for r in bench_json["quant"]}
    assert formats == {"int8", "fp8", "nf4", "int4", "lossless"}
    for r in bench_json["quant"]:
        assert r["pack_gbps_src"] > 0 and r["dequant_cpu_gbps_bf16_out"] > 0, r
        n = r["rows"] * r["cols"]
        if r["format"] == "lossless":  # from the weights in bf16; its size depends on their values
            assert r["source"] == "bf16" and 0.5 * n * 2 < r["packed_bytes"] <= 0.75 * n * 2, r
        else:
            assert r["source"] == "f32" and r["packed_bytes"] == _packed_bytes(r["format"], r["rows"], r["cols"]), r
        src = 2 if r["source"] == "bf16" else 4
        assert r["pack_gbps_src"] == pytest.approx(n * src / r["pack_s"] / 1e9, rel=1e-3), r
        assert r["dequant_cpu_gbps_bf16_out"] == pytest.approx(n * 2 / r["dequant_cpu_s"] / 1e9, rel=1e-3), r


def test_bench_bad_option_exits_2():
    assert_one_line_usage_error(run("bench", "--bogus"), "bench")
    assert_one_line_usage_error(run("bench", "--only", "nothing"), "bench")


def test_bench_plot_writes_a_png_and_still_prints_the_tables(tmp_path):
    out = tmp_path / "bench.png"
    r = run("bench", "--quick", "--only", "overlap", "--plot", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "== overlap (sim device)" in r.stdout and f"wrote {out}" in r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # axes, lines, labels
    # A Python that cannot draw: one clear error, exit 1, after the results (they were lost).
    for extra in ((), ("--json",)):
        r = run("bench", "--quick", "--only", "overlap", "--plot", tmp_path / "x.png", *extra, timeout=300,
                env=dict(os.environ, LS_PYTHON="/nonexistent/python"))
        assert r.returncode == 1 and "--plot" in r.stderr and "LS_PYTHON" in r.stderr, r.stderr
        assert not (tmp_path / "x.png").exists()
        if extra:
            assert json.loads(r.stdout)["overlap"], r.stdout
        else:
            assert "== overlap (sim device)" in r.stdout, r.stdout


BENCH_ROWS = {"quick": True, "overlap_config": {"layers": 2, "compute_ms": 3, "layer_mib": 1, "steps": 1},
              "overlap": [{"transfer_over_compute": 1, "prefetch": 0, "slots": 1, "step_ms": 12, "ideal_ms": 6,
                           "overlap_ratio": 2, "hit_rate": 0}],
              "overhead_available": False, "overhead": [], "quant": []}


@pytest.mark.parametrize("content,out,says", [
    (None, "o.png", ["cannot read", "No such file or directory"]),
    ("not json", "o.png", ["is not JSON", "layerstream bench --json"]),
    ("[]", "o.png", ["none of the lists overlap, overhead, quant", "layerstream bench --json"]),
    ("{}", "o.png", ["none of the lists overlap, overhead, quant", "layerstream bench --json"]),
    ("plan", "o.png", ["none of the lists overlap, overhead, quant", "layerstream bench --json"]),
    (json.dumps({"overlap": [{"transfer_over_compute": 1, "prefetch": 0}]}), "o.png",
     ["overlap[0] has no valid overlap_ratio", "layerstream bench --json"]),
    (json.dumps(BENCH_ROWS), "o.xyz", ["must end in .png, .pdf or .svg"]),
    (json.dumps(BENCH_ROWS), "nodir/o.png", ["cannot write into", "no such directory"]),
], ids=["missing", "not-json", "list", "empty", "plan-json", "row-without-ratio", "extension", "no-directory"])
def test_bench_plot_refuses_what_is_not_bench_output_in_one_line(tmp_path, capsys, content, out, says):
    """`python -m layerstream.bench_plot` printed a raw traceback for a missing file, text
    that is not JSON, a JSON list, a row without overlap_ratio or an output name matplotlib
    cannot write, and drew an empty "overlap not run" plot, exit 0, from `{}` or from
    `layerstream plan --json` output passed by mistake."""
    from layerstream import bench_plot
    src = tmp_path / "in.json"
    if content == "plan":
        r = run("plan", "--model", "gpt2-small", "--budget", "1GiB", "--json")
        assert r.returncode == 0, r.stderr
        content = r.stdout
    if content is not None:
        src.write_text(content)
    assert bench_plot.main([str(src), str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("layerstream.bench_plot: error: "), err
    assert all(s in err[0] for s in says), err[0]
    assert not (tmp_path / out).exists()


def test_bench_plot_draws_bench_output_with_empty_sections(tmp_path):
    """What `bench --only quant --plot` passes (every list but quant's empty) still draws."""
    from layerstream import bench_plot
    src, out = tmp_path / "in.json", tmp_path / "o.png"
    src.write_text(json.dumps(dict(BENCH_ROWS, overlap=[])))
    assert bench_plot.main([str(src), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
