// EngineOptions: every setting of a Strata engine, as plain structs with defaults.
//
// Build them with designated initializers, load them from JSON (strata/core/config.h), or both;
// then call Validate() before use. Defaults follow DeepSpeed where DeepSpeed has a setting of
// the same meaning (the DeepSpeed key is named in each field's comment), and PyTorch's AdamW for
// the optimizer. docs/config.md maps every DeepSpeed key to these fields.
//
// The structs hold no resources and are safe to copy; Validate() is const and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata {

/// Parses "host" or "cuda" (case-insensitive; "cpu" is accepted for host, "gpu" for cuda).
Result<DeviceKind> ParseDeviceKind(std::string_view text);

struct DeviceOptions {
  /// Device implementation. Not part of a DeepSpeed config (DeepSpeed always uses the GPU).
  DeviceKind kind = DeviceKind::kHost;
  /// Budget of "device memory" for HostDevice, in bytes. Must be > 0 when kind is host.
  uint64_t host_device_memory_bytes = 2 * kGiB;
  /// Budget of GPU memory for CudaDevice, in bytes; 0 = all memory free when the engine starts.
  uint64_t cuda_memory_bytes = 0;
  /// HostDevice only: throttle host<->device copies to this many GB/s (10^9 bytes per second)
  /// to imitate PCIe; 0 = unthrottled.
  double copy_bandwidth_gbps = 0.0;
  /// CUDA device ordinal used when kind is cuda.
  int cuda_device = 0;

  friend bool operator==(const DeviceOptions&, const DeviceOptions&) = default;
};

struct HostOptions {
  /// Budget of pinned (page-locked) host memory in bytes, covering host-tier training state and
  /// the staging buffers; 0 = automatic (the engine sizes it from physical memory).
  uint64_t pinned_memory_bytes = 0;
  /// Page-lock host-tier training state (cudaHostRegister) so copies to and from the GPU run at
  /// full PCIe speed, at the cost of unswappable memory. Staging buffers are always pinned.
  /// DeepSpeed: offload_optimizer.pin_memory / offload_param.pin_memory (default false).
  bool pin_memory = false;
  /// Number of staging buffers for optimizer state moving to and from NVMe; each holds one
  /// chunk's states from its read to its write, so it bounds how many chunks' states are read
  /// ahead of backward. 0 = automatic (the default): one per NVMe-state chunk and one more, so
  /// a whole step's reads can run during forward, within the host budget left free (less what
  /// speculative updates would keep there, at least a quarter of it) and never fewer than 4.
  /// DeepSpeed: offload_optimizer.buffer_count (default 4, >= 1).
  int optimizer_buffer_count = 0;
  /// Number of staging buffers for parameters moving to and from NVMe. Must be >= 1.
  /// DeepSpeed: offload_param.buffer_count (default 5).
  int param_buffer_count = 5;
  /// Size of one staging buffer in bytes (allocated rounded up to a 4 KiB multiple); >= 4096.
  /// DeepSpeed: offload_param.buffer_size, which counts elements (default 1e8); a DeepSpeed
  /// config is converted with the size of the working dtype.
  uint64_t buffer_size = 100'000'000;

  friend bool operator==(const HostOptions&, const HostOptions&) = default;
};

/// Which NVMe I/O backend to use.
enum class NvmeBackend : int {
  kAuto = 0,     ///< io_uring where the kernel allows it, else POSIX.
  kIoUring = 1,  ///< io_uring only; Unavailable at engine creation where it is not allowed.
  kPosix = 2,    ///< pread/pwrite on a thread pool.
};

/// "auto", "io_uring" or "posix".
std::string_view NvmeBackendName(NvmeBackend backend);
/// Parses "auto", "io_uring" (also "uring", "iouring") or "posix" (case-insensitive).
Result<NvmeBackend> ParseNvmeBackend(std::string_view text);

