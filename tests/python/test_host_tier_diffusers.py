"""The host tier with diffusers checkpoints (docs/design/host-tier.md): a diffusers
model's directory written by save_pretrained (sharded with its index, unsharded,
a variant) loads into the model built on the meta device, streams from disk under
a quarter of its weights, and gives the resident model's outputs and LoRA
gradients; a pipeline's root is an error naming the component's folder."""
import json

import accelerate
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from peft import LoraConfig

import layerstream
from layerstream import FileWeight, LayerstreamError

# Two double-stream and two single-stream blocks, width 64: about 1.8 MB of Linear
# weights, its largest layer (AdaLayerNormZero's 64 -> 384) 96 KiB.
CONFIG = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))


def _reference(dtype=torch.float32):
    torch.manual_seed(0)
    return FluxTransformer2DModel(**CONFIG).to(dtype).eval()


def _empty(ref):
    with accelerate.init_empty_weights():
        return FluxTransformer2DModel.from_config(ref.config).to(ref.dtype).eval()


def _inputs(step, dtype):
    g = torch.Generator().manual_seed(step)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g).to(dtype),           # a 4x4 latent
                encoder_hidden_states=torch.randn(1, 5, 32, generator=g).to(dtype),    # 5 text tokens
                pooled_projections=torch.randn(1, 32, generator=g).to(dtype),
                timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))


def _linear_tensors(model):
    return sorted(f"{name}.{k}" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  for k, p in m.named_parameters(recurse=False))


@pytest.mark.parametrize("shards,dtype", [(True, torch.float32), (False, torch.bfloat16)],
                         ids=["sharded-f32", "unsharded-bf16"])
def test_save_pretrained_directory_streams_from_disk_like_the_resident_model(tmp_path, shards, dtype):
    """host_budget = 1/4 of the streamed weights: every Linear weight stays in its
    file; outputs and the gradients of a peft LoRA (diffusers' add_adapter) over
    the frozen base equal the resident model's, bit for bit (the same CPU ops on the
    same values), over several steps."""
    ref = _reference(dtype)
    ref.save_pretrained(tmp_path, **(dict(max_shard_size="200KB") if shards else {}))
    files = sorted(p.name for p in tmp_path.iterdir())
    if shards:
        assert "diffusion_pytorch_model.safetensors.index.json" in files
        assert sum(f.startswith("diffusion_pytorch_model-0") and f.endswith(".safetensors") for f in files) > 4
    else:
        assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    model = _empty(ref)
    report = layerstream.load_safetensors(model, str(tmp_path))
    assert not report.missing and not report.unexpected
    assert sorted(report.in_file) == _linear_tensors(ref)
    assert report.dense and all(n.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight",
                                            "norm_added_k.weight")) for n in report.dense)  # the RMSNorms: the Linear layers' weights and biases stay in the file
    assert isinstance(model.transformer_blocks[0].attn.to_q.weight, FileWeight)
    model.requires_grad_(False)
    ref.requires_grad_(False)
    lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                      target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out"])
    torch.manual_seed(5)
    model.add_adapter(lora)
    torch.manual_seed(5)
    ref.add_adapter(lora)
    ours = {n: p for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert len(ours) == 38 and all(torch.equal(p, theirs[n]) for n, p in ours.items())
    budget = report.in_file_bytes // 4
    handle = layerstream.offload(model, device="sim", host_budget=budget)
    assert handle.host_plan["disk_bytes"] >= report.in_file_bytes and handle.host_plan["staging_bytes"] <= budget
    for step in range(3):
        x = _inputs(step, dtype)
        out, want = model(**x).sample, ref(**x).sample
        assert torch.equal(out, want), f"step {step}"
        out.float().square().mean().backward()
        want.float().square().mean().backward()
        for n, p in ours.items():
            assert torch.equal(p.grad, theirs[n].grad), f"step {step}: {n}"
            p.grad = theirs[n].grad = None
    stats = handle.stats()
    assert stats["disk_layers"] == len({n.rsplit(".", 1)[0] for n in report.in_file})  # every Linear
    assert stats["disk_read_bytes"] > 0
    assert stats["staging_hits"] > 0 and stats["ordering_errors"] == 0
    handle.detach()
    assert isinstance(model.transformer_blocks[0].attn.to_q.base_layer.weight, FileWeight)


def test_a_variant_loads_from_its_index_and_its_directory_says_so(tmp_path):
    """save_pretrained(variant="fp16") names its index
    diffusion_pytorch_model.safetensors.index.fp16.json: the directory alone is
    an error naming it (it is not the default checkpoint); the index loads."""
    ref = _reference()
    ref.save_pretrained(tmp_path, variant="fp16", max_shard_size="200KB")
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json"
    assert index.exists()
    model = _empty(ref)
    with pytest.raises(LayerstreamError, match=r"holds the index of a variant \(diffusion_pytorch_model"
                                               r"\.safetensors\.index\.fp16\.json.*pass the index"):
        layerstream.load_safetensors(model, str(tmp_path))
    assert all(p.is_meta for p in model.parameters())
    report = layerstream.load_safetensors(model, str(index))
    assert not report.missing and not report.unexpected
    layerstream.offload(model, device="sim")
    with torch.no_grad():
        assert torch.equal(model(**_inputs(0, torch.float32)).sample, ref(**_inputs(0, torch.float32)).sample)


class _TinyPipeline(DiffusionPipeline):
    def __init__(self, transformer, vae, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler)


def test_a_pipeline_directory_is_an_error_naming_the_components_folder(tmp_path):
    """A pipeline's save_pretrained writes model_index.json and a folder per
    component: its root is not one model's checkpoint. The error (C++'s
    read_checkpoint, the same for `layerstream plan`) names every folder with
    weights and its class from model_index.json; the transformer's folder loads."""
    ref = _reference()
    vae = AutoencoderKL(block_out_channels=(8,), layers_per_block=1, norm_num_groups=4, latent_channels=4)
    _TinyPipeline(ref, vae, FlowMatchEulerDiscreteScheduler()).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["transformer"] == ["diffusers",
                                                                                     "FluxTransformer2DModel"]
    model = _empty(ref)
    with pytest.raises(LayerstreamError, match=r"is a diffusers pipeline \(it holds model_index.json\), not one "
                                               r"model's checkpoint; pass the folder of one component: '[^']*"
                                               r"/transformer' \(FluxTransformer2DModel\), '[^']*/vae' "
                                               r"\(AutoencoderKL\)"):
        layerstream.load_safetensors(model, str(tmp_path))
    assert all(p.is_meta for p in model.parameters())
    report = layerstream.load_safetensors(model, str(tmp_path / "transformer"))
    assert not report.missing and not report.unexpected and report.in_file
