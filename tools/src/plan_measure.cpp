#include "plan_measure.h"

#include <algorithm>
#include <cmath>

#include "copy_bench.h"
#include "strata/core/bytes.h"
#include "strata/offload/pipeline_benchmark.h"

namespace strata::tools {
namespace {

/// Enough chunks to reach the engine's steady state, few enough to take seconds.
constexpr double kMaxMeasuredParams = 32.0 * kMiB;

double RateOf(const offload::PipelineBenchmarkResult& r, const std::string& name) {
  for (const offload::ResourceTime& t : r.resources) {
    if (t.name == name && t.seconds > 0) return double(t.bytes) / t.seconds;
  }
  return 0.0;
}

}  // namespace

Result<offload::MachineRates> MeasureRates(const MeasureSettings& s) {
  auto progress = [&](const std::string& line) {
    if (s.progress) s.progress(line);
  };
  offload::MachineRates rates;

  if (s.copies) {
    progress("measuring host<->device copies of " + FormatBytes(s.chunk_bytes));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                            OpenTrainingDevice(std::max<uint64_t>(s.chunk_bytes, 64 * kMiB)));
    STRATA_ASSIGN_OR_RETURN(
        std::vector<CopyPoint> copies,
        RunCopyBench(*device, {.sizes = {s.chunk_bytes}, .bytes_per_size = 256 * kMiB}));
    for (const CopyPoint& p : copies) {
      (p.direction == "host_to_device" ? rates.host_to_device_bytes_per_second
                                       : rates.device_to_host_bytes_per_second) =
          p.bytes_per_second();
    }
  }
  if (!s.states) return rates;

  offload::PipelineBenchmarkOptions o;
  o.chunk_bytes = s.chunk_bytes;
  o.working_dtype = s.working_dtype;
  const double chunk_params = double(s.chunk_bytes) / DTypeSize(s.working_dtype);
  o.chunks = int(
      std::clamp(std::ceil(std::min(s.params, kMaxMeasuredParams) / chunk_params), 4.0, 1024.0));
  o.forward_ms = 0.0;
  o.backward_ms = 0.0;
  o.copy_gbps = 0.0;
  o.optimizer_states = Tier::kNvme;
  o.nvme_paths = {s.nvme_path};
  o.warmup_steps = 0;
  o.timed_steps = 1;
  progress("measuring the CPU optimizer and NVMe state traffic as the engine runs them (" +
           std::to_string(o.chunks) + " chunks in " + s.nvme_path + ")");
  STRATA_ASSIGN_OR_RETURN(offload::PipelineBenchmarkResult r, offload::RunPipelineBenchmark(o));
  rates.nvme_read_bytes_per_second = RateOf(r, "nvme_read");
  rates.nvme_write_bytes_per_second = RateOf(r, "nvme_write");
  for (const offload::ResourceTime& t : r.resources) {
    if (t.name == "cpu_adam" && t.seconds > 0) {
      rates.optimizer_params_per_second = double(r.params) / t.seconds;
    }
  }
  return rates;
}

}  // namespace strata::tools
