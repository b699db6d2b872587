"""Bugs planted in the Python optimizers and their state dicts (layerstream.optim:
optim.py, _optim_base.py, _optim_overlap.py, _optim_state.py, _optim_calls.py) and in
the several-process wiring (_distributed.py)."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS = [
    Mutation(
        "sharded-clip-norm-not-summed", "python/layerstream/_optim_overlap.py",
        "                plan.sum_of_squares = self._frame.exchange(plan.sum_of_squares) / shard.nodes",
        "                self._frame.exchange(plan.sum_of_squares)",
        [P + "test_distributed.py::test_sharded_step_overlapped_with_the_backward"],
        "an overlapped sharded step clips by its own shards' norm, not the ranks' sum"),
    Mutation(
        "scaler-not-told", "python/layerstream/_optim_overlap.py",
        "            self._report_to_scaler(scaler, skipped and not found)",
        "            pass",
        [P + "test_optim.py::test_overlap_tells_the_scaler_of_an_overflow_it_cannot_see"],
        "the scaler never hears of an overflow in the gradients an overlapped backward consumed"),
    Mutation(
        "scaler-found-inf-ignored", "python/layerstream/_optim_overlap.py",
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
        "scaler-check-not-summed-over-ranks", "python/layerstream/_optim_overlap.py",
        "if (self.max_grad_norm is not None or scaler is not None) and shard is not None:",
        "if self.max_grad_norm is not None and shard is not None:",
        [P + "test_distributed.py::test_sharded_overlap_skips_on_every_rank_when_one_ranks_shard_has_nan"],
        "a rank whose shards are finite steps while the rank that holds the NaN skips"),
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
        "suspend-leaves-optimizer-states", "python/layerstream/_optim_state.py",
        "                    st[key] = move(t)\n",
        "                    pass\n",
        [P + "test_optim.py::test_suspend_moves_the_states_of_the_moved_parameters"],
        "suspend() leaves layerstream.optim's states of the moved parameters on the device"),
    Mutation(
        "optim-load-takes-checkpoint-precision", "python/layerstream/optim.py",
        '    _OWN_OPTIONS = ("state_precision",)',
        "    _OWN_OPTIONS = ()",
        [P + "test_optim.py::test_load_state_dict_keeps_the_constructed_state_precision"],
        "AdamW(state_precision='8bit').load_state_dict() of an fp32 checkpoint keeps fp32 states (4x the host "
        "memory), and an fp32 one keeps 8-bit codes, silently"),
    Mutation(
        "8bit-codes-saved-under-torch-names", "python/layerstream/optim.py",
        "        return {cls._CODE_KEYS.get(k, k): v for k, v in st.items()}",
        "        return st",
        [P + "test_optim.py::test_an_8bit_state_dict_does_not_load_into_torch_adamw_as_moments"],
        "an 8-bit AdamW state dict loads into torch.optim.AdamW, which steps with the codes (0..255) as moments"),
    Mutation(
        "resume-leaves-states-loaded-while-suspended", "python/layerstream/_optim_state.py",
        "            for p, device in params:\n                st = opt.state.get(p)",
        "            for p, device in params:\n                st = None",
        [P + "test_optim.py::test_resume_puts_every_state_of_a_moved_parameter_where_a_step_on_its_device_makes_it"],
        "resume() leaves on the host the states layerstream.optim keeps for parameters back on the device"),
    Mutation(
        "adamw-ignores-torch-only-options", "python/layerstream/optim.py",
        '        on = [k for k in ("amsgrad", "maximize") if group.get(k)]',
        "        on = []",
        [P + "test_optim.py::test_a_torch_state_dict_with_options_it_lacks_is_refused_before_anything_loads"],
        "a torch.optim.AdamW state dict with maximize=True / amsgrad=True loads and the step ignores them"),
    Mutation(
        "overlap-ignores-late-hyperparameters", "python/layerstream/_optim_overlap.py",
        "                        if now.get(k) != v]",
        "                        if False]",
        [P + "test_optim.py::test_a_hyperparameter_set_between_an_overlapped_backward_and_step_is_refused"],
        "an lr set between an overlapped backward and step() reaches the resident parameters only"),
    Mutation(
        "overlap-ignores-edited-kept-grads", "python/layerstream/_optim_overlap.py",
        "        edited = sum(1 for p, g, v in self._overlap_grads if p.grad is not g or (g is not None and g._version != v))",
        "        edited = 0",
        [P + "test_optim.py::test_kept_gradients_written_between_an_overlapped_backward_and_step_are_refused"],
        "a custom clip of kept gradients after an overlapped backward reaches the resident parameters only"),
    Mutation(
        "uncounted-training-warning-points-into-torch", "python/layerstream/_optim_base.py",
        "RuntimeWarning, stacklevel=_user_stacklevel())",
        "RuntimeWarning, stacklevel=4)",
        [P + "test_optim.py::test_the_uncounted_training_warning_points_at_the_users_step"],
        "the uncounted-training warning names torch's no_grad wrapper instead of the user's step() line"),
    Mutation(
        "rank-difference-paired-by-position", "python/layerstream/_distributed.py",
        "    if only_a or only_b:",
        "    if False:",
        [P + "test_distributed.py::test_the_ranks_first_difference_names_a_layer_only_one_rank_streams"],
        "ranks that stream different layers are told about an unrelated row (compared by position)"),
    Mutation(
        "ranks-streamed-values-unchecked", "python/layerstream/_distributed.py",
        "        rows = _fingerprint(model, layers, settings, values=share_host_store != \"all\")",
        "        rows = _fingerprint(model, layers, settings, values=False)",
        [P + "test_distributed.py::test_ranks_that_disagree_are_told"],
        "ranks whose streamed weights were initialised differently train different weights for good "
        "(DDP's broadcast skips them)"),
    Mutation(
        "ddp-join-not-refused", "python/layerstream/_distributed.py",
        "if ddp is not None and _joining(ddp) and torch.is_grad_enabled()",
        "if False and ddp is not None and _joining(ddp) and torch.is_grad_enabled()",
        [P + "test_distributed.py::test_ddp_join_is_refused_while_streamed_weights_train_and_allowed_when_they_are_frozen"],
        "DDP's join() with trained streamed weights: the ranks' collectives stop pairing (gloo aborts a rank)"),
    Mutation(
        "optim-refused-step-counts", "python/layerstream/_optim_base.py",
        "        except BaseException:\n            for p in fresh:\n                self.state.pop(p, None)\n            raise\n",
        "        except BaseException:\n            for st in states:\n                st[\"step\"] += 1\n            raise\n",
        [P + "test_optim.py::test_a_refused_step_counts_nothing_and_the_next_steps_equal_a_fresh_optimizers"],
        "a refused optimizer step advances the step counts: every later step's bias correction is off by one"),
    Mutation(
        "optim-duplicate-param-stepped-twice", "python/layerstream/_optim_base.py",
        "        if len({id(p) for p in params}) != len(params):\n",
        "        if False:\n",
        [P + "test_optim.py::test_a_parameter_listed_twice_in_a_group_is_refused"],
        "a parameter listed twice in a group is stepped twice in one kernel call with one count"),
    Mutation(
        "optim-late-amsgrad-ignored", "python/layerstream/_optim_base.py",
        "        for gi, group in enumerate(self.param_groups):\n            self._check_foreign_options(group, f\"param group {gi}\")\n",
        "        for gi, group in enumerate(self.param_groups):\n            pass\n",
        [P + "test_optim.py::test_an_option_it_lacks_set_through_param_groups_later_is_refused_at_the_step"],
        "amsgrad / maximize set through param_groups after construction: stepped without, silently"),
    Mutation(
        "optim-refused-load-half-loaded", "python/layerstream/_optim_state.py",
        "        except BaseException:\n            self.state, self.param_groups = kept\n            raise\n",
        "        except BaseException:\n            raise\n",
        [P + "test_optim.py::test_a_refused_load_state_dict_changes_nothing"],
        "a refused optimizer load_state_dict() leaves the checkpoint's lr and some of its moments in place"),
    Mutation(
        "optim-set-of-params-accepted", "python/layerstream/_optim_base.py",
        "        if isinstance(params, set):\n",
        "        if False:\n",
        [P + "test_optim.py::test_a_parameter_listed_twice_in_a_group_is_refused"],
        "a param group given as a set is accepted: its order (state indices, rounding keys) changes between runs"),
    Mutation(
        "adafactor-maximize-ignored", "python/layerstream/optim.py",
        "        if group.get(\"maximize\"):\n            raise ValueError(\n                f\"layerstream.optim.Adafactor:",
        "        if False:\n            raise ValueError(\n                f\"layerstream.optim.Adafactor:",
        [P + "test_optim.py::test_adafactor_refuses_maximize"],
        "Adafactor with maximize=True in a group minimizes, silently"),
    Mutation(
        "optim-overlap-zeroed-grads-forgotten", "python/layerstream/_optim_base.py",
        "            self._zeroed.update((i, p) for i, p in self._dropped.items() if p.grad is None)\n",
        "            pass\n",
        [P + "test_optim.py::test_zero_grad_without_none_steps_layers_no_gradient_reached_as_a_plain_step_does"],
        "overlap + zero_grad(set_to_none=False): a layer no gradient reaches is no longer stepped from zeros"),
    Mutation(
        "ddp-join-end-unseen", "python/layerstream/_distributed.py",
        "    if ddp.__dict__.get(\"_layerstream_join_ended\") is config:\n        return False\n",
        "",
        [P + "test_distributed.py::test_training_outside_join_after_a_join_block_ended_equals_the_resident_model"],
        "after any DDP join() block (torch never resets its enable flag) every training forward is refused"),
    Mutation(
        "ddp-ranks-streamed-values-unchecked-at-first-forward", "python/layerstream/_distributed.py",
        "        if any(g != digest for g in gathered):",
        "        if False:",
        [P + "test_distributed.py::test_what_ddp_leaves_to_layerstream_is_checked_at_its_first_training_forward"],
        "a checkpoint loaded on rank 0 alone after offload(): DDP's broadcast skips the streamed weights, "
        "the ranks train apart, silently"),
    Mutation(
        "ddp-without-engine-group-unrefused", "python/layerstream/_distributed.py",
        "            if mine is None or dist.get_process_group_ranks(mine) != dist.get_process_group_ranks(pg):",
        "            if False:",
        [P + "test_distributed.py::test_what_ddp_leaves_to_layerstream_is_checked_at_its_first_training_forward"],
        "offload(process_group=False) under a DDP of 2 ranks: streamed gradients never averaged, silently"),
    Mutation(
        "optim-step-ctrl-c-not-held", "python/layerstream/optim.py",
        "                    with held_interrupts(), self._counted_if_stepped(ps) as states:\n"
        "                        states += [self._states(p, fmt,",
        "                    with self._counted_if_stepped(ps) as states:\n                        states += [self._states(p, fmt,",
        [P + "test_errors.py::test_a_ctrl_c_as_the_optimizer_kernel_returns_lands_after_the_step_is_counted"],
        "a Ctrl-C as AdamW's kernel returns leaves the step counts behind the applied update"),
    Mutation(
        "ddp-after-late-init-unchecked", "python/layerstream/_distributed.py",
        "        model._ddp_params_and_buffers_to_ignore = _IgnoreList(ignored, model)",
        "        model._ddp_params_and_buffers_to_ignore = ignored",
        [P + "test_ddp_rules.py::test_ddp_of_a_model_offloaded_before_init_process_group_without_world_size_is_checked"],
        "offload() before init_process_group() without WORLD_SIZE (mp.spawn): DDP's ranks step streamed weights apart, silently"),
    Mutation(
        "join-left-by-exception-never-ends", "python/layerstream/_distributed.py",
        "    if seen[1] is not None and seen[1]() is not None:\n        return True",
        "    if True:\n        return True",
        [P + "test_ddp_rules.py::test_training_after_a_join_left_by_an_exception_equals_the_resident_model"],
        "after a join() left by an exception every training forward is refused as if still inside join()"),
    Mutation(
        "ranks-different-streamed-backwards-unchecked", "python/layerstream/_distributed.py",
        "        if highest == -lowest:\n            return",
        "        if True:\n            return",
        [P + "test_ddp_rules.py::test_ranks_that_run_different_streamed_layers_are_refused_naming_the_layer"],
        "a rank that skips a streamed layer under DDP: gloo aborts a rank ('collective mismatch'), the rule unnamed"),
    Mutation(
        "overlap-counts-ctrl-c-not-held", "python/layerstream/_optim_overlap.py",
        "        with held_interrupts():\n            scale, done, stepped, skipped = self._finish_overlap(",
        "        if True:\n            scale, done, stepped, skipped = self._finish_overlap(",
        [P + "test_interrupts.py::test_a_ctrl_c_as_an_overlapped_step_settles_lands_after_its_counts"],
        "a Ctrl-C as an overlapped step's wait() or settle() returns leaves Adafactor's counts behind the layers "
        "stepped: every later step's lr and decay one step off"),
    Mutation(
        "rerun-step-after-ctrl-c-steps-again", "python/layerstream/_optim_overlap.py",
        "        if unfinished is not None and self._overlap is None and unfinished.resumes(work):\n",
        "        if False:\n",
        [P + "test_loose_ends.py::test_a_step_rerun_after_a_ctrl_c_completes_it_once"],
        "step() run again after a Ctrl-C stopped it steps a second time what it had stepped (kept gradients, "
        "groups done) and clips the rest by their norm alone"),
    Mutation(
        "optim-adopts-loaded-states-into-meta-parameter", "python/layerstream/_optim_state.py",
        "                    if p.is_meta:  # Note [States loaded for a meta parameter]\n",
        "                    if False:  # Note [States loaded for a meta parameter]\n",
        [P + "test_resume_order.py::test_optimizer_state_loaded_before_offload_into_a_meta_model_resumes_bit_for_bit"],
        "an optimizer state loaded before offload() into a model load_safetensors() filled is adopted in the "
        "meta parameters' layout: the moments become meta tensors, lost, and state_dict() saves them so"),
    Mutation(
        "sharded-step-ctrl-c-not-held-whole", "python/layerstream/_optim_base.py",
        "        return held_interrupts() if self._frame is not None else contextlib.nullcontext()",
        "        return contextlib.nullcontext()",
        [P + "test_distributed.py::test_a_ctrl_c_in_a_sharded_step_leaves_it_done_once_on_every_rank"],
        "a Ctrl-C in a sharded step skips its closing barrier and version records: the next forward refuses the "
        "step's own writes, the other ranks wait in the barrier, a re-run does not end it either"),
    Mutation(
        "sharded-offload-leaves-earlier-states-whole", "python/layerstream/_distributed.py",
        "            _states_made_whole(self.shards)  # Note [States made before their parameters were sharded]",
        "            pass",
        [P + "test_distributed.py::"
             "test_an_optimizer_state_loaded_before_a_sharded_offload_resumes_as_one_loaded_after_it"],
        "optimizer states loaded before offload(share_host_store='all') stay whole tensors': AdamW's first sharded "
        "step refuses them, Adafactor ranks keep and save states of tensors another rank steps"),
    Mutation(
        "overlap-unscaled-twice", "python/layerstream/_optim_overlap.py",
        "        if told and gs is None:\n",
        "        if False:\n",
        [P + "test_optim.py::test_kept_gradients_written_between_an_overlapped_backward_and_step_are_refused"],
        "scaler.unscale_() after overlap(grad_scaler=) divides kept (or Adafactor's) gradients by the scale "
        "twice: the weights off, silently"),
    Mutation(
        "model-state-dict-between-overlap-and-step", "python/layerstream/_attach.py",
        "        if self._engine.unsettled_step():",
        "        if False:",
        [P + "test_optim.py::test_state_dict_between_an_overlapped_backward_and_its_step_is_an_error"],
        "model.state_dict() between an overlapped backward and step() saves the streamed layers a step ahead of "
        "the others (and unclipped): a torn checkpoint"),
]
