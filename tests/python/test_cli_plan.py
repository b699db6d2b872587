"""End-to-end tests of `layerstream plan` on real checkpoints.

Runs the built binary at $LS_BUILD_DIR/layerstream (default <repo>/build).
Checkpoints are written with safetensors.torch.save_file and with
transformers' save_pretrained (sharded, with an index json).
"""
import json
import re
import math
import os
import struct
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


def run(*args, timeout=60):
    return subprocess.run([str(BINARY), "plan", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def plan_json(*args):
    r = run(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_one_line_error(r, code=None, contains=None):
    assert r.returncode != 0, r.stdout
    if code is not None:
        assert r.returncode == code, (r.returncode, r.stderr)
    assert r.returncode in (1, 2)  # never a crash (negative = signal)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("layerstream plan: error: "), lines[0]
    if contains:
        assert contains in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def st_file(tmp_path_factory):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    d = tmp_path_factory.mktemp("st")
    tensors = {}
    for i in range(4):
        tensors[f"blocks.{i}.fc1.weight"] = torch.randn(256, 128, dtype=torch.float16)
        tensors[f"blocks.{i}.fc1.bias"] = torch.randn(256, dtype=torch.float16)
        tensors[f"blocks.{i}.fc2.weight"] = torch.randn(128, 256, dtype=torch.float16)
        tensors[f"blocks.{i}.norm.weight"] = torch.ones(128, dtype=torch.float32)
    tensors["embed.weight"] = torch.randn(200, 128, dtype=torch.bfloat16)
    path = d / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(d), max_shard_size="200KB", safe_serialization=True)
    assert list(d.glob("*.safetensors.index.json")), "expected a sharded checkpoint with an index"
    assert len(list(d.glob("*.safetensors"))) >= 2
    return d


def test_help_and_list_models():
    r = run("--help")
    assert r.returncode == 0 and "--checkpoint" in r.stdout and "--budget" in r.stdout
    r = run("--list-models")
    assert r.returncode == 0 and "llama-7b" in r.stdout.split()


def planner_md_section(title):
    text = (REPO / "docs" / "design" / "planner.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_planner_md_usage_block_is_plan_help_s_option_list():
    """planner.md's CLI usage block left out --host-budget, --disk-gbps, --activations
    host, --quantize lossless and --resident-dequantized, which `plan --help` lists."""
    help_text = run("--help").stdout
    block = "\n".join(l for l in planner_md_section("CLI").splitlines() if l.startswith("    "))
    # An option line: the flag, and its literal value where it takes one (--activations host).
    options = re.findall(r"^ +(?:-h, )?(--[a-z-]+)(?: ([a-z][a-z0-9]*)\b)?", help_text, re.M)
    assert len(options) > 15, help_text
    flag = r"(?<![\w-])--[a-z][a-z-]*"
    assert set(re.findall(flag, block)) == {f for f, _ in options}, block
    for f, value in options:
        assert not value or f"{f} {value}" in block, (f, value)
    for choices in re.findall(r"\b[a-z0-9]+(?:\|[a-z0-9]+)+\b", help_text):  # int8|fp8|nf4|int4|lossless
        assert choices in block, choices


def test_planner_md_json_schema_names_every_key_plan_writes(st_file, tmp_path):
    """planner.md's `--json` schema gave source.kind as "checkpoint" | "model" (a .gguf
    file gives "gguf") and lacked source.cast_layers and the top-level "host" object."""
    torch = pytest.importorskip("torch")
    from conftest import write_gguf

    gguf = write_gguf(tmp_path / "m.gguf", [("blk.0.attn_q.weight", (64, 64), "F16",
                                             torch.zeros(64 * 64 * 2, dtype=torch.uint8))])
    schema = planner_md_section("JSON output (`--json`)").split("```json", 1)[1].split("```", 1)[0]
    kind_line = next(l for l in schema.splitlines() if '"kind":' in l)

    def keys(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from keys(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from keys(v)

    for args in (["--checkpoint", st_file, "--host-budget", "1GiB"], ["--checkpoint", gguf], ["--model", "gpt2-small"]):
        j = plan_json(*args, "--budget", "1GiB")
        assert f'"{j["source"]["kind"]}"' in kind_line, (args, kind_line)
        missing = sorted({k for k in keys(j) if f'"{k}"' not in schema})
        assert not missing, (args, missing)


def test_safetensors_file_text_and_json(st_file):
    r = run("--checkpoint", st_file, "--budget", "300KB")
    assert r.returncode == 0, r.stderr
    for i in range(4):
        assert f"blocks.{i}.fc1" in r.stdout and f"blocks.{i}.fc2" in r.stdout
    assert "host RAM needed (pinned)" in r.stdout
    assert "predicted step time" in r.stdout
    j = plan_json("--checkpoint", st_file, "--budget", "300KB")
    p = j["plan"]
    assert p["device_bytes"] <= p["budget_bytes"] == 300_000
    names = [l["name"] for l in p["layers"]]
    assert names[0] == "embed"  # embeddings first, then natural order
    assert names.index("blocks.0.fc1") < names.index("blocks.0.fc2") < names.index("blocks.1.fc1")
    assert j["source"]["small_tensors"] == 4  # the four norm weights
    assert p["num_streamed"] > 0 and p["num_slots"] >= 2
    # The table is looked up in host memory (as offload() does): pinned, never on the device.
    assert [l["placement"] for l in p["layers"] if l["name"] == "embed"] == ["lookup"] and p["num_lookup"] == 1
    assert p["host_pinned_bytes"] == sum(l["bytes"] for l in p["layers"] if l["placement"] in ("streamed", "lookup"))


def test_transformers_sharded_checkpoint(hf_dir):
    index = next(hf_dir.glob("*.safetensors.index.json"))
    for source in (hf_dir, index):
        j = plan_json("--checkpoint", source, "--budget", "400KB", "--tokens", "128")
        p = j["plan"]
        assert p["device_bytes"] <= p["budget_bytes"]
        assert len(j["source"]["files"]) >= 2
        names = [l["name"] for l in p["layers"]]
        for i in range(3):
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
                assert f"model.layers.{i}.{proj}" in names
        # Approximate execution order.
        assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
        order = [names.index(f"model.layers.0.{m}") for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        assert order == sorted(order)
        assert names.index("model.layers.1.self_attn.q_proj") < names.index("model.layers.2.self_attn.q_proj")
    r = run("--checkpoint", hf_dir, "--budget", "1MiB", "--quantize", "nf4", "--train")
    assert r.returncode == 0, r.stderr
    assert "model.layers.2.mlp.up_proj" in r.stdout


def test_budget_respected_across_budgets(hf_dir):
    for budget in ("270KB", "300KB", "500KB", "1MB", "10MB"):
        p = plan_json("--checkpoint", hf_dir, "--budget", budget)["plan"]
        assert p["device_bytes"] <= p["budget_bytes"]


def test_budget_too_small(hf_dir):
    r = run("--checkpoint", hf_dir, "--budget", "10KB")
    line = assert_one_line_error(r, code=1, contains="is too small: the largest layer")
    assert "a budget of at least" in line


def test_builtin_model():
    p = plan_json("--model", "llama-7b", "--budget", "8GiB")["plan"]
    assert p["device_bytes"] <= p["budget_bytes"]
    assert p["time"]["step_s"] > 0


# ------------------------------------------------------------- bad inputs

def write(path, data):
    path.write_bytes(data)
    return path


def test_a_plan_with_nothing_streamed_is_transfer_bound_when_its_lookups_take_longer(tmp_path):
    """Every layer resident, the table's lookups on the link took longer than the compute,
    and the plan said compute-bound (planner.md: transfer when the copies take longer)."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "lookup.safetensors"
    st.save_file({"model.embed_tokens.weight": torch.zeros(1000, 128, dtype=torch.bfloat16),
                  "model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128, dtype=torch.bfloat16)}, str(path))
    p = plan_json("--checkpoint", path, "--budget", "1GiB", "--tokens", "4096")["plan"]
    t = p["time"]
    assert p["num_streamed"] == 0 and p["num_lookup"] == 1 and t["transfer_s"] > t["compute_s"] > 0
    assert t["bound"] == "transfer"


@pytest.mark.parametrize("args,contains", [
    (["--link-gbps", "1e308"], "--link-gbps 1e+308 is too large"),
    (["--tflops", "1e308"], "--tflops 1e+308 is too large"),
    (["--train="], "--train= needs a spec"),
    # 1e-320 GB/s planned "inf s", and its JSON held inf (not JSON)
    (["--link-gbps", "1e-320"], "--link-gbps 1e-320 is too small (at least 1e-09, or 0: no time model)"),
    (["--tflops", "1e-320"], "--tflops 1e-320 is too small"),
    (["--host-budget", "1GiB", "--disk-gbps", "1e-320"], "--disk-gbps 1e-320 is too small (at least 1e-09)"),
    # 2^63 bytes and more read as a negative budget in the JSON
    (["--host-budget", "9.3e18"], "--host-budget 9.3e18 is too large"),
    # "--model --budget 1GiB" took --budget as the model's name; a flag given twice: the last won
    (["--tokens", "--json"], '--tokens needs a value, got the option "--json"'),
    (["--tokens", "8", "--tokens", "16"], "--tokens is given twice: give it once"),
    (["--train", "grads"], "(a --train spec goes after '=': --train=grads)"),
])
def test_values_that_overflow_or_say_nothing_are_usage_errors(args, contains):
    """--link-gbps 1e308 (finite, infinite once in bytes/s) failed in the planner with exit 1
    and a message calling it negative; --train= planned no gradients while saying
    "(training)"."""
    assert_one_line_error(run("--model", "llama-7b", "--budget", "8GiB", *args), code=2, contains=contains)


def test_the_budget_follows_the_rule_offload_and_demo_follow():
    """plan --budget took 1e19 and 9.3e18 bytes, which offload() and demo refuse (at most
    2^63 - 1): it parsed the size itself, not through the one budget rule."""
    for budget in ("1e19", "9.3e18"):
        assert_one_line_error(run("--model", "llama-7b", "--budget", budget), code=2,
                              contains=f"budget '{budget}' is too large (at most 2^63 - 1 bytes)")


def test_a_gguf_file_is_known_by_its_magic_not_its_name(tmp_path):
    """A GGUF named Model-Q8_0.GGUF was read as a safetensors file: "header length ... is
    absurd". The first four bytes decide now."""
    torch = pytest.importorskip("torch")
    from conftest import write_gguf

    path = write_gguf(tmp_path / "m.gguf", [("blk.0.attn_q.weight", (64, 64), "F16",
                                             torch.zeros(64 * 64 * 2, dtype=torch.uint8))])
    upper = tmp_path / "Model-Q8_0.GGUF"
    upper.write_bytes(open(path, "rb").read())
    for p in (path, str(upper)):
        assert plan_json("--checkpoint", p, "--budget", "1GiB")["source"]["kind"] == "gguf"


def test_a_gguf_type_it_cannot_read_says_what_it_can_and_what_to_do(tmp_path):
    """plan said only "... is GGUF type IQ4_NL, which layerstream cannot read", where
    load_gguf() lists the types it reads and says to requantize: one message now."""
    torch = pytest.importorskip("torch")
    from conftest import gguf_random_blocks, write_gguf

    path = write_gguf(tmp_path / "iq.gguf", [("blk.0.attn_q.weight", (64, 64), "IQ4_NL",
                                              gguf_random_blocks("IQ4_NL", 64, 64))])
    line = assert_one_line_error(run("--checkpoint", path, "--budget", "1GiB"), code=1,
                                 contains="is GGUF type IQ4_NL, which layerstream cannot read; supported: F32")
    assert "llama-quantize" in line


def test_a_step_time_of_many_days_keeps_its_unit():
    """The time was cut at 31 characters: 9130999807999926608506360991311, no unit."""
    r = run("--model", "llama-7b", "--budget", "4GiB", "--link-gbps", "1e-9")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("predicted step time:"))
    assert re.search(r"predicted step time: +[0-9.]+e\+[0-9]+ s steady state", line), line


def test_a_checkpoint_without_tensors_is_an_error(tmp_path):
    """A safetensors header of {} (or a GGUF with no tensors) planned "0 layers" with exit 0."""
    from conftest import write_gguf

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert_one_line_error(run("--checkpoint", empty, "--budget", "1GiB"), 1, "holds no tensors: nothing to plan")
    gguf = write_gguf(tmp_path / "empty.gguf", [])
    assert_one_line_error(run("--checkpoint", gguf, "--budget", "1GiB"), 1, "holds no tensors: nothing to plan")


def test_truncated_file(tmp_path, st_file):
    data = st_file.read_bytes()
    p = write(tmp_path / "t.safetensors", data[:5])
    assert_one_line_error(run("--checkpoint", p, "--budget", "1GB"), code=1, contains="too short")
    # Header intact, data cut off: tensors run past the end.
    p = write(tmp_path / "t2.safetensors", data[: len(data) // 2])
    assert_one_line_error(run("--checkpoint", p, "--budget", "1GB"), code=1, contains="past the end of the file")


def test_header_length_past_eof(tmp_path):
    p = write(tmp_path / "h.safetensors", struct.pack("<Q", 10_000) + b"{}")
    assert_one_line_error(run("--checkpoint", p, "--budget", "1GB"), code=1, contains="runs past the end of the file")


def test_bad_json(tmp_path):
    h = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'
    p = write(tmp_path / "j.safetensors", struct.pack("<Q", len(h)) + h + b"\0" * 4)
    assert_one_line_error(run("--checkpoint", p, "--budget", "1GB"), code=1, contains="bad JSON")


def test_unknown_dtype(tmp_path):
    h = b'{"a.weight": {"dtype": "Q7", "shape": [1, 1], "data_offsets": [0, 4]}}'
    p = write(tmp_path / "d.safetensors", struct.pack("<Q", len(h)) + h + b"\0" * 4)
    assert_one_line_error(run("--checkpoint", p, "--budget", "1GB"), code=1, contains='unknown dtype "Q7"')


def test_missing_file(tmp_path):
    assert_one_line_error(run("--checkpoint", tmp_path / "nope.safetensors", "--budget", "1GB"),
                          code=1, contains="does not exist")


def test_unknown_model():
    line = assert_one_line_error(run("--model", "gpt5", "--budget", "1GB"), code=2, contains='unknown model "gpt5"')
    assert "llama-7b" in line


@pytest.mark.parametrize("args,needle", [
    ((), "exactly one of --checkpoint"),
    (("--model", "llama-7b"), "--budget SIZE is required"),
    (("--model", "llama-7b", "--budget", "lots"), 'invalid size "lots"'),
    (("--model", "llama-7b", "--budget", "1GB", "--quantize", "int3"), "unknown quantization format 'int3'"),
    (("--model", "llama-7b", "--budget", "1GB", "--tokens", "-5"), "--tokens expects a positive integer"),
    (("--model", "llama-7b", "--budget", "1GB", "--link-gbps", "fast"), "--link-gbps expects"),
    (("--model", "llama-7b", "--budget", "1GB", "--frobnicate"), 'unknown option "--frobnicate"'),
    (("--model", "llama-7b", "--budget"), "--budget needs a value"),
    (("--model", "a", "--checkpoint", "b", "--budget", "1GB"), "exactly one of"),
    # -1 said "expects a non-negative number", then 0 "expects a positive number"
    (("--model", "llama-7b", "--budget", "1GB", "--disk-gbps", "-1"), '--disk-gbps expects a positive number, got "-1"'),
    (("--model", "llama-7b", "--budget", "1GB", "--disk-gbps", "0"), '--disk-gbps expects a positive number, got "0"'),
])
def test_usage_errors(args, needle):
    assert_one_line_error(run(*args), code=2, contains=needle)


@pytest.mark.parametrize("value,needle", [
    ("100000", "--max-prefetch: prefetch must be in [0, 64]"),
    ("-1", "--max-prefetch: prefetch must be in [0, 64]"),
    ("two", "--max-prefetch expects an integer in [0, 64]"),
    ("99999999999999999999", "--max-prefetch expects an integer in [0, 64]"),
])
def test_max_prefetch_has_one_rule(value, needle):
    """--max-prefetch 0 said "expects a positive integer" while 100000 said "must be in
    [0, 64]": both follow offload(prefetch=)'s rule (core/options.h), 0 included."""
    assert_one_line_error(run("--model", "llama-7b", "--budget", "8GiB", "--max-prefetch", value), code=2,
                          contains=needle)


def test_max_prefetch_zero_plans_like_offload_prefetch_zero():
    """0 is offload(prefetch=0): 2 slots, nothing copied ahead; the text says the
    prediction assumes the overlap that gives up."""
    j = plan_json("--model", "llama-7b", "--budget", "8GiB", "--max-prefetch", "0")
    assert j["options"]["max_prefetch"] == 0 and j["plan"]["num_slots"] == 2
    r = run("--model", "llama-7b", "--budget", "8GiB", "--max-prefetch", "0")
    assert r.returncode == 0 and "--max-prefetch 0" in r.stdout and "offload(prefetch=0)" in r.stdout


@pytest.mark.parametrize("value", ["9223372036854775807", "18446744073709551616", str((1 << 40) + 1)])
def test_tokens_too_large_says_so(value):
    """A huge --tokens said "expects a positive integer, got ..." though it is one."""
    assert_one_line_error(run("--model", "llama-7b", "--budget", "8GiB", "--tokens", value), code=2,
                          contains=f"--tokens {value} is too large (at most {1 << 40})")
    assert plan_json("--model", "llama-7b", "--budget", "8GiB", "--tokens", str(1 << 40))["options"][
        "tokens"] == 1 << 40


@pytest.mark.parametrize("budget", ["50%", "auto", " 40% "])
def test_budget_share_says_plan_needs_a_byte_count(budget):
    """--budget 50% / auto said "unknown unit (use B, KB, ...)": plan has no device to
    take a share of, and says which forms it takes."""
    line = assert_one_line_error(run("--model", "llama-7b", "--budget", budget), code=2,
                                 contains="layerstream plan needs a byte count")
    assert "no free memory to take a share of" in line and "2MiB" in line, line
    assert "unknown unit" not in line


def test_compute_dtype_adds_the_cast_copy_to_each_slot():
    """--compute-dtype mirrors offload(compute_dtype=): a bf16 model planned for
    fp32 activations holds each weight's fp32 copy in its slot too (2 + 4 bytes
    per parameter); for bf16 activations nothing changes."""
    base = plan_json("--model", "llama-13b", "--budget", "20GiB")
    same = plan_json("--model", "llama-13b", "--budget", "20GiB", "--compute-dtype", "bf16")
    wide = plan_json("--model", "llama-13b", "--budget", "20GiB", "--compute-dtype", "fp32")
    assert wide["options"]["compute_dtype"] == "F32" and base["options"]["compute_dtype"] is None
    s = base["plan"]["slot_bytes"]
    assert s > 0
    assert same["plan"]["slot_bytes"] == s
    assert 3 * s <= wide["plan"]["slot_bytes"] <= 3 * s + 1024
    assert wide["plan"]["device_bytes"] <= wide["plan"]["budget_bytes"]


def test_compute_dtype_bad_value_is_a_usage_error():
    r = run("--model", "llama-13b", "--budget", "24GiB", "--compute-dtype", "int8")
    assert_one_line_error(r, code=2, contains="--compute-dtype expects fp32, bf16 or fp16")


def test_tied_lm_head_from_config(tmp_path):
    """A tied model's checkpoint stores only the table; config.json says it is tied, so
    the plan adds the lm_head that offload() streams from the table's host copy (counted
    once in pinned host memory, never quantized). Without the config it plans what the
    checkpoint holds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    assert (tmp_path / "config.json").is_file()
    table = 128 * 64 * 4

    def layers_of(j):
        return {l["name"]: l for l in j["plan"]["layers"]}

    # 200 KB: the head streams, reading the table's host copy (counted once).
    j = plan_json("--checkpoint", tmp_path, "--budget", "200KB")
    assert j["source"]["tied_lm_head"] == "model.embed_tokens"
    layers, p = layers_of(j), j["plan"]
    head, emb = layers["lm_head"], layers["model.embed_tokens"]
    assert head["tied_with"] == "model.embed_tokens" and emb["tied_with"] == "lm_head"
    assert (head["placement"], emb["placement"]) == ("streamed", "lookup")
    assert p["host_pinned_bytes"] == sum(l["bytes"] for l in p["layers"]
                                         if l["placement"] in ("streamed", "lookup")) - table
    # Quantized: the others pack, the head reads the dense table.
    layers = layers_of(plan_json("--checkpoint", tmp_path, "--budget", "200KB", "--quantize", "int8"))
    assert layers["lm_head"]["bytes"] == table
    assert layers["model.layers.0.mlp.up_proj"]["bytes"] < 176 * 64 * 4
    # 350 KB: the head is resident, and the table with it (no extra device bytes).
    layers = layers_of(plan_json("--checkpoint", tmp_path, "--budget", "350KB"))
    assert layers["lm_head"]["placement"] == layers["model.embed_tokens"]["placement"] == "resident"
    assert layers["model.embed_tokens"]["resident_bytes"] == 0
    r = run("--checkpoint", tmp_path, "--budget", "200KB")
    assert r.returncode == 0, r.stderr
    assert "lm_head: not in the checkpoint, tied to model.embed_tokens" in r.stdout
    assert "tied weights:             lm_head streams the host copy of model.embed_tokens" in r.stdout
    # The safetensors file alone (no config.json beside it): no head is added.
    alone = tmp_path / "alone"
    alone.mkdir()
    (tmp_path / "model.safetensors").rename(alone / "model.safetensors")
    j = plan_json("--checkpoint", alone / "model.safetensors", "--budget", "700KB")
    assert j["source"]["tied_lm_head"] is None
    assert "lm_head" not in [l["name"] for l in j["plan"]["layers"]]


def _save_tiny_qwen3_moe(path, dtype=None, **over):
    """A 2-layer transformers Qwen3-MoE checkpoint (8 experts, 2 per token, unless `over`
    says otherwise; per-expert tensors, as transformers saves them) with its config.json,
    in `path`; in `dtype` when given."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64), **over})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    (model.to(dtype) if dtype else model).save_pretrained(str(path), safe_serialization=True)


def test_moe_checkpoint_plans_one_group_per_experts_module(tmp_path):
    """transformers saves a mixture-of-experts model with per-expert tensors; the plan groups
    them per experts module, as offload() streams them (one slot; with --quantize each tensor
    packed), and takes the experts a token runs from config.json."""
    _save_tiny_qwen3_moe(tmp_path)
    group = 8 * 3 * 16 * 32 * 4
    j = plan_json("--checkpoint", tmp_path, "--budget", "200KB", "--quantize", "int8", "--tokens", "100")
    layers = {l["name"]: l for l in j["plan"]["layers"]}
    assert not [n for n in layers if ".experts." in n]
    for i in range(2):
        g = layers[f"model.layers.{i}.mlp.experts"]
        # Each of the 24 tensors (16 x 32 or 32 x 16) packed as int8: 512 B of codes and an
        # fp32 scale per row, in 256-byte-aligned sections: 768 B instead of 2048 B.
        assert g["bytes"] == 24 * 768 < group
        assert g["flops"] == 2 * 100 * (group // 4) * 2 / 8  # 2 of 8 experts per token
    r = run("--checkpoint", tmp_path, "--budget", "200KB")
    assert r.returncode == 0, r.stderr
    assert ("2 mixture-of-experts group(s), one slot each; a token runs 25% of the experts (config.json), "
            "4096 tokens reach ~100%: more than half, so each group crosses whole") in r.stdout
    assert j["options"]["experts"] == "routed" and "routed_bytes" not in g


def test_an_invalid_expert_count_in_config_json_is_an_error(tmp_path):
    """num_experts_per_tok of 16 (of 8 experts), 0, -2 or "2" was ignored as if absent:
    "no config.json with num_experts_per_tok", every expert planned."""
    import json as json_module

    _save_tiny_qwen3_moe(tmp_path)
    config = tmp_path / "config.json"
    good = json_module.loads(config.read_text())
    for value, says in ((16, "num_experts_per_tok 16 is more than the model's 8 experts ("),
                        (0, "num_experts_per_tok is 0, not a whole number of experts above 0"),
                        (-2, "num_experts_per_tok is -2, not a whole"), ("2", 'num_experts_per_tok is "2", not')):
        config.write_text(json_module.dumps({**good, "num_experts_per_tok": value}))
        line = assert_one_line_error(run("--checkpoint", tmp_path, "--budget", "200KB"), code=1, contains=says)
        assert "config.json" in line and "remove the key to plan every expert" in line


def test_moe_checkpoint_plans_the_router_before_its_experts(tmp_path):
    """The order heuristic ranked neither `gate` (the router) nor `experts`: alphabetical,
    the experts came first, and their routed copy was timed against the layer before
    the router (planner.md: it starts after the router's compute)."""
    _save_tiny_qwen3_moe(tmp_path)
    names = [l["name"] for l in plan_json("--checkpoint", tmp_path, "--budget", "200KB", "--tokens", "1")
             ["plan"]["layers"]]
    for i in range(2):
        block = [n for n in names if n.startswith(f"model.layers.{i}.")]
        assert block.index(f"model.layers.{i}.mlp.gate") + 1 == block.index(f"model.layers.{i}.mlp.experts"), block
        assert block.index(f"model.layers.{i}.self_attn.o_proj") < block.index(f"model.layers.{i}.mlp.gate"), block


def test_quantize_lossless_codes_moe_groups_per_expert(tmp_path):
    """--quantize lossless on a mixture-of-experts checkpoint: each experts group's bytes
    are its tensors' coded size, within 5% of what offload(quantize="lossless") codes
    (it codes the fused tensors transformers loads one piece per expert; the plan measures
    the checkpoint's per-expert tensors one by one) and below the dense size. Trained, the
    groups cross coded too, and their slot holds each tensor's largest coding and its
    decoded copy, as offload() sizes the trainable group's slot (Note [Trainable coded
    weights]; the plan's, of the checkpoint's per-expert tensors, leans high by their
    headers: within 1%): both say so when the budget is too small."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import layerstream
    _save_tiny_qwen3_moe(tmp_path, torch.bfloat16, hidden_size=128, intermediate_size=128,
                         moe_intermediate_size=128, head_dim=64, num_experts=4)
    args = ("--checkpoint", tmp_path, "--budget", "1MiB", "--quantize", "lossless")
    planned = {l["name"]: l for l in plan_json(*args)["plan"]["layers"]}
    trained = {l["name"]: l for l in plan_json(*args[:2], "--budget", "4MiB", *args[4:], "--train")["plan"]["layers"]}
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    handle = layerstream.offload(model.requires_grad_(False), device="sim", quantize="lossless")
    index = {a.name: a.index for a in handle._attached}
    dense = 4 * 3 * 128 * 128 * 2
    for i in range(2):
        name = f"model.layers.{i}.mlp.experts"
        coded, got = handle._engine.layer_bytes(index[name]), planned[name]["bytes"]
        assert abs(got - coded) <= 0.05 * coded, (name, got, coded)
        assert got < 0.75 * dense
        assert trained[name]["bytes"] == got
    handle.detach()
    experts = model.requires_grad_(True).model.layers[0].mlp.experts
    slot = layerstream._C.slot_layout([(layerstream._C.lossless_max_bytes(p.detach(), 4), p.numel() * 2)
                                       for p in (experts.gate_up_proj, experts.down_proj)])["slot_bytes"]
    r = run("--checkpoint", tmp_path, "--budget", "1MiB", "--quantize", "lossless", "--train")
    assert_one_line_error(r, contains=f'"model.layers.0.mlp.experts" needs a slot of')
    with pytest.raises(layerstream.LayerstreamError, match=rf"needs a slot of .* \({slot} bytes"):
        layerstream.offload(model, device="sim", quantize="lossless", budget="900KiB")
    planned_slot = int(re.search(r"needs a slot of [^(]*\((\d+) bytes", r.stderr).group(1))
    assert slot <= planned_slot <= 1.01 * slot, (slot, planned_slot)


def test_moe_decoding_plans_the_routed_experts_only(tmp_path):
    """One token per step (decoding) reaches 2 of 8 experts: as offload(experts="routed")
    copies only those, the plan counts a quarter of each group on the bus, on demand (the
    table says "routed"); --experts all counts every expert."""
    _save_tiny_qwen3_moe(tmp_path)
    group = 8 * 3 * 16 * 32 * 4
    routed = plan_json("--checkpoint", tmp_path, "--budget", "110KB", "--tokens", "1")
    whole = plan_json("--checkpoint", tmp_path, "--budget", "110KB", "--tokens", "1", "--experts", "all")
    assert routed["options"]["experts"] == "routed" and whole["options"]["experts"] == "all"
    for i in range(2):
        g = {l["name"]: l for l in routed["plan"]["layers"]}[f"model.layers.{i}.mlp.experts"]
        assert g["bytes"] == group and g["routed_bytes"] == group // 4
        assert g["placement"] == "streamed" and g["transfer_s"] == pytest.approx(group / 4 / 25e9)
    assert routed["plan"]["bus_bytes_per_step"] < whole["plan"]["bus_bytes_per_step"] - group
    r = run("--checkpoint", tmp_path, "--budget", "110KB", "--tokens", "1")
    assert "1 tokens reach ~25%: only those cross the bus (routed), on demand" in r.stdout
    assert " routed " in r.stdout
    bad = run("--checkpoint", tmp_path, "--budget", "200KB", "--experts", "some")
    assert bad.returncode == 2 and "--experts expects routed or all" in bad.stderr
    # The built-in Qwen3-30B-A3B (8 of 128 experts per token), decoding under 16 GiB:
    # routed, a step moves about a tenth of what every expert would.
    q = plan_json("--model", "qwen3-30b-a3b", "--budget", "16GiB", "--tokens", "1")
    q_all = plan_json("--model", "qwen3-30b-a3b", "--budget", "16GiB", "--tokens", "1", "--experts", "all")
    assert q["plan"]["bus_bytes_per_step"] < q_all["plan"]["bus_bytes_per_step"] / 8
    assert q["plan"]["time"]["step_s"] < q_all["plan"]["time"]["step_s"] / 8


def test_gguf_file_plans_the_file_blocks(tmp_path):
    """`plan --checkpoint x.gguf`: Q4_K / Q8_0 Linear weights cross as the file's
    blocks and are dequantized in the slot (to --dense-dtype, default bf16); resident
    they are dense."""
    torch = pytest.importorskip("torch")
    from conftest import gguf_random_blocks, write_gguf

    tensors = []
    for i in range(4):
        tensors.append((f"blocks.{i}.attn.qkv.weight", (768, 512), "Q4_K", gguf_random_blocks("Q4_K", 768, 512)))
        tensors.append((f"blocks.{i}.mlp.fc.weight", (1024, 512), "Q8_0", gguf_random_blocks("Q8_0", 1024, 512)))
        tensors.append((f"blocks.{i}.norm.weight", (512,), "F32", torch.zeros(512 * 4, dtype=torch.uint8)))
    path = write_gguf(tmp_path / "m.gguf", tensors)
    q4k, q8 = 768 * 512 // 256 * 144, 1024 * 512 // 32 * 34  # 221184 and 557056: multiples of 256
    p = plan_json("--checkpoint", path, "--budget", "6MiB", "--tokens", "16")
    assert p["source"]["kind"] == "gguf" and p["source"]["layers"] == 8
    layers = {l["name"]: l for l in p["plan"]["layers"]}
    streamed = [l for l in layers.values() if l["placement"] == "streamed"]
    assert streamed, "a 6 MiB budget cannot hold every layer dense"
    for l in streamed:
        assert l["bytes"] == (q4k if "qkv" in l["name"] else q8), l
    assert p["plan"]["slot_bytes"] == q8 + 1024 * 512 * 2  # packed + dense bf16 (both 256-byte multiples)
    assert all(l["resident_bytes"] == l["bytes"] // (q4k if "qkv" in l["name"] else q8) * (768 if "qkv" in
               l["name"] else 1024) * 512 * 2 for l in layers.values())  # resident: dense bf16
    fp32 = plan_json("--checkpoint", path, "--budget", "6MiB", "--dense-dtype", "fp32")
    assert fp32["plan"]["slot_bytes"] == q8 + 1024 * 512 * 4
    r = run("--checkpoint", path, "--budget", "6MiB")
    assert r.returncode == 0 and "8 weight(s) cross as the file's blocks, dequantized in the slot to BF16" in r.stdout
    # --quantize reaches only a GGUF's dense weights, and the inputs line says so (here: none).
    r = run("--checkpoint", path, "--budget", "6MiB", "--quantize", "int8")
    assert r.returncode == 0 and "quantize int8 (none applies: every weight crosses as the file's blocks)" in r.stdout
    assert_one_line_error(run("--checkpoint", tmp_path / "none.gguf", "--budget", "1GiB"), 1, "does not exist")


def test_plan_texts_name_its_own_flags_and_sources(tmp_path):
    """The "too small" advice named offload()'s options (dequant_dtype / compute_dtype)
    and a GGUF file's routed share was said to come from "config.json"; `plan` names its
    flags and the file's metadata. --quantize takes offload()'s aliases (e4m3)."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize
    from conftest import gguf_random_blocks, write_gguf

    path = write_gguf(tmp_path / "q8.gguf", [(f"blocks.{i}.mlp.fc.weight", (1024, 512), "Q8_0",
                                              gguf_random_blocks("Q8_0", 1024, 512)) for i in range(4)])
    r = run("--checkpoint", path, "--budget", "1MiB", "--dense-dtype", "fp32")
    assert r.returncode == 1 and "--compute-dtype bf16 / --dense-dtype bf16" in r.stderr, r.stderr
    assert "dequant_dtype" not in r.stderr and "quantize=" not in r.stderr, r.stderr
    assert plan_json("--checkpoint", path, "--budget", "8MiB", "--quantize", "e4m3")["options"]["quantize"] == "fp8"

    moe = tmp_path / "moe.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(moe), "qwen3moe")
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_block_count(1)
    for name, shape in (("ffn_gate_exps", (8, 128, 64)), ("ffn_up_exps", (8, 128, 64)), ("ffn_down_exps", (8, 64, 128))):
        a = rng.standard_normal(shape).astype(np.float32) * 0.02
        w.add_tensor(f"blk.0.{name}.weight", quantize(a, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((8, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("--checkpoint", moe, "--budget", "1MiB", "--tokens", "1")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if "mixture-of-experts" in l)
    assert "(the file's metadata)" in line and "config.json" not in line, line


def test_gguf_plain_float_tensors_are_planned_in_the_models_dtype(tmp_path):
    """load_gguf() casts a GGUF's F32/F16 tensors to the model's dtype; the plan kept
    their file dtype whatever --dense-dtype said (an all-F32 file planned at twice its
    bf16 size)."""
    torch = pytest.importorskip("torch")
    from conftest import write_gguf

    path = write_gguf(tmp_path / "plain.gguf", [
        ("blk.0.attn_q.weight", (64, 64), "F16", torch.zeros(64 * 64 * 2, dtype=torch.uint8)),
        ("blk.0.ffn_up.weight", (64, 64), "F32", torch.zeros(64 * 64 * 4, dtype=torch.uint8))])
    for dtype, size in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        args = ["--checkpoint", path, "--budget", "1MiB"]
        layers = plan_json(*args, "--dense-dtype", dtype)["plan"]["layers"]
        assert [l["bytes"] for l in layers] == [64 * 64 * size] * 2, (dtype, layers)
    assert [l["bytes"] for l in plan_json("--checkpoint", path, "--budget", "1MiB")["plan"]["layers"]] == [8192] * 2
    r = run("--checkpoint", path, "--budget", "1MiB", "--quantize", "int8")
    assert r.returncode == 0 and "quantize int8 (the 2 dense weight(s) only; the file's blocks cross as" in r.stdout


def test_host_budget_shows_the_layers_from_disk_and_the_step_with_the_disk(st_file):
    """--host-budget: streamed Linear weights that do not fit stay in the checkpoint
    (core/host_tier.h, as offload(host_budget=) decides); the disk read per step
    at --disk-gbps bounds the predicted step."""
    all_ram = plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", "1GiB")
    assert all_ram["host"]["disk_bytes"] == 0 and all_ram["host"]["from_disk"] == []
    streamed = all_ram["plan"]["host_pinned_bytes"]
    p = plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", str(streamed // 2),
                  "--disk-gbps", "0.001")
    h = p["host"]
    assert h["from_disk"] and h["disk_bytes"] > 0
    assert h["store_bytes"] + h["staging_bytes"] <= streamed // 2
    assert h["disk_read_bytes_per_step"] > 0
    assert h["step_time_s"] == pytest.approx(h["disk_read_bytes_per_step"] / 1e6, rel=1e-3)  # disk-bound
    text = run("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", str(streamed // 2), "--disk-gbps",
               "0.001")
    assert text.returncode == 0 and "stay in the checkpoint" in text.stdout and "(disk-bound)" in text.stdout
    # Quantized: the layers on disk are read packed (offload(cache_dir=)'s cache file).
    packed = plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", "1GiB", "--quantize",
                       "int8")["plan"]["host_pinned_bytes"]
    q = plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", str(packed * 2 // 3),
                  "--quantize", "int8")["host"]
    assert q["from_disk"] and 0 < q["disk_bytes"] < h["disk_bytes"]
    # The pinned-RAM line of the plan is what the layers would need without the host
    # budget, and says so (it printed that beside the host budget's smaller split).
    pinned = next(l for l in text.stdout.splitlines() if l.startswith("host RAM needed (pinned)"))
    assert "without a host budget" in pinned and "see the host lines below" in pinned, pinned
    plain = run("--checkpoint", st_file, "--budget", "200KiB").stdout
    assert "without a host budget" not in plain
    # Training: every weight must be in RAM, so a small host budget is an error.
    r = run("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", str(streamed // 2), "--train")
    assert r.returncode == 1 and "cannot hold the streamed weights" in r.stderr


def test_quantize_lossless_measures_each_weights_coded_size(tmp_path):
    """--quantize lossless: each layer's bytes on the bus are its coded size,
    predicted from a sample of its own elements in the checkpoint (within 2% of
    what offload() codes)."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from layerstream import _C
    g = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.fc.weight": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16)
               for i in range(3)}
    tensors["blocks.3.fc.weight"] = (torch.randn(64, 64, generator=g) * 0.02).to(torch.float16)
    path = tmp_path / "m.safetensors"
    st.save_file(tensors, str(path))
    layers = {l["name"]: l for l in plan_json("--checkpoint", path, "--budget", "4MiB", "--quantize",
                                              "lossless")["plan"]["layers"]}
    for name, t in tensors.items():
        coded = _C.lossless_coded_bytes(t)
        got = layers[name[:-len(".weight")]]["bytes"]
        assert abs(got - coded) <= 0.02 * coded, (name, got, coded)
        assert got < t.numel() * 2
    # Trained (full fine-tuning), a weight stays dense on the host next to its coded copy at its
    # largest size, and a slot holds that size and the decoded weight; the bus still carries the
    # coded bytes (Note [Trainable coded weights]).
    deep = {f"blocks.{i}.fc.weight": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(8)}
    st.save_file(deep, str(tmp_path / "deep.safetensors"))
    args = ("--checkpoint", tmp_path / "deep.safetensors", "--budget", "2500KiB", "--quantize", "lossless")
    infer, train = plan_json(*args)["plan"], plan_json(*args, "--train")["plan"]
    streamed = [l["name"] + ".weight" for l in train["layers"] if l["placement"] == "streamed"]
    assert len(streamed) >= 6
    assert [l["bytes"] for l in train["layers"]] == [l["bytes"] for l in infer["layers"]]
    assert train["host_pinned_bytes"] == sum(deep[n].numel() * 2 + _C.lossless_max_bytes(deep[n]) for n in streamed)
    big = deep["blocks.0.fc.weight"]
    assert train["slot_bytes"] >= _C.lossless_max_bytes(big) + big.numel() * 2 > infer["slot_bytes"]
    r = run("--model", "llama-7b", "--budget", "1GiB", "--quantize", "lossless")
    assert_one_line_error(r, 2, "--quantize lossless needs a .safetensors --checkpoint")


def test_activation_offload_uses_both_directions_of_the_link(st_file):
    """--activations host (with --train): each linear layer's saved input, tokens x
    in_features in its dtype, goes to the host in the forward and comes back over the
    weights' link in the backward: the plan counts the bytes, and the step takes longer
    when the link is slow."""
    args = ("--checkpoint", st_file, "--budget", "10MiB", "--train", "--tokens", "1000", "--link-gbps", "1")
    off = plan_json(*args)["plan"]
    on = plan_json(*args, "--activations", "host")["plan"]
    per_step = 4 * 1000 * (128 + 256) * 2  # fc1 (in 128) and fc2 (in 256) of 4 blocks, fp16
    assert off["activation_bytes_per_step"] == 0
    assert on["activation_bytes_per_step"] == per_step
    assert on["time"]["transfer_s"] == pytest.approx(off["time"]["transfer_s"] + per_step / 1e9)
    # The compute is tiny: the copies back are nearly all on the step's critical path.
    assert on["time"]["step_s"] >= off["time"]["step_s"] + 0.9 * per_step / 1e9
    assert on["time"]["bound"] == "transfer"
    text = run(*args, "--activations", "host").stdout
    assert "saved activations:        2.93 MiB per step to the host in the forward and back" in text
    r = run("--checkpoint", st_file, "--budget", "10MiB", "--activations", "host")
    assert_one_line_error(r, code=2, contains="--activations host needs --train")
    r = run(*args, "--activations", "disk")
    assert_one_line_error(r, code=2, contains="--activations expects host")


def test_activation_offload_counts_an_input_several_projections_read_once():
    """offload(activations=) copies the normed input of q, k and v (and of gate and up)
    once (Note [A tensor saved by several ops]): the plan counts it once per block, not
    once per projection. llama-7b, 1000 tokens in fp16: per block the inputs of q/k/v,
    o, gate/up (4096 each) and down (11008), and lm_head's."""
    plan = plan_json("--model", "llama-7b", "--budget", "4GiB", "--train", "--tokens", "1000",
                     "--activations", "host")["plan"]
    assert plan["activation_bytes_per_step"] == 1000 * 2 * (32 * (3 * 4096 + 11008) + 4096)


def test_training_counts_the_gradients_staging_buffers_in_the_host_budget(st_file):
    """--train --host-budget: each streamed trainable layer's gradient staging buffer is
    host RAM too (as offload() plans it)."""
    j = plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", "100MiB", "--train")
    streamed = sum(l["bytes"] for l in j["plan"]["layers"] if l["placement"] == "streamed")
    assert streamed > 0 and j["host"]["grad_staging_bytes"] == streamed
    text = run("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", "100MiB", "--train").stdout
    assert "of gradient staging buffers (training)" in text
    assert plan_json("--checkpoint", st_file, "--budget", "200KiB", "--host-budget", "100MiB")["host"][
        "grad_staging_bytes"] == 0


@pytest.mark.parametrize("spec,per_elem_states", [(None, 0), ("grads", 0), ("adamw", 8), ("adamw-bf16", 4), ("6", 6)])
def test_training_budget_holds_the_resident_weights_gradients_and_states(st_file, spec, per_elem_states):
    """--train[=SPEC], as offload(train=SPEC): a resident trainable weight also needs its
    gradient (its own dtype) and its optimizer states on the device; the plan counts them
    per layer and for the small tensors, and keeps the total within the budget."""
    flag = "--train" if spec is None else f"--train={spec}"
    j = plan_json("--checkpoint", st_file, "--budget", "600KiB", flag)
    plan = j["plan"]
    assert j["options"]["train"] == (spec or "grads")
    shapes = {"fc1": [(256, 128), (256,)], "fc2": [(128, 256)]}  # float16
    resident = [l for l in plan["layers"] if l["placement"] == "resident"]
    assert resident and any(l["placement"] == "streamed" for l in plan["layers"])
    for l in resident:
        numel = sum(math.prod(s) for s in shapes[l["name"].split(".")[-1]])
        assert l["train_bytes"] == numel * (2 + per_elem_states), l
    small = 4 * 128 * (4 + per_elem_states)  # the fp32 norms
    assert plan["train_bytes"] == sum(l["train_bytes"] for l in resident) + small
    assert plan["device_bytes"] == (plan["resident_bytes"] + plan["small_resident_bytes"] + plan["train_bytes"]
                                    + plan["num_slots"] * plan["slot_bytes"]) <= 600 * 1024
    assert all("train_bytes" not in l for l in plan["layers"] if l["placement"] != "resident")
    assert plan_json("--checkpoint", st_file, "--budget", "600KiB")["plan"]["train_bytes"] == 0
    assert_one_line_error(run("--checkpoint", st_file, "--budget", "600KiB", "--train=sgd"), 2,
                          "train='sgd' is not a training footprint")


@pytest.mark.parametrize("spec", ["grads", "adamw", "adamw-bf16", "adafactor", "6"])
def test_cli_and_offload_count_the_same_training_bytes(tmp_path, spec):
    """The same checkpoint planned by `layerstream plan --train=SPEC` and by
    offload(train=SPEC) on the model it was saved from, under a budget that holds
    everything: the same layers resident with the same gradient and state bytes each,
    and the same total with the small tensors (a LayerNorm's; not an int64 buffer's)."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import layerstream

    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96),
                                torch.nn.Linear(96, 32, bias=False), torch.nn.Linear(32, 48)).to(torch.bfloat16)
    model.register_buffer("position_ids", torch.arange(128))  # an int64 small tensor: it does not train
    path = tmp_path / "m.safetensors"
    st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    cli = plan_json("--checkpoint", path, "--budget", "1MiB", f"--train={spec}")["plan"]
    py = json.loads(layerstream.offload(model, device="sim", budget="1MiB", train=spec)._plan["json"])
    for plan in (cli, py):
        assert all(l["placement"] == "resident" for l in plan["layers"]), plan
    assert ({l["name"]: l["train_bytes"] for l in cli["layers"]}
            == {l["name"]: l["train_bytes"] for l in py["layers"]})
    assert cli["train_bytes"] == py["train_bytes"] > sum(l["train_bytes"] for l in py["layers"])


def test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it(tmp_path):
    """An fp32 checkpoint for a bf16 model: `--dense-dtype bf16` plans each layer at
    the bytes offload() holds after load_safetensors() casts it, and never on disk
    (offload() reads cast weights into RAM), where the fp32 plan puts layers on disk.
    (The CLI's planner picks its own prefetch depth, so placements may differ.)
    Convolutions and lossless layers stay off the disk tier too (offload() reads them
    into RAM); lossless sizes are measured from the values cast."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import layerstream

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    path = tmp_path / "fp32.safetensors"
    st.save_file(model.state_dict(), str(path))
    args = ("--checkpoint", path, "--budget", "140KiB", "--host-budget", "250KiB")
    fp32 = plan_json(*args)
    assert fp32["source"]["cast_layers"] == 0 and len(fp32["host"]["from_disk"]) == 6
    cli = plan_json(*args, "--dense-dtype", "bf16")
    assert cli["source"]["cast_layers"] == 6 and cli["host"]["from_disk"] == [] and cli["host"]["disk_bytes"] == 0
    assert "6 layer(s) cast to BF16 as offload() reads them" in run(*args, "--dense-dtype", "bf16").stdout
    # A built-in model too: its bf16 weights planned as fp32.
    bf16, fp32 = (plan_json("--model", "llama-7b", "--budget", "4GiB", *a)["plan"]
                  for a in ((), ("--dense-dtype", "fp32")))
    assert fp32["layers"][1]["bytes"] == 2 * bf16["layers"][1]["bytes"]
    # A host budget below the cast layers' bytes: an error, as offload() says, not a plan from disk.
    assert plan_json("--checkpoint", path, "--budget", "140KiB", "--host-budget", "130KiB")["host"]["from_disk"]
    r = run("--checkpoint", path, "--budget", "70KiB", "--host-budget", "130KiB", "--dense-dtype", "bf16")
    assert r.returncode == 1 and "cannot hold the streamed weights" in r.stderr, r.stderr
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)]).to(torch.bfloat16)
    meta.requires_grad_(False)
    layerstream.load_safetensors(meta, str(path))
    with pytest.raises(layerstream.LayerstreamError, match="cast as read"):
        layerstream.offload(meta, device="sim", budget="70KiB", host_budget="130KiB")
    handle = layerstream.offload(meta, device="sim", budget="140KiB", host_budget="250KiB")
    py = json.loads(handle._plan["json"])
    assert ({l["name"]: l["bytes"] for l in cli["plan"]["layers"]}
            == {l["name"]: l["bytes"] for l in py["layers"]} == {str(i): 128 * 129 * 2 for i in range(6)})
    for plan, store in ((cli["plan"], cli["host"]["store_bytes"]), (py, handle.host_plan["store_bytes"])):
        assert store == sum(l["bytes"] for l in plan["layers"] if l["placement"] == "streamed") > 0
    assert handle.stats()["disk_layers"] == 0
    handle.detach()

    conv = {"conv.weight": torch.randn(64, 64, 3, 3), **{f"fc{i}.weight": torch.randn(64, 576) for i in range(3)}}
    st.save_file(conv, str(tmp_path / "conv.safetensors"))  # 144 KiB each, all streamed; 576 KiB in RAM
    c = plan_json("--checkpoint", tmp_path / "conv.safetensors", "--budget", "300KiB", "--host-budget", "450KiB")
    assert c["host"]["from_disk"] and "conv" not in c["host"]["from_disk"], c["host"]
    # Lossless: the coded size of the values cast to the model's dtype, as offload() codes
    # them after load_safetensors() casts them (within 2%; + the bias, which is not coded).
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        j = plan_json("--checkpoint", path, "--budget", "1MiB", "--dense-dtype", flag, "--quantize", "lossless")
        for layer in j["plan"]["layers"]:
            want = layerstream._C.lossless_coded_bytes(model[int(layer["name"])].weight.detach().to(dtype))
            assert abs(layer["bytes"] - 128 * dtype.itemsize - want) <= 0.02 * want, (flag, layer, want)
    # Lossless layers are read into RAM (offload() codes them there): a host budget
    # below their coded bytes is an error, not a plan from disk.
    r = run("--checkpoint", path, "--budget", "250KiB", "--host-budget", "250KiB", "--quantize", "lossless")
    assert r.returncode == 1 and "cannot hold the streamed weights" in r.stderr, r.stderr


@pytest.mark.parametrize("quantize, width", [("int8", 256), ("nf4", 256), ("int4", 320)])
def test_quantized_plan_places_and_sizes_layers_as_offload_does(tmp_path, quantize, width):
    """`plan --quantize` charged resident quantized layers their packed size (offload()
    holds them dense: 8 of 8 resident predicted, 1 kept), and sized int4 layers of a
    width not a multiple of 128 packed (offload() streams them as stored: 6.7x the bytes)."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import warnings
    import layerstream
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).requires_grad_(False)
    path = tmp_path / "m.safetensors"
    st.save_file(model.state_dict(), str(path))
    cli = plan_json("--checkpoint", path, "--budget", "1MiB", "--quantize", quantize, "--max-prefetch", "1",
                    "--link-gbps", "0")["plan"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = layerstream.offload(model, device="sim", budget="1MiB", prefetch=1, quantize=quantize)
    try:
        ours = json.loads(handle._plan["json"])
        place = lambda p: {l["name"]: (l["placement"], l["bytes"]) for l in p["layers"]}
        assert place(cli) == place(ours)
        model(torch.randn(1, width))
        s = handle.stats()
        assert cli["device_bytes"] == s["peak_device_bytes"] and cli["host_pinned_bytes"] == s["pinned_bytes"]
    finally:
        handle.detach()


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_cli_layer_bytes_are_the_slot_bytes_offload_allocates(tmp_path, compute_dtype):
    """Each part of a slot starts on a 256-byte boundary (core/slot_layout.h, the one rule the
    engine lays its slots out by). `plan` added a layer's weight and bias bytes unaligned:
    a 100x100 fp32 layer (40000 + 400 B) planned 304 B short of what offload() allocates."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import layerstream
    torch.manual_seed(0)
    # One shape: the CLI orders residency by FLOPs per byte, offload() (no FLOPs) by size.
    model = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(6)]).requires_grad_(False)
    path = tmp_path / "m.safetensors"
    st.save_file(model.state_dict(), str(path))
    flags = ("--compute-dtype", "bf16") if compute_dtype else ()
    cli = plan_json("--checkpoint", path, "--budget", "150KiB", "--max-prefetch", "1", "--link-gbps", "0",
                    *flags)["plan"]
    handle = layerstream.offload(model, device="sim", budget="150KiB", prefetch=1,
                                 compute_dtype=getattr(torch, compute_dtype) if compute_dtype else None)
    try:
        ours = json.loads(handle._plan["json"])
        place = lambda p: {l["name"]: (l["placement"], l["bytes"]) for l in p["layers"]}
        assert place(cli) == place(ours)
        assert cli["layers"][0]["bytes"] == 40192 + 512  # 40000 B of weight and 400 B of bias, each aligned
        assert "streamed" in {l["placement"] for l in cli["layers"]}
        model(torch.randn(1, 100))
        s = handle.stats()
        assert cli["slot_bytes"] == s["slot_bytes"] > 0 and cli["device_bytes"] == s["peak_device_bytes"]
        assert cli["host_pinned_bytes"] == ours["host_pinned_bytes"]
    finally:
        handle.detach()


def test_readme_says_plan_and_offload_may_place_the_same_model_differently(tmp_path):
    """README's Command-line tool section did not say that `plan` picks the slot count by
    its time model while offload() reserves prefetch + 1 slots first, and said
    `plan --train=adamw` "plans the same": here the CLI plans 2 slots and 2 resident
    layers, offload(prefetch=2) 3 slots and 1 resident, from the same bytes per layer."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import layerstream
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 256) if i % 2 == 0 else torch.nn.Linear(256, 128, bias=False)
                                  for i in range(8)]).half().requires_grad_(False)
    path = tmp_path / "m.safetensors"
    st.save_file(model.state_dict(), str(path))
    cli = plan_json("--checkpoint", path, "--budget", "300KiB", "--max-prefetch", "2")["plan"]
    handle = layerstream.offload(model, device="sim", budget="300KiB", prefetch=2)
    try:
        ours = json.loads(handle._plan["json"])
        assert "3 slots" in handle.plan and "1 resident" in handle.plan, handle.plan
    finally:
        handle.detach()
    assert [l["bytes"] for l in cli["layers"]] == [l["bytes"] for l in ours["layers"]]
    assert cli["slot_bytes"] == ours["slot_bytes"]
    assert (cli["num_slots"], cli["num_resident"]) == (2, 2) and (ours["num_slots"], ours["num_resident"]) == (3, 1)
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Command-line tool\n", 1)[1].split("\n## ", 1)[0]
    prose = " ".join(section.split("```")[-1].split())
    for says in ("`plan` counts each layer's bytes and the slot size as `offload()` does",
                 "`offload()` reserves `prefetch + 1` slots first", "which layers stay resident may differ",
                 "`print(handle.plan)`"):
        assert says in prose, says
    assert "plans the same" not in readme
