"""Bugs planted in the Python layer (python/layerstream: module surgery, forwards,
activation scopes, tensor groups, loaders, compat), and the harness's control entry. The
optimizers' and several processes' are in python_optim.py."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS = [
    Mutation(
        "group-recompute-ignores-autocast", "python/layerstream/_group_op.py",
        "torch.autocast(dev.type, dtype=autocast[1], enabled=autocast[0])",
        "torch.autocast(dev.type, dtype=autocast[1], enabled=False)",
        [P + "test_groups.py::test_group_under_autocast_recomputes_in_the_autocast_dtype"],
        "a group's recompute in backward ignores autocast", survived_before=True),
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
        "    with _as_eager():\n        outs, spec",
        "    if True:\n        outs, spec",
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
        "group-recompute-other-dropout-mask", "python/layerstream/_group_op.py",
        "        torch.set_rng_state(cpu_rng)\n",
        "        pass\n",
        [P + "test_groups.py::test_named_modules_stream_whole_and_train_exactly"],
        "a group's recompute does not restore the RNG (other dropout masks)"),
    Mutation(
        "layout-quantized-detach-size1-strides", "python/layerstream/_attach.py",
        "                  strides=tuple(weight.stride()))",
        "                  strides=None if weight.is_contiguous() else tuple(weight.stride()))",
        [P + "test_parity_layers.py::test_a_channels_last_1x1_conv_keeps_its_strides"],
        "detach() gives a quantized channels_last 1x1 conv weight the contiguous strides"),
    Mutation(
        "activation-interrupted-scope-kept", "python/layerstream/_activations.py",
        "        if self._depth and not self._entering_call_running():",
        "        if False:",
        [P + "test_activations.py::test_a_forward_interrupted_by_ctrl_c_does_not_leave_its_scope_open"],
        "a forward interrupted by Ctrl-C leaves the saved-tensor hooks entered: the next call nests in it"),
    Mutation(
        "activation-detach-keeps-scope", "python/layerstream/_activations.py",
        "which no longer holds the engine.\"\"\"\n        self.close()",
        "which no longer holds the engine.\"\"\"\n        pass",
        [P + "test_activations.py::test_a_forward_interrupted_by_ctrl_c_does_not_leave_its_scope_open"],
        "detach() leaves an interrupted forward's saved-tensor hooks entered (autograd then fails)"),
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
        "a-call-begins-no-step", "python/layerstream/_calls.py",
        "            engine = self._engine_of()\n            if engine is not None:\n                engine.begin_call()",
        "            engine = None",
        [P + "test_training.py::test_a_data_write_between_calls_that_skip_the_first_layer_is_seen"],
        "a call of the offloaded model that skips the trace's first layer shares the step (and the "
        "cached weights) of the call before"),
    Mutation(
        "compat-call-begins-no-step", "python/layerstream/compat.py",
        "        self._call_hook = CallHooks(module, lambda: this().engine, self._streamed_ids(),",
        "        self._call_hook = CallHooks(module, lambda: None, self._streamed_ids(),",
        [P + "test_compat_aitoolkit.py::test_a_call_that_skips_the_first_streamed_layer_still_begins_a_step"],
        "compat: a call of the attached model that skips the trace's first layer reuses the weights "
        "the call before cached"),
    Mutation(
        "calls-do-not-take-turns", "python/layerstream/_calls.py",
        "            while not interrupted and self._owner is not None and self._held(me):",
        "            while False:",
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
        "turn-kept-when-its-call-is-gone", "python/layerstream/_calls.py",
        "            f = f.f_back\n        return False",
        "            f = f.f_back\n        return True",
        [P + "test_threads.py::test_a_call_ended_by_keyboard_interrupt_gives_its_turn_to_the_next_call",
         P + "test_threads.py::test_a_turn_whose_thread_is_gone_is_taken_over"],
        "a call ended by KeyboardInterrupt (or a thread that ended inside a call) keeps the model's "
        "turn: every other thread's call waits for ever"),
    Mutation(
        "suspend-detach-do-not-wait", "python/layerstream/_handle.py",
        "        turns.enter(frame)\n        try:\n            yield\n        finally:\n            turns.leave(frame)",
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
        "turn-taken-from-a-call-under-way", "python/layerstream/_calls.py",
        "            if f is frame:\n                return True",
        "            if f is frame:\n                return False",
        [P + "test_threads.py::test_a_waiting_call_does_not_take_the_turn_of_a_call_under_way"],
        "a waiting call takes the turn of a call still under way"),
    Mutation(
        "optimizer-step-not-a-write", "python/layerstream/_calls.py",
        "        torch.autograd.graph.increment_version(written)",
        "        pass",
        [P + "test_training.py::test_an_optimizer_step_writing_behind_the_version_counters_is_seen"],
        "with cache_across_steps an optimizer step that writes through .data elements the next step's "
        "sample skips (a bf16 step whose updates mostly round away) leaves them stale in the slots"),
    Mutation(
        "optimizer-step-writes-frozen-weights", "python/layerstream/_calls.py",
        "               if p.grad is not None and any(id(p) in ids for ids in live)",
        "               if any(id(p) in ids for ids in live)",
        [P + "test_training.py::test_an_optimizer_step_writing_behind_the_version_counters_is_seen"],
        "an optimizer step counts the frozen weights it was given as written: with cache_across_steps "
        "they are copied again every step (a LoRA run loses the cache)"),
    Mutation(
        "own-optimizer-step-written-twice", "python/layerstream/_calls.py",
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
    Mutation(
        "compiled-autograd-loses-staged-grads", "python/layerstream/_ops.py",
        "    if stage:\n        _refuse_compiled_autograd()\n",
        "",
        [P + "test_compile.py::test_compiled_autograd_is_refused_for_staged_gradients_and_runs_frozen_layers"],
        "torch._dynamo's compiled autograd traces a staged backward: the weight gradients are never applied"),
    Mutation(
        "layerwise-casting-wrapper-not-replaced", "python/layerstream/_discovery.py",
        "    if wrapper is None or not isinstance(hooks, dict) or list(hooks) != [\"layerwise_casting\"]:",
        "    if True:",
        [P + "test_parity_layers.py::test_diffusers_layerwise_casting_streams_the_storage_dtype_with_the_hooks_numbers"],
        "diffusers' layerwise casting counts as any wrapper: its layers stay resident (a model stored in float8 "
        "for a small GPU does not stream at all)"),
    Mutation(
        "added-tensors-stay-on-the-host", "python/layerstream/_calls.py",
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
        "conv-padding-mode-ignored", "python/layerstream/_forward.py",
        "        return x if self._pad is None else torch.nn.functional.pad(x, self._pad[0], mode=self._pad[1])",
        "        return x",
        [P + "test_parity_layers.py::test_conv_padding_modes_stream_padding_the_input_as_torch_does"],
        "a streamed conv with padding_mode reflect/replicate/circular convolves the unpadded input"),
    Mutation(
        "streamed-layer-copy-refused", "python/layerstream/_attach.py",
        '        a.module.__dict__["__deepcopy__"] = _PlainCopy(a)  # a copy of one layer is a plain module',
        "",
        [P + "test_training.py::test_a_copy_of_one_streamed_layer_is_a_plain_module_so_peft_modules_to_save_trains"],
        "copy.deepcopy() of one streamed layer (peft's modules_to_save) raises \"an offloaded model cannot be "
        "deep-copied\""),
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
        "resident-quantized-keeps-original-values", "python/layerstream/_attach.py",
        "                    o._parameters[k].copy_(values)\n",
        "",
        [P + "test_quant_offload.py::test_a_quantized_layer_the_budget_keeps_resident_computes_with_the_streamed_values"],
        "with quantize= and a budget, a layer the planner keeps resident computes with its unquantized weight"),
    Mutation(
        "ctrl-c-lands-half-way", "python/layerstream/_interrupts.py",
        "            if callable(handler) and getattr(handler, \"__self__\", None) is not self:",
        "            if False:",
        [P + "test_errors.py::test_a_ctrl_c_in_a_tensor_group_call_lands_after_its_slot_is_released",
         P + "test_errors.py::test_a_ctrl_c_as_an_activation_is_stashed_does_not_leak_its_host_copy",
         P + "test_threads.py::test_a_ctrl_c_at_the_turns_lock_leaves_it_free_for_the_next_calls"],
        "a Ctrl-C as a hot path's C++ call returns (a group's fetch, an activation's stash, the turns lock) "
        "lands before its result is owned: a slot or a host copy leaks, the lock stays taken"),
    Mutation(
        "export-lifts-streamed-weights", "python/layerstream/_forward.py",
        "        if torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling():\n            # Non-strict export swaps",
        "        if False:\n            # Non-strict export swaps",
        [P + "test_compile.py::test_an_exported_program_trains_the_parameters_and_exports_quantized_models"],
        "non-strict torch.export lifts streamed weights as constants: no weight gradient reaches them"),
    Mutation(
        "export-lifts-group-tensors", "python/layerstream/_group_op.py",
        "    current = ([o._parameters[k] for o, k in fwd._slots] if torch.compiler.is_exporting() else fwd._params)",
        "    current = fwd._params",
        [P + "test_compile.py::test_an_exported_program_trains_the_parameters_and_exports_quantized_models"],
        "non-strict torch.export lifts a streamed group's tensors as constants: no gradient reaches them"),
    Mutation(
        "standin-refuses-is-conj", "python/layerstream/_standin.py",
        "\"_is_zerotensor\", \"is_conj\", \"is_neg\",",
        "\"_is_zerotensor\",",
        [P + "test_compile.py::test_an_exported_program_trains_the_parameters_and_exports_quantized_models"],
        "torch.export of a quantized model fails: fakifying its packed stand-ins reads is_conj()"),
    Mutation(
        "ddp-around-a-parent-unchecked", "python/layerstream/_calls.py",
        "        if ddp is not self._ddp_checked:",
        "        if False:",
        [P + "test_distributed.py::test_ddp_around_a_parent_of_the_offloaded_module_is_refused_naming_the_fix"],
        "DDP around a parent of the offloaded module reduces the streamed gradients itself: zeros, silently"),
    Mutation(
        "control-harmless-comment", "python/layerstream/_forward.py",
        "class _GroupFn(torch.autograd.Function):",
        "class _GroupFn(torch.autograd.Function):  # (no-op: the anchor check itself)",
        [P + "test_groups.py::test_quantized_group_module"],
        "control: a harmless edit must survive (checks the harness itself)"),
    Mutation(
        "unfrozen-disk-weight-unchecked", "python/layerstream/_forward.py",
        "        if self._frozen:  # only layers with stand-ins pay for the check (the disk tier, GGUF)\n"
        "            self._unfrozen()\n",
        "",
        [P + "test_host_tier.py::test_unfreezing_a_weight_the_disk_tier_streams_is_an_error_at_the_next_forward"],
        "a weight the disk tier streams, unfrozen after offload(), is silently never trained (grad None)"),
    Mutation(
        "lossless-hint-offers-cache-dir", "python/layerstream/_host_plan.py",
        "        quantized = [t.name or \"<root>\" for t in streamed if why[t.name] == [\"quantized\"]]",
        "        quantized = [t.name or \"<root>\" for t in streamed if t.fmt is not None and cache_dir is None]",
        [P + "test_host_tier_quant.py::test_lossless_weights_cannot_stay_on_disk_and_the_error_does_not_offer_cache_dir"],
        "the host-budget error of lossless weights suggests cache_dir=, which cannot keep them on disk"),
    Mutation(
        "in-memory-model-hint-missing", "python/layerstream/_host_plan.py",
        "    if dense:\n",
        "    if False:\n",
        [P + "test_host_tier.py::test_the_error_of_a_model_in_memory_says_how_weights_can_stay_in_their_file"],
        "the host-budget error of a model in memory no longer says to load it with load_safetensors()"),
    Mutation(
        "resident-quant-writes-not-requantized", "python/layerstream/_attach.py",
        "            handle._resident_quant.arm()  # later writes into them are quantized too\n",
        "",
        [P + "test_quant_offload.py::test_writes_into_quantized_layers_the_budget_keeps_resident_are_quantized_too"],
        "a checkpoint loaded into a quantized model: the layers the budget keeps resident compute unquantized"),
    Mutation(
        "resident-quant-call-unchecked", "python/layerstream/_guards.py",
        "            self.refresh(module)",
        "            pass",
        [P + "test_quant_offload.py::test_writes_into_quantized_layers_the_budget_keeps_resident_are_quantized_too"],
        "copy_() into a quantized layer the budget keeps resident: it computes with the unquantized values"),
    Mutation(
        "detach-drops-a-later-wrapper", "python/layerstream/_wrappers.py",
        "    if current is ours or current is None:\n        return \"own\"\n",
        "    if True:\n        return \"own\"\n",
        [P + "test_errors.py::test_a_wrapper_installed_after_offload_keeps_working_after_detach",
         P + "test_errors.py::test_accelerate_cpu_offload_on_an_offloaded_model"],
        "detach() removes a forward wrapper installed after offload() (accelerate's hooks): other outputs, silently"),
    Mutation(
        "detach-keeps-a-wrapper-calling-the-stale-forward", "python/layerstream/_wrappers.py",
        "    if places and not fixed:\n        return places\n",
        "    if True:\n        return places\n",
        [P + "test_misuse.py::test_detach_refuses_a_wrapper_that_keeps_the_streamed_forward_out_of_reach"],
        "detach() goes ahead under a wrapper that keeps the streamed forward where it cannot be put back"),
    Mutation(
        "detach-rebuilds-weights-after-letting-go", "python/layerstream/_handle.py",
        "        restored = self._restored_weights(engine)\n"
        "        if self._suspended is not None:  # the resident parts back; no slots for detach\n"
        "            self._move_back()\n"
        "            self._end_suspension()\n"
        "        devices = [a.devices[0] for a in self._attached]\n"
        "        engine.detach(devices)\n",
        "        if self._suspended is not None:  # the resident parts back; no slots for detach\n"
        "            self._move_back()\n"
        "            self._end_suspension()\n"
        "        devices = [a.devices[0] for a in self._attached]\n"
        "        engine.detach(devices)\n"
        "        restored = self._restored_weights(engine)\n",
        [P + "test_misuse.py::test_a_failure_while_detach_rebuilds_the_weights_changes_nothing"],
        "detach() rebuilds the quantized weights after the engine let go: a failure leaves them data-less for good"),
    Mutation(
        "self-overlapping-weight-streamed", "python/layerstream/_offload.py",
        "    _check_no_self_overlap(candidates)\n",
        "",
        [P + "test_misuse.py::test_a_parameter_whose_memory_overlaps_itself_is_refused"],
        "an expand()ed (stride 0) weight streams; detach() cannot write it back in its layout"),
    Mutation(
        "quantize-pattern-typo-silent", "python/layerstream/_offload.py",
        "        _warn_unmatched(model, stacklevel=3, quantize=list(quantize))\n",
        "        pass\n",
        [P + "test_misuse.py::test_a_quantize_pattern_that_names_no_module_is_warned"],
        "a quantize={pattern: format} typo quantizes nothing, silently"),
    Mutation(
        "part-of-model-conversion-unchecked", "python/layerstream/_attach.py",
        "    handle._subtree_checks = install_subtree_checks(\n",
        "    handle._subtree_checks = [] or (lambda *a: [])(\n",
        [P + "test_misuse.py::test_a_refused_conversion_of_a_part_of_the_model_changes_nothing_and_a_copy_of_it_is_plain"],
        "model.blocks[0].half() converts the block's resident layers before its streamed Linear refuses"),
    Mutation(
        "compat-parent-detach-leaves-child-manager", "python/layerstream/compat.py",
        "                if getattr(m.module, \"__dict__\", {}).get(\"_memory_manager\") is m:\n",
        "                if False:\n",
        [P + "test_compat.py::test_detach_of_a_parent_hands_back_a_child_given_to_attach_whole"],
        "MemoryManager.detach(parent) leaves a dead manager on a child given to attach(): re-attach streams nothing"),
    Mutation(
        "compat-wrapper-calls-released-engine", "python/layerstream/compat.py",
        "            if args or kwargs or self.manager.engine is None:\n",
        "            if args or kwargs:\n",
        [P + "test_compat.py::test_a_wrapper_installed_after_attach_calls_the_layers_own_forward_after_detach"],
        "a wrapper installed after MemoryManager.attach crashes after detach (the released engine)"),
    Mutation(
        "compat-attaches-file-weights", "python/layerstream/compat.py",
        "        if in_file:\n            raise LayerstreamError(\n",
        "        if False:\n            raise LayerstreamError(\n",
        [P + "test_compat.py::test_a_model_whose_weights_are_still_in_their_file_is_refused_naming_offload"],
        "MemoryManager.attach of a load_safetensors() model fails with torch's meta-tensor error"),
    Mutation(
        "compat-part-of-model-conversion-unchecked", "python/layerstream/compat.py",
        "        self._subtree_checks = install_subtree_checks(self.module,",
        "        self._subtree_checks = (lambda *a: [])(self.module,",
        [P + "test_compat.py::test_a_refused_conversion_of_a_part_of_the_model_changes_nothing"],
        "compat: model[0].half() converts the block's resident layers before its streamed Linear refuses"),
    Mutation(
        "detach-misses-a-hook-objects-forward", "python/layerstream/_wrappers.py",
        "            if callable(x) or (type(getattr(x, \"__dict__\", None)) is dict and not isinstance(x, torch.Tensor)):\n",
        "            if callable(x):\n",
        [P + "test_errors.py::test_a_diffusers_hook_installed_after_offload_keeps_working_after_detach"],
        "detach() under a diffusers hook: the hook keeps calling the stale streamed forward (every call raises)"),
    Mutation(
        "safetensors-file-dtype-of-the-last-tensor", "python/layerstream/_safetensors.py",
        "                                                    file_dtype=_DTYPES[rec[\"dtype\"]]))\n",
        "                                                    file_dtype=dtype))\n",
        [P + "test_host_tier.py::test_each_weight_left_in_the_file_is_read_in_its_own_dtype"],
        "every FileWeight takes the dtype of the checkpoint's last tensor: bf16 bytes decoded as fp16, silently"),
    Mutation(
        "file-weight-read-any-byte-count", "python/layerstream/_file_weight.py",
        "        if r.bytes != out.nbytes:",
        "        if False:",
        [P + "test_host_tier.py::test_file_weight_read_refuses_a_byte_count_its_dtype_does_not_need"],
        "FileWeight.read() decodes a prefix of its range in the wrong dtype when file_dtype disagrees with the file"),
    Mutation(
        "file-weight-read-in-as-a-new-parameter", "python/layerstream/_host_plan.py",
        "        torch.utils.swap_tensors(p, new)\n",
        "        from ._loading import put, tensor_slots\n        put(tensor_slots(model)[1].get(id(p), []), p, new)\n"
        "        return new\n",
        [P + "test_host_tier.py::test_an_optimizer_built_before_offload_steps_the_weights_read_from_the_file"],
        "offload() puts a new Parameter in place of each FileWeight: an optimizer built before it never trains them"),
    Mutation(
        "file-weight-read-in-walks-the-model", "python/layerstream/_host_plan.py",
        "        torch.utils.swap_tensors(p, new)\n",
        "        torch.utils.swap_tensors(p, new)\n        list(model.named_modules(remove_duplicate=False))\n",
        [P + "test_host_tier.py::test_offload_of_a_file_loaded_model_walks_it_as_often_whatever_its_layer_count"],
        "offload() walks the whole model for each weight it reads from a file: time quadratic in the layer count"),
    Mutation(
        "gguf-casts-float-and-integer", "python/layerstream/_gguf.py",
        "        if not rec[\"format\"]:\n            check_kind(",
        "        if False:\n            check_kind(",
        [P + "test_gguf.py::test_a_float_tensor_and_an_integer_one_do_not_load_into_each_other_with_either_loader"],
        "load_gguf() casts a float tensor into an integer buffer (0.7 -> 0) and back, silently"),
    Mutation(
        "loaders-cast-float-and-integer", "python/layerstream/_loading.py",
        "    if file_dtype.is_floating_point != target.dtype.is_floating_point and target.dtype != torch.bool:\n",
        "    if False:\n",
        [P + "test_gguf.py::test_a_float_tensor_and_an_integer_one_do_not_load_into_each_other_with_either_loader"],
        "neither loader refuses a float tensor for an integer one (or the reverse): truncated or cast, silently"),
    Mutation(
        "group-recompute-differentiates-under-autocast", "python/layerstream/_group_op.py",
        "        with torch.enable_grad(), fwd.fetched(needs[n_in + n_ex:], experts, bind(adapters, ex)) as views:\n",
        "        with torch.enable_grad(), torch.autocast(dev.type, dtype=autocast[1], enabled=autocast[0]), \\\n"
        "                fwd.fetched(needs[n_in + n_ex:], experts, bind(adapters, ex)) as views:\n",
        [P + "test_groups.py::test_a_group_with_an_fp32_region_trains_under_autocast_exactly",
         P + "test_attention.py::test_transformer_encoder_trains_under_autocast_exactly"],
        "a group's backward recompute differentiates inside the forward's autocast state (bf16 backward ops)"),
    Mutation(
        "group-recompute-writes-buffers", "python/layerstream/_group_op.py",
        "            o._buffers[k] = copies[id(b)]\n",
        "            pass\n",
        [P + "test_groups.py::test_a_groups_buffers_are_written_once_per_training_step"],
        "a group's backward recompute writes its BatchNorm running stats again (each batch counted twice)"),
    Mutation(
        "group-recompute-reads-buffers-after-forward", "python/layerstream/_group_op.py",
        "                written[(id(o), k)] = value\n",
        "                pass\n",
        [P + "test_groups.py::test_a_groups_buffers_are_written_once_per_training_step"],
        "a group's recompute starts from the buffers its forward wrote, not the values the forward read"),
    Mutation(
        "group-saves-an-input-per-position", "python/layerstream/_forward.py",
        "        ctx.save_for_backward(*distinct.values())\n",
        "        ctx.where = list(range(len(tensors)))\n        ctx.save_for_backward(*tensors)\n",
        [P + "test_attention.py::test_self_attention_under_non_reentrant_checkpoint_trains_exactly"],
        "a group saves a tensor passed at several positions once per position (non-reentrant checkpoint: "
        "attention's query is not key in the recompute)"),
    Mutation(
        "mha-computed-out-proj-streams", "python/layerstream/_discovery.py",
        "        owners.append((\"out_proj.\", module.out_proj))\n",
        "        pass\n",
        [P + "test_errors.py::test_attention_whose_out_proj_weight_is_computed_stays_resident"],
        "attention whose out_proj weight is weight_norm'd streams as a group: the parametrization's originals get no gradient"),
    Mutation(
        "non-parameter-bias-streams", "python/layerstream/_discovery.py",
        "names = _MHA_TENSORS if isinstance(owner, nn.MultiheadAttention) else (\"weight\", \"bias\")",
        "names = _MHA_TENSORS if isinstance(owner, nn.MultiheadAttention) else (\"weight\",)",
        [P + "test_errors.py::test_layer_whose_bias_or_weight_is_not_its_own_parameter_stays_resident"],
        "a pruned bias or a bias buffer streams, and every call fails claiming the parameters were replaced"),
    Mutation(
        "float64-linear-streams", "python/layerstream/_discovery.py",
        "        dtype = _activation_dtype(module, kind)\n",
        "        dtype = None\n",
        [P + "test_errors.py::test_layers_of_a_dtype_streamed_layers_refuse_stay_resident"],
        "a float64 Linear/conv streams without a word, then every forward fails (Double input)"),
    Mutation(
        "rnn-recommended-for-groups", "python/layerstream/_discovery.py",
        "    rnn = [n for n, (_, m) in held.items() if any(isinstance(sub, nn.RNNBase) for sub in m.modules())]\n",
        "    rnn = []\n",
        [P + "test_misuse.py::test_a_large_rnn_is_said_to_stay_resident_not_sent_to_groups"],
        "the warning for a large LSTM recommends groups=, which refuses it"),
    Mutation(
        "quantize-fp8-alias-refused", "python/layerstream/_prequant.py",
        "        name = _C.quant_format(fmt)\n",
        "        name = fmt.lower() if fmt.lower() in _C.quant_formats() else _C.quant_format(\"q4_k\")\n",
        [P + "test_quant_offload.py::test_fp8_by_its_other_names_and_none_are_read_as_the_engine_reads_them"],
        "quantize=\"e4m3\" / \"fp8_e4m3\" refused as GGUF formats though C++'s parse_format takes them"),
    Mutation(
        "device-auto-sim-fallback-silent", "python/layerstream/_offload.py",
        "    if opts.device == \"auto\" and resolved == \"sim\":",
        "    if device is None and resolved == \"sim\":",
        [P + "test_misuse.py::test_device_auto_without_cuda_warns_why_as_no_device_does"],
        "offload(device=\"auto\") falls back to the sim device without the warning device=None gives"),
    Mutation(
        "to-empty-after-offload-not-refused", "python/layerstream/_guards.py",
        "        module.to_empty = _NoToEmpty(module, f\"'{name}'\" if name else \"the offloaded model\")",
        "        module.to_empty = _NoToEmpty(module, None)",
        [P + "test_misuse.py::test_to_empty_after_offload_is_refused_before_anything_changes"],
        "model.to_empty(device=<compute device>) after offload(): resident tensors become uninitialised memory"),
    Mutation(
        "too-small-advises-quantizing-as-stored", "python/layerstream/_offload.py",
        "as_stored=[i for i, t in enumerate(layers) if t.name in as_stored],",
        "as_stored=[],",
        [P + "test_quant_offload.py::test_a_budget_too_small_suggests_quantizing_only_a_layer_it_applies_to"],
        "\"budget too small\" tells to quantize a largest layer quantize= does not apply to (a tied head)"),
    Mutation(
        "readme-usage-streams-nothing", "README.md",
        "    budget=\"16MiB\",         # every weight on the device",
        "    budget=\"64MiB\",         # every weight on the device",
        [P + "test_readme.py::test_the_usage_example_streams_more_layers_than_its_slots_hold"],
        "the README's first example keeps its whole model resident: it shows nothing streamed"),
    Mutation(
        "compiled-layer-skips-replaced-check", "python/layerstream/_forward.py",
        "            self._check_own()\n        grad = torch.is_grad_enabled()",
        "            pass\n        grad = torch.is_grad_enabled()",
        [P + "test_compile.py::test_parameters_replaced_after_offload_raise_under_compile_as_eagerly"],
        "a compiled call streams the original weights after load_state_dict(assign=True) or a new "
        "nn.Parameter (eager raises; the new parameters get no gradient)"),
    Mutation(
        "compiled-group-skips-replaced-check", "python/layerstream/_forward.py",
        "                raise LayerstreamError(_REPLACED.format(name=self._name))\n            if self._adapted:",
        "                pass\n            if self._adapted:",
        [P + "test_compile.py::test_parameters_replaced_after_offload_raise_under_compile_as_eagerly"],
        "a compiled nn.MultiheadAttention group traced after load_state_dict(assign=True) streams the "
        "original weights (and its fake kernel puts them back into the module)"),
    Mutation(
        "export-skips-replaced-check", "python/layerstream/_forward.py",
        "            self._check_own((weight, bias))\n",
        "            pass\n",
        [P + "test_compile.py::test_exporting_a_model_whose_parameters_were_replaced_raises"],
        "non-strict torch.export after load_state_dict(assign=True) exports a program that streams "
        "the original weights"),
    Mutation(
        "export-with-activation-offload-unrefused", "python/layerstream/_activations.py",
        "        if torch.compiler.is_exporting():\n            _not_exported()\n",
        "",
        [P + "test_compile.py::test_exporting_a_model_with_activation_offload_says_to_offload_it_without"],
        "torch.export of a model with activations= fails with torch's data-pointer error (non-strict) "
        "or the torch.compile advice (strict)"),
    Mutation(
        "group-call-ctrl-c-not-held", "python/layerstream/_forward.py",
        "            with held_interrupts():\n                token, views = self._engine.fetch(",
        "            if True:\n                token, views = self._engine.fetch(",
        [P + "test_errors.py::test_a_ctrl_c_in_a_tensor_group_call_lands_after_its_slot_is_released"],
        "a Ctrl-C as a tensor group's fetch() returns leaks the slot's token (all slots held, detach refused)"),
    Mutation(
        "activation-stash-ctrl-c-not-held", "python/layerstream/_activations.py",
        "        with held_interrupts():\n            token = engine.stash_activation(t)",
        "        if True:\n            token = engine.stash_activation(t)",
        [P + "test_errors.py::test_a_ctrl_c_as_an_activation_is_stashed_does_not_leak_its_host_copy"],
        "a Ctrl-C as an activation is stashed leaks its host copy"),
    Mutation(
        "turns-lock-ctrl-c-not-held", "python/layerstream/_calls.py",
        "        with held_interrupts() as interrupted, self._cond:\n",
        "        with contextlib.nullcontext([]) as interrupted, self._cond:\n",
        [P + "test_threads.py::test_a_ctrl_c_at_the_turns_lock_leaves_it_free_for_the_next_calls"],
        "a Ctrl-C at the call turns' lock leaves it taken: every later call waits for ever"),
    Mutation(
        "already-offloaded-names-no-way-back", "python/layerstream/_discovery.py",
        "        back = (f\"call detach() on that handle first (the one offload() returned; if it was not kept: \"\n"
        "                f\"{path}._layerstream_handle.detach())\")\n",
        "        back = \"call detach() on that handle first\"\n",
        [P + "test_misuse.py::test_a_model_offloaded_by_a_dropped_handle_names_the_way_back"],
        "offload() of a model whose handle was dropped says to detach 'that handle', which the user no longer has"),
    Mutation(
        "gguf-tied-weight-untied-at-offload", "python/layerstream/_formats.py",
        "    _dequantize_tied_gguf(model)\n",
        "",
        [P + "test_gguf.py::test_a_gguf_weight_tied_to_an_embedding_stays_tied_and_trains_like_the_resident_model"],
        "a GGUF weight tied to an embedding table comes apart at offload(): each holder gets its own copy"),
    Mutation(
        "compat-attach-streams-float64", "python/layerstream/compat.py",
        "    if reason is None and _activation_dtype(module, kind) is not None:\n",
        "    if False:\n",
        [P + "test_compat.py::test_a_float64_layer_stays_resident_under_attach_as_under_offload"],
        "compat's attach streams a float64 Linear, which then refuses its input at every call"),
    Mutation(
        "compat-to-float64-not-refused", "python/layerstream/compat.py",
        "        if dtype is not None and self._layers and not _takes_activations(dtype):\n",
        "        if False:\n",
        [P + "test_compat.py::test_converting_an_attached_model_to_float64_is_refused_before_anything_changes"],
        "model.to(torch.float64) after compat's attach streams the layers again in float64: every call fails"),
    Mutation(
        "group-fake-restores-offload-tensors", "python/layerstream/_group_op.py",
        "        for (o, k), p in zip(fwd._slots, held):\n",
        "        for (o, k), p in zip(fwd._slots, fwd._params):\n",
        [P + "test_attention.py::test_an_exported_attention_called_twice_gets_both_calls_gradients"],
        "a group's fake kernel puts offload()'s tensors back where export had its parameter inputs: a second "
        "call of the group is exported with constants and its gradients are lost"),
    Mutation(
        "multiprocessing-share-of-streamed-unrefused", "python/layerstream/_guards.py",
        "        if i and self.ranges[i - 1][1] > start:",
        "        if False:",
        [P + "test_ddp_rules.py::test_sending_a_streamed_parameter_through_torch_multiprocessing_is_refused_and_the_model_keeps_its_numbers"],
        "a state_dict sent through torch.multiprocessing moves streamed storages away from the engine; the next call names module.to()"),
    Mutation(
        "only-ctrl-c-held-in-offload", "python/layerstream/_interrupts.py",
        "        for s in signal.valid_signals() if self._signals is None else self._signals:\n",
        "        for s in [signal.SIGINT]:\n",
        [P + "test_interrupts.py::test_a_timeout_signal_anywhere_in_offload_lands_with_the_model_as_it_was",
         P + "test_interrupts.py::test_a_timeout_signal_anywhere_in_detach_lands_after_it"],
        "a timeout's SIGALRM exception as offload()'s engine.add_* or detach()'s engine.detach() returns leaves a "
        "model neither streamed nor plain"),
    Mutation(
        "detach-stops-at-a-failed-step", "python/layerstream/_handle.py",
        "        except BaseException as e:  # raised below, after the other steps\n            errors.append(e)\n",
        "        except BaseException as e:  # raised below, after the other steps\n            raise\n",
        [P + "test_interrupts.py::test_a_step_of_detach_that_raises_after_the_engine_let_go_does_not_stop_the_others"],
        "a step of detach() that raises after engine.detach() leaves the later modules streaming from a detached "
        "engine"),
    Mutation(
        "stale-signal-recorder-swallows", "python/layerstream/_interrupts.py",
        "        if not self._holding(frame):",
        "        if False:",
        [P + "test_interrupts.py::test_a_timeout_signal_anywhere_in_detach_lands_after_it"],
        "a timeout's exception as a signal holder's __exit__ is entered leaves its recorder in place: every later "
        "Ctrl-C is swallowed"),
    Mutation(
        "lossless-write-advises-requantizing-copy", "python/layerstream/_packed.py",
        "        if ls[4] == \"lossless\":\n            # Its coded size",
        "        if False:\n            # Its coded size",
        [P + "test_packed_advice.py::test_a_write_into_a_frozen_lossless_weight_advises_detach_change_offload"],
        "a write into a frozen lossless weight advises load_state_dict()/copy_(), which are refused for it"),
    Mutation(
        "quantize-pattern-inside-group-ignored", "python/layerstream/_formats.py",
        "    _check_quantize_inside_groups(candidates, quantize)\n",
        "",
        [P + "test_group_patterns.py::test_quantize_naming_an_attention_out_proj_is_an_error_naming_the_attention",
         P + "test_group_patterns.py::test_quantize_naming_a_child_of_a_groups_module_is_an_error"],
        "quantize={pattern: format} naming a module inside a tensor group is silently ignored"),
    Mutation(
        "exclude-pattern-inside-group-ignored", "python/layerstream/_discovery.py",
        "        _check_exclude_inside_groups(candidates, exclude)\n",
        "        pass\n",
        [P + "test_group_patterns.py::test_exclude_naming_an_attention_out_proj_is_an_error",
         P + "test_group_patterns.py::test_exclude_naming_a_child_of_a_groups_module_is_an_error"],
        "exclude= naming a module inside a tensor group is silently ignored (it streams with the group)"),
    Mutation(
        "quantized-group-detach-loses-strides", "python/layerstream/_attach.py",
        "            a.strides = {part: tuple(params[part].stride()) for _, part, _, _ in a.packed_parts if not gguf[part]}\n",
        "",
        [P + "test_detach_quantized.py::test_a_quantized_tensor_group_keeps_its_layout_after_detach"],
        "detach() gives a quantized tensor group's channels_last convs back contiguous"),
    Mutation(
        "detach-ignores-dequant-dtype", "python/layerstream/_handle.py",
        "    if dequant is not None and dequant != w.dtype:\n        w = w.to(dequant).to(w.dtype)\n",
        "",
        [P + "test_detach_quantized.py::test_detach_gives_the_same_quantized_weights_whatever_the_budget"],
        "with a dequant_dtype, detach() of a streamed quantized layer gives other weights than a resident one's "
        "(the budget changes the numbers)"),
    Mutation(
        "offload-plans-tied-layers-apart", "python/layerstream/_offload.py",
        "fixed_train_bytes=fixed_train, ties=ties,\n",
        "fixed_train_bytes=fixed_train,\n",
        [P + "test_planner_ties.py"],
        "offload(budget=) plans two layers sharing a weight as unrelated ones: the weight counted twice, and "
        "handle.plan / stats() report one resident where both are"),
    Mutation(
        "group-forward-graph-leaks", "python/layerstream/_group_op.py",
        "saved_tensors_hooks(torch.Tensor.detach, _as_is)",
        "saved_tensors_hooks(_as_is, _as_is)",
        [P + "test_attention.py::test_training_steps_with_a_streamed_attention_leave_no_graph_behind"],
        "a group's forward without a graph saves its tensors with their grad_fn: attention's graph is a reference "
        "cycle Python's collector does not see, and every training step leaks its graphs"),
    Mutation(
        "group-recompute-input-always-a-leaf", "python/layerstream/_group_op.py",
        "                seen[id(t)] = c if leaf is None or leaf[i] or not r else c.view_as(c)\n",
        "                seen[id(t)] = c\n",
        [P + "test_autocast_cache.py::test_a_group_using_its_input_twice_trains_under_autocast_exactly"],
        "a group's recompute takes an activation input as a leaf: autocast casts it once and sums its uses' "
        "gradients in bf16, where the resident module casts at each use and sums in fp32"),
    Mutation(
        "group-recompute-ignores-cast-cache-setting", "python/layerstream/_group_op.py",
        "enabled=autocast[0]), _cast_cache(autocast[2]), \\\n",
        "enabled=autocast[0]), \\\n",
        [P + "test_autocast_cache.py::test_a_group_using_its_input_twice_trains_under_autocast_exactly"],
        "a group's recompute runs with autocast's cast cache on after a forward under cache_enabled=False: "
        "a leaf input used twice is cast once, its gradients summed in bf16"),
    Mutation(
        "group-forward-caches-casts", "python/layerstream/_group_op.py",
        "_as_is), _cast_cache(False):\n",
        "_as_is):\n",
        [P + "test_autocast_cache.py::test_a_group_trained_under_autocast_holds_no_cast_of_its_weights_for_the_region"],
        "a group's training forward under autocast leaves autocast's cache holding a bf16 copy of its weights "
        "until the region exits: a model's worth of weights on the device outside the budget"),
    Mutation(
        "refused-offload-keeps-groups-marks", "python/layerstream/_offload.py",
        "    except BaseException:\n        unmark_groups(model, grouped)\n        raise\n",
        "    except BaseException:\n        raise\n",
        [P + "test_loose_ends.py::test_a_refused_offload_leaves_no_groups_marks"],
        "offload(groups=...) refused after discovery (budget too small, a bad option, Ctrl-C) leaves its marks: a "
        "later offload() of the model says a module streams whole because of groups= it was not given"),
    Mutation(
        "tied-table-resident-uncounted", "python/layerstream/_offload.py",
        "                plan[\"held_tables\"].update({n: held_by for n in group if n not in resident_names})\n",
        "                pass\n",
        [P + "test_loose_ends.py::test_a_table_resident_with_its_tied_head_is_in_the_plan_and_stats"],
        "a table resident with its tied head is left out of stats()['resident_layers'] and handle.plan"),
    Mutation(
        "pickle-refusal-hides-the-truncated-file", "python/layerstream/_forward.py",
        "\"detach()); torch.save(model, path) has already truncated `path`, so a checkpoint that was \"",
        "\"detach()); \"",
        [P + "test_resume_order.py::test_torch_save_of_an_offloaded_model_says_that_the_file_it_writes_is_lost"],
        "torch.save(model, path) of an offloaded model is refused after torch.save truncated `path`, and the "
        "message does not say that the checkpoint there is lost"),
    Mutation(
        "root-apply-holds-its-model", "python/layerstream/_guards.py",
        "        self._model_ref, self._layers = weakref.ref(model), layers\n",
        "        self._model_ref, self._layers = (lambda: model), layers\n",
        [P + "test_del_frees.py"],
        "the _apply offload() installs on the model holds it strongly: a dropped model, its optimizer and "
        "handle keep the engine (4 threads, host store, device slots) until the cyclic collector runs"),
    Mutation(
        "activation-compiled-before-keeps-hookless-graph", "python/layerstream/_activations.py",
        '            model.__dict__["forward"] = self._forward\n',
        "",
        [P + "test_activation_hooks.py::test_a_model_compiled_before_offload_offloads_its_activations"],
        "a model compiled before offload(activations=...) keeps its graph without the hooks: its compiled calls "
        "offload nothing, silently"),
    Mutation(
        "activation-scope-shared-by-threads", "python/layerstream/_activations.py",
        "class _Scope(threading.local):",
        "class _Scope:",
        [P + "test_activation_hooks.py::test_a_call_beginning_as_another_thread_s_call_ends_opens_its_own_scope"],
        "one activation scope depth for all threads: a call beginning as another thread's ends is not offloaded, "
        "and leaves that thread's saved-tensor hooks (torch's INTERNAL ASSERT, a thread offloading for good)"),
    Mutation(
        "activation-forward-holds-its-model", "python/layerstream/_activations.py",
        "            self._root, self._forward = weakref.ref(model), _OwnForward(type(model).forward, model)",
        "            self._root, self._forward = weakref.ref(model), model.forward",
        [P + "test_del_frees.py::test_dropping_the_model_its_optimizer_and_handle_frees_the_engine_without_gc",
         P + "test_activation_hooks.py::test_the_forward_offload_sets_on_the_model_reads_as_its_bound_method"],
        "the forward activation offload puts in the model's __dict__ is a bound method: a dropped model keeps its "
        "engine until gc"),
    Mutation(
        "activation-detach-keeps-other-threads-hooks-live", "python/layerstream/_activations.py",
        "        self.engine, self._scope, self._held = None, _Scope(), set()\n",
        "",
        [P + "test_activation_threads.py::"
             "test_after_detach_a_thread_whose_forward_was_interrupted_saves_as_plain_torch"],
        "after detach() the hooks a forward interrupted on another thread left there still reach the engine: every "
        "later save on that thread fails (\"handle was detached\"), and they keep the engine and the model alive"),
    Mutation(
        "activation-kept-tensor-keeps-its-graph", "python/layerstream/_activations.py",
        "        t = t.detach()\n        self.tensor = t",
        "        self.tensor = t",
        [P + "test_activations.py::test_a_forward_without_backward_frees_its_graph_when_a_saved_output_is_kept_as_"
             "it_is"],
        "a saved tensor activation offload keeps as it is holds its autograd history: a forward without backward "
        "whose output is saved keeps its graph (a cycle gc does not free)"),
    Mutation(
        "file-standin-data-is-a-plain-meta-tensor", "python/layerstream/_standin.py",
        "                return self  # metadata reads through it work; writes reach the refusals below\n",
        "                return cls._common(func, types, args, kwargs)\n",
        [P + "test_standin_writes.py"],
        "a FileWeight's / GgufWeight's .data is a plain meta tensor: writes through it (peft's merge_and_unload()) "
        "are dropped without a word and the file's values stream"),
    Mutation(
        "quantize-silently-skips-gguf-layers", "python/layerstream/_formats.py",
        "        fmt = _quant_for(name, quantize)\n        if pre is not None:",
        "        fmt = _quant_for(name, quantize) if pre is None else None\n        if pre is not None:",
        [P + "test_gguf.py::test_quantize_over_gguf_layers_warns_that_they_stream_as_stored",
         P + "test_gguf.py::test_quantize_dict_naming_a_gguf_layer_is_refused"],
        "quantize= over layers load_gguf() kept packed is ignored without a word, even a dict naming the layer: "
        "they stream their GGUF blocks"),
    Mutation(
        "train-plan-counts-inference-copies", "python/layerstream/_offload.py",
        "                                   training=bool(train_spec), fixed_train_bytes=fixed_train, ties=ties,",
        "                                   fixed_train_bytes=fixed_train, ties=ties,",
        [P + "test_optim.py::test_train_budget_covers_the_resident_weights_gradients_and_states"],
        "offload(train=...) plans an inference pass's copies per step (the backward's second crossing uncounted)"),
    Mutation(
        "peft-patch-holds-its-wrapper", "python/layerstream/_peft_params.py",
        "                w._activate_lora = _Activate(w, fwd)\n",
        "                w._activate_lora = functools.partial(_activate, w, fwd)\n",
        [P + "test_del_frees.py::test_a_model_with_peft_lora_on_a_groups_tensors_is_freed_without_gc"],
        "the _activate_lora patched on a peft wrapper over a streamed group holds the wrapper: a dropped model "
        "keeps its experts, handle and engine until gc"),
    Mutation(
        "peft-copy-keeps-the-original-patch", "python/layerstream/_peft_params.py",
        "        return self if copied is None else _Activate(copied)\n",
        "        return self\n",
        [P + "test_experts.py::test_a_copy_of_a_lora_wrapper_over_streamed_experts_computes_with_its_own_adapters"],
        "a deep copy of a peft wrapper over streamed experts keeps the original's patch: it applies the original "
        "wrapper's adapters, silently"),
    Mutation(
        "peft-copy-patch-blocks-offload", "python/layerstream/_peft_params.py",
        '    return patch is not None and getattr(patch, "_fwd", True) is not None\n',
        "    return patch is not None\n",
        [P + "test_experts.py::test_a_copy_of_a_lora_wrapper_over_streamed_experts_computes_with_its_own_adapters"],
        "a copied peft wrapper (its patch without a group forward) is not patched when its model is offloaded: "
        "peft parametrizes the host tensor"),
    Mutation(
        "compat-manager-holds-its-model", "python/layerstream/compat.py",
        "        self._module = weakref.ref(module)\n        self.process_device",
        "        self._module = (lambda: module)\n        self.process_device",
        [P + "test_del_frees.py::test_a_model_attached_by_compat_is_freed_without_gc"],
        "layerstream.compat's MemoryManager holds its model strongly (the model holds it): a dropped model keeps "
        "its engine and threads until gc"),
    Mutation(
        "held-signals-keep-their-recorder", "python/layerstream/_interrupts.py",
        "        self._received = []  # (handler, signal, frame) in order of arrival, each signal once\n",
        "        self._received = []  # (handler, signal, frame) in order of arrival, each signal once\n"
        "        self._recorder = self._record\n",
        [P + "test_del_frees.py::test_holding_signals_leaves_nothing_to_the_cyclic_collector"],
        "a HeldSignals keeps its recorder (a bound method of itself): every held block, on the hot paths too, "
        "leaves a cycle to the cyclic collector"),
    Mutation(
        "peft-base-readers-only-dora", "python/layerstream/_discovery.py",
        "    label = _PEFT_BASE_READERS.get(parts[2]) if parts[:2]",
        "    label = None and _PEFT_BASE_READERS.get(parts[2]) if parts[:2]",
        [P + "test_peft_adapters.py::test_peft_adapters_that_read_their_base_weight_keep_it_resident_at_offload"],
        "only DoRA's base layers stay resident: HRA, DeFT (a bias), MiSS 'bat' and the other peft adapters whose "
        "forward reads the base weight stream it, unwarned (on a GPU the adapter meets host tensors)"),
    Mutation(
        "peft-base-reader-added-after-offload-unchecked", "python/layerstream/_calls.py",
        "        _check_no_base_readers(model, self._skip_modules)  # refused: the next call looks again\n",
        "",
        [P + "test_peft_adapters.py::test_dora_added_after_offload_is_refused_at_the_first_call_naming_the_adapter",
         P + "test_peft_adapters.py::test_hra_added_after_a_quantized_offload_is_refused_naming_hra"],
        "a DoRA/HRA adapter added after offload() computes with its streamed base layer's host weights (on a GPU "
        "torch's device mismatch; quantized, the stand-in's refusal naming no adapter)"),
    Mutation(
        "packed-refusal-names-no-peft-caller", "python/layerstream/_packed.py",
        "        caller = _peft_caller()\n        if caller is not None:\n            return _peft_refusal(ls, what, "
        "caller, cast_yet)\n",
        "",
        [P + "test_peft_adapters.py::test_qdora_over_a_quantized_offload_is_refused_naming_dora"],
        "QDoRA's get_peft_model() over a quantized offload fails with 'cannot be converted or moved (to())' and "
        "advice about load_state_dict and merges, naming no adapter"),
    Mutation(
        "kbit-prepare-casts-before-refusal", "python/layerstream/_packed.py",
        '                and _peft_caller() == ("kbit", ""):',
        '                and _peft_caller() == ("never", ""):',
        [P + "test_peft_adapters.py::"
             "test_prepare_model_for_kbit_training_after_a_quantized_offload_is_refused_before_casting"],
        "prepare_model_for_kbit_training() after offload(quantize=...) casts the embedding to float32 before a "
        "packed weight refuses the cast: the model is left half-converted and its next call fails"),
    Mutation(
        "host-budget-error-says-all-in-memory", "python/layerstream/_host_plan.py",
        "        else:\n            hint += _in_ram_hint(model, streamed, entries, why)\n",
        "        elif not in_file:\n            hint += (\" (this model's weights are all in memory already: build the "
        "model on the meta device and load it with load_safetensors())\")\n",
        [P + "test_host_tier.py::"
             "test_the_host_budget_error_of_a_gpt2_loaded_by_load_safetensors_names_what_stays_in_ram",
         P + "test_host_tier.py::test_the_error_of_a_model_in_memory_says_how_weights_can_stay_in_their_file"],
        "the host budget error of a GPT-2 loaded by load_safetensors() says to load it with load_safetensors(), "
        "not that its Conv1D groups, tables and tied head stay in RAM whatever loads them"),
    Mutation(
        "meta-refusal-ignores-partial-load", "python/layerstream/_discovery.py",
        "    if all(p.is_meta and not isinstance(p, (_PackedWeight, GgufWeight, FileWeight)) for p in params):\n",
        "    if True:\n",
        [P + "test_host_tier.py::test_offload_after_a_partial_load_names_the_weights_the_load_left_out",
         P + "test_host_tier.py::"
             "test_offload_of_non_persistent_buffers_left_meta_says_to_build_under_init_empty_weights"],
        "a weight load_safetensors(strict=False) left out is refused as a model built without weights (load real "
        "weights, from_pretrained), not as the one weight the load missed"),
    Mutation(
        "meta-refusal-names-no-layerstream-loader", "python/layerstream/_discovery.py",
        '            f"them with layerstream.load_safetensors(model, path) (a .safetensors file, or a transformers or "',
        '            f"them with from_pretrained (a .safetensors file, or a transformers or "',
        [P + "test_host_tier.py::test_offload_of_a_model_built_on_meta_names_load_safetensors_and_load_gguf"],
        "the refusal of a meta model names from_pretrained and to_empty(), not load_safetensors() / load_gguf(), "
        "the loaders for meta models"),
    Mutation(
        "device-plan-host-line-as-if-pinned", "python/layerstream/_handle.py",
        "        explain = self._plan[\"explain_host_budget\" if self.host_plan else \"explain\"]",
        "        explain = self._plan[\"explain\"]",
        [P + "test_host_tier.py::test_with_a_host_budget_the_device_plan_says_its_pinned_ram_is_without_one"],
        "handle.plan under a host budget says the streamed layers' RAM is pinned, though they stay in their file"),
]
