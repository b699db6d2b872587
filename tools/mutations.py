"""The mutation audit's catalogue: each entry plants one plausible bug (an exact source
snippet, the anchor, replaced in one file) and names the tests that must catch it.
tools/mutate.py runs them (its docstring says how); tests/python/test_mutation_entries.py
keeps every anchor and test name in step with the code. Figures: docs/mutation-audit.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Mutation:
    name: str
    file: str            # path in the repository
    anchor: str          # exact snippet, must occur once
    replacement: str
    tests: list          # "py:tests/python/x.py::test_y" or "gtest:binary:Filter.*"
    why: str             # the bug it plants, and the issue item it stands for
    survived_before: bool = False  # survived the audit of issue 29 (before its tests)
    extra_targets: list = field(default_factory=list)


P = "py:tests/python/"
MUTATIONS = [
    # ---- the four that survived the audit of issue 29 ----
    Mutation(
        "bf16-weight-grad-1pct", "csrc/torch/ops_streamed.cpp",
        "dopts.dtype(l.w_dtype)).copy_(gw));",
        "dopts.dtype(l.w_dtype)).copy_(l.w_dtype == torch::kBFloat16 ? gw * 1.01 : gw));",
        [P + "test_parity_layers.py::test_linear_bf16"],
        "bf16 Linear weight gradients 1% too large", survived_before=True),
    Mutation(
        "group-packed-from-half-the-rows", "csrc/torch/engine_groups.cpp",
        "            quant::pack(f, src.data_ptr(), d, rows, cols, e.host, 0);",
        "            quant::pack(f, src.data_ptr(), d, rows / 2, cols, e.host, 0);",
        [P + "test_groups.py::test_quantized_group_module",
         P + "test_attention.py::test_quantized_attention_streams_packed"],
        "quantized tensor groups packed from half the weights", survived_before=True),
    Mutation(
        "group-recompute-ignores-autocast", "python/layerstream/_group_op.py",
        "torch.autocast(dev.type, dtype=autocast[1], enabled=autocast[0])",
        "torch.autocast(dev.type, dtype=autocast[1], enabled=False)",
        [P + "test_groups.py::test_group_under_autocast_recomputes_in_the_autocast_dtype"],
        "a group's recompute in backward ignores autocast", survived_before=True),
    Mutation(
        "slot-utilisation-denominator", "csrc/core/scheduler.h",
        "static_cast<double>(max_slots_held) / num_slots : 0.0;",
        "static_cast<double>(max_slots_held) / (num_slots + 1) : 0.0;",
        [P + "test_telemetry.py"],
        "slot_utilisation divided by one slot too many", survived_before=True),
    Mutation(
        "allreduce-blocks-the-backward", "csrc/torch/engine_distributed.cpp",
        "    backend_->launch_host_func(grad_stream_, [works = std::move(works)] {\n"
        "      for (const auto& w : works) w->wait();\n    });",
        "    for (const auto& w : works) w->wait();",
        [P + "test_distributed.py::test_averaging_overlaps_the_backward"],
        "a streamed gradient's all-reduce waited for on the backward's thread (no overlap)"),
    Mutation(
        "busy-slots-not-last", "csrc/core/scheduler.cpp",
        "return cost >= 0 && busy ? cost + 2 : cost;",
        "return cost;",
        [P + "test_distributed.py::test_averaging_overlaps_the_backward"],
        "a scratch slot still busy with an all-reduce taken before an idle one (the backward waits)"),
    Mutation(
        "overlap-shard-prior-unsliced", "csrc/torch/host_overlap.cpp",
        "src.prior = prior.defined() ? part(p, prior).data_ptr() : nullptr;",
        "src.prior = prior.defined() ? prior.data_ptr() : nullptr;",
        [P + "test_distributed.py::test_sharded_step_overlapped_with_the_backward"],
        "an overlapped shard step reads the earlier micro-batches' gradient from the tensor's start"),
    Mutation(
        "sharded-clip-norm-not-summed", "python/layerstream/optim.py",
        "            plan.sum_of_squares = total.item() / shard.nodes",
        "            pass",
        [P + "test_distributed.py::test_sharded_step_overlapped_with_the_backward"],
        "an overlapped sharded step clips by its own shards' norm, not the ranks' sum"),
    # ---- other holes named by issue 29, now covered ----
    Mutation(
        "planner-keeps-nothing-resident", "csrc/core/planner.cpp",
        "    best = build(all_resident, in.min_slots);",
        "    best = build(std::vector<char>(n, 0), in.min_slots);",
        [P + "test_errors.py::test_budget_that_fits_everything_keeps_layers_resident"],
        "a budget that holds the whole model keeps nothing resident (streams everything)"),
    Mutation(
        "planner-greedy-fill-keeps-nothing", "csrc/core/planner.cpp",
        "        if (fits) {\n          resident[i] = 1;",
        "        if (false) {\n          resident[i] = 1;",
        [P + "test_parity_layers.py::test_resident_and_streamed_layers_in_one_model"],
        "a budget with room for some layers beside the slots keeps none of them resident"),
    Mutation(
        "sim-destructor-leaks-buffers", "csrc/backends/sim/sim_backend.cpp",
        "  for (auto& kv : impl_->allocs) ::operator delete(kv.first, std::align_val_t(kAlign));\n",
        "",
        ["gtest:test_sim_backend:SimMemory.*"],
        "the sim backend's destructor no longer frees buffers never freed"),
    Mutation(
        "json-no-depth-limit", "csrc/core/json.cpp",
        "    if (depth >= kMaxDepth) fail(",
        "    if (false) fail(",
        ["gtest:test_safetensors:Safetensors.*Replay"],
        "the header parser recurses without a depth limit (a hostile file's stack)"),
    Mutation(
        "scheduler-slots-held-off-by-one", "csrc/core/scheduler.cpp",
        "  const int held = pool_->num_slots() - pool_->num_free();",
        "  const int held = pool_->num_slots() - pool_->num_free() - 1;",
        [P + "test_telemetry.py::test_step_stats_of_a_constructed_schedule"],
        "slot utilisation's numerator (most slots held) one too small"),
    Mutation(
        "skip-policy-accepts-no-device", "bench/gpu/skip_policy.py",
        '        if NO_DEVICE.search(reason) and mode == "gpu":',
        '        if False:',
        ["cmd:python bench/gpu/skip_policy.py --self-test"],
        "the GPU script's skip policy no longer names a no-device skip as a failure"),
    # ---- issue 19: the streamed path issues the resident module's calls ----
    Mutation(
        "device-view-drops-requires-grad", "csrc/torch/engine_device.cpp",
        "    if (l.weight.requires_grad()) p.w_leaf.set_requires_grad(true);\n",
        "",
        [P + "test_blas_calls.py"],
        "the slot view of a trainable weight does not require grad (at::matmul takes another path)"),
    Mutation(
        "group-views-drop-requires-grad", "csrc/torch/engine_groups.cpp",
        "    if (l.parts()[views.size() - 1].param.requires_grad()) views.back().set_requires_grad(true);\n",
        "",
        [P + "test_blas_calls.py"],
        "a tensor group's fetched views do not require grad as their parameters do"),
    Mutation(
        "group-forward-without-grad-mode", "python/layerstream/_group_op.py",
        "    with torch.enable_grad(), fwd.fetched(experts=experts, adapters=bound) as views, \\\n",
        "    with fwd.fetched(experts=experts, adapters=bound) as views, \\\n",
        [P + "test_blas_calls.py"],
        "a tensor group's forward runs without grad mode (eval attention takes its fused path)"),
    Mutation(
        "group-inputs-lose-identity", "python/layerstream/_group_op.py",
        "    return [seen[id(t)] for t in tensors]\n",
        "    return [t.detach().requires_grad_(bool(r)) for t, r in zip(tensors, requires_grad)]\n",
        [P + "test_blas_calls.py"],
        "a tensor passed twice to a group becomes two tensors (attention: query is not key)"),
    Mutation(
        "group-op-kernel-below-autograd", "python/layerstream/_group_op.py",
        "    with _as_eager():\n        single, outs",
        "    if True:\n        single, outs",
        [P + "test_blas_calls.py::test_attention_group_issues_the_resident_calls"],
        "the compiled group operator runs the module below autograd (other GEMMs than the resident module)"),
    Mutation(
        "group-op-forward-without-grad", "python/layerstream/_group_op.py",
        "        if c.grad:\n",
        "        if False:\n",
        [P + "test_blas_calls.py::test_attention_group_issues_the_resident_calls"],
        "the compiled group operator runs the module's forward without grad mode when a gradient is needed"),
    Mutation(
        "compile-marks-never-applied", "python/layerstream/_dynamo_marks.py",
        "        setattr(mod, name, mark(dynamo, getattr(mod, name)))\n",
        "        pass\n",
        [P + "test_compile.py::test_compile_marks_are_on_before_dynamo_traces_and_eager_runs_do_not_import_it",
         P + "test_compile.py::test_a_group_call_that_is_not_one_operator_runs_eagerly"],
        "torch.compile's marks are never put on when torch._dynamo is imported after layerstream"),
    # ---- Note [No copy in flight at a step's end] (csrc/core/scheduler.cpp) ----
    Mutation(
        "backward-end-leaves-guessed-prefetch", "csrc/core/scheduler.cpp",
        "void Scheduler::backward_ended() {\n  wait_unused_prefetches();\n",
        "void Scheduler::backward_ended() {\n",
        [P + "test_optim.py::test_accumulation_over_three_micro_batches_equals_one_batch",
         P + "test_optim.py::test_overlapped_steps_that_leave_the_trace_write_no_weight_a_copy_reads"],
        "a prefetch guessed while recording still reads weights when the backward ends and the optimizer writes"),
    Mutation(
        "scheduler-never-waits-for-unused-prefetches", "csrc/core/scheduler.cpp",
        "    if (st.use == Use::Prefetched) backend_.synchronize(st.ready);\n",
        "    (void)st;\n",
        ["gtest:test_scheduler:*NoGuessedPrefetch*"],
        "wait_unused_prefetches() returns with the untaken copies still reading host bytes"),
    # ---- lossless-coded tensor groups: a coded piece per expert ----
    Mutation(
        "lossless-routed-decodes-first-piece", "csrc/torch/engine_groups.cpp",
        "for (int64_t x = run.first; x < run.second; ++x) add(static_cast<size_t>(x));",
        "for (int64_t x = run.first; x < run.second; ++x) add(static_cast<size_t>(run.first));",
        [P + "test_experts.py::test_lossless_experts_route_and_decode_bit_for_bit"],
        "a routed call decodes its run's first expert into every expert's place"),
    Mutation(
        "lossless-experts-one-piece", "csrc/core/lossless.cpp",
        "  return piece_out % 16 == 0 ? experts : 1;\n",
        "  return piece_out % 16 == 0 ? 1 : 1;\n",
        [P + "test_experts.py::test_lossless_experts_route_and_decode_bit_for_bit"],
        "expert tensors coded whole, so a routed call copies every expert"),
    Mutation(
        "planner-lossless-groups-raw-bytes", "csrc/core/planner_models.cpp",
        "        } else if (coded) {  // decoded into its own dtype",
        "        } else if (false && coded) {  // decoded into its own dtype",
        [P + "test_cli_plan.py::test_quantize_lossless_codes_moe_groups_per_expert"],
        "the planner counts a lossless tensor group's raw bytes, not its measured coded size"),
    Mutation(
        "lossless-group-part-refreshed-in-place", "csrc/torch/engine_groups.cpp",
        "  LS_CHECK(e.qformat != quant::Format::Lossless, \"tensor #\", part, \" of group '\", l.name, \"' streams \"",
        "  LS_CHECK(true, \"tensor #\", part, \" of group '\", l.name, \"' streams \"",
        [P + "test_experts.py::test_lossless_experts_under_lora_train_exactly"],
        "new values are 'packed' into a lossless-coded group tensor (pack() refuses with another message)"),
    Mutation(
        "peft-adapter-not-applied", "python/layerstream/_peft_params.py",
        "    with fwd.adapted(slot, fn, tensors):\n        yield\n",
        "    yield\n",
        [P + "test_experts.py::test_lora_on_expert_parameters_trains_exactly"],
        "peft's adapter on an expert tensor is dropped: the streamed group computes the base weights"),
    Mutation(
        "peft-adapter-gradients-dropped", "python/layerstream/_group_op.py",
        "    return result[:n_in], result[n_in:n_in + n_ex], host\n",
        "    return result[:n_in], [None] * n_ex, host\n",
        [P + "test_experts.py::test_lora_on_expert_parameters_trains_exactly"],
        "the adapters' factors get no gradient through a streamed group"),
    Mutation(
        "peft-adapters-streamed", "python/layerstream/_discovery.py",
        "        if id(module) in adapters:\n            continue\n",
        "",
        [P + "test_experts.py::test_lora_on_expert_parameters_trains_exactly"],
        "the Linear modules of a ParamWrapper (read directly, not called) stream"),
    Mutation(
        "lossless-trainable-group-routed-no-recode", "csrc/torch/engine_groups.cpp",
        "    recode_for_fetch(layer_index);\n",
        "",
        ["gtest:test_torch_offload:*TrainableLosslessGroup*",
         P + "test_experts.py::test_routed_lossless_trainable_experts_recode_between_steps"],
        "a routed fetch of a trainable coded group copies the pieces coded before the last optimizer step"),
    Mutation(
        "scheduler-partial-copy-not-awaited", "csrc/core/scheduler.cpp",
        "  // wait_copies_read() waits for this one too (a re-code of the bytes it reads).\n"
        "  if (!l.copied_once) l.last_copy = backend_.create_event();\n"
        "  backend_.record(l.last_copy, transfer_);\n"
        "  l.copied_once = true;\n",
        "",
        ["gtest:test_scheduler:*PartialCopyInFlight*"],
        "a re-code of a group's coded pieces does not wait for the routed copies still reading them"),
    # ---- plausible bugs the suite already caught in the audit ----
    Mutation(
        "int8-scale-128", "csrc/core/quant.cpp",
        "    const float scale = absmax / 127.0f;",
        "    const float scale = absmax / 128.0f;",
        ["gtest:test_quant:*", P + "test_quant_offload.py::test_streamed_values_equal_the_reference_dequantization"],
        "int8 packing with the wrong scale"),
    Mutation(
        "group-recompute-other-dropout-mask", "python/layerstream/_group_op.py",
        "        torch.set_rng_state(cpu_rng)\n",
        "        pass\n",
        [P + "test_groups.py::test_named_modules_stream_whole_and_train_exactly"],
        "a group's recompute does not restore the RNG (other dropout masks)"),
    Mutation(
        "linear-bias-grad-dropped", "csrc/torch/ops_streamed.cpp",
        "                        .copy_(gb));",
        "                        .zero_());",
        [P + "test_parity_layers.py::test_linear_fp32_bit_exact"],
        "streamed Linear bias gradient lost"),
    Mutation(
        "sim-device-bytes-miscounted", "csrc/backends/sim/sim_backend.cpp",
        "BufferRef SimBackend::alloc_device(size_t bytes, const std::string& label) {\n"
        "  std::lock_guard<std::mutex> l(impl_->mem_mu);",
        "BufferRef SimBackend::alloc_device(size_t bytes, const std::string& label) {\n"
        "  bytes += 64;\n  std::lock_guard<std::mutex> l(impl_->mem_mu);",
        ["gtest:test_sim_backend:SimMemory.*"],
        "the sim device counts more memory than a buffer asks for"),
    # ---- issues 20-28: host optimizer, disk tier, distributed, activations, lossless ----
    Mutation(
        "lossless-recode-ignores-changes", "csrc/torch/engine_coded.cpp",
        "  if (c.coded && !c.forced && version == c.version && sample == c.sample) return false;",
        "  if (c.coded && !c.forced) return false;",
        [P + "test_lossless.py::test_trainable_lossless_weights_train_like_plain_streamed_ones"],
        "a trainable lossless weight changed by the optimizer crosses the bus with its old coding"),
    Mutation(
        "lossless-recode-ahead-skips-wait", "csrc/torch/engine_coded.cpp",
        "    sched_->wait_copies_read(layer);\n",
        "",
        [P + "test_lossless.py::test_trainable_lossless_weights_train_like_plain_streamed_ones",
         P + "test_lossless.py::test_trainable_lossless_weights_with_cached_slots_pageable_buffers_accumulation_and_compile"],
        "the overlapped re-code rewrites a coded buffer that an issued copy may still read"),
    Mutation(
        "lossless-last-symbol-pair", "csrc/core/lossless_device.h",
        "    if (two && i + 1 == n) {  // the last symbol alone",
        "    if (false) {  // the last symbol alone",
        ["gtest:test_lossless:*"],
        "the block decoder takes a table entry's second symbol past the block's last element"),
    Mutation(
        "planner-lossless-raw-bytes", "csrc/core/planner_models.cpp",
        "    const uint64_t w_bus = lossless ? l.lossless_bytes : quantized_weight_bytes(",
        "    const uint64_t w_bus = false ? l.lossless_bytes : quantized_weight_bytes(",
        [P + "test_cli_plan.py::test_quantize_lossless_measures_each_weights_coded_size"],
        "the planner counts a lossless weight's raw bytes on the bus, not its measured coded size"),
    Mutation(
        "activation-copy-back-before-host-copy", "csrc/torch/engine_activations.cpp",
        "  backend_->wait(transfer_, s.to_host);  // the host copy is complete\n",
        "",
        [P + "test_activations.py::test_a_restore_before_the_copy_to_the_host_finished_copies_back_after_it"],
        "a saved activation's copy back does not wait for its copy to the host"),
    Mutation(
        "activation-in-flight-unbounded", "csrc/torch/engine_activations.cpp",
        "  while (in_flight_.size() > 1 && in_flight_bytes_ > cap) {",
        "  while (false && in_flight_.size() > 1 && in_flight_bytes_ > cap) {",
        [P + "test_parity_layers.py::test_copies_to_the_host_in_flight_are_bounded"],
        "copies of saved activations to the host are not bounded (the device keeps them all)"),
    Mutation(
        "activation-budget-evicts-newest", "csrc/torch/engine_activations.cpp",
        "    const int64_t oldest = window_.front();\n    window_.pop_front();",
        "    const int64_t oldest = window_.back();\n    window_.pop_back();",
        [P + "test_activations.py::test_a_device_budget_keeps_the_newest_saved_tensors",
         P + "test_activations.py::test_the_window_is_the_newest_tensors_through_the_engine_api"],
        "the device budget for saved activations sends the newest to the host, not the oldest"),
    Mutation(
        "layout-size1-strides-dropped", "csrc/torch/engine_register.cpp",
        "  std::vector<int64_t> kept = strides ? strides_to_keep(src) : std::vector<int64_t>{};",
        "  std::vector<int64_t> kept = strides && !src.is_contiguous() ? strides_to_keep(src) : std::vector<int64_t>{};",
        [P + "test_parity_layers.py::test_a_channels_last_1x1_conv_keeps_its_strides"],
        "the host store makes a channels_last 1x1 conv weight's strides the contiguous ones"),
    Mutation(
        "layout-quantized-detach-size1-strides", "python/layerstream/_offload.py",
        "                      strides=tuple(weight.stride()))",
        "                      strides=None if weight.is_contiguous() else tuple(weight.stride()))",
        [P + "test_parity_layers.py::test_a_channels_last_1x1_conv_keeps_its_strides"],
        "detach() gives a quantized channels_last 1x1 conv weight the contiguous strides"),
    Mutation(
        "lossless-codes-row-major", "csrc/torch/engine_register.cpp",
        "    if (format == quant::Format::Lossless) info.w_strides = strides_to_keep(src);",
        "",
        [P + "test_parity_layers.py::test_lossless_conv_weights_keep_their_layout"],
        "lossless codes a channels_last conv weight in row-major order (the conv computes contiguous)"),
    Mutation(
        "conv-weight-grad-without-fetch", "csrc/torch/ops_streamed.cpp",
        "    if (!need_x && !l.is_conv()) {",
        "    if (!need_x) {",
        [P + "test_parity_layers.py::test_a_conv_whose_input_and_weight_layouts_differ_trains_exactly"],
        "a conv's weight-only backward runs on the parked weight (ATen copies it into the input's layout)"),
    Mutation(
        "activation-interrupted-scope-kept", "python/layerstream/_activations.py",
        "        if self._depth and not self._entering_call_running():",
        "        if False:",
        [P + "test_activations.py::test_a_forward_interrupted_by_ctrl_c_does_not_leave_its_scope_open"],
        "a forward interrupted by Ctrl-C leaves the saved-tensor hooks entered: the next call nests in it"),
    Mutation(
        "activation-detach-keeps-scope", "python/layerstream/_activations.py",
        "(close()).\"\"\"\n        self.close()",
        "(close()).\"\"\"\n        pass",
        [P + "test_activations.py::test_a_forward_interrupted_by_ctrl_c_does_not_leave_its_scope_open"],
        "detach() leaves an interrupted forward's saved-tensor hooks entered (autograd then fails)"),
    Mutation(
        "scaler-speculates-scaled", "csrc/torch/host_overlap.cpp",
        "FusedWork{settle, speculate}, loss_mult_, g.seed)",
        "FusedWork{settle, speculate}, 1.0f, g.seed)",
        [P + "test_optim.py::test_overlap_with_a_grad_scaler_equals_the_step_after_backward"],
        "an overlapped step under a GradScaler steps with the gradient still multiplied by the loss scale"),
    Mutation(
        "scaler-skip-keeps-speculation", "csrc/torch/host_overlap.cpp",
        "        if (speculated_[i]) restore_one(i);",
        "        (void)0;",
        [P + "test_optim.py::test_overlap_tells_the_scaler_of_an_overflow_it_cannot_see"],
        "a skipped loss-scaled step leaves the layers stepped during the backward stepped (NaN weights)"),
    Mutation(
        "scaler-not-told", "python/layerstream/optim.py",
        "            self._report_to_scaler(scaler, skipped and not found)",
        "            pass",
        [P + "test_optim.py::test_overlap_tells_the_scaler_of_an_overflow_it_cannot_see"],
        "the scaler never hears of an overflow in the gradients an overlapped backward consumed"),
    Mutation(
        "scaler-found-inf-ignored", "python/layerstream/optim.py",
        "        return inv, bool(fi.item() if isinstance(fi, torch.Tensor) else fi)",
        "        return inv, False",
        [P + "test_optim.py::test_a_grad_scaler_steps_like_torch_and_skips_the_overflowing_steps"],
        "a step whose gradients GradScaler found Inf/NaN in is taken anyway"),
    Mutation(
        "scaler-not-unscaled", "python/layerstream/optim.py",
        "keys, scale * inv, int(group[\"seed\"]))",
        "keys, scale, int(group[\"seed\"]))",
        [P + "test_optim.py::test_a_grad_scaler_steps_like_torch_and_skips_the_overflowing_steps"],
        "AdamW under a GradScaler steps with the scaled gradients"),
    Mutation(
        "scaler-check-not-summed-over-ranks", "python/layerstream/optim.py",
        "if (self.max_grad_norm is not None or scaler is not None) and shard is not None:",
        "if self.max_grad_norm is not None and shard is not None:",
        [P + "test_distributed.py::test_sharded_overlap_skips_on_every_rank_when_one_ranks_shard_has_nan"],
        "a rank whose shards are finite steps while the rank that holds the NaN skips"),
    Mutation(
        "checkpoint-step-not-restored", "csrc/torch/host_optim.cpp",
        "      prm.step = loaded[gi].params[i].first;",
        "      (void)0;",
        ["gtest:test_torch_optim:*CheckpointResumesBitIdentically*"],
        "a C++ AdamW resumed from a checkpoint restarts its bias correction at step 1"),
    Mutation(
        "clone-keeps-binding", "csrc/torch/offload.cpp",
        "std::shared_ptr<torch::nn::Module> LinearImpl::clone(const std::optional<torch::Device>& device) const {\n  refuse_clone();",
        "std::shared_ptr<torch::nn::Module> LinearImpl::clone(const std::optional<torch::Device>& device) const {",
        ["gtest:test_torch_offload:*CloneOfAnOffloadedModel*"],
        "a clone of an offloaded layerstream::nn::Linear streams and trains the original's weights"),
    Mutation(
        "sharded-state-loads-anywhere", "python/layerstream/_optim_state.py",
        "        if saved == mine or not state_dict.get(\"state\"):",
        "        if True:",
        [P + "test_distributed.py::test_a_sharded_optimizer_resumes_from_each_ranks_checkpoint_and_refuses_another_ranks"],
        "rank 0's sharded optimizer state dict loads on rank 1, which steps its elements with rank 0's moments"),
    Mutation(
        "whole-state-wrong-shard", "python/layerstream/optim.py",
        "                out[key] = p._layerstream_shard.view(laid).clone()",
        "                out[key] = p._layerstream_shard.flat(laid)[:p._layerstream_shard.hi - p._layerstream_shard.lo].clone()",
        [P + "test_distributed.py::test_a_sharded_optimizer_resumes_from_each_ranks_checkpoint_and_refuses_another_ranks"],
        "every rank takes the first elements of a whole AdamW state dict, not its own shard"),
    Mutation(
        "overlap-drops-uncovered-grads", "csrc/torch/host_overlap.cpp",
        "  if (!landed) return;  // not consumed: the engine applied it to .grad",
        "  return;",
        [P + "test_optim.py::test_overlap_leaves_the_gradients_of_layers_it_does_not_step_in_grad"],
        "an overlapped backward drops the landed gradients of layers its optimizer does not step"),
    Mutation(
        "overlap-second-hook-replaces", "csrc/torch/engine_grad_ready.cpp",
        "  LS_CHECK(!setting || !gr_hook_,",
        "  LS_CHECK(true || !gr_hook_,",
        [P + "test_optim.py::test_a_second_overlap_on_one_handle_is_an_error"],
        "a second optimizer's overlap() silently replaces the first one's hook"),
    Mutation(
        "activation-no-prefetch", "csrc/torch/engine_activations.cpp",
        "  int ahead = opts_.prefetch;",
        "  int ahead = 0;",
        [P + "test_activations.py::test_copies_back_start_ahead_of_the_backward"],
        "saved activations come back only when the backward asks for them (nothing ahead)"),
    Mutation(
        "activation-prefetch-runs-ahead", "csrc/torch/engine_activations.cpp",
        "    if (!q.copying_back) copy_back_locked(q);\n    --ahead;",
        "    if (q.copying_back) continue;\n    copy_back_locked(q);\n    --ahead;",
        [P + "test_activations.py::test_copies_back_start_ahead_of_the_backward"],
        "each restore starts `prefetch` more copies back, so they run ever further ahead (fixed 2026-12-04)"),
    Mutation(
        "activation-h2d-uncounted", "csrc/torch/engine_activations.cpp",
        "  act_h2d_bytes_ += s.bytes;\n",
        "",
        [P + "test_activations.py::test_mlp_gradients_are_bit_identical_and_activations_cross_both_ways"],
        "stats() does not count saved activations' bytes back to the device"),
    Mutation(
        "overlap-steps-before-every-use", "csrc/torch/engine_grad_ready.cpp",
        "  if (uses != l.forward_uses) return;",
        "  if (uses < 1) return;",
        [P + "test_optim.py::test_overlap_waits_for_every_use_of_a_layer_used_twice"],
        "the overlapped host step of a layer used twice runs after its first gradient"),
    Mutation(
        "adamw-bf16-bias-correction", "csrc/core/optim/optim.cpp",
        "  s.neg_step_bc2 = static_cast<float>(-step_size * bc2_sqrt);",
        "  s.neg_step_bc2 = static_cast<float>(-step_size * bc2);",
        ["gtest:test_optim:*"],
        "the host AdamW of bf16 parameters folds 1 - beta2^t into its step, not its square root"),
    Mutation(
        "disk-tier-file-change-unseen", "csrc/core/io/source_file.cpp",
        "  LS_CHECK(same, path_, \": the file changed after it was loaded",
        "  LS_CHECK(same || true, path_, \": the file changed after it was loaded",
        [P + "test_host_tier.py::test_a_file_changed_after_loading_is_an_error_never_other_weights"],
        "a checkpoint file rewritten after loading is read as if it were the same weights"),
    Mutation(
        "host-store-pins-past-its-cap", "csrc/core/host_store.cpp",
        "    pin = stats_.pinned_bytes + bytes <= static_cast<uint64_t>(pinned_cap_);",
        "    pin = true;",
        [P + "test_host_tier.py::test_pinned_budget_zero_stores_pageable_and_stages_copies",
         P + "test_host_tier.py::test_disk_tier_under_a_quarter_of_the_model_equals_the_resident_model"],
        "the host store pins weights past pinned_budget"),
    Mutation(
        "ddp-gradients-summed-not-averaged", "csrc/torch/engine_distributed.cpp",
        "    c.div_(pg.getSize());  // divided first, as DistributedDataParallel does",
        "    // (mutated: not divided)",
        [P + "test_distributed.py::test_averaging_overlaps_the_backward"],
        "a streamed gradient is summed over the ranks instead of averaged"),
    Mutation(
        "ddp-accumulated-gradients-summed", "csrc/torch/engine_distributed.cpp",
        "  c.div_(pg.getSize());\n  std::vector<at::Tensor> v{c};\n  pg.allreduce(v)->wait();",
        "  std::vector<at::Tensor> v{c};\n  pg.allreduce(v)->wait();",
        [P + "test_distributed.py::test_full_fine_tuning_equals_one_process"],
        "a gradient accumulated under no_sync() is summed over the ranks instead of averaged"),
    Mutation(
        "suspend-keeps-the-slots", "csrc/torch/engine.cpp",
        "  retire_scheduler_locked(&suspended_trace_, &suspended_trace_forward_);\n  suspended_ = true;",
        "  suspended_ = true;",
        [P + "test_parity_layers.py::test_parity_suspend_frees_the_device_and_resume_continues_exactly",
         "gtest:test_torch_offload:*SuspendFreesTheSlots*"],
        "suspend() keeps the slot arena allocated (no device memory comes back)"),
    Mutation(
        "resume-forgets-the-trace", "csrc/torch/engine.cpp",
        "  so.trace = suspended_trace_;",
        "  // (mutated: the learnt order is not given)",
        [P + "test_parity_layers.py::test_parity_suspend_frees_the_device_and_resume_continues_exactly"],
        "the scheduler rebuilt by resume() records the fetch order again (the first step guesses)"),
    Mutation(
        "suspend-leaves-gradients-on-the-device", "python/layerstream/_handle.py",
        "                if p.grad is not None and p.grad.device == device:\n                    p.grad = move(p.grad)",
        "                pass",
        [P + "test_misuse.py::test_suspend_moves_each_device_tensor_once_with_its_gradient"],
        "suspend() moves a resident parameter to the host and leaves its gradient on the device"),
    Mutation(
        "to-cpu-does-not-suspend", "python/layerstream/_guards.py",
        "                handle.suspend()\n                return model",
        "                pass",
        [P + "test_misuse.py::test_the_whole_model_to_the_host_suspends_and_back_to_the_compute_device_resumes"],
        "model.to('cpu') of a model streamed to a GPU keeps its device memory (or is refused)"),
    Mutation(
        "to-compute-does-not-resume", "python/layerstream/_guards.py",
        "                handle.resume()\n        return getattr",
        "                pass\n        return getattr",
        [P + "test_misuse.py::test_the_whole_model_to_the_host_suspends_and_back_to_the_compute_device_resumes"],
        "model.to(<compute device>) after model.to('cpu') leaves the model suspended"),
    Mutation(
        "compat-to-cpu-keeps-the-slots", "python/layerstream/compat.py",
        "            if device.type == \"cpu\":  # the original kept no device memory there: free the slots too\n                self.engine.suspend()",
        "            if device.type == \"cpu\":  # the original kept no device memory there: free the slots too\n                pass",
        [P + "test_compat_aitoolkit.py::test_to_the_cpu_frees_the_slots_and_back_to_the_gpu_resumes"],
        "compat: model.to('cpu') of a model attached for a GPU keeps the engine's slots"),
    Mutation(
        "suspend-leaves-optimizer-states", "python/layerstream/optim.py",
        "                    st[key] = move(t)\n",
        "                    pass\n",
        [P + "test_optim.py::test_suspend_moves_the_states_of_the_moved_parameters"],
        "suspend() leaves layerstream.optim's states of the moved parameters on the device"),
    Mutation(
        "backward-end-begins-no-step", "csrc/core/scheduler.cpp",
        "  wait_unused_prefetches();\n  begin_call();",
        "  wait_unused_prefetches();",
        [P + "test_training.py::test_steps_that_skip_the_first_layer_read_the_weights_the_optimizer_wrote",
         P + "test_training.py::test_peft_merge_and_unload_after_training_computes_with_the_merged_weights",
         "gtest:test_scheduler:*AfterABackwardTheNextForward*"],
        "the forward after a backward continues the step when it skips the trace's first layer: "
        "slots serve the weights from before the optimizer step"),
    Mutation(
        "a-call-begins-no-step", "python/layerstream/_handle.py",
        "            engine = self._engine_of()\n            if engine is not None:\n                engine.begin_call()",
        "            pass",
        [P + "test_training.py::test_a_data_write_between_calls_that_skip_the_first_layer_is_seen"],
        "a call of the offloaded model that skips the trace's first layer shares the step (and the "
        "cached weights) of the call before"),
    Mutation(
        "unexpected-refetch-begins-no-step", "csrc/core/scheduler.cpp",
        " ||\n              (fetched_in_[static_cast<size_t>(layer)] == step_serial_ && !expected_later_locked(layer))",
        "",
        [P + "test_training.py::test_peft_merge_and_unload_after_training_computes_with_the_merged_weights",
         "gtest:test_scheduler:*AFetchTheTraceDoesNotExpectAgain*"],
        "an inner module called again (peft's unwrapped model after merge_and_unload) shares the step "
        "of the call before and reads its cached weights"),
    Mutation(
        "write-version-unchecked", "csrc/core/scheduler.cpp",
        "  const auto& version = opts_.content_version ? opts_.content_version : opts_.write_version;\n  if (!version",
        "  const auto& version = opts_.content_version;\n  if (!version",
        ["gtest:test_scheduler:*WriteVersionRefuses*"],
        "cached content is reused within a step after an in-place (version-counted) write"),
    Mutation(
        "staging-entry-unversioned", "csrc/core/scheduler.cpp",
        "    if (v != staged_version_[static_cast<size_t>(layer)]) stager_->forget_memory_layer(layer);\n",
        "",
        ["gtest:test_stager:*AnInPlaceWriteToALayerReadFromMemory*"],
        "a layer read from pageable memory is served from its staging entry after an in-place write"),
    Mutation(
        "synchronize-does-not-recode", "csrc/torch/engine.cpp",
        "  wait_all_locked();\n  force_recode_locked();",
        "  wait_all_locked();",
        [P + "test_lossless.py::test_a_write_to_a_few_elements_through_data_is_seen_after_synchronize"],
        "handle.synchronize() leaves a trainable lossless weight's coding as it is after a `.data` "
        "write the sample missed"),
    Mutation(
        "compat-call-begins-no-step", "python/layerstream/compat.py",
        "        self._call_hook = CallHooks(module, lambda: self.engine, self._streamed_ids())",
        "        pass",
        [P + "test_compat_aitoolkit.py::test_a_call_that_skips_the_first_streamed_layer_still_begins_a_step"],
        "compat: a call of the attached model that skips the trace's first layer reuses the weights "
        "the call before cached"),
    Mutation(
        "calls-do-not-take-turns", "python/layerstream/_handle.py",
        "            self._turns.enter(sys._getframe(1))",
        "            pass",
        [P + "test_threads.py::test_threads_calling_one_offloaded_model_get_the_resident_models_outputs"],
        "two threads calling one offloaded model at once interleave their calls: they run out of "
        "slots or meet each other's swapped group parameters"),
    Mutation(
        "group-swap-without-lock", "python/layerstream/_forward.py",
        "        with self._swap_lock:",
        "        with contextlib.nullcontext():",
        [P + "test_threads.py::test_threads_calling_one_streamed_group_directly_take_turns_on_it"],
        "two threads calling one streamed tensor group each find the other's views in place of "
        "the parameters"),
    Mutation(
        "forked-child-not-refused", "csrc/torch/engine.cpp",
        "  if (g_forks.load(std::memory_order_relaxed) == forks_at_creation_) return;",
        "  return;",
        [P + "test_fork.py::test_a_forked_child_calling_the_model_is_refused_and_the_parent_goes_on"],
        "a forked child calling an offloaded model waits forever on the parent's streams"),
    Mutation(
        "forked-child-frees-the-engine", "csrc/torch/engine.cpp",
        "    if (auto e = entry.second.lock()) new std::shared_ptr<EngineImpl>(std::move(e));",
        "    (void)entry;",
        [P + "test_fork.py::test_a_forked_child_may_drop_the_model",
         "gtest:test_torch_offload:*AChildForkedAfterOffload*"],
        "a forked child that drops the model destroys the parent's engine: it joins threads that "
        "are not there"),
    Mutation(
        "forked-child-keeps-the-pool", "csrc/core/optim/thread_pool.cpp",
        "  g_shared = nullptr;\n  g_shared_mu.unlock();",
        "  g_shared_mu.unlock();",
        [P + "test_fork.py::test_a_host_optimizer_steps_in_a_forked_child"],
        "a forked child's optimizer step runs on the parent's pool, whose workers are not in the "
        "child: it waits forever"),
    Mutation(
        "turn-kept-when-its-call-is-gone", "python/layerstream/_handle.py",
        "            f = f.f_back\n        return False",
        "            f = f.f_back\n        return True",
        [P + "test_threads.py::test_a_call_ended_by_keyboard_interrupt_gives_its_turn_to_the_next_call",
         P + "test_threads.py::test_a_turn_whose_thread_is_gone_is_taken_over"],
        "a call ended by KeyboardInterrupt (or a thread that ended inside a call) keeps the model's "
        "turn: every other thread's call waits for ever"),
    Mutation(
        "suspend-detach-do-not-wait", "python/layerstream/_handle.py",
        "        turns.enter(frame)\n        try:\n            yield\n        finally:\n            turns.leave()",
        "        yield",
        [P + "test_threads.py::test_suspend_and_detach_wait_for_another_threads_call"],
        "suspend() or detach() from one thread pulls slots and weights from under another "
        "thread's call"),
    Mutation(
        "compiled-group-takes-the-fused-attention", "python/layerstream/_group_op.py",
        "        with torch.set_grad_enabled(c.grad_mode), fresh, _unfused_attention(fwd), \\",
        "        with torch.set_grad_enabled(c.grad_mode), fresh, \\",
        [P + "test_compile.py::test_a_compiled_eval_without_gradients_streams_attention_groups"],
        "the fake kernel of a compiled eval of a streamed nn.MultiheadAttention takes torch's fused "
        "path, whose meta kernel promises a weights tensor the real kernel never returns"),
    Mutation(
        "turn-taken-from-a-call-under-way", "python/layerstream/_handle.py",
        "            if f is self._frame:\n                return True",
        "            if f is self._frame:\n                return False",
        [P + "test_threads.py::test_a_waiting_call_does_not_take_the_turn_of_a_call_under_way"],
        "a waiting call takes the turn of a call still under way"),
    # ---- Note [An optimizer step is a write] (python/layerstream/_handle.py) ----
    Mutation(
        "optimizer-step-not-a-write", "python/layerstream/_handle.py",
        "        torch.autograd.graph.increment_version(written)",
        "        pass",
        [P + "test_training.py::test_an_optimizer_step_writing_behind_the_version_counters_is_seen"],
        "with cache_across_steps an optimizer step that writes through .data elements the next step's "
        "sample skips (a bf16 step whose updates mostly round away) leaves them stale in the slots"),
    Mutation(
        "optimizer-step-writes-frozen-weights", "python/layerstream/_handle.py",
        "               if p.grad is not None and any(id(p) in ids for ids in live)",
        "               if any(id(p) in ids for ids in live)",
        [P + "test_training.py::test_an_optimizer_step_writing_behind_the_version_counters_is_seen"],
        "an optimizer step counts the frozen weights it was given as written: with cache_across_steps "
        "they are copied again every step (a LoRA run loses the cache)"),
    Mutation(
        "own-optimizer-step-written-twice", "python/layerstream/_handle.py",
        '    if not live or getattr(optimizer, "_layerstream_moves_versions", False):',
        "    if not live:",
        [P + "test_distributed.py::test_sharded_host_step_into_one_shared_copy"],
        "the post-hook moves the counters layerstream.optim's sharded step recorded: the next call "
        "refuses the parameters as written by another optimizer"),
    Mutation(
        "stand-in-bytes-read-at-zero", "python/layerstream/_standin.py",
        '"storage_offset",\n    "untyped_storage",',
        '"storage_offset", "data_ptr",\n    "untyped_storage",',
        [P + "test_quant_offload.py::test_writes_to_a_quantized_weight_requantize_or_are_refused",
         P + "test_gguf.py::test_gguf_weights_refuse_writes_and_saving_but_deep_copy",
         P + "test_host_tier.py::test_saving_a_weight_the_disk_tier_streams_says_how"],
        "safetensors' save_file of an offloaded model's state dict reads a stand-in's bytes at its "
        "data_ptr(), 0, and fails with an error that names no tensor"),
    # ---- Note [Writes through .data between steps] (csrc/torch/engine.cpp) ----
    Mutation(
        "data-writes-not-sampled", "csrc/core/scheduler.cpp",
        "      if (loaded_[l] >= 0) opts_.step_begins(static_cast<int>(l));",
        "      if (false) opts_.step_begins(static_cast<int>(l));",
        [P + "test_training.py::test_data_writes_between_calls_with_cache_across_steps_are_seen",
         P + "test_training.py::test_peft_merge_unmerge_and_unload_between_calls_match_the_resident_model",
         P + "test_compile.py::test_compiled_steps_that_skip_the_first_layer_and_data_writes_after_them_stay_exact",
         "gtest:test_torch_offload:*WriteThroughDataBeforeACallIsSeen*",
         "gtest:test_scheduler:*StepBeginsLooksAtEachCachedLayer*"],
        "with cache_across_steps a write through .data between steps (peft's merge_adapter(), "
        "diffusers' fuse_lora()) leaves the old weight in its slot"),
    Mutation(
        "data-writes-sample-skips-the-bias", "csrc/torch/engine.cpp",
        "    if (!l.b_file && l.b_host != nullptr && l.b_bytes > 0) src.emplace_back(l.b_host, l.b_bytes);\n",
        "",
        [P + "test_training.py::test_data_writes_between_calls_with_cache_across_steps_are_seen",
         "gtest:test_torch_offload:*WriteThroughDataBeforeACallIsSeen*"],
        "a bias written through .data between steps is not sampled: its old value stays cached"),
    Mutation(
        "data-writes-not-in-the-version", "csrc/torch/engine.cpp",
        "uint64_t v = samples->empty() ? 0 : (*samples)[static_cast<size_t>(layer)].writes;",
        "uint64_t v = 0;",
        [P + "test_training.py::test_data_writes_between_calls_with_cache_across_steps_are_seen",
         "gtest:test_torch_offload:*WriteThroughDataBeforeACallIsSeen*"],
        "a write seen in the sample is counted but the content version does not fold it in"),
    Mutation(
        "refetch-rule-ignores-phases", "csrc/core/scheduler.cpp",
        "    if (trace_fwd_[*it]) return true;",
        "    return true;",
        [P + "test_training.py::test_an_inner_module_called_on_its_own_after_training_reads_each_write",
         "gtest:test_scheduler:*AFetchTheTraceDoesNotExpectAgain*"],
        "an inner module called again after training shares the step of the call before: the trace "
        "names it again in its backward"),
    Mutation(
        "forward-after-backward-fetch-begins-no-step", "csrc/core/scheduler.cpp",
        "  if (forward && backward_in_step_) boundary_due_ = true;  // a forward after this step's backward\n",
        "",
        [P + "test_compile.py::test_compiled_steps_that_skip_the_first_layer_and_data_writes_after_them_stay_exact",
         "gtest:test_scheduler:*AForwardAfterABackwardFetchBeginsAStep*"],
        "under torch.compile (no call hook, no backward_ended()) steps that skip the trace's first layer "
        "share one step: inference calls after them read weights cached before a `.data` write"),
    # ---- Note [Compiled weight gradients are staged] (csrc/torch/ops_compiled.cpp) ----
    Mutation(
        "compiled-grads-never-staged", "csrc/torch/ops_library.cpp",
        "    const bool stage = mask[0] && (mask[1] || mask[2]) && !EngineImpl::grads_to_autograd(spec) &&\n",
        "    const bool stage = false && (mask[1] || mask[2]) && !EngineImpl::grads_to_autograd(spec) &&\n",
        [P + "test_compile.py::test_compiled_weight_gradients_are_staged_and_stepped_during_the_backward",
         P + "test_compile.py::test_compiled_gradient_hooks_fire_and_late_ones_are_refused"],
        "compiled weight gradients go back to autograd after a blocking copy each: opt.overlap() steps "
        "nothing during a compiled backward"),
    Mutation(
        "compiled-forward-uses-not-counted", "csrc/torch/ops_compiled.cpp",
        "  if (trained) note_forward_use(l);",
        "",
        [P + "test_compile.py::test_compiled_weight_gradients_are_staged_and_stepped_during_the_backward"],
        "a compiled call given trainable parameters is not counted: the gradient-ready hook never "
        "finds a staged layer complete"),
    Mutation(
        "compiled-late-hook-ignored", "csrc/torch/ops_compiled.cpp",
        "        LS_CHECK(!has_grad_hooks(p), \"a gradient hook was registered on the \"",
        "        LS_CHECK(true || !has_grad_hooks(p), \"a gradient hook was registered on the \"",
        [P + "test_compile.py::test_compiled_gradient_hooks_fire_and_late_ones_are_refused"],
        "a gradient hook registered after torch.compile traced the model silently never fires"),
    Mutation(
        "compiled-unasked-grads-staged", "csrc/torch/ops_compiled.cpp",
        "        g[i] = torch::Tensor();  // not asked for: autograd would drop it too\n",
        "",
        [P + "test_compile.py::test_compiled_autograd_grad_for_the_input_leaves_weight_grads_alone"],
        "torch.autograd.grad(loss, x) through a compiled model adds the weights' gradients to .grad"),
    Mutation(
        "compiled-autograd-loses-staged-grads", "python/layerstream/_ops.py",
        "    if stage:\n        _refuse_compiled_autograd()\n",
        "",
        [P + "test_compile.py::test_compiled_autograd_is_refused_for_staged_gradients_and_runs_frozen_layers"],
        "torch._dynamo's compiled autograd traces a staged backward: the weight gradients are never applied"),
    Mutation(
        "eager-layer-lets-compiled-autograd-hash-its-graph", "csrc/torch/ops_streamed.cpp",
        "template <>\nvoid CppNode<layerstream::StreamedFn>::compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) "
        "const {\n",
        "template <class Unused>  // LibTorch's own compiled_args then\n"
        "void never_called(const CppNode<layerstream::StreamedFn>& node) {\n  const auto& ctx_ = node.ctx_;\n",
        [P + "test_compile.py::test_compiled_autograd_over_an_eager_streamed_backward_says_what_to_do"],
        "compiled autograd collects an eagerly called streamed layer: torch's opaque 'unhashable Capsule' error"),
    Mutation(
        "op-spec-names-the-kind-only", "csrc/torch/ops_spec.cpp",
        "  s << \" w=\";\n  put_dims(s, l.w_shape, 'x');\n",
        "  l.spec = s.str();  // the kind only\n  return l.spec;\n",
        [P + "test_compile.py::test_inductors_cache_serves_no_graph_of_another_layout_to_another_process"],
        "an operator call's spec names the kind only: Inductor's cache serves one width's or padding's graph to "
        "another"),
    Mutation(
        "op-spec-names-no-gradient-route", "csrc/torch/ops_spec.cpp",
        "  if (linear_or_conv && !stages_grads(index)) spec += kGradsToAutograd;",
        "  if (false && !stages_grads(index)) spec += kGradsToAutograd;",
        [P + "test_compile.py::test_inductors_cache_serves_no_graph_of_another_layout_to_another_process"],
        "a Linear's spec leaves out where its weight gradients go: torch's autograd cache serves a process whose "
        "weight has a gradient hook the staged backward of one without"),
    Mutation(
        "removed-hook-still-a-hook", "csrc/torch/ops_streamed.cpp",
        "    if (!pre || pre(*h)) return true;",
        "    return true;",
        [P + "test_compile.py::test_a_removed_gradient_hook_is_no_hook"],
        "a parameter's emptied hook object counts as a hook: a compiled backward raises 'registered after "
        "torch.compile traced it' for a hook registered and removed again"),
    Mutation(
        "layerwise-casting-wrapper-not-replaced", "python/layerstream/_discovery.py",
        "    if wrapper is None or not isinstance(hooks, dict) or list(hooks) != [\"layerwise_casting\"]:",
        "    if True:",
        [P + "test_parity_layers.py::test_diffusers_layerwise_casting_streams_the_storage_dtype_with_the_hooks_numbers"],
        "diffusers' layerwise casting counts as any wrapper: its layers stay resident (a model stored in float8 "
        "for a small GPU does not stream at all)"),
    Mutation(
        "added-tensors-stay-on-the-host", "python/layerstream/_handle.py",
        "                if t is None or id(t) in skip_params or id(t) in seen or t.is_meta or t.device == device:",
        "                if True:",
        [P + "test_training.py::test_tensors_added_after_offload_are_moved_by_the_next_call"],
        "tensors added to an offloaded model (peft adapters, in host memory beside their streamed base) are "
        "never moved to the compute device: on a GPU the adapter meets device activations"),
    Mutation(
        "group-call-names-no-layout", "python/layerstream/_group_op.py",
        "torch.get_autocast_dtype(kind), fwd._layout)",
        "torch.get_autocast_dtype(kind), \"\")",
        [P + "test_compile.py::test_inductors_cache_serves_no_graph_of_another_layout_to_another_process"],
        "a tensor group's call leaves its module's layout out: Inductor's cache serves one head count's graph to "
        "another"),
    Mutation(
        "compiled-bias-standin-traced", "python/layerstream/_forward.py",
        "        b = None if self._bias_standin or not (",
        "        b = None if not (",
        [P + "test_host_tier.py::test_a_compiled_model_whose_weights_and_biases_stay_in_the_file"],
        "torch.compile hands a bias left in its file (the disk tier) to Dynamo: tracing fails"),
    Mutation(
        "cast-as-read-chunks-from-the-start", "csrc/torch/engine_host_tier.cpp",
        "      file->read(tmp.data_ptr(), src.offset + static_cast<uint64_t>(i) * c10::elementSize(from),",
        "      file->read(tmp.data_ptr(), src.offset,",
        [P + "test_host_tier.py::test_a_weight_cast_as_read_crosses_the_chunks_of_the_temporary"],
        "a weight cast as it is read (the file holds another dtype) reads every chunk of the temporary from the "
        "tensor's start: values past the first 64 MiB are the first chunk's again"),
    Mutation(
        "cast-as-read-streams-the-files-bytes", "csrc/core/host_tier.cpp",
        "  return linear && frozen && as_stored && (dense || (cache_dir && format != \"lossless\"));",
        "  return linear && frozen && (dense || (cache_dir && format != \"lossless\"));",
        [P + "test_host_tier.py::test_a_checkpoint_in_another_float_dtype_is_cast_as_offload_reads_it",
         P + "test_cli_plan.py::test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it"],
        "a frozen weight whose file holds another dtype is left on the disk tier, which streams the file's bytes "
        "as they are (a wrong size, or another dtype's bits); `layerstream plan --dense-dtype` plans it there"),
    Mutation(
        "plan-disk-takes-cast-layers", "tools/cli/cmd_plan.cpp",
        "                                                    !l.cast, to_string(opt.quantize), true));",
        "                                                    true, to_string(opt.quantize), true));",
        [P + "test_cli_plan.py::test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it"],
        "`layerstream plan --dense-dtype` plans layers cast from the checkpoint's dtype on the disk tier, which "
        "offload() reads into RAM"),
    Mutation(
        "plan-disk-takes-convolutions", "tools/cli/cmd_plan.cpp",
        "host_tier::may_stay_in_file(!l.group && l.weight_shape.size() == 2, !opt.training,",
        "host_tier::may_stay_in_file(!l.group, !opt.training,",
        [P + "test_cli_plan.py::test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it"],
        "`layerstream plan --host-budget` plans convolutions on the disk tier; load_safetensors() leaves only "
        "Linear weights in the file"),
    Mutation(
        "lossless-measure-ignores-the-cast", "csrc/core/planner_models.cpp",
        "    const lossless::Dtype d = codable(as_dtype) ? lossless_dtype(as_dtype) : stored;  // what offload() codes",
        "    const lossless::Dtype d = stored;",
        [P + "test_cli_plan.py::test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it"],
        "`layerstream plan --dense-dtype bf16 --quantize lossless` measures the coded size of the file's fp32 "
        "values, not of the bf16 ones offload() codes"),
    Mutation(
        "group-raw-bytes-refused", "csrc/torch/engine_groups.cpp",
        "    LS_CHECK(t.defined() && (t.is_floating_point() || !t.requires_grad()), \"tensor group '\", name,",
        "    LS_CHECK(t.defined() && t.is_floating_point(), \"tensor group '\", name,",
        ["gtest:test_torch_offload:TorchOffload.AGroupsRawBytesCrossAsTheyAreEvenWithAFormat",
         P + "test_gguf.py::test_diffusers_gguf_layers_stream_their_blocks_and_compute_what_diffusers_computes"],
        "a tensor group refuses a tensor that is not floating point: diffusers' GGUF layers cannot stream"),
    Mutation(
        "group-raw-bytes-quantized", "csrc/torch/engine_groups.cpp",
        "    if (pre || (format != quant::Format::None && e.param.dim() >= 2 && e.param.is_floating_point() &&",
        "    if (pre || (format != quant::Format::None && e.param.dim() >= 2 &&",
        ["gtest:test_torch_offload:TorchOffload.AGroupsRawBytesCrossAsTheyAreEvenWithAFormat"],
        "quantize= packs a group's raw bytes (diffusers' GGUF blocks) as if they were weights"),
    Mutation(
        "gguf-view-loses-its-quant-type", "python/layerstream/_discovery.py",
        "        return type(p)(t, requires_grad=False, quant_type=p.quant_type)",
        "        return t",
        [P + "test_gguf.py::test_diffusers_gguf_layers_stream_their_blocks_and_compute_what_diffusers_computes"],
        "the slot's view of diffusers' GGUF blocks is handed to its forward as a plain uint8 tensor, which "
        "diffusers' dequantize passes through undecoded"),
    Mutation(
        "custom-group-refuses-raw-bytes", "python/layerstream/_discovery.py",
        "            if not any(p is not None for m in below for p in m._parameters.values()):",
        "            if not all(p.is_floating_point() for m in below for p in m._parameters.values() if p is not None):",
        [P + "test_gguf.py::test_a_custom_group_holding_diffusers_gguf_layers_streams_their_blocks"],
        "offload(groups=...) refuses a module holding diffusers' GGUF blocks (non-float parameters)"),
    Mutation(
        "cpp-swap-ignores-held-children", "csrc/torch/offload.cpp",
        "      if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 2)",
        "      if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 1000)",
        ["gtest:test_torch_offload:TorchOffload.ATorchLinearHeldOutsideTheRegistryIsRefusedNamingTheFix"],
        "C++ offload() swaps a torch::nn::Linear its parent calls through a member: the old module goes on "
        "computing unstreamed"),
    Mutation(
        "cpp-torch-load-replaces-streamed-tensors", "csrc/torch/offload.cpp",
        "  if (!engine_) return false;\n  const std::string name = engine_->layer_name(index_);",
        "  if (engine_ || !engine_) return false;\n  const std::string name = engine_->layer_name(index_);",
        ["gtest:test_torch_offload:TorchOffload.TorchLoadIntoAnOffloadedModelWritesItsValuesInPlace"],
        "torch::load() into an offloaded C++ model replaces the streamed tensors (LibTorch's set_)"),
    Mutation(
        "cpp-torch-load-leaves-the-watch-stale", "csrc/torch/offload.cpp",
        "    if (w.packed) engine_->watch_weight(index_, w.param);",
        "",
        ["gtest:test_torch_offload:TorchOffload.TorchLoadIntoAnOffloadedModelWritesItsValuesInPlace"],
        "torch::load() into a quantized streamed layer: its write to the dense parameter is refused at the "
        "next call"),
    Mutation(
        "cpp-conv-padding-mode-ignored", "csrc/torch/offload.cpp",
        "  if (engine_) return engine_->conv(index_, in);",
        "  if (engine_) return engine_->conv(index_, x);",
        ["gtest:test_torch_offload:TorchOffload.ConvPaddingModesPadTheInputAsTheTorchModuleDoes"],
        "an attached layerstream::nn::Conv with padding_mode reflect/replicate/circular convolves the unpadded "
        "input"),
    Mutation(
        "conv-padding-mode-ignored", "python/layerstream/_forward.py",
        "        return x if self._pad is None else torch.nn.functional.pad(x, self._pad[0], mode=self._pad[1])",
        "        return x",
        [P + "test_parity_layers.py::test_conv_padding_modes_stream_padding_the_input_as_torch_does"],
        "a streamed conv with padding_mode reflect/replicate/circular convolves the unpadded input"),
    Mutation(
        "adamw-ignores-torch-only-options", "python/layerstream/optim.py",
        '        on = [k for k in ("amsgrad", "maximize") if group.get(k)]',
        "        on = []",
        [P + "test_optim.py::test_a_torch_state_dict_with_options_it_lacks_is_refused_before_anything_loads"],
        "a torch.optim.AdamW state dict with maximize=True / amsgrad=True loads and the step ignores them"),
    Mutation(
        "adafactor-steps-empty-parameters", "csrc/torch/host_optim.cpp",
        "    if (p.numel() == 0) continue;  // nothing to step (transformers' Adafactor leaves it as it is too)",
        "",
        [P + "test_optim.py::test_adafactor_leaves_a_parameter_of_zero_elements_as_transformers_does"],
        "Adafactor raises on a parameter of zero elements"),
    Mutation(
        "cpp-conv-unattached-refuses-unbatched", "csrc/torch/offload.cpp",
        "  const bool unbatched = in.dim() == static_cast<int64_t>(D) + 1;",
        "  const bool unbatched = false;",
        ["gtest:test_torch_offload:TorchOffload.ConvTakesAnUnbatchedInputAttachedOrNot"],
        "an unattached layerstream::nn::Conv (kept resident by the plan, or detached) refuses an unbatched input"),
    Mutation(
        "streamed-layer-copy-refused", "python/layerstream/_offload.py",
        '            a.module.__dict__["__deepcopy__"] = _PlainCopy(a)  # a copy of one layer is a plain module',
        "",
        [P + "test_training.py::test_a_copy_of_one_streamed_layer_is_a_plain_module_so_peft_modules_to_save_trains"],
        "copy.deepcopy() of one streamed layer (peft's modules_to_save) raises \"an offloaded model cannot be "
        "deep-copied\""),
    Mutation(
        "activation-stash-takes-conj-views", "csrc/torch/engine_activations.cpp",
        "  if (t.layout() != torch::kStrided || t.is_conj() || t.is_neg() || t._is_zerotensor()) return -1;",
        "  if (t.layout() != torch::kStrided) return -1;",
        [P + "test_activations.py::test_conjugate_and_negative_views_are_saved_with_their_bit"],
        "a saved conjugate / negative view crosses as bytes and comes back without its bit"),
    Mutation(
        "activation-restore-skips-the-version-check", "csrc/torch/engine_activations.cpp",
        "  check_saved_version(s.version, s.saved_version, s.sizes);\n  if (!s.offloaded) return s.device;",
        "  if (!s.offloaded) return s.device;",
        [P + "test_activations.py::test_a_write_in_place_between_forward_and_backward_is_still_caught"],
        "a saved activation written in place after the forward is restored without autograd's version check"),
    Mutation(
        "activation-kept-skips-the-version-check", "python/layerstream/_activations.py",
        "        if self.version is not None:\n            _C.check_saved_version(self.tensor, self.version)",
        "        pass",
        [P + "test_activations.py::test_a_write_in_place_between_forward_and_backward_is_still_caught"],
        "a kept saved tensor (a weight) written in place after the forward passes autograd's version check"),
    Mutation(
        "activation-pack-reads-sparse-storage", "python/layerstream/_activations.py",
        "        if (isinstance(t, nn.Parameter) or t.layout != torch.strided or t.is_nested",
        "        if (isinstance(t, nn.Parameter) or t.is_nested",
        [P + "test_activations.py::test_sparse_and_wrapper_saved_tensors_stay_as_they_are"],
        "the pack hook reads the storage of a sparse saved tensor (NotImplementedError)"),
    Mutation(
        "sim-unwrap-keeps-the-region", "csrc/backends/sim/sim_backend.cpp",
        "  std::lock_guard<std::mutex> l(impl_->ck_mu);\n  impl_->regions.erase(buf.id);",
        "  return;",
        ["gtest:test_sim_checker:SimChecker.UnwrapDropsTracking"],
        "the sim checker keeps what it knew of a wrapped buffer after unwrap() (a region per saved activation, "
        "for the backend's life)"),
    Mutation(
        "control-harmless-comment", "python/layerstream/_forward.py",
        "class _GroupFn(torch.autograd.Function):",
        "class _GroupFn(torch.autograd.Function):  # (no-op: the anchor check itself)",
        [P + "test_groups.py::test_quantized_group_module"],
        "control: a harmless edit must survive (checks the harness itself)"),
]

CONTROL = {"control-harmless-comment"}
