"""Bugs planted in the LibTorch glue (csrc/torch: the engine, its autograd functions and
custom ops, the C++ modules and offload(), the host optimizer's glue) and the Python bindings."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS = [
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
        "allreduce-blocks-the-backward", "csrc/torch/engine_distributed.cpp",
        "    backend_->launch_host_func(grad_stream_, [works = std::move(works)] {\n"
        "      for (const auto& w : works) w->wait();\n    });",
        "    for (const auto& w : works) w->wait();",
        [P + "test_distributed.py::test_averaging_overlaps_the_backward"],
        "a streamed gradient's all-reduce waited for on the backward's thread (no overlap)"),
    Mutation(
        "overlap-shard-prior-unsliced", "csrc/torch/host_overlap.cpp",
        "src.prior = prior.defined() ? part(p, prior).data_ptr() : nullptr;",
        "src.prior = prior.defined() ? prior.data_ptr() : nullptr;",
        [P + "test_distributed.py::test_sharded_step_overlapped_with_the_backward"],
        "an overlapped shard step reads the earlier micro-batches' gradient from the tensor's start"),
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
        "lossless-routed-decodes-first-piece", "csrc/torch/engine_groups.cpp",
        "for (int64_t x = run.first; x < run.second; ++x) add(static_cast<size_t>(x));",
        "for (int64_t x = run.first; x < run.second; ++x) add(static_cast<size_t>(run.first));",
        [P + "test_experts.py::test_lossless_experts_route_and_decode_bit_for_bit"],
        "a routed call decodes its run's first expert into every expert's place"),
    Mutation(
        "lossless-group-part-refreshed-in-place", "csrc/torch/engine_groups.cpp",
        "  if (e.qformat == quant::Format::Lossless)\n    return compose(\"tensor #\", part,",
        "  if (false)\n    return compose(\"tensor #\", part,",
        [P + "test_experts.py::test_lossless_experts_under_lora_train_exactly"],
        "new values are 'packed' into a lossless-coded group tensor (pack() refuses with another message)"),
    Mutation(
        "lossless-trainable-group-routed-no-recode", "csrc/torch/engine_groups.cpp",
        "    recode_for_fetch(layer_index);\n",
        "",
        ["gtest:test_torch_offload:*TrainableLosslessGroup*",
         P + "test_experts.py::test_routed_lossless_trainable_experts_recode_between_steps"],
        "a routed fetch of a trainable coded group copies the pieces coded before the last optimizer step"),
    Mutation(
        "linear-bias-grad-dropped", "csrc/torch/ops_streamed.cpp",
        "                        .copy_(gb));",
        "                        .zero_());",
        [P + "test_parity_layers.py::test_linear_fp32_bit_exact"],
        "streamed Linear bias gradient lost"),
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
        "checkpoint-step-not-restored", "csrc/torch/host_optim.cpp",
        "      prm.step = loaded[gi].params[i].first;",
        "      (void)0;",
        ["gtest:test_torch_optim:*CheckpointResumesBitIdentically*"],
        "a C++ AdamW resumed from a checkpoint restarts its bias correction at step 1"),
    Mutation(
        "clone-keeps-binding", "csrc/torch/nn_modules.cpp",
        "std::shared_ptr<torch::nn::Module> LinearImpl::clone(const std::optional<torch::Device>& device) const {\n  refuse_clone();",
        "std::shared_ptr<torch::nn::Module> LinearImpl::clone(const std::optional<torch::Device>& device) const {",
        ["gtest:test_torch_offload:*CloneOfAnOffloadedModel*"],
        "a clone of an offloaded layerstream::nn::Linear streams and trains the original's weights"),
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
        "    if (!served && !q.copying_back) {\n      copy_back_locked(q);",
        "    if (served || q.copying_back) continue;\n    {\n      copy_back_locked(q);",
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
        "synchronize-does-not-recode", "csrc/torch/engine.cpp",
        "  wait_all_locked();\n  force_recode_locked();",
        "  wait_all_locked();",
        [P + "test_lossless.py::test_a_write_to_a_few_elements_through_data_is_seen_after_synchronize"],
        "handle.synchronize() leaves a trainable lossless weight's coding as it is after a `.data` "
        "write the sample missed"),
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
        "cast-as-read-chunks-from-the-start", "csrc/torch/engine_host_tier.cpp",
        "      file->read(tmp.data_ptr(), src.offset + static_cast<uint64_t>(i) * c10::elementSize(from),",
        "      file->read(tmp.data_ptr(), src.offset,",
        [P + "test_host_tier.py::test_a_weight_cast_as_read_crosses_the_chunks_of_the_temporary"],
        "a weight cast as it is read (the file holds another dtype) reads every chunk of the temporary from the "
        "tensor's start: values past the first 64 MiB are the first chunk's again"),
    Mutation(
        "checkpoint-read-into-ram-kept-open", "csrc/torch/engine_host_tier.cpp",
        "  std::shared_ptr<SourceFile> file = open_file_locked(src);\n"
        "  if (!file) file = SourceFile::open(src.path, src.identity, src.kind);",
        "  std::shared_ptr<SourceFile> file = file_locked(src);",
        [P + "test_host_tier_files.py::test_a_checkpoint_read_into_ram_is_closed_and_its_space_freed_when_deleted"],
        "a checkpoint whose weights were all read into RAM stays open until detach(): deleting it frees no "
        "disk space"),
    Mutation(
        "saved-tensor-not-shared", "csrc/torch/engine_activations.cpp",
        "    if (p != stashed_.end() && holds_unchanged(p->second, t)) {",
        "    if (false) {",
        [P + "test_activation_shared.py::test_a_tensor_saved_by_three_projections_crosses_once_each_way"],
        "a tensor saved by several ops (q, k and v's input) is copied to the host and back once per save"),
    Mutation(
        "saved-tensor-shared-after-a-write", "csrc/torch/engine_activations.cpp",
        "  return !now || (now->current_version() == s.saved_version && s.version->current_version() == s.saved_version);",
        "  return true;",
        [P + "test_activation_shared.py::test_a_tensor_written_between_saves_is_not_shared"],
        "a tensor written in place between two saves shares the first save's entry: the second op's backward "
        "reads the values from before the write"),
    Mutation(
        "shared-copy-back-dropped-after-first-unpack", "csrc/torch/engine_activations.cpp",
        "    if (s.sharers > 1) {\n      s.shared = out;",
        "    if (false) {\n      s.shared = out;",
        [P + "test_activation_shared.py::test_a_tensor_saved_by_three_projections_crosses_once_each_way"],
        "the copy back of a shared saved tensor is not kept for the other saves' unpacks: copied back once per "
        "unpack"),
    Mutation(
        "shared-copy-back-kept-after-backward", "csrc/torch/engine_activations.cpp",
        "    if (s.shared.defined() && s.shared_task == task) let_go_locked(s.shared);",
        "",
        [P + "test_activation_shared.py::test_a_retained_graph_backward_twice_and_a_partial_backward"],
        "a shared copy back stays on the device after the backward that made it (a retained graph, a partial "
        "backward): device memory held until the graph goes"),
    Mutation(
        "requantize-leaves-the-dense-parameter", "csrc/torch/engine_register.cpp",
        "    param.copy_(dense.detach());",
        "    (void)param;",
        ["gtest:test_torch_offload:TorchOffload.RequantizedOrFreedDenseWeightIsNotLostBySaveOrDetach"],
        "C++: values loaded with Engine::requantize() never reach the module's dense parameter: torch::save() "
        "and detach() give the old weights back"),
    Mutation(
        "detach-leaves-a-freed-dense-parameter-empty", "csrc/torch/engine.cpp",
        "      if (param.defined() && param.sizes().vec() != l.w_shape) param.set_data(dequantized_weight(int(i)).to(dev));",
        "",
        ["gtest:test_torch_offload:TorchOffload.RequantizedOrFreedDenseWeightIsNotLostBySaveOrDetach"],
        "C++: a quantized layer's dense parameter freed to save host RAM is left empty by detach() (the next "
        "forward fails; the weights are gone)"),
    Mutation(
        "save-writes-a-freed-dense-parameter", "csrc/torch/nn_modules.cpp",
        "  if (!engine_ || engine_->layer_format(index_).empty()) return false;",
        "  return false;",
        ["gtest:test_torch_offload:TorchOffload.RequantizedOrFreedDenseWeightIsNotLostBySaveOrDetach"],
        "C++: torch::save() of a quantized layer whose dense parameter was freed writes a 0-element weight"),
    Mutation(
        "cpp-float64-layer-streamed", "csrc/torch/offload.cpp",
        "w && w->is_floating_point() && !dynamic_cast<nn::EmbeddingImpl*>(m.get()) && !streams_in(w->scalar_type())) {",
        "false) {",
        ["gtest:test_torch_offload:TorchOffload.AFloat64LayerStaysResidentAndAnIncludeTypoIsWarned"],
        "C++ offload() streams a float64 Linear, which then refuses every float64 input (Python keeps it resident)"),
    Mutation(
        "cpp-include-typo-silent", "csrc/torch/offload.cpp",
        "      c.unmatched_include.push_back(\"'\" + p + \"'\");",
        "      (void)p;",
        ["gtest:test_torch_offload:TorchOffload.AFloat64LayerStaysResidentAndAnIncludeTypoIsWarned"],
        "C++ offload(): an include pattern that names no module streams nothing there, silently"),
    Mutation(
        "call-between-overlap-and-step", "csrc/torch/engine_grad_ready.cpp",
        "  if (gr_unsettled_.load(std::memory_order_relaxed) && torch::autograd::get_current_graph_task_id() == -1)",
        "  if (false)",
        ["gtest:test_torch_optim:TorchOptim.ChangesBetweenTheOverlapScopeAndStepAreRefused", P + "test_optim.py::test_state_dict_between_an_overlapped_backward_and_its_step_is_an_error"],
        "a call of the model between an overlapped backward and step() computes with the streamed layers "
        "stepped (unclipped) and the resident ones not"),
    Mutation(
        "overlap-block-end-marks-nothing", "csrc/torch/host_overlap.cpp",
        "  if (stepped_now && any_stepped(status_)) mark_unsettled(*engine_, unsettled_, true);\n  return status_;\n}\n\n// ----",
        "  return status_;\n}\n\n// ----",
        ["gtest:test_torch_optim:TorchOptim.ChangesBetweenTheOverlapScopeAndStepAreRefused", P + "test_optim.py::test_state_dict_between_an_overlapped_backward_and_its_step_is_an_error"],
        "AdamW's overlap block ends without marking the engine: calls and saves before step() see half a step"),
    Mutation(
        "cpp-save-between-overlap-and-step", "csrc/torch/nn_modules.cpp",
        "  LS_CHECK(!engine_ || !engine_->unsettled_step(), \"torch::save() of streamed layer '\",",
        "  LS_CHECK(true, \"torch::save() of streamed layer '\",",
        ["gtest:test_torch_optim:TorchOptim.ChangesBetweenTheOverlapScopeAndStepAreRefused"],
        "C++ torch::save() of the model between an overlapped backward and step(): a torn checkpoint"),
    Mutation(
        "cpp-plan-without-the-sim-link", "csrc/torch/offload.cpp",
        "  if (resolve_device(options.device, DeviceSpelling::Cpp) == \"sim\") in.link_bytes_per_s = options.sim_h2d_gbps * 1e9;",
        "",
        ["gtest:test_torch_offload:TorchOffload.BudgetIsPlannedAsInPython"],
        "C++ offload()'s plan on the sim device says 'no link bandwidth given' (Python's times the modelled link)"),
    Mutation(
        "group-raw-bytes-refused", "csrc/torch/engine_groups.cpp",
        "    LS_CHECK(t.is_floating_point() || !t.requires_grad(), \"tensor group '\", name, \"': tensor #\", k, \" (\",",
        "    LS_CHECK(t.is_floating_point(), \"tensor group '\", name, \"': tensor #\", k, \" (\",",
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
        "cpp-swap-ignores-held-children", "csrc/torch/offload.cpp",
        "    if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 2)",
        "    if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 1000)",
        ["gtest:test_torch_offload:TorchOffload.ATorchLinearHeldOutsideTheRegistryIsRefusedNamingTheFix"],
        "C++ offload() swaps a torch::nn::Linear its parent calls through a member: the old module goes on "
        "computing unstreamed"),
    Mutation(
        "cpp-torch-load-replaces-streamed-tensors", "csrc/torch/nn_modules.cpp",
        "  if (!engine_) return false;\n  const std::string name = engine_->layer_name(index_);",
        "  if (engine_ || !engine_) return false;\n  const std::string name = engine_->layer_name(index_);",
        ["gtest:test_torch_offload:TorchOffload.TorchLoadIntoAnOffloadedModelWritesItsValuesInPlace"],
        "torch::load() into an offloaded C++ model replaces the streamed tensors (LibTorch's set_)"),
    Mutation(
        "cpp-torch-load-leaves-the-watch-stale", "csrc/torch/engine_register.cpp",
        "  if (l.watched) l.watched_version = l.watched->current_version();",
        "",
        ["gtest:test_torch_offload:TorchOffload.TorchLoadIntoAnOffloadedModelWritesItsValuesInPlace"],
        "torch::load() into a quantized streamed layer: its write to the dense parameter is refused at the "
        "next call"),
    Mutation(
        "cpp-conv-padding-mode-ignored", "csrc/torch/nn_modules.cpp",
        "  if (engine_) return engine_->conv(index_, in);",
        "  if (engine_) return engine_->conv(index_, x);",
        ["gtest:test_torch_offload:TorchOffload.ConvPaddingModesPadTheInputAsTheTorchModuleDoes"],
        "an attached layerstream::nn::Conv with padding_mode reflect/replicate/circular convolves the unpadded "
        "input"),
    Mutation(
        "adafactor-steps-empty-parameters", "csrc/torch/host_optim.cpp",
        "    if (p.numel() == 0) continue;  // nothing to step (transformers' Adafactor leaves it as it is too)",
        "",
        [P + "test_optim.py::test_adafactor_leaves_a_parameter_of_zero_elements_as_transformers_does"],
        "Adafactor raises on a parameter of zero elements"),
    Mutation(
        "cpp-conv-unattached-refuses-unbatched", "csrc/torch/nn_modules.cpp",
        "  const bool unbatched = in.dim() == static_cast<int64_t>(D) + 1;",
        "  const bool unbatched = false;",
        ["gtest:test_torch_offload:TorchOffload.ConvTakesAnUnbatchedInputAttachedOrNot"],
        "an unattached layerstream::nn::Conv (kept resident by the plan, or detached) refuses an unbatched input"),
    Mutation(
        "activation-stash-takes-conj-views", "csrc/torch/engine_activations.cpp",
        "  if (t.layout() != torch::kStrided || t.is_conj() || t.is_neg() || t._is_zerotensor()) return -1;",
        "  if (t.layout() != torch::kStrided) return -1;",
        [P + "test_activations.py::test_conjugate_and_negative_views_are_saved_with_their_bit"],
        "a saved conjugate / negative view crosses as bytes and comes back without its bit"),
    Mutation(
        "activation-restore-skips-the-version-check", "csrc/torch/engine_activations.cpp",
        "  check_saved_version(it->second.version, it->second.saved_version, it->second.sizes);",
        "",
        [P + "test_activations.py::test_a_write_in_place_between_forward_and_backward_is_still_caught"],
        "a saved activation written in place after the forward is restored without autograd's version check"),
    Mutation(
        "quant-cache-change-blames-the-user", "csrc/python/bindings.cpp",
        "SourceFile::Kind::QuantCache, res.items[i].checksum});",
        "SourceFile::Kind::Checkpoint, res.items[i].checksum});",
        [P + "test_host_tier_quant.py::test_a_cache_file_changed_under_a_reader_is_named_as_layerstreams_cache"],
        "a changed quantization cache file is reported as the user's checkpoint (\"Load the model again\"), not as "
        "layerstream's cache to rebuild with offload()"),
    Mutation(
        "cpp-resident-quantized-keeps-original-values", "csrc/torch/offload.cpp",
        "    q.weight.copy_(q.values);\n",
        "",
        ["gtest:test_torch_offload:TorchOffload.AQuantizedLayerKeptResidentComputesWithTheStreamedValues"],
        "C++ offload() with quantize and a budget: a layer the plan keeps resident computes unquantized"),
    Mutation(
        "detach-frees-the-scheduler-under-a-held-slot", "csrc/torch/engine.cpp",
        "  LS_CHECK(fetched_.empty(), \"detach(): \", fetched_.size(),",
        "  LS_CHECK(true, \"detach(): \", fetched_.size(),",
        [P + "test_misuse.py::test_detach_is_refused_while_a_fetched_group_is_held"],
        "detach() while another thread's layer holds a slot frees the scheduler its release goes through "
        "(use after free)"),
    Mutation(
        "cpp-handle-stats-omit-resident", "csrc/torch/offload.cpp",
        "    s.peak_device_bytes += resident_bytes_;\n",
        "",
        ["gtest:test_torch_offload:*BudgetIsPlannedAsInPython*"],
        "C++ OffloadHandle::stats(): the peak leaves out the layers the planner kept resident (Python counts "
        "them), so a demo's \"within budget\" check could not fail"),
    Mutation(
        "saved-tensor-destroyed-under-the-lock", "csrc/torch/engine_activations.cpp",
        "  if (t.defined()) t_let_go.push_back(std::move(t));\n",
        "",
        [P + "test_threads.py::test_threads_saving_and_freeing_activations_do_not_deadlock"],
        "a saved activation destroyed under the engine's lock: threads calling a model with "
        "activations=\"host\" deadlock (the GIL against the lock)"),
    Mutation(
        "handed-out-activations-counted-until-drop", "csrc/torch/engine_activations.cpp",
        "  release_copied_locked();\n  prune_handed_out_locked();\n",
        "  release_copied_locked();\n",
        [P + "test_activations.py::test_retain_graph_backwards_count_each_copy_back_only_while_autograd_holds_it"],
        "stats(): each retain_graph backward adds its copies back to the activation peak for good"),
    Mutation(
        "engine-host-options-unchecked", "csrc/torch/engine.cpp",
        "  options::check_staging_bytes(opts_.staging_bytes);\n  options::check_reader_threads(opts_.reader_threads);\n",
        "",
        ["gtest:test_torch_offload:*EngineRefusesBadHostOptions*"],
        "EngineOptions::staging_bytes < 0 and reader_threads < 1 are taken without a word (a negative staging "
        "size read as the least, 0 reader threads as 1)"),
    Mutation(
        "device-advice-in-python-everywhere", "csrc/torch/engine.cpp",
        "  const DeviceAdvice advice = device_advice(spelling);",
        "  const DeviceAdvice advice = device_advice(DeviceSpelling::Python);",
        ["gtest:test_torch_offload:*CudaWithoutAGpuAdvisesEachCallersSpelling*",
         P + "test_cli_demo_bench.py::test_demo_cuda_without_a_gpu_names_the_cli_option"],
        "device \"cuda\" without a GPU advises device='sim' and torch.cuda.is_available() to C++ and "
        "command-line users"),
    Mutation(
        "adamw-takes-an-empty-list", "csrc/torch/host_optim.cpp",
        "  LS_CHECK(!params.empty(), \"layerstream::optim::AdamW got an empty parameter list",
        "  LS_CHECK(true, \"layerstream::optim::AdamW got an empty parameter list",
        ["gtest:test_torch_optim:*AdamWRefusesAnEmptyParameterList*"],
        "layerstream::optim::AdamW made with no parameters steps nothing, silently (torch.optim refuses it)"),
    Mutation(
        "overlap-block-calls-the-model-mid-step", "csrc/torch/engine_grad_ready.cpp",
        "  if (gr_jobs_.load(std::memory_order_relaxed) == 0 || torch::autograd::get_current_graph_task_id() != -1) "
        "return;",
        "  return;",
        [P + "test_optim.py::test_two_backwards_inside_one_overlap_block_are_refused",
         P + "test_optim.py::test_a_call_of_the_model_inside_an_overlap_block_after_its_backward_is_refused"],
        "a call of the model inside an overlap() block after its backward copies weights the step is writing "
        "(a second micro-batch's forward and backward: each layer stepped twice)"),
    Mutation(
        "failed-overlapped-backward-uncounted", "csrc/torch/engine_gradients.cpp",
        "    ++failed_backwards_;\n    if (dropped) failed_backward_unreported_ = true;",
        "    if (dropped) ++failed_backwards_;\n    if (dropped) failed_backward_unreported_ = true;",
        [P + "test_optim.py::test_every_overlapped_backward_that_raises_is_counted_in_stats"],
        "a failed backward whose gradients an overlapped step consumed is not counted in stats()['failed_backwards']"),
    Mutation(
        "activation-pool-never-evicts", "csrc/torch/engine_activations.cpp",
        "  if (pooled == host_pool_.end()) evict_host_pool_locked(alloc);\n",
        "",
        [P + "test_activations.py::test_the_host_pool_stays_bounded_when_shapes_change_every_step"],
        "the saved activations' host pool keeps every buffer: it grows with the shapes seen and fills the host budget"),
    Mutation(
        "activation-pool-exact-size-no-eviction", "csrc/torch/engine_activations.cpp",
        "  auto pooled = host_pool_.lower_bound(s.bytes);\n  if (pooled != host_pool_.end() && pooled->first > 2 * host_class_bytes(s.bytes)) pooled = host_pool_.end();\n  const size_t alloc = host_class_bytes(s.bytes);\n  if (pooled == host_pool_.end()) evict_host_pool_locked(alloc);",
        "  auto pooled = host_pool_.find(s.bytes);\n  const size_t alloc = s.bytes;",
        [P + "test_activations.py::test_the_host_pool_stays_bounded_when_shapes_change_every_step"],
        "the host pool as before: exact sizes only, never freed (85 MiB after 60 steps of 2 MiB; offload stops at the cap)"),
    Mutation(
        "retained-backward-prefetches-nothing", "csrc/torch/engine_activations.cpp",
        "        q.shared.defined() || (q.handed_out && (!again || (task != -1 && q.handed_task == task)));",
        "        q.shared.defined() || q.handed_out;",
        [P + "test_activations.py::test_copies_back_start_ahead_of_the_backward"],
        "a retained graph's second backward starts no copy back ahead of its restores"),
    Mutation(
        "overlap-abort-keeps-stepped-grads", "csrc/torch/host_overlap.cpp",
        "    } else if (status_[i] == kStepped) {\n      drop_grad(params_[i].param);  // Note [A stepped layer's kept gradient goes at an abort]\n    }",
        "    }",
        [P + "test_optim.py::test_a_block_left_by_an_exception_after_its_backward_steps_each_layer_once",
         "gtest:test_torch_optim:*AScopeLeftByAnExceptionKeepingGradsStepsEachLayerOnce*"],
        "an overlap block left by an exception with keep_grads: step() steps the layers stepped during the backward again"),
    Mutation(
        "adafactor-overlap-abort-keeps-stepped-grads", "csrc/torch/host_overlap.cpp",
        "    if (status_[i] == AdamWOverlap::kStepped) drop_grad(params_[i].param);\n}",
        "    if (false) drop_grad(params_[i].param);\n}",
        [P + "test_optim.py::test_a_block_left_by_an_exception_after_its_backward_steps_each_layer_once"],
        "Adafactor's overlap block left by an exception with keep_grads: step() steps the stepped layers again"),
    Mutation(
        "adamw-steps-a-parameter-listed-twice-twice", "csrc/torch/host_optim.cpp",
        "    if (std::any_of(g.params.begin(), g.params.end(), [&](const Param& q) { return q.param.is_same(p); }))\n      continue;\n",
        "",
        ["gtest:test_torch_optim:*AParameterListedTwiceIsSteppedOnce*"],
        "layerstream::optim::AdamW(net->parameters()) steps a tied weight (listed once per module) twice per step"),
    Mutation(
        "root-layer-is-not-streamed", "csrc/torch/offload.cpp",
        "      c.items.insert(c.items.begin(), Item{\"\", nullptr, {}, \"\", c.root});\n",
        "",
        ["gtest:test_torch_offload:*ARootThatIsAStreamedLayerIsStreamed*"],
        "offload(*layerstream::nn::Linear(...)) finds nothing to stream (the root is never a candidate)"),
    Mutation(
        "cast-warning-says-quantized-numbers-are-the-same", "csrc/torch/engine_device.cpp",
        "      l.qformat == quant::Format::None\n",
        "      true\n",
        [P + "test_errors.py::test_cast_at_use_of_a_quantized_weight_says_the_numbers_change"],
        "the cast-at-use warning promises the same numbers with compute_dtype=<activations> for a quantized weight"),
    Mutation(
        "optim-error-names-the-index-among-grads", "csrc/torch/host_optim.cpp",
        "    const int64_t at = positions.empty() ? static_cast<int64_t>(i) : positions[i];",
        "    const int64_t at = static_cast<int64_t>(i);",
        [P + "test_optim.py::test_sparse_gradients_are_refused",
         "gtest:test_torch_optim:*GroupsPrecisionsAndErrors*"],
        "an optimizer's error names a parameter by its index among those with a gradient, not its place in the group"),
    Mutation(
        "max-slots-held-reset-by-resume", "csrc/torch/engine.cpp",
        "  carried_.max_slots_held = std::max(carried_.max_slots_held, st.max_slots_held);  // a peak, not a sum\n",
        "",
        [P + "test_telemetry.py::test_step_stats_go_on_across_suspend_and_resume"],
        "stats()['max_slots_held'] falls to 0 after suspend() and resume() (a peak since the engine was made)"),
    Mutation(
        "resident-quantized-not-refreshed", "csrc/torch/nn_modules.cpp",
        "  refresh_quantized(weight);\n  return torch::linear(x, weight, bias);",
        "  return torch::linear(x, weight, bias);",
        ["gtest:test_torch_offload:*AQuantizedLayerKeptResidentIsQuantizedAgainAfterALoadOrAWrite*"],
        "a write into a quantized layer the budget keeps resident computes dense: the budget changes the numbers"),
    Mutation(
        "resident-quantized-load-not-requantized", "csrc/torch/nn_modules.cpp",
        "  torch::nn::Module::load(archive);\n  refresh_quantized(weight, /*force=*/true);",
        "  torch::nn::Module::load(archive);",
        ["gtest:test_torch_offload:*AQuantizedLayerKeptResidentIsQuantizedAgainAfterALoadOrAWrite*"],
        "torch::load() into a quantized layer the budget keeps resident writes dense values"),
    Mutation(
        "scope-ended-elsewhere-freed", "csrc/torch/saved_activations.cpp",
        "  if (state_->thread != std::this_thread::get_id()) {",
        "  if (false) {",
        ["gtest:test_torch_offload:*SavedActivationsOfAnOffloadedModelGoToTheHost*"],
        "a SavedActivations scope destroyed on another thread leaves its thread's chain pointing into freed memory"),
    Mutation(
        "cpp-overlap-inputs-unchecked", "csrc/torch/host_optim.cpp",
        "  if (pending) check_overlap_inputs(*pending);\n",
        "",
        ["gtest:test_torch_optim:*ChangesBetweenTheOverlapScopeAndStepAreRefused*"],
        "the C++ AdamW steps the rest with an lr or a .grad changed after the overlap() scope, silently"),
    Mutation(
        "cpp-group-clip-dropped", "csrc/torch/host_optim.cpp",
        "    LS_CHECK(!options.max_grad_norm || options.max_grad_norm == first.max_grad_norm,",
        "    LS_CHECK(true,",
        ["gtest:test_torch_optim:*AdamWRefusesAnEmptyParameterList*"],
        "add_param_group() drops a group's own max_grad_norm silently"),
    Mutation(
        "resident-quantized-requantizes-its-own-values", "csrc/torch/nn_modules.cpp",
        "  if (tensor_checksum(weight) != quantized_->checksum) {",
        "  if (true) {",
        ["gtest:test_torch_offload:*AQuantizedLayerKeptResidentLoadsItsOwnSaveUnchanged*"],
        "torch::load() of a resident quantized layer's own save quantizes its quantized values again, moving them"),
    Mutation(
        "cpp-resident-quantized-unfrozen-runs", "csrc/torch/nn_modules.cpp",
        "  LS_CHECK(force || !weight.requires_grad(), \"the weight of quantized layer '\", quantized_->name,",
        "  LS_CHECK(true, \"the weight of quantized layer '\", quantized_->name,",
        ["gtest:test_torch_offload:*AQuantizedLayerKeptResidentRefusesUnfreezingAndWarnsOfRounding*"],
        "a C++ resident quantized weight unfrozen after offload() trains dense values, quantized again at each write"),
    Mutation(
        "resident-rounding-rule-never-rounds", "csrc/torch/engine_register.cpp",
        "  return dequant && c10::promoteTypes(weight, *dequant) != weight;",
        "  return false;",
        ["gtest:test_torch_offload:*AQuantizedLayerKeptResidentRefusesUnfreezingAndWarnsOfRounding*",
         P + "test_quant_offload.py::test_resident_quantized_layers_rounded_from_a_wider_dequant_dtype_are_warned_of"],
        "a dequant_dtype wider than a resident quantized layer's weights rounds its values without a warning"),
    Mutation(
        "activation-prefetch-left-on-the-device", "csrc/torch/engine_activations.cpp",
        "    if (!s.copying_back || s.prefetch_task != task) continue;",
        "    continue;",
        [P + "test_activations.py::test_a_backward_frees_the_copies_back_it_did_not_hand_out"],
        "copies back that no backward reads (another graph's) stay on the device until their graph is freed"),
    Mutation(
        "cpp-kept-saved-tensor-not-detached", "csrc/torch/saved_activations.cpp",
        "      kept_ = t.detach();",
        "      kept_ = t;",
        ["gtest:test_torch_offload:*AForwardWithoutBackwardInASavedActivationsScopeIsFreed*"],
        "a C++ activation scope keeps a saved output with its grad_fn: a forward without backward is never freed"),
    Mutation(
        "shared-requantize-unrefused", "csrc/torch/engine_groups.cpp",
        "    if (store_->in_shared(l.w_host))",
        "    if (false)",
        [P + "test_distributed.py::test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank"],
        "a quantized frozen weight's copy_() on one rank re-quantizes it into the store every rank of the "
        "node shares"),
    Mutation(
        "shared-requantize-part-unrefused", "csrc/torch/engine_groups.cpp",
        "  if (store_->in_shared(e.host))",
        "  if (false)",
        [P + "test_distributed.py::test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank"],
        "load_state_dict() into a quantized frozen group tensor on one rank re-quantizes it into the store "
        "every rank of the node shares"),
    Mutation(
        "late-grad-hook-gets-a-staged-gradient", "csrc/torch/ops_streamed.cpp",
        "ctx->saved_data[\"via_autograd\"].toBool() || !plain_backward() || !e->stages_grads(layer);",
        "ctx->saved_data[\"via_autograd\"].toBool() || !plain_backward();",
        [P + "test_training.py::test_param_hooks_registered_after_the_forward_fire_like_reference"],
        "a gradient hook registered between a streamed layer's forward and its backward gets None (the gradient "
        "staged, not returned to autograd): a hook that scales it is skipped silently"),
    Mutation(
        "stashed-activation-never-dropped", "csrc/python/bindings.cpp",
        "      engine->drop_activation(token);",
        "      (void)engine;",
        [P + "test_errors.py::test_a_ctrl_c_as_an_activation_is_stashed_does_not_leak_its_host_copy"],
        "a stashed activation's host copy is never given back when autograd frees its graph: the pool grows "
        "every step"),
    Mutation(
        "q8-states-decoded-as-second-moments", "csrc/torch/host_optim.cpp",
        "  out.exp_avg = adopt(loaded.exp_avg, loaded.exp_avg_absmax, \"exp_avg\", true, &out.exp_avg_absmax);",
        "  out.exp_avg = adopt(loaded.exp_avg, loaded.exp_avg_absmax, \"exp_avg\", false, &out.exp_avg_absmax);",
        [P + "test_optim.py::test_8bit_states_convert_to_float_and_back"],
        "8-bit first moments converted to floats are read as unsigned second-moment codes: every sign lost"),
    Mutation(
        "q8-states-adopted-across-layouts", "csrc/torch/host_optim.cpp",
        "    if (format == StateFormat::Q8 && codes && same_memory_order(t, r)) {",
        "    if (format == StateFormat::Q8 && codes) {",
        [P + "test_optim.py::test_8bit_states_of_another_memory_layout_are_reencoded"],
        "8-bit AdamW states loaded into a parameter of another memory layout are decoded with other "
        "blocks' scales: the moments silently wrong"),
]