struct NvmeOptions {
  /// Directories for swap files, on NVMe drives; state is striped over all of them. Required
  /// when any placement tier is nvme. DeepSpeed: offload_optimizer.nvme_path and
  /// offload_param.nvme_path (both go into this list).
  std::vector<std::string> paths;
  /// Size of one I/O request in bytes; a positive multiple of 4096. DeepSpeed: aio.block_size.
  uint64_t block_size = kMiB;
  /// I/O requests in flight per thread (io_uring entries). DeepSpeed: aio.queue_depth.
  int queue_depth = 8;
  /// I/O submission threads. DeepSpeed: aio.intra_op_parallelism (older: aio.thread_count).
  int thread_count = 1;
  /// Submit requests one at a time instead of in batches. DeepSpeed: aio.single_submit.
  bool single_submit = false;
  /// Submit new requests while completions are being reaped. DeepSpeed: aio.overlap_events.
  bool overlap_events = true;
  /// Open swap files with O_DIRECT, bypassing the page cache.
  bool direct_io = true;
  /// When a path does not support O_DIRECT (tmpfs, some network filesystems), fall back to
  /// buffered I/O with a warning instead of failing.
  bool allow_buffered_fallback = false;
  /// Store a checksum with every block written and verify it on read (DataLoss on mismatch).
  bool checksums = true;
  /// I/O backend.
  NvmeBackend backend = NvmeBackend::kAuto;

  friend bool operator==(const NvmeOptions&, const NvmeOptions&) = default;
};

/// The optimizer run on the CPU.
enum class OptimizerType : int {
  kAdamW = 0,    ///< Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
  kAdam = 1,     ///< Adam with L2 weight decay added to the gradient, as torch.optim.Adam.
  kAdagrad = 2,  ///< Adagrad (uses lr, eps, weight_decay).
  kLion = 3,     ///< Lion (uses lr, beta1, beta2, weight_decay).
};

/// Whether `type` keeps a first moment (exp_avg; Lion's momentum): all but Adagrad.
constexpr bool UsesExpAvg(OptimizerType type) { return type != OptimizerType::kAdagrad; }
/// Whether `type` keeps a second moment (exp_avg_sq; Adagrad's sum of squares): all but Lion.
constexpr bool UsesExpAvgSq(OptimizerType type) { return type != OptimizerType::kLion; }

/// "adamw", "adam", "adagrad" or "lion".
std::string_view OptimizerTypeName(OptimizerType type);
/// Parses the names above, case-insensitive.
Result<OptimizerType> ParseOptimizerType(std::string_view text);

struct OptimizerOptions {
  /// Update rule. DeepSpeed: optimizer.type ("Adam" means kAdamW unless
  /// optimizer.params.adam_w_mode is false; see docs/config.md).
  OptimizerType type = OptimizerType::kAdamW;
  /// Learning rate, >= 0. DeepSpeed: optimizer.params.lr.
  double lr = 1e-3;
  /// First-moment decay, in [0, 1). DeepSpeed: optimizer.params.betas[0].
  double beta1 = 0.9;
  /// Second-moment decay, in [0, 1). DeepSpeed: optimizer.params.betas[1].
  double beta2 = 0.999;
  /// Term added to the denominator, > 0. DeepSpeed: optimizer.params.eps.
  double eps = 1e-8;
  /// Weight decay, >= 0 (torch.optim.AdamW's default 0.01). DeepSpeed:
  /// optimizer.params.weight_decay, whose own default is 0.
  double weight_decay = 0.01;
  /// Apply Adam's bias correction. DeepSpeed: optimizer.params.bias_correction.
  bool bias_correction = true;
  /// Clip gradients to this global L2 norm before the step; 0 = no clipping.
  /// DeepSpeed: gradient_clipping.
  double gradient_clipping = 0.0;
  /// With gradient clipping or fp16 overflow checks, the update of a chunk needs the global
  /// gradient norm, known only when backward ends. true: each chunk is updated as soon as its
  /// gradients land, as if the step will neither clip nor overflow, and the verdict redoes those
  /// updates with the clip coefficient (or undoes them for an overflow) when it says otherwise:
  /// the same results bit for bit, with the updates overlapping backward in the common case.
  /// Rolling back is free: new NVMe-kept states go to shadow extents, and host-kept ones are
  /// written out of place into a second buffer, in host memory the budget
  /// (host.pinned_memory_bytes) has left after everything else (chunks it has no room for wait
  /// for the norm). Device-kept states always wait. false: every update waits for the norm.
  /// DeepSpeed has no such key (its SuperOffload does this on GH200).
  bool speculative_updates = true;
  /// The trainer may change the gradients between GradsReady and Step() (PyTorch's
  /// clip_grad_norm_, GradScaler's unscale_, an edit through .data), and the step must use them
  /// as they are at Step(). Every step is then gated: each chunk's gradients get a checksum as
  /// they land, and Step() reads them again where the trainer keeps them; a chunk whose
  /// gradients changed is measured again and its update made ahead of Step() is rolled back and
  /// redone (a multiplication by exactly 1 changes nothing). The verdict (norm, clipping,
  /// overflow) comes from the gradients at Step(), and Engine::AbandonStep may drop a step
  /// before it. Needs a device whose memory the CPU reads in place (HostDevice standing for CPU
  /// tensors), one rank, gradient_accumulation_steps 1 (the trainer sums micro-steps itself), no
  /// delayed update and every trained chunk's parameters on the device. DeepSpeed has no such
  /// key: its trainer hands gradients over only at step().
  bool recheck_gradients = false;
  /// Delayed parameter update (the ZeRO-Offload paper's DPU): from step
  /// delayed_update_from_step on, a step's new parameters reach the device only after the next
  /// step's backward is done with them, so the next step computes its gradients with parameters
  /// one update old while this step's CPU update runs beside its forward and backward: Step()'s
  /// future completes during the next step, and the next step's first GradsReady waits for it.
  /// Needs every trained chunk's parameters on the device and its optimizer states off it, and
  /// no dynamic fp16 loss scaling (the next step's scale would depend on an unfinished
  /// verdict). Off by default, as in the paper's accuracy tables. DeepSpeed has no such key.
  bool delayed_update = false;
  /// The first step (counting from 0, as Engine::step_count does) whose parameters are
  /// delayed; the paper leaves the first few dozen steps, where parameters change fastest, exact.
  /// >= 0.
  int delayed_update_from_step = 40;
  /// Micro-batches whose gradients are summed before one optimizer step; >= 1.
  /// DeepSpeed: gradient_accumulation_steps.
  int gradient_accumulation_steps = 1;
  /// Threads of the CPU optimizer (oneTBB arena); 0 = the hardware threads, shared evenly by the
  /// ranks on the node (EngineEnvironment::ranks_on_node).
  int cpu_threads = 0;

