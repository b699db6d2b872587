"""Bugs planted in the Python layer (python/layerstream), continued: python.py holds the
earlier entries (at ~900 lines it is full), python_optim.py the optimizers' and the
several-process wiring's."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS: list = [
    Mutation(
        "resident-quant-requantizes-its-own-values", "python/layerstream/_guards.py",
        "            if _C.tensor_checksum(p) != checksum:  # new values (a write of its own ones stays as it is)",
        "            if True:",
        [P + "test_quant_offload.py::test_loading_its_own_state_dict_into_a_resident_quantized_layer_changes_nothing"],
        "load_state_dict(model.state_dict()) quantizes a resident quantized layer's quantized values again "
        "(int4, a narrower dequant_dtype): its weights and outputs move at each load"),
    Mutation(
        "resident-quant-nan-load-written", "python/layerstream/_guards.py",
        "            del state_dict[prefix + qualified]",
        "            pass",
        [P + "test_quant_offload.py::test_a_load_with_nan_into_a_resident_quantized_layer_is_refused_and_keeps_the_old_weight"],
        "load_state_dict() with NaN for a resident quantized layer writes it: the old values are lost, every "
        "later call fails"),
    Mutation(
        "resident-quant-trains", "python/layerstream/_guards.py",
        "                if p is not None and p.requires_grad:  # unfrozen after offload() (frozen then: _formats.py)",
        "                if False:",
        [P + "test_quant_offload.py::test_a_resident_quantized_weight_unfrozen_after_offload_is_refused_as_a_streamed_one_is"],
        "a resident quantized weight unfrozen after offload() trains and is quantized again at the next call, "
        "silently"),
    Mutation(
        "resident-quant-rounding-unwarned", "python/layerstream/_attach.py",
        "        if _C.resident_quantized_rounds(dtype, dq):",
        "        if False:",
        [P + "test_quant_offload.py::test_resident_quantized_layers_rounded_from_a_wider_dequant_dtype_are_warned_of"],
        "bf16 weights with dequant_dtype=float32: the layers a budget keeps resident hold bf16-rounded values, "
        "the streamed ones compute in float32, without a word"),
    Mutation(
        "dequant-dtype-ignored-unwarned", "python/layerstream/_offload.py",
        "        if asked_dequant is not None and not gguf and all(",
        "        if False and all(",
        [P + "test_quant_offload.py::test_dequant_dtype_without_a_lossy_format_is_warned_of"],
        "offload(dequant_dtype=...) without a lossy quantize= is ignored without a word"),
    Mutation(
        "quantize-pattern-on-excluded-unwarned", "python/layerstream/_formats.py",
        "            and not any(fnmatch.fnmatchcase(n, p) for n in layers)]",
        "            and False]",
        [P + "test_misuse.py::test_a_quantize_pattern_that_names_only_modules_not_streamed_is_warned"],
        "quantize={'0': 'int8'} with exclude=['0'] quantizes nothing, without a word"),
    Mutation(
        "overlap-ignores-edited-resident-grads", "python/layerstream/_optim_overlap.py",
        "        self._overlap_grads = [(p, p.grad, None if p.grad is None else p.grad._version)\n"
        "                               for g in self.param_groups for p in g[\"params\"]]",
        "        self._overlap_grads = [(p, p.grad, p.grad._version) for p in plist if p.grad is not None] if keep_grads "
        "else []",
        [P + "test_optim.py::test_a_clip_between_an_overlapped_backward_and_step_is_refused"],
        "clip_grad_norm_ between an overlapped backward (no keep_grads) and step() clips the resident parameters "
        "only, the streamed layers stepped unclipped, silently"),
    Mutation(
        "readme-train-list-lacks-adamw-fp32", "README.md",
        "`train=\"adamw\"` (or `\"adamw-fp32\"`, the same; `\"adamw-bf16\"`",
        "`train=\"adamw\"` (or `\"adamw-bf16\"`",
        [P + "test_optim.py::test_every_train_name_the_optimizers_suggest_is_documented"],
        "the step's warning suggests train='adamw-fp32', which README's train= list does not name"),
    Mutation(
        "overlap-ignores-a-later-backward", "python/layerstream/_optim_overlap.py",
        "                               for g in self.param_groups for p in g[\"params\"]]",
        "                               for g in self.param_groups for p in g[\"params\"] if p.grad is not None]",
        [P + "test_optim.py::test_a_backward_between_an_overlapped_backward_and_step_is_refused"],
        "a backward between an overlapped backward and step() is dropped for the layers the block stepped, "
        "silently"),
    Mutation(
        "bench-plot-draws-any-object", "python/layerstream/bench_plot.py",
        "    if not isinstance(results, dict) or not any(k in results for k in SECTIONS):",
        "    if not isinstance(results, dict):",
        [P + "test_cli_demo_bench.py::test_bench_plot_refuses_what_is_not_bench_output_in_one_line"],
        "`python -m layerstream.bench_plot` given `{}` or `plan --json` output draws an empty plot, exit 0"),
    Mutation(
        "planner-md-usage-lacks-disk-options", "docs/design/planner.md",
        "        [--host-budget SIZE] [--disk-gbps GB/s]\n",
        "        [--host-budget SIZE]\n",
        [P + "test_cli_plan.py::test_planner_md_usage_block_is_plan_help_s_option_list"],
        "planner.md's `plan` usage block leaves out an option `plan --help` lists"),
    Mutation(
        "planner-md-json-kind-lacks-gguf", "docs/design/planner.md",
        '"kind": "checkpoint" | "gguf" | "model"',
        '"kind": "checkpoint" | "model"',
        [P + "test_cli_plan.py::test_planner_md_json_schema_names_every_key_plan_writes"],
        "planner.md's `plan --json` schema omits the source kind a .gguf file gives"),
    Mutation(
        "readme-cli-plan-said-to-place-as-offload", "README.md",
        "  counts the same). Without it the budget counts weights only.",
        "  plans the same). Without it the budget counts weights only.",
        [P + "test_cli_plan.py::test_readme_says_plan_and_offload_may_place_the_same_model_differently"],
        "README says `layerstream plan --train=adamw` plans as offload() does; its slots and residency may differ"),
    Mutation(
        "in-ram-advice-ignores-the-rule", "python/layerstream/_host_plan.py",
        "        elif t.pre is None and not why[t.name]:  # loaded by load_safetensors(), it could stay in its file",
        "        elif t.pre is None and t.fmt in (None, \"lossless\"):",
        [P + "test_host_tier_quant.py::test_the_advice_for_quantized_weights_in_memory_follows_the_disk_rule"],
        "the host budget's error tells to load an in-memory lossless model with load_safetensors(), though "
        "lossless weights cannot stay on disk"),
    Mutation(
        "group-input-written-in-place-recomputed", "python/layerstream/_group_op.py",
        "        if any(version_of(x) != v for x, v in versions):\n            raise _writes_input(fwd)\n",
        "",
        [P + "test_groups.py::test_a_group_that_writes_its_input_in_place_is_refused_when_it_trains"],
        "a groups= module that writes an input that requires no grad in place trains with silently wrong "
        "gradients (the backward's recompute starts from the written input)"),
    Mutation(
        "exclude-group-advice-streams-its-children", "python/layerstream/_discovery.py",
        "            whole = [group, f\"{group}.*\"] if module in _WHOLE_GROUPS else [group]",
        "            whole = [group]",
        [P + "test_group_patterns.py::test_exclude_naming_a_child_of_a_groups_module_is_an_error"],
        "exclude= naming a module inside a groups= module advises exclude=['g'], which streams g's Linears one "
        "by one instead of keeping the group resident"),
    Mutation(
        "tie-inside-a-group-told-as-a-resident-partner", "python/layerstream/_discovery.py",
        "        (inside if kind == \"group\" and _tied_inside(module, owners) else other).append(label)",
        "        other.append(label)",
        [P + "test_tied.py::test_a_tie_inside_one_group_says_so"],
        "a tie inside one groups= module keeps it resident with the warning \"another module that stays resident, "
        "or a bias, shares the tensor\", true of neither, and no word of how to stream it"),
    Mutation(
        "groups-inside-an-attention-left-to-the-engine", "python/layerstream/_discovery.py",
        "            _check_group_not_inside_a_group(name, module, candidates, groups)\n",
        "",
        [P + "test_group_patterns.py::test_groups_naming_an_attention_out_proj_is_an_error_naming_the_attention"],
        "groups=['mha.out_proj'] fails in the engine (\"tensor #0 is already streamed by layer 'mha'\"), naming "
        "no option to change"),
    Mutation(
        "param-using-part-of-its-memory-streamed", "python/layerstream/_discovery.py",
        "        if uses < holds:\n",
        "        if False:\n",
        [P + "test_misuse.py::test_a_parameter_using_part_of_its_memory_is_refused"],
        "a streamed weight that is a view into a flat buffer outside the model, or a strided slice, streams: "
        "writes to the buffer no longer reach it, and detach() gives it back in memory of its own, dense"),
    Mutation(
        "groups-trainable-complex-left-to-the-engine", "python/layerstream/_discovery.py",
        "            if trained is not None:\n",
        "            if False:\n",
        [P + "test_errors.py::test_complex_tables_and_trainable_complex_group_tensors_say_why"],
        "a trainable complex parameter in groups= fails in the engine (\"tensor #0 is undefined, or requires "
        "grad and is not a floating-point tensor\"), naming neither the parameter nor the fix"),
    Mutation(
        "non-float-table-resident-unwarned", "python/layerstream/_discovery.py",
        "            return \"table_dtype\"  # complex, integer\n",
        "            return \"table_dtype\" if False else None  # complex, integer\n",
        [P + "test_errors.py::test_complex_tables_and_trainable_complex_group_tensors_say_why"],
        "a complex or integer nn.Embedding is taken for a streamed table (or, as before, left resident without "
        "a word: \"found no ... Embedding\" for a model with one)"),
    Mutation(
        "offload-doc-says-groups-streams-rnns", "python/layerstream/_offload.py",
        "directly: custom layers, ...): all",
        "directly: custom layers, RNNs, ...): all",
        [P + "test_groups.py::test_offload_docstring_names_no_rnn_among_what_groups_streams"],
        "offload()'s docstring lists RNNs among what groups= streams; groups= on a module holding an nn.LSTM "
        "raises"),
    Mutation(
        "torch-glue-says-encoder-eval-bit-for-bit", "docs/design/torch-glue.md",
        "equals the resident layer's unfused path bit for bit and its fused kernel\nonly to rounding",
        "equals the resident layer bit for bit, its unfused path and its fused kernel\nalike, not to rounding",
        [P + "test_attention.py::test_an_encoder_layer_in_eval_equals_its_fused_path_to_rounding_as_the_design_note_says"],
        "torch-glue.md says an nn.TransformerEncoderLayer in eval is tested bit for bit with masks, where "
        "offload() turns its fused path off and the output equals the resident fused path to rounding only"),
    Mutation(
        "group-output-container-lost-in-training", "python/layerstream/_forward.py",
        "        return torch.utils._pytree.tree_unflatten(list(outs), box[0])",
        "        return outs[0] if len(outs) == 1 else outs",
        [P + "test_groups.py::test_a_group_returns_its_own_container_when_it_trains"],
        "a groups= module's namedtuple, list or dict output comes back as a plain tuple when a gradient is needed"),
    Mutation(
        "compiled-group-output-container-lost", "python/layerstream/_group_op.py",
        "    if kind == \"tuple\":\n        return tuple(values)\n",
        "    if kind != \"dict\":\n        return tuple(values)\n",
        [P + "test_compile.py::test_a_compiled_group_returns_its_own_container"],
        "a compiled groups= module's namedtuple or list output comes back as a plain tuple (a namedtuple's "
        "fields gone), where the eager call returns the module's own container"),
    Mutation(
        "compiled-group-changed-container-unchecked", "python/layerstream/_group_op.py",
        "    if expected is not None and expected != pattern:",
        "    if False:",
        [P + "test_compile.py::test_a_compiled_group_refuses_a_container_it_cannot_rebuild_and_a_changed_one"],
        "a compiled groups= module whose container changes after the trace is rebuilt in the traced one: its "
        "tensors silently land in other fields"),
    Mutation(
        "activation-scope-opens-inside-backward", "python/layerstream/_activations.py",
        "        if torch._C._current_graph_task_id() != -1:\n            return False",
        "        if False:\n            return False",
        [P + "test_activations.py::test_a_checkpoint_around_the_whole_model_keeps_checkpointing"],
        "a reentrant checkpoint around the whole offloaded model: its recomputation in backward opens a scope, "
        "and what it saves goes to the host and straight back (or stays on the device with a budget)"),
    Mutation(
        "activation-scope-over-callers-hooks", "python/layerstream/_activations.py",
        "        if top is None or isinstance(getattr(top[0], \"__self__\", None), ActivationOffload):",
        "        if True:",
        [P + "test_activations.py::test_a_checkpoint_around_the_whole_model_keeps_checkpointing",
         P + "test_activations.py::test_saved_tensor_hooks_of_the_caller_stay_in_charge"],
        "a non-reentrant checkpoint around the whole offloaded model: layerstream's hooks entered over the "
        "checkpoint's take every save, and the checkpoint recomputes nothing (with a device budget all stay on "
        "the device), silently"),
    Mutation(
        "activation-scope-under-another-offload-left", "python/layerstream/_activations.py",
        "        if top is None or isinstance(getattr(top[0], \"__self__\", None), ActivationOffload):",
        "        if top is None:",
        [P + "test_activations.py::test_an_offloaded_model_called_inside_another_offloads_its_own_saves"],
        "an offloaded model called inside another's forward leaves its saves to the outer model's engine, "
        "with a warning about someone else's hooks"),
    Mutation(
        "plan-activations-pinned-without-pin-memory", "python/layerstream/_handle.py",
        "        if not self._pin_memory:\n",
        "        if False:\n",
        [P + "test_activations.py::test_the_plan_says_pageable_when_saved_activations_get_no_pinned_memory"],
        "handle.plan says saved activations go to pinned host memory with pin_memory=False"),
    Mutation(
        "plan-activations-pinned-past-the-pinned-budget", "python/layerstream/_handle.py",
        "        cap = (self.host_plan or {}).get(\"spare_pinned_bytes\", -1)",
        "        cap = -1",
        [P + "test_activations.py::test_the_plan_says_pageable_when_saved_activations_get_no_pinned_memory",
         P + "test_activations.py::test_the_pinned_budget_bounds_the_pinned_host_copies"],
        "handle.plan says saved activations go to pinned host memory when the pinned budget leaves them little "
        "or nothing (the engine copies them to pageable memory)"),
    Mutation(
        "stats-lack-resident-layers-without-a-budget", "python/layerstream/_handle.py",
        "        s[\"resident_bytes\"] = s[\"resident_layers\"] = 0",
        "        s[\"resident_bytes\"] = 0",
        [P + "test_telemetry.py::test_stats_have_the_same_keys_with_and_without_a_budget"],
        "stats() without a budget has no resident_layers key: code written for stats() with a budget fails "
        "with KeyError"),
    Mutation(
        "suspend-moves-make-inference-tensors", "python/layerstream/_handle.py",
        "    with torch.inference_mode(False), torch.no_grad():\n        for module in model.modules():",
        "    with torch.no_grad():\n        for module in model.modules():",
        [P + "test_misuse.py::test_suspend_and_resume_inside_inference_mode_leave_tensors_a_backward_can_save"],
        "handle.suspend() inside torch.inference_mode() makes the parameters inference tensors: the next "
        "training step fails"),
    Mutation(
        "ddp-of-compiled-ignores-plain-names", "python/layerstream/_distributed.py",
        "    return names + [_COMPILED + n for n in names]",
        "    return names",
        [P + "test_distributed.py::test_ddp_of_a_compiled_model_equals_one_process"],
        "DDP(torch.compile(model)) names the parameters '_orig_mod.<name>' and reduces the streamed gradients "
        "itself: they arrive as zeros"),
    Mutation(
        "compiled-ddp-checks-skipped", "python/layerstream/_distributed.py",
        "        return checked_eagerly(check, *args)",
        "        return None",
        [P + "test_distributed.py::test_what_ddp_leaves_to_layerstream_is_checked_at_its_first_training_forward"],
        "under torch.compile(DDP(model)) the first-training-forward checks and the parent refusal are skipped: "
        "ranks with different streamed weights, no averaging group or a parent's zero gradients train on"),
    Mutation(
        "shared-frozen-writes-unchecked", "python/layerstream/_distributed.py",
        "        return bool(self.shards) or bool(self.frozen)",
        "        return bool(self.shards)",
        [P + "test_distributed.py::test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank"],
        "peft's merge_adapter() on rank 0 alone changes every rank's shared frozen weights, silently"),
    Mutation(
        "shared-frozen-dotdata-write-unseen", "python/layerstream/_distributed.py",
        "            if not torch.equal(now, before):",
        "            if False:",
        [P + "test_distributed.py::test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank"],
        "a write through .data (merge_adapter()) to a shared frozen weight, or another rank's write, is not "
        "seen: only version counters are checked"),
    Mutation(
        "shared-frozen-version-unchecked", "python/layerstream/_distributed.py",
        "            if p._version != version:",
        "            if False:",
        [P + "test_distributed.py::test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank"],
        "load_state_dict() into a shared frozen weight is seen by its bytes only (a write of few elements "
        "passes; the writer is told of another rank's write)"),
    Mutation(
        "entry-modules-unhooked", "python/layerstream/_calls.py",
        "        self.entries = [weakref.ref(m) for m in entry_modules(model, streamed_modules)]",
        "        self.entries = []",
        [P + "test_threads.py::test_threads_calling_a_model_below_its_root_take_turns",
         P + "test_peft_adapters.py::test_dora_added_to_an_offloaded_peft_model_is_refused_in_its_generate",
         P + "test_activations.py::test_a_call_below_the_root_offloads_its_activations"],
        "calls that enter the model below its root (peft's generate(), model.model(...)) take no turn, "
        "refuse no late DoRA adapter and offload no activations"),
    Mutation(
        "entry-hooks-copied-live", "python/layerstream/_forward.py",
        "    def __deepcopy__(self, memo):\n        return _no_hook",
        "    def __deepcopy__(self, memo):\n        return self",
        [P + "test_threads.py::test_threads_calling_a_model_below_its_root_take_turns"],
        "a deep copy of a module between the root and its blocks keeps the offloaded model's hooks: "
        "its calls wait for the offloaded model's turn and begin steps in its engine"),
    Mutation(
        "raised-call-keeps-its-turn", "python/layerstream/_calls.py",
        "                if frame is frames[i][0] or frame is frames[i][1]:",
        "                if frame is frames[i][0]:",
        [P + "test_threads.py::test_a_call_that_raises_passes_the_turn_on"],
        "a call that raised keeps its turn until the next call finds it stale (a waiting thread polls "
        "for a second)"),
    Mutation(
        "peft-merge-unguarded", "python/layerstream/_offload.py",
        "            guard_peft_merges()",
        "            pass",
        [P + "test_quant_offload.py::test_peft_merge_into_a_quantized_base_kept_resident_is_refused_before_any_layer_is_written"],
        "peft's merge_adapter() / merge_and_unload() over a quantized base write the dense and the resident "
        "quantized layers before the first streamed one refuses: the adapter half merged"),
    Mutation(
        "peft-merge-resident-unseen", "python/layerstream/_packed.py",
        "            if name is not None:",
        "            if False:",
        [P + "test_quant_offload.py::test_peft_merge_into_a_quantized_base_kept_resident_is_refused_before_any_layer_is_written"],
        "peft's merge into a quantized layer kept resident is let through (its dense weight takes the merged "
        "values, unquantized); the refusal names a streamed layer after it, or none comes"),
    Mutation(
        "refused-load-writes-first", "python/layerstream/_packed.py",
        "        if refused:\n            more = f\" ({len(refused) - 1} more key(s) likewise)\"",
        "        if False:\n            more = f\" ({len(refused) - 1} more key(s) likewise)\"",
        [P + "test_lossless.py::test_frozen_lossless_weights_are_not_rewritten_in_place_and_a_refused_load_writes_nothing"],
        "a load_state_dict() refused for a lossless-coded weight has written the keys before it: the model "
        "holds parts of two checkpoints"),
    Mutation(
        "peft-merge-unguarded-after-late-import", "python/layerstream/_calls.py",
        "        guard_peft_merges()  # peft imported after offload(): its adapters came now",
        "        pass",
        [P + "test_quant_offload.py::test_a_merge_after_peft_was_imported_after_offload_is_refused_before_any_layer_is_written"],
        "peft imported after offload(): its merge into a quantized base half-writes the model before a "
        "streamed layer refuses"),
    Mutation(
        "sharded-step-error-not-sent", "python/layerstream/_optim_base.py",
        "            elif frame.pending:  # the other ranks wait for this one at the step's next collective",
        "            elif False:",
        [P + "test_distributed.py::test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank"],
        "an exception on one rank in a sharded step leaves the others waiting in its next barrier until the "
        "group's timeout"),
    Mutation(
        "sharded-step-barriers-from-local-work", "python/layerstream/_optim_base.py",
        "        if frame is not None and frame.pending:\n            frame.finished = True",
        "        if frame is not None and frame.pending and written:\n            frame.finished = True",
        [P + "test_distributed.py::test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank"],
        "step() run again after one rank's error: the ranks with nothing left skip the closing barrier, the "
        "failed rank waits in it, paired with the others' next collective"),
    Mutation(
        "sharded-failed-step-versions-unrecorded", "python/layerstream/_optim_base.py",
        "        for _, p in self._sharded_params():  # the step's own writes: not refused at the next forward",
        "        for _, p in []:",
        [P + "test_distributed.py::test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank"],
        "after one rank's error in a sharded step, the next forward refuses the step's own writes as "
        "'written by something other than layerstream.optim'"),
    Mutation(
        "sharded-peer-keeps-speculated-steps", "python/layerstream/_optim_overlap.py",
        "            coef, norm, skipped = plan.settle(other_sq, found)\n        except BaseException:\n"
        "            self._abort(plan, plist)",
        "            coef, norm, skipped = plan.settle(other_sq, found)\n        except BaseException:\n"
        "            pass",
        [P + "test_distributed.py::test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank"],
        "another rank's error before the clip is settled leaves this rank's speculated (unclipped) steps of its "
        "shards in place, while the failed rank took its own back"),
    Mutation(
        "sharded-failed-step-keeps-its-plan", "python/layerstream/_optim_base.py",
        "                if self._overlap is not None:  # not taken yet: taken back as step()'s own refusals do",
        "                if False:",
        [P + "test_distributed.py::test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank"],
        "an error on one rank before its step() took the overlapped plan leaves it pending (speculated steps "
        "kept, the next overlap() refused) while the other ranks took theirs back"),
    Mutation(
        "optim-dtype-checked-at-the-step-only", "python/layerstream/_optim_base.py",
        "        _C.optim_check_param_dtypes([p for p in params if isinstance(p, torch.Tensor)], len(self.param_groups))",
        "        pass",
        [P + "test_optim.py::test_a_parameter_dtype_it_cannot_step_is_refused_before_anything_moves"],
        "a float64 trainable parameter is accepted by the optimizer's constructor and refused only at the step"),
    Mutation(
        "optim-dtype-unchecked-before-an-overlapped-backward", "python/layerstream/_optim_overlap.py",
        "        self._check_dtypes()\n",
        "",
        [P + "test_optim.py::test_a_parameter_dtype_it_cannot_step_is_refused_before_anything_moves"],
        "a parameter unfrozen since the optimizer was made, of a dtype it cannot step, is refused only at step(), "
        "after the overlapped backward stepped the streamed layers: the model half-stepped"),
    Mutation(
        "resume-moves-the-step-count-to-the-device", "python/layerstream/_optim_state.py",
        " and t.device != device and key not in opt._HOST_STATES:",
        " and t.device != device:",
        [P + "test_optim.py::test_resume_puts_every_state_of_a_moved_parameter_where_a_step_on_its_device_makes_it"],
        "resume() puts the step count of layerstream.optim's states on the device, where a step of a device "
        "parameter keeps it on the host (each step's .item() then waits for the device)"),
    Mutation(
        "resume-moves-adafactor-rms-to-the-device", "python/layerstream/optim.py",
        '    _HOST_STATES = ("step", "RMS")  # as AdamW\'s',
        '    _HOST_STATES = ("step",)  # as AdamW\'s',
        [P + "test_optim.py::test_resume_puts_every_state_of_a_moved_parameter_where_a_step_on_its_device_makes_it"],
        "resume() puts Adafactor's RMS on the device, where a step of a device parameter keeps it on the host"),
    Mutation(
        "quantized-merge-refuses-every-adapter", "python/layerstream/_packed.py",
        "    if adapter_names is _EVERY:\n        return sorted(held)",
        "    if True:\n        return sorted(held)",
        [P + "test_quant_offload.py::test_a_peft_merge_refuses_only_the_adapters_it_would_write_into_a_quantized_layer"],
        "merge_adapter(adapter_names=['d']) of an adapter on dense layers only is refused because another "
        "adapter is on a quantized layer"),
    Mutation(
        "quantized-merge-ignores-adapter-names", "python/layerstream/_packed.py",
        "        token = _MERGING.set(names)",
        "        token = _MERGING.set(None)",
        [P + "test_quant_offload.py::test_a_peft_merge_refuses_only_the_adapters_it_would_write_into_a_quantized_layer"],
        "merge_adapter(adapter_names=['q']) is checked for the active adapters: q is half merged into the "
        "quantized layers (the resident one written, the streamed one refused)"),
    Mutation(
        "quantized-merge-unnamed-checks-active-only", "python/layerstream/_packed.py",
        '_MERGING = contextvars.ContextVar("layerstream_peft_merging", default=_EVERY)',
        '_MERGING = contextvars.ContextVar("layerstream_peft_merging", default=None)',
        [P + "test_quant_offload.py::test_a_peft_merge_refuses_only_the_adapters_it_would_write_into_a_quantized_layer"],
        "a peft merge entered other than through merge_adapter() / merge_and_unload() (adapters unknown) is "
        "checked for the active adapters only, and may write the others into quantized layers"),
    Mutation(
        "sharded-closure-error-says-nothing", "python/layerstream/_optim_base.py",
        "            if self._sharded_params():\n                state = (",
        "            if False:\n                state = (",
        [P + "test_distributed.py::test_an_error_in_one_ranks_step_closure_is_raised_on_every_rank_saying_nothing_was_stepped"],
        "an error in one rank's step() closure of a sharded step: no rank's error says that nothing was "
        "stepped (the others raise the group's timeout at their next collective)"),
    Mutation(
        "sharded-collective-error-says-nothing", "python/layerstream/_optim_base.py",
        "        except Exception as e:\n            wrote = (",
        "        except ImportError as e:\n            wrote = (",
        [P + "test_distributed.py::test_an_error_in_one_ranks_step_closure_is_raised_on_every_rank_saying_nothing_was_stepped"],
        "a collective of a sharded step that raises (the group's timeout after another rank's closure failed, "
        "a rank that died) does not say what this rank's step wrote"),
    Mutation(
        "conv-table-attrs-changed-after-offload-ignored", "python/layerstream/_forward.py",
        "        if self._taken is not None and any(map(operator.is_not, self._taken_now(), self._taken_at)):",
        "        if False:",
        [P + "test_errors.py::test_a_conv_or_table_attribute_changed_after_offload_is_refused_naming_it"],
        "conv.stride = (2, 2) or emb.padding_idx = pad after offload(): the streamed layer computes with the "
        "values it had at offload() (another output shape, a padding row trained), without a word"),
    Mutation(
        "compiled-conv-table-attrs-unchecked", "python/layerstream/_forward.py",
        "            self._retaken()  # read under Dynamo (while tracing only): the graph is guarded on the attributes",
        "            pass",
        [P + "test_errors.py::test_a_conv_or_table_attribute_changed_after_offload_is_refused_naming_it"],
        "under torch.compile a conv or table attribute changed after offload() is ignored (eager refuses)"),
    Mutation(
        "group-writes-its-own-tensor-lost", "python/layerstream/_forward.py",
        "                            if _group_op.version_of(t) != version:",
        "                            if False:",
        [P + "test_groups.py::test_a_group_that_writes_its_own_tensor_in_place_is_refused"],
        "a groups= module whose forward clamps its weight in place writes the slot's copy: the parameter, "
        "state_dict() and detach() never see it, silently"),
    Mutation(
        "groups-renormed-table-accepted", "python/layerstream/_discovery.py",
        "            if renormed is not None:  # the check in _GroupForward.fetched would refuse its first call",
        "            if False:",
        [P + "test_groups.py::test_a_group_that_writes_its_own_tensor_in_place_is_refused"],
        "offload(groups=...) accepts a module holding an nn.Embedding(max_norm=...), whose renormalization "
        "only the first call refuses"),
    Mutation(
        "group-inplace-input-error-claims-resident-parity", "python/layerstream/_forward.py",
        "                                   f\"streamed tensor group runs its forward again in backward from its inputs \"",
        "                                   f\"autograd raises the same for a resident module \"",
        [P + "test_attention.py::test_an_attention_input_written_in_place_before_backward_is_refused_saying_why"],
        "`h += attn(h, h, h)[0]` before backward: the error says a resident module fails the same, which is "
        "false, and not why the streamed attention needs its input"),
    Mutation(
        "layout-conversion-after-offload-skipped", "python/layerstream/_guards.py",
        "            if p is not None and p.dim() in (4, 5) and self._relayouts(fn, p):",
        "            if False:",
        [P + "test_misuse.py::test_a_layout_conversion_after_offload_is_refused_before_anything_changes"],
        "model.to(memory_format=torch.channels_last) after offload() converts the rest and leaves the streamed conv "
        "weights contiguous, silently"),
    Mutation(
        "peft-mixed-merge-unguarded", "python/layerstream/_packed.py",
        "        cls._unload_and_optionally_merge = _telling_adapters(own, check_first=True)",
        "        pass",
        [P + "test_peft_merges.py::test_mixed_model_merge_and_unload_into_a_quantized_base_is_refused_before_any_layer_is_written"],
        "PeftMixedModel's merge_and_unload() (LoRA + LoHa) over a quantized base merges and unwraps the layers "
        "before the first streamed one, which refuses: the model half merged, half unwrapped"),
    Mutation(
        "peft-ln-tuning-merge-refused", "python/layerstream/_packed.py",
        "        if not isinstance(m, layer_cls) or isinstance(m, swapping):",
        "        if not isinstance(m, layer_cls):",
        [P + "test_peft_merges.py::test_ln_tuning_merges_over_a_quantized_base_compute_the_tuned_layers"],
        "LN tuning's merge_adapter() over a quantized base is refused as a write into it, though it only swaps "
        "in the tuned copy (its merge_and_unload() goes through)"),
    Mutation(
        "share-memory-passes-on-sim", "python/layerstream/_guards.py",
        "        if self._shares(fn):",
        "        if False:",
        [P + "test_ddp_rules.py::test_share_memory_of_an_offloaded_model_is_refused_on_the_sim_device_as_on_a_gpu"],
        "model.share_memory() after offload() on the sim device returns normally with the streamed weights "
        "unshared (on a GPU refused as a move, with a message about moves and dtypes)"),
    Mutation(
        "conv-attribute-restated-refused", "python/layerstream/_forward.py",
        "                   if not _restates(n, a, b, dims)]",
        "                   if a != b]",
        [P + "test_conv_after_offload.py"],
        "conv.stride = [1, 1] (or 1) where it held (1, 1) after offload() is refused as a change of the stride, "
        "though torch's conv computes the same"),
    Mutation(
        "layout-conversion-with-a-move-skipped", "python/layerstream/_guards.py",
        "            fmt = self._moved_format(fn, p.dim(), torch.float32 if p.is_quantized else p.dtype)",
        "            fmt = None",
        [P + "test_conv_after_offload.py::test_a_layout_conversion_with_a_move_after_offload_is_refused_as_without_one"],
        "model.to(device, memory_format=torch.channels_last) after offload() converts the rest and leaves the "
        "streamed conv weights in their layout, silently (model.to(memory_format=...) alone is refused)"),
    Mutation(
        "group-own-parameter-write-reported-as-input", "python/layerstream/_group_op.py",
        "            own = _own_tensor_written(fwd, rebuild, inputs, views)",
        "            own = None",
        [P + "test_groups.py::test_a_group_that_writes_its_own_parameter_with_grad_enabled_is_named_as_such"],
        "a groups= module clamping its own trainable weight in place with grad enabled is reported as modifying "
        "an input in place (clone the input), or as torch's bare leaf error"),
    Mutation(
        "dcp-save-of-standin-refused-after-truncating", "python/layerstream/_standin.py",
        "    def __create_write_items__(self, fqn, obj):",
        "    def _create_write_items_unused(self, fqn, obj):",
        [P + "test_refused_saves_loads.py::test_a_refused_dcp_save_leaves_the_checkpoint_already_in_its_folder_intact"],
        "torch.distributed.checkpoint.save() of a quantized or disk-tier offloaded model is refused only at its "
        "writer's cpu(), after it opened its data file: a checkpoint already in the folder is left with a 0-byte "
        "data file, and the quantized weight's message is about moving it, not saving"),
    Mutation(
        "file-weight-load-written-per-key", "python/layerstream/_packed.py",
        "            elif not assign:\n                refused.append(p._load_refusal())",
        "            elif False:\n                refused.append(p._load_refusal())",
        [P + "test_refused_saves_loads.py::test_a_load_into_file_weights_is_refused_before_any_key_is_written",
         P + "test_refused_saves_loads.py::test_a_load_into_gguf_weights_before_offload_is_refused_before_any_key_is_written"],
        "load_state_dict() into a model with FileWeights (the disk tier, or before offload()) or GgufWeights "
        "fails per key after torch wrote the other keys (a half-loaded model), with torch's misleading "
        "'no-op ... assign=True' warning"),
    Mutation(
        "load-safetensors-leaves-loads-unchecked", "python/layerstream/_safetensors.py",
        "    if out.in_file:\n        install_refused_loads(model)",
        "    if False:\n        install_refused_loads(model)",
        [P + "test_refused_saves_loads.py::test_a_load_into_file_weights_is_refused_before_any_key_is_written"],
        "between load_safetensors() and offload(), load_state_dict() writes the norms and biases, then fails "
        "per key at the FileWeights"),
    Mutation(
        "load-gguf-leaves-loads-unchecked", "python/layerstream/_gguf.py",
        "    if out.packed:\n        from ._packed import install_refused_loads",
        "    if False:\n        from ._packed import install_refused_loads",
        [P + "test_refused_saves_loads.py::test_a_load_into_gguf_weights_before_offload_is_refused_before_any_key_is_written"],
        "between load_gguf() and offload(), load_state_dict() writes the norms and biases, then fails per key "
        "at the GgufWeights"),
    Mutation(
        "readme-hides-resident-quant-data-writes", "README.md",
        "  warned of). A write through `.data` (`p.data.copy_(new)`, diffusers'",
        "  warned of). (`p.data.copy_(new)`, diffusers'",
        [P + "test_resident_quant_data_writes.py::test_a_data_write_into_a_resident_quantized_layer_is_not_quantized_as_the_readme_says"],
        "the README says a quantized layer kept resident quantizes what is written into it, without the "
        "exception: a .data write (EMAModel.copy_to) is not quantized, so the budget changes the numbers"),
    Mutation(
        "bnb-state-dict-drops-quant-state", "python/layerstream/_attach.py",
        "        if pre is not None and pre.bnb_stats is not None:  # its quant state's keys in state_dict()",
        "        if False:",
        [P + "test_bnb_nf4.py::test_state_dict_of_an_offloaded_bnb_model_keeps_its_quant_state_keys"],
        "state_dict() of an offloaded bitsandbytes Linear4bit model silently lacks the quant state's keys "
        "(weight.absmax, weight.quant_map, weight.nested_*, weight.quant_state.*) that the resident one has"),
    Mutation(
        "bnb-state-dict-quant-state-aliased", "python/layerstream/_prequant.py",
        "v.clone() if torch.is_tensor(v) else v",
        "v",
        [P + "test_bnb_nf4.py::test_state_dict_of_an_offloaded_bnb_model_keeps_its_quant_state_keys"],
        "the quant-state entries of an offloaded Linear4bit's state_dict() are the tensors detach() rebuilds "
        "from: a write into them changes the weight detach() gives back (not the one that streams)"),
    Mutation(
        "diffusers-fuse-unguarded", "python/layerstream/_packed.py",
        "    guard_diffusers_fuses()\n",
        "",
        [P + "test_peft_merges.py::test_diffusers_fuse_lora_into_a_quantized_base_is_refused_before_any_layer_is_written"],
        "diffusers' fuse_lora() over a quantized base fuses the dense and the resident quantized layers before "
        "the first streamed one refuses: the model half fused"),
    Mutation(
        "diffusers-pipeline-fuse-unguarded", "python/layerstream/_packed.py",
        "    (\"diffusers.loaders.lora_base\", \"LoraBaseMixin\", \"fuse_lora\", _fused_models),\n",
        "",
        [P + "test_peft_merges.py::test_diffusers_fuse_lora_into_a_quantized_base_is_refused_before_any_layer_is_written"],
        "a pipeline's fuse_lora() fuses its components one after another: the unet fused whole before the "
        "quantized transformer refuses"),
    Mutation(
        "conv-one-int-not-expanded", "python/layerstream/_discovery.py",
        "    stride, pad, dilation = (list(v) if isinstance(v, (list, tuple)) else [v] * dims",
        "    stride, pad, dilation = (list(v)",
        [P + "test_conv_after_offload.py::test_a_conv_given_one_int_or_a_padding_string_before_offload_streams_as_the_resident_model"],
        "conv.stride = 2 (one int) set before offload(): offload() fails with a TypeError from list(2), though "
        "torch's conv takes it"),
    Mutation(
        "conv-attribute-float-taken-as-int", "python/layerstream/_forward.py",
        "        return None\n    try:\n        return operator.index(v)",
        "        return v\n    try:\n        return operator.index(v)",
        [P + "test_conv_after_offload.py::test_a_conv_attribute_set_to_floats_after_offload_is_refused_as_torch_refuses_it"],
        "conv.stride = (1.0, 1.0) after offload() restates (1, 1) to the check, while torch's conv refuses floats: "
        "the streamed conv computes on"),
    Mutation(
        "conv-attribute-checked-by-value", "python/layerstream/_forward.py",
        "any(map(operator.is_not, self._taken_now(), self._taken_at))",
        "self._taken_now() != self._taken_at",
        [P + "test_conv_after_offload.py::test_a_conv_attribute_set_to_floats_after_offload_is_refused_as_torch_refuses_it"],
        "the eager call's quick check compares the attributes by value: (1.0, 1.0) == (1, 1), so a float stride "
        "set after offload() is never looked at"),
    Mutation(
        "peft-unmerge-unguarded", "python/layerstream/_packed.py",
        "        if hasattr(tuner, \"unmerge_adapter\"):\n",
        "        if not hasattr(tuner, \"unmerge_adapter\"):\n",
        [P + "test_peft_merges.py::test_unmerge_of_adapters_merged_before_offload_into_a_quantized_base_is_refused_before_any_layer_is_written"],
        "peft's unmerge_adapter() of a LoRA merged before offload(int8): the dense and resident quantized layers "
        "unmerge, the first streamed one refuses with its merged flag popped: half unmerged, flags wrong"),
    Mutation(
        "diffusers-unfuse-unguarded", "python/layerstream/_packed.py",
        "fuses + [e + (_DIFFUSERS_UNFUSE,) for e in _DIFFUSERS_UNFUSES]",
        "fuses",
        [P + "test_peft_merges.py::test_unmerge_of_adapters_merged_before_offload_into_a_quantized_base_is_refused_before_any_layer_is_written"],
        "diffusers' unfuse_lora() of a LoRA fused before offload(int8) unfuses the layers before the first "
        "streamed one, which refuses with its flag popped: the model half unfused"),
]
