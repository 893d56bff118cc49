#include "deepspeed_keys.h"

#include <algorithm>
#include <array>
#include <vector>

namespace strata::internal {
namespace {

constexpr auto kTopLevel = std::to_array<std::string_view>({
    "optimizer",
    "scheduler",
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "torch_autocast",
    "aio",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "seq_parallel_comm_data_type",
    "sequence_parallel_size",
    "vocabulary_size",
    "gradient_allreduce_op",
    "log_level",
    "datastates",
    "data_types",
    "fp32_allreduce",
    "disable_allgather",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "monitor_config",
    "elasticity",
    "checkpoint",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "quantize_training",
    "autotuning",
    "pipeline",
    "sparse_attention",
    "eigenvalue",
    "progressive_layer_drop",
    "hybrid_engine",
    "nebula",
    "load_universal_checkpoint",
    "use_node_local_storage",
    "timers",
    "weight_quantization",
    "swap_tensor",
    "compile",
    "graph_harvesting",
    "use_data_before_expert_parallelism",
    "dataloader_drop_last",
    "zero_optimization_stage",
    "tensor_parallel",
    "expert_parallel",
});

// DeepSpeedZeroConfig: field names, then their stage3_ aliases, then deprecated names.
constexpr auto kZero = std::to_array<std::string_view>({
    "stage",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_param",
    "offload_optimizer",
    "zenflow",
    "sub_group_size",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "partition_stream_chunk_size",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "stage3_partition_stream_chunk_size",
    "stage3_gather_fp16_weights_on_model_save",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
});

constexpr auto kOffloadParam = std::to_array<std::string_view>(
    {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"});

constexpr auto kOffloadOptimizer = std::to_array<std::string_view>(
    {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline", "pipeline_read",
     "pipeline_write", "fast_init", "ratio", "super_offload", "convert_grad_on_cpu",
     "cpuadam_cores_perc"});

constexpr auto kFp16 = std::to_array<std::string_view>(
    {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
     "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads", "fused_mode"});

constexpr auto kBf16 =
    std::to_array<std::string_view>({"enabled", "immediate_grad_update", "check_grad_overflow",
                                     "bf16_master_weights_and_grads", "bf16_optimizer_states"});

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

}  // namespace

std::span<const std::string_view> DeepSpeedTopLevelKeys() { return kTopLevel; }

std::optional<std::span<const std::string_view>> DeepSpeedStrictSectionKeys(std::string_view path) {
  if (path == "zero_optimization") return kZero;
  if (path == "zero_optimization.offload_param") return kOffloadParam;
  if (path == "zero_optimization.offload_optimizer") return kOffloadOptimizer;
  if (path == "fp16") return kFp16;
  if (path == "bf16" || path == "bfloat16") return kBf16;
  return std::nullopt;
}

std::string_view NearMiss(std::string_view key, std::span<const std::string_view> candidates) {
  const size_t allowed = std::max<size_t>(2, key.size() / 3);
  std::string_view best;
  size_t best_distance = allowed + 1;
  for (std::string_view candidate : candidates) {
    const size_t distance = EditDistance(key, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace strata::internal