  friend bool operator==(const OptimizerOptions&, const OptimizerOptions&) = default;
};

struct PrecisionOptions {
  /// Dtype of working parameters and gradients on the device; master weights and optimizer
  /// states are always fp32. DeepSpeed: fp16.enabled / bf16.enabled (neither = fp32).
  DType working_dtype = DType::kBf16;
  /// fp16 only: a fixed loss scale, or 0 for dynamic loss scaling. DeepSpeed: fp16.loss_scale.
  double loss_scale = 0.0;
  /// fp16 dynamic scaling starts at 2^initial_scale_power; in [0, 126].
  /// DeepSpeed: fp16.initial_scale_power.
  int initial_scale_power = 16;
  /// fp16 dynamic scaling doubles the scale after this many steps without overflow; >= 1.
  /// DeepSpeed: fp16.loss_scale_window.
  int loss_scale_window = 1000;
  /// fp16 dynamic scaling halves the scale after this many overflows; >= 1.
  /// DeepSpeed: fp16.hysteresis.
  int hysteresis = 2;
  /// fp16 dynamic scaling never goes below this scale; > 0. DeepSpeed: fp16.min_loss_scale.
  double min_loss_scale = 1.0;

  friend bool operator==(const PrecisionOptions&, const PrecisionOptions&) = default;
};

