"""Bugs planted in the core (csrc/core: scheduler, planner, host store and tier, formats,
optimizer kernels), the sim backend, the command-line tool and the GPU script's helpers."""
from __future__ import annotations

from .base import P, Mutation

MUTATIONS = [
    Mutation(
        "slot-utilisation-denominator", "csrc/core/scheduler.h",
        "static_cast<double>(max_slots_held) / num_slots : 0.0;",
        "static_cast<double>(max_slots_held) / (num_slots + 1) : 0.0;",
        [P + "test_telemetry.py"],
        "slot_utilisation divided by one slot too many", survived_before=True),
    Mutation(
        "busy-slots-not-last", "csrc/core/scheduler.cpp",
        "return cost >= 0 && busy ? cost + 2 : cost;",
        "return cost;",
        [P + "test_distributed.py::test_averaging_overlaps_the_backward"],
        "a scratch slot still busy with an all-reduce taken before an idle one (the backward waits)"),
    Mutation(
        "planner-keeps-nothing-resident", "csrc/core/planner.cpp",
        "    best = build(all_resident, in.min_slots);",
        "    best = build(std::vector<char>(n, 0), in.min_slots);",
        [P + "test_errors.py::test_budget_that_fits_everything_keeps_layers_resident"],
        "a budget that holds the whole model keeps nothing resident (streams everything)"),
    Mutation(
        "planner-greedy-fill-keeps-nothing", "csrc/core/planner.cpp",
        "        if (fits) {\n          for (size_t j : unit[i]) resident[j] = 1;",
        "        if (false) {\n          for (size_t j : unit[i]) resident[j] = 1;",
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
        "scheduler-partial-copy-not-awaited", "csrc/core/scheduler.cpp",
        "  // wait_copies_read() waits for this one too (a re-code of the bytes it reads).\n"
        "  if (!l.copied_once) l.last_copy = backend_.create_event();\n"
        "  backend_.record(l.last_copy, transfer_);\n"
        "  l.copied_once = true;\n",
        "",
        ["gtest:test_scheduler:*PartialCopyInFlight*"],
        "a re-code of a group's coded pieces does not wait for the routed copies still reading them"),
    Mutation(
        "int8-scale-128", "csrc/core/quant.cpp",
        "    const float scale = top_code_finite(absmax / 127.0f, 127.0f);",
        "    const float scale = top_code_finite(absmax / 128.0f, 127.0f);",
        ["gtest:test_quant:*", P + "test_quant_offload.py::test_streamed_values_equal_the_reference_dequantization"],
        "int8 packing with the wrong scale"),
    Mutation(
        "sim-device-bytes-miscounted", "csrc/backends/sim/sim_backend.cpp",
        "BufferRef SimBackend::alloc_device(size_t bytes, const std::string& label) {\n"
        "  std::lock_guard<std::mutex> l(impl_->mem_mu);",
        "BufferRef SimBackend::alloc_device(size_t bytes, const std::string& label) {\n"
        "  bytes += 64;\n  std::lock_guard<std::mutex> l(impl_->mem_mu);",
        ["gtest:test_sim_backend:SimMemory.*"],
        "the sim device counts more memory than a buffer asks for"),
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
        "adamw-bf16-bias-correction", "csrc/core/optim/optim.cpp",
        "  s.neg_step_bc2 = static_cast<float>(-step_size * bc2_sqrt);",
        "  s.neg_step_bc2 = static_cast<float>(-step_size * bc2);",
        ["gtest:test_optim:*"],
        "the host AdamW of bf16 parameters folds 1 - beta2^t into its step, not its square root"),
    Mutation(
        "q8-conversion-truncates", "csrc/core/optim/optim.cpp",
        "  constexpr uint32_t kNearest = 0x80000u;",
        "  constexpr uint32_t kNearest = 0u;",
        ["gtest:test_optim:OptimQ8.*"],
        "8-bit states converted from floats (a checkpoint of another state_precision or layout) truncate to the "
        "code below instead of the nearest: moments biased low"),
    Mutation(
        "q8-conversion-absmax-of-signed-values", "csrc/core/optim/optim.cpp",
        "      top = std::max(top, bits_from_f32(x[i]) & 0x7FFFFFFFu);",
        "      top = std::max(top, bits_from_f32(x[i]));",
        ["gtest:test_optim:OptimQ8.*"],
        "the absmax of a converted block compares signed bits: a negative first moment larger than the rest "
        "reads as NaN (the sign bit) and wipes its block"),
    Mutation(
        "int4-dequantized-values-requantized-inexactly", "csrc/core/quant.cpp",
        "        if (!int4_gives_back(ld, base, q, zero, scale)) {",
        "        if (false) {",
        ["gtest:test_quant:QuantKnown.*"],
        "int4 values that detach() restored are quantized to another scale: each detach()/offload() cycle moves "
        "some bf16/fp16 weights by an ulp, or a code (symmetric groups)"),
    Mutation(
        "int4-exact-scale-tie-end-dropped", "csrc/core/quant.cpp",
        "    if (!(lo <= hi)) return false;",
        "    if (!(lo < hi)) return false;",
        ["gtest:test_quant:QuantKnown.*"],
        "an intersection of scales that is one point (a tie that rounds to the value) is taken for empty: "
        "some fp32 groups requantize an ulp off"),
    Mutation(
        "disk-tier-file-change-unseen", "csrc/core/io/source_file.cpp",
        "  if (now == identity_ && opened_ == identity_) return;",
        "  if (true) return;",
        [P + "test_host_tier_files.py::test_a_file_changed_after_loading_is_an_error_never_other_weights"],
        "a checkpoint file rewritten after loading is read as if it were the same weights"),
    Mutation(
        "host-store-pins-past-its-cap", "csrc/core/host_store.cpp",
        "    pin = stats_.pinned_bytes + bytes <= static_cast<uint64_t>(pinned_cap_);",
        "    pin = true;",
        [P + "test_host_tier.py::test_pinned_budget_zero_stores_pageable_and_stages_copies",
         P + "test_host_tier.py::test_disk_tier_under_a_quarter_of_the_model_equals_the_resident_model"],
        "the host store pins weights past pinned_budget"),
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
        "forked-child-keeps-the-pool", "csrc/core/optim/thread_pool.cpp",
        "  g_shared = nullptr;\n  g_shared_mu.unlock();",
        "  g_shared_mu.unlock();",
        [P + "test_fork.py::test_a_host_optimizer_steps_in_a_forked_child"],
        "a forked child's optimizer step runs on the parent's pool, whose workers are not in the "
        "child: it waits forever"),
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
    Mutation(
        "cast-as-read-streams-the-files-bytes", "csrc/core/host_tier.cpp",
        "  if (!as_stored) why.emplace_back(\"cast\");",
        "  if (false && !as_stored) why.emplace_back(\"cast\");",
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
        "disk-rule-lets-lossless-stay", "csrc/core/host_tier.cpp",
        "  if (format == \"lossless\") why.emplace_back(\"lossless\");",
        "  if (format == \"lossless\" && !cache_dir) why.emplace_back(\"lossless\");",
        [P + "test_host_tier_quant.py::test_lossless_weights_cannot_stay_on_disk_and_the_error_does_not_offer_cache_dir"],
        "lossless weights are left on disk with cache_dir=, though they are coded in RAM"),
    Mutation(
        "lossless-measure-ignores-the-cast", "csrc/core/planner_models.cpp",
        "    const lossless::Dtype d = codable(as_dtype) ? lossless_dtype(as_dtype) : stored;  // what offload() codes",
        "    const lossless::Dtype d = stored;",
        [P + "test_cli_plan.py::test_dense_dtype_plans_a_checkpoint_cast_as_offload_reads_it"],
        "`layerstream plan --dense-dtype bf16 --quantize lossless` measures the coded size of the file's fp32 "
        "values, not of the bf16 ones offload() codes"),
    Mutation(
        "sim-unwrap-keeps-the-region", "csrc/backends/sim/sim_backend.cpp",
        "  std::lock_guard<std::mutex> l(impl_->ck_mu);\n  impl_->regions.erase(buf.id);",
        "  return;",
        ["gtest:test_sim_checker:SimChecker.UnwrapDropsTracking"],
        "the sim checker keeps what it knew of a wrapped buffer after unwrap() (a region per saved activation, "
        "for the backend's life)"),
    Mutation(
        "host-plan-stages-under-two-entries", "csrc/core/host_tier.cpp",
        "  if (total + grads + (crosses ? 2 * largest : 0) <= budget) {",
        "  if (total + grads <= budget) {",
        ["gtest:test_planner:HostTierPlan.StagesTwoEntriesOrNoneWhateverTheBudgets",
         P + "test_host_tier.py::test_a_pinned_budget_below_the_store_never_plans_less_than_two_staging_entries"],
        "a pinned_budget below the store stages whatever host_budget leaves, fewer than the two entries the "
        "stager needs (offload() accepts it, the first forward fails)"),
    Mutation(
        "host-plan-spare-before-staging", "csrc/core/host_tier.cpp",
        "  if (limited) p.spare_host_bytes = static_cast<int64_t>(budget - std::min(p.host_bytes(), budget));",
        "  if (limited) p.spare_host_bytes = static_cast<int64_t>(budget - std::min(p.store_bytes + "
        "p.grad_staging_bytes, budget));",
        ["gtest:test_planner:HostTierPlan.SpareHostBytesCountEveryStagingEntry",
         P + "test_host_tier.py::test_a_pinned_budget_below_the_store_never_plans_less_than_two_staging_entries"],
        "spare_host_bytes (the saved activations' host cap) leaves out the staging entries: the plan exceeds "
        "host_budget"),
    Mutation(
        "host-plan-pins-no-entry-below-the-wanted", "csrc/core/host_tier.cpp",
        "      if (p.staging_bytes > pinned && pinned >= 2 * largest) p.staging_bytes = pinned / largest * largest;",
        "",
        ["gtest:test_planner:HostTierPlan.PinsAsManyStagingEntriesAsFit"],
        "a pinned budget below the prefetch + 2 entries wanted pins no staging entry, though two or more fit"),
    Mutation(
        "host-plan-entries-read-as-the-total", "csrc/core/host_tier.cpp",
        "                                  \" each (\" + format_bytes(2 * largest_file) + \")\" : \"\",",
        "                                  \"\" : \"\",",
        ["gtest:test_planner:HostTierPlan.TooSmallSaysWhatEachFigureIs"],
        "the host-budget error's two staging entries read as if they totalled the model's bytes"),
    Mutation(
        "disk-tier-load-identity-ignored", "csrc/core/io/source_file.cpp",
        "  f->identity_ = recorded.recorded() ? recorded : f->opened_;",
        "  f->identity_ = f->opened_;",
        [P + "test_host_tier_files.py::test_a_file_changed_between_loading_and_offload_is_an_error"],
        "a checkpoint rewritten between load_safetensors() and offload() is read as the weights loaded (the "
        "identity recorded with its header is ignored; a longer header shifts every offset)"),
    Mutation(
        "checkpoint-path-stays-relative", "csrc/core/safetensors.cpp",
        "  const std::string path = named.empty() ? named : fs::absolute(named, ec).string();",
        "  const std::string path = named;",
        [P + "test_host_tier_files.py::test_a_checkpoint_loaded_by_a_relative_path_streams_after_a_chdir"],
        "a checkpoint loaded by a relative path cannot be read after os.chdir()"),
    Mutation(
        "quant-cache-dir-stays-relative", "csrc/core/io/quant_cache.cpp",
        "  if (dir.empty() || dir.front() == '/') return dir;",
        "  return dir;",
        [P + "test_host_tier_quant.py::test_a_relative_cache_dir_is_taken_from_the_working_directory_of_offload"],
        "a relative cache_dir= is read from whatever the working directory is at each step"),
    Mutation(
        "quant-cache-beside-its-checkpoint", "csrc/core/io/quant_cache.cpp",
        "      LS_CHECK(parent_of(src) != real_dir, ",
        "      LS_CHECK(true, ",
        [P + "test_host_tier_quant.py::test_the_checkpoints_own_directory_is_refused_as_cache_dir"],
        "cache_dir= the checkpoint's own directory: the cache file makes load_safetensors() of that directory "
        "fail next time (two .safetensors files)"),
    Mutation(
        "quant-cache-dead-temporaries-kept", "csrc/core/io/quant_cache.cpp",
        "    ::unlink((dir + \"/\" + name).c_str());",
        "",
        [P + "test_host_tier_quant.py::test_temporaries_of_builds_whose_process_is_gone_are_removed"],
        "a cache build killed by SIGTERM leaves its temporary file in cache_dir forever"),
    Mutation(
        "quant-cache-name-ignores-the-weights", "csrc/core/io/quant_cache.cpp",
        "    h = fnv1a(it.tensor + '\\n' + r->second",
        "    if (false) h = fnv1a(it.tensor + '\\n' + r->second",
        [P + "test_host_tier_quant.py::test_two_models_with_other_weights_on_disk_keep_their_own_cache_files"],
        "a model with another set of weights on disk rewrites the cache file another handle streams (that one "
        "then fails)"),
    Mutation(
        "quant-top-code-overflows", "csrc/core/quant.cpp",
        "  return std::isinf(top * scale) ? std::nextafter(scale, 0.0f) : scale;",
        "  return scale;",
        ["gtest:test_quant:*WeightsNearTheFloatLimit*"],
        "int8/fp8: a row with values near FLT_MAX dequantizes its top code to Inf"),
    Mutation(
        "quant-int4-range-overflows", "csrc/core/quant.cpp",
        "          if (std::isinf((static_cast<float>(q[i]) - zero) * scale)) return kOverflowBit | base;\n",
        "",
        ["gtest:test_quant:*WeightsNearTheFloatLimit*"],
        "int4: a group spanning ±3.2e38 dequantizes to Inf, silently"),
    Mutation(
        "plan-max-prefetch-zero-to-the-planner", "tools/cli/cmd_plan.cpp",
        "  in.max_prefetch = std::max(1, max_prefetch);",
        "  in.max_prefetch = max_prefetch;",
        [P + "test_cli_plan.py::test_max_prefetch_zero_plans_like_offload_prefetch_zero"],
        "`layerstream plan --max-prefetch 0`, which the option rule accepts as offload(prefetch=0) does, fails "
        "in the planner (at least 2 slots: one layer in flight)"),
    Mutation(
        "plan-pinned-line-ignores-the-host-budget", "tools/cli/cmd_plan.cpp",
        "std::fputs(plan.explain(!host_budget_s.empty()).c_str(), stdout);",
        "std::fputs(plan.explain().c_str(), stdout);",
        [P + "test_cli_plan.py::test_host_budget_shows_the_layers_from_disk_and_the_step_with_the_disk"],
        "`layerstream plan --host-budget` prints the pinned RAM of all streamed layers as needed, beside the "
        "host budget's split that keeps some of them in the checkpoint"),
    Mutation(
        "cli-budget-share-taken-as-a-size", "tools/cli/progress.h",
        "  if (layerstream::options::names_share(v))",
        "  if (false)",
        [P + "test_cli_plan.py::test_budget_share_says_plan_needs_a_byte_count",
         P + "test_cli_demo_bench.py::test_demo_budget_share_says_a_byte_count_is_needed"],
        "`plan`/`demo --budget 50%` (or auto) says \"unknown unit\" instead of that they take a byte count"),
    Mutation(
        "planner-tied-layers-placed-apart", "csrc/core/planner.cpp",
        "          for (size_t j : unit[i]) resident[j] = 1;",
        "          resident[i] = 1;",
        ["gtest:test_planner:Planner.LayersSharingAWeightArePlacedTogetherAndCountItOnce:"
         "Planner.RandomTiedLayersArePlacedTogetherWithinBudget"],
        "the planner keeps one of two layers sharing a weight resident and streams the other (offload() then "
        "kept both resident, beyond the plan it reported)"),
    Mutation(
        "plan-layer-bytes-unaligned", "csrc/core/planner_models.cpp",
        "    s.bytes = slot_layout::of({{w_bus, w_written}, {bias, b_written}}).bus_bytes;",
        "    s.bytes = w_bus + bias;",
        ["gtest:test_planner:Models.LayerBytesAreTheSlotLayoutTheEngineAllocates"],
        "`layerstream plan` adds a layer's weight and bias bytes unaligned: up to 255 B per tensor short of the "
        "slot the engine allocates"),
    Mutation(
        "quant-cache-checksum-not-checked", "csrc/core/io/stager.cpp",
        "          if (p.check) p.file->verify(dst + off[i], p.bytes, p.tensor, *p.check);",
        "          (void)p.check;",
        [P + "test_host_tier_quant.py::test_cache_bytes_changed_in_place_are_refused_at_their_first_read_and_a_"
         "deleted_cache_is_rebuilt"],
        "the disk tier streams a quantization cache file's bytes changed in place (same size, times put back) "
        "as they are: wrong weights"),
    Mutation(
        "quant-cache-checksums-not-required", "csrc/core/io/quant_cache.cpp",
        "      return \"no checksum for tensor '\" + items[i].tensor + \"'\";",
        "      value = 0;",
        [P + "test_host_tier_quant.py::test_cache_bytes_changed_in_place_are_refused_at_their_first_read_and_a_"
         "deleted_cache_is_rebuilt"],
        "a cache file without checksums is read (with none to check against)"),
    Mutation(
        "checkpoint-fifo-opened", "csrc/core/safetensors.cpp",
        "  LS_CHECK(fs::is_regular_file(st), q(path), \" is not a regular file (a FIFO, socket or device); pass the path \"\n"
        "           \"of a .safetensors file\");",
        "",
        ["gtest:test_safetensors:SafetensorsFile.AFifoIsRefusedWithoutBlocking"],
        "a FIFO named as a checkpoint blocks load_safetensors() forever (until Ctrl-C)"),
    Mutation(
        "json-strings-not-checked-for-utf8", "csrc/core/json.cpp",
        "        if (n == 0) fail(\"invalid UTF-8 inside a string (the file is damaged)\");",
        "        if (n == 0) {\n          out.push_back(static_cast<char>(c));\n          ++pos_;\n          continue;\n        }",
        ["gtest:test_safetensors:Json.StringsMustBeUtf8"],
        "a safetensors header with a name that is not UTF-8 reaches Python as a bare UnicodeDecodeError naming no file"),
    Mutation(
        "gguf-duplicate-tensor-names-accepted", "csrc/core/gguf.cpp",
        "      LS_CHECK(seen[t.name]++ == 0, what,",
        "      LS_CHECK(seen[t.name]++ >= 0, what,",
        ["gtest:test_gguf:GgufReader.DuplicateOrNonUtf8NamesAreADamagedFile"],
        "a GGUF file naming a tensor twice is blamed on rename= instead of called damaged"),
    Mutation(
        "staging-keeps-entries-a-slot-serves", "csrc/core/scheduler.cpp",
        "  if (s < 0 || d >= span) return false;",
        "  if (true) return false;",
        ["gtest:test_stager:StagerCache.APrefetchDeeperThanTheEntriesReadsEachLayerOnce"],
        "the disk tier's staging cache keeps the entries of layers already copied into device slots: with a "
        "prefetch deeper than the entries every layer is read about twice a step"),
    Mutation(
        "host-plan-staging-in-part-entries", "csrc/core/host_tier.cpp",
        "      p.staging_bytes = std::min(entries_wanted * largest, budget - total - grads) / largest * largest;",
        "      p.staging_bytes = std::min(entries_wanted * largest, budget - total - grads);",
        ["gtest:test_planner:HostTierPlan.SpareHostBytesCountEveryStagingEntry"],
        "all in RAM with pageable store tensors, the host plan counts part of a staging entry the stager never "
        "makes: that RAM is left to nothing (saved activations got 0 B)"),
    Mutation(
        "plan-prefetch-depth-is-slots-minus-one", "csrc/core/planner.cpp",
        "  if (in.prefetch_depth >= 0) plan.prefetch_depth = std::min(plan.prefetch_depth, in.prefetch_depth);",
        "",
        ["gtest:test_planner:Planner.PlansThePrefetchDepthTheEngineRuns"],
        "the plan says prefetch depth slots - 1 where the engine runs min(prefetch, slots - 1)"),
    Mutation(
        "slots-first-caps-at-64", "csrc/core/planner.cpp",
        "  LS_CHECK(in.max_prefetch >= 1 && in.max_prefetch < options::kMaxSlots,",
        "  LS_CHECK(in.max_prefetch >= 1 && in.max_prefetch <= 64,",
        ["gtest:test_planner:*PlansEverySlotCountTheEngineTakesAndRefusesOthersInItsWords*"],
        "offload(slots=66, budget=...) is refused with the planner's internal bound"),
    Mutation(
        "too-small-hides-the-stored-slot", "csrc/core/planner.cpp",
        "              L.stored_slot_bytes && L.stored_slot_bytes < L_slot\n",
        "              false\n",
        [P + "test_quant_offload.py::test_a_budget_too_small_for_quantized_slots_says_when_the_stored_slot_is_smaller"],
        "a budget too small for nf4 slots of bf16 weights gives no advice, though the unquantized slots fit"),
    Mutation(
        "plan-rate-without-a-floor", "tools/cli/cmd_plan.cpp",
        "    if (v != 0 && v < kMinRate) {",
        "    if (false) {",
        [P + "test_cli_plan.py::test_values_that_overflow_or_say_nothing_are_usage_errors"],
        "`layerstream plan --link-gbps 1e-320` prints inf s and writes inf into its JSON"),
    Mutation(
        "plan-flag-takes-the-next-flag", "tools/cli/cmd_plan.cpp",
        "        if (std::string(argv[i + 1]).rfind(\"--\", 0) == 0)\n",
        "        if (false)\n",
        [P + "test_cli_plan.py::test_values_that_overflow_or_say_nothing_are_usage_errors"],
        "`layerstream plan --model --budget 1GiB` takes --budget as the model's name"),
    Mutation(
        "bench-plot-failure-loses-results", "tools/cli/cmd_bench.cpp",
        "    if (json) std::printf(\"%s\\n\", s.c_str());\n",
        "",
        [P + "test_cli_demo_bench.py::test_bench_plot_writes_a_png_and_still_prints_the_tables"],
        "`layerstream bench --json --plot` prints nothing: the results are lost"),
    Mutation(
        "planner-rows-not-on-the-link", "csrc/core/planner_time.cpp",
        "      if (op.rows_in > 0) link_free = std::max(link_free, start) + op.rows_in;\n",
        "",
        ["gtest:test_planner:*LookedUpRowsAreChargedToTheLink*"],
        "the time model reads a table's rows on the compute stream only: a transfer-bound step is predicted "
        "shorter than the bytes it moves"),
    Mutation(
        "demo-budget-leaves-out-resident-tensors", "tools/cli/cmd_demo.cpp",
        "    budget += resident_bytes;\n",
        "",
        [P + "test_cli_demo_bench.py::test_demo_default_budget_holds_the_resident_tensors_and_three_slots"],
        "`layerstream demo`'s default budget has no room for the resident tensors: 2 slots, prefetch 1"),
    Mutation(
        "plan-quantize-aliases-refused", "csrc/core/planner_models.cpp",
        "  switch (quant::parse_format(s)) {",
        "  switch (s == \"e4m3\" ? quant::Format::GgufQ8_0 : quant::parse_format(s)) {",
        ["gtest:test_planner:*"],
        "`layerstream plan --quantize e4m3` is refused while offload(quantize=\"e4m3\") takes it"),
    Mutation(
        "gguf-tensor-bytes-wrap", "csrc/core/gguf.cpp",
        "    LS_CHECK(blocks <= UINT64_MAX / ty.block_bytes, where,",
        "    LS_CHECK(true, where,",
        ["gtest:test_gguf:GgufReader.DamagedFilesAreOneClearError"],
        "a damaged GGUF whose tensor claims 2^62 F32 elements reads as 0 bytes and is planned"),
    Mutation(
        "demo-floor-without-resident", "tools/cli/cmd_demo.cpp",
        "  const int64_t min_budget = two_slots + resident_bytes;",
        "  const int64_t min_budget = two_slots;",
        [P + "test_cli_demo_bench.py::test_demo_budget_bounds_count_the_resident_tensors"],
        "the demo's floor leaves out the resident tensors: the budget it names is refused by offload()"),
    Mutation(
        "demo-everything-fits-without-resident", "tools/cli/cmd_demo.cpp",
        "  } else if (static_cast<uint64_t>(budget - resident_bytes) >= size.bytes) {",
        "  } else if (static_cast<uint64_t>(budget) >= size.bytes) {",
        [P + "test_cli_demo_bench.py::test_demo_budget_bounds_count_the_resident_tensors"],
        "demo --layers 1 refuses its own default budget as holding every weight"),
    Mutation(
        "plan-budget-own-rule", "tools/cli/cmd_plan.cpp",
        "    in.budget_bytes = layerstream::options::parse_budget(budget_s).bytes;  // shares refused above",
        "    in.budget_bytes = parse_bytes(budget_s);",
        [P + "test_cli_plan.py::test_the_budget_follows_the_rule_offload_and_demo_follow"],
        "plan --budget takes 1e19 bytes, which offload() and demo refuse"),
    Mutation(
        "plan-gguf-by-name", "tools/cli/cmd_plan.cpp",
        "  const bool gguf = have_checkpoint && starts_as_gguf(checkpoint);",
        "  const bool gguf = have_checkpoint && checkpoint.size() > 5 && "
        "checkpoint.compare(checkpoint.size() - 5, 5, \".gguf\") == 0;",
        [P + "test_cli_plan.py::test_a_gguf_file_is_known_by_its_magic_not_its_name"],
        "a GGUF file named .GGUF is read as a damaged safetensors file"),
    Mutation(
        "plan-expert-share-above-one", "csrc/core/planner_models.cpp",
        "  LS_CHECK(k == 0.0 || e == 0.0 || k <= e, what,",
        "  LS_CHECK(true, what,",
        [P + "test_cli_plan.py::test_an_invalid_expert_count_in_config_json_is_an_error"],
        "a config.json naming more experts per token than the model has is taken as is"),
    Mutation(
        "plan-gguf-unreadable-type-bare", "csrc/core/planner_models.cpp",
        "             gguf_type_unreadable(g.path, t.name, t.type_name));",
        "             g.path + \": cannot read \" + t.name);",
        [P + "test_cli_plan.py::test_a_gguf_type_it_cannot_read_says_what_it_can_and_what_to_do"],
        "plan's refusal of an IQ-type GGUF tensor names neither the types it reads nor what to do"),
    Mutation(
        "planner-routed-groups-by-size", "csrc/core/planner.cpp",
        "      if (saves[a] != saves[b]) return saves[a] > saves[b];",
        "      if (false) return saves[a] > saves[b];",
        ["gtest:test_planner:Planner.DenseLayersStayBeforeRoutedGroupsOfTheSameFlopsPerByte"],
        "the planner keeps routed expert groups resident before dense layers of the same FLOPs per byte: "
        "MoE decoding moves ~1.7x the bytes"),
    Mutation(
        "planner-shared-input-counted-per-layer", "csrc/core/planner_models.cpp",
        "    if (reads_an_earlier_layers_input(m.layers, static_cast<size_t>(&l - m.layers.data()))) return 0;",
        "",
        [P + "test_cli_plan.py::test_activation_offload_counts_an_input_several_projections_read_once"],
        "layerstream plan --activations host counts q, k and v's shared input (and gate and up's) once per "
        "projection, though offload() copies it once"),
]