struct PlacementOptions {
  /// ZeRO stage, 0..3: what is sharded across ranks (1: optimizer states, 2: + gradients,
  /// 3: + parameters). Offload tiers below are independent of the stage. DeepSpeed:
  /// zero_optimization.stage.
  int zero_stage = 2;
  /// Home tier of fp32 master params and optimizer moments. DeepSpeed:
  /// zero_optimization.offload_optimizer.device (none = device, cpu = host, nvme = nvme).
  /// host: when the host budget cannot hold them all next to the rest and nvme.paths is set,
  /// the last chunks' states spill to NVMe (with a warning) instead of Create failing.
  Tier optimizer_states = Tier::kHost;
  /// Fraction of optimizer states offloaded to optimizer_states' tier and updated by the CPU
  /// optimizer, in [0, 1]; the rest stays on the device. DeepSpeed:
  /// zero_optimization.offload_optimizer.ratio.
  double offload_ratio = 1.0;
  /// Home tier of the working (fp16/bf16/fp32) parameters between uses. DeepSpeed:
  /// zero_optimization.offload_param.device.
  Tier params = Tier::kDevice;
  /// When params live on nvme, up to this many bytes of them (whole chunks, the first ones)
  /// live in host memory instead; 0 = none. DeepSpeed: offload_param.max_in_cpu, which counts
  /// elements; a DeepSpeed config is converted with the working dtype's size.
  uint64_t max_params_in_host = 0;
  /// When optimizer_states is nvme, up to this many bytes of them (whole chunks, the first
  /// trained ones first: backward reaches them last; one too large for what is left is skipped)
  /// live in host memory instead, so the step reads and writes only the rest on NVMe; 0 = none.
  /// Every tier at once for states larger than host memory: `strata plan --host-memory` gives
  /// the value that fills it (states on host spill by themselves, see optimizer_states). The host
  /// budget must hold them. DeepSpeed has no such key.
  uint64_t max_states_in_host = 0;
  /// Overlap the NVMe read of the next chunk's optimizer state with the step of the current
  /// one. DeepSpeed: offload_optimizer.pipeline_read. The Strata engine always overlaps reads,
  /// writes and steps of different chunks (bounded by optimizer_buffer_count); the field is
  /// accepted for DeepSpeed configs and changes nothing.
  bool pipeline_read = false;
  /// Overlap the NVMe write of the previous chunk's optimizer state with the step of the
  /// current one. DeepSpeed: offload_optimizer.pipeline_write. Always on in Strata, as above.
  bool pipeline_write = false;
  /// Target size of one chunk's working parameters in bytes; a positive multiple of 4096.
  uint64_t chunk_bytes = 64 * kMiB;
  /// Chunks fetched ahead of the one in use during forward/backward; 0 = no prefetch.
  int prefetch_depth = 2;
  /// With several ranks: how long one collective may wait for the other ranks before the step
  /// fails naming it, in seconds (> 0): a rank that died or hangs becomes an error on the
  /// others, not a hang. torch.distributed's default is 10 minutes too; DeepSpeed takes it in
  /// deepspeed.init_distributed(timeout=...), not in its config.
  double collective_timeout_seconds = 600.0;
  /// ZeRO++'s quantized weights (qwZ): with stage 3 across several ranks, parameters are
  /// all-gathered as blockwise int8 (256 values to an fp32 scale), 51% of bf16's bytes, and
  /// forward and backward compute with the dequantized values; master weights and the update
  /// stay exact. Needs zero_stage 3. DeepSpeed: zero_optimization.zero_quantized_weights.
  bool quantized_weights = false;
  /// ZeRO++'s quantized gradients (qgZ): with stage 3 across several ranks, gradients are
  /// reduced by sending each rank its part of every rank's gradients as blockwise integers of
  /// quantized_gradient_bits (an all-to-all) and summing them there in fp32. Needs zero_stage 3.
  /// DeepSpeed: zero_optimization.zero_quantized_gradients.
  bool quantized_gradients = false;
  /// Width of quantized gradients: 8 (int8, 25% of fp32's bytes) or 4 (int4, 13%, with steps 18
  /// times as coarse: DeepSpeed's qgZ width). Used only with quantized_gradients. Strata's own
  /// key: DeepSpeed has none (its qgZ is always int4).
  int quantized_gradient_bits = 8;

  friend bool operator==(const PlacementOptions&, const PlacementOptions&) = default;
};

/// Every setting of an engine. See docs/config.md.
struct EngineOptions {
  DeviceOptions device;
  HostOptions host;
  NvmeOptions nvme;
  OptimizerOptions optimizer;
  PrecisionOptions precision;
  PlacementOptions placement;

  /// Checks every field and combination that can be judged without touching the machine
  /// (whether a GPU, a path or io_uring exists is checked when the engine starts). Returns the
  /// first problem as InvalidArgument naming the field, its value, why it is wrong and, where
  /// the setting exists in DeepSpeed, the DeepSpeed key; OK otherwise.
  Status Validate() const;

  friend bool operator==(const EngineOptions&, const EngineOptions&) = default;
};

}  // namespace strata
