#include "plan_measure.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "copy_bench.h"
#include "strata/core/bytes.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/pipeline_benchmark.h"

namespace strata::tools {
namespace {

/// The rates of the engine's access pattern do not depend on the model's size: a small model
/// is measured on this much state traffic per direction (short passes on a shared disk are
/// noise), a large one on at most kMaxMeasuredParams of it.
constexpr double kMinMeasuredStateBytes = 256.0 * kMiB;
constexpr double kMaxMeasuredParams = 32.0 * kMiB;

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
  const double chunk_state_bytes = double(offload::ChunkStateBytes(size_t(chunk_params)));
  o.chunks =
      int(std::clamp(std::ceil(std::max(std::min(s.params, kMaxMeasuredParams) / chunk_params,
                                        kMinMeasuredStateBytes / chunk_state_bytes)),
                     4.0, 1024.0));
  o.forward_ms = 0.0;
  o.backward_ms = 0.0;
  o.copy_gbps = 0.0;
  o.optimizer_states = Tier::kNvme;
  o.nvme_paths = {s.nvme_path};
  progress("measuring the CPU optimizer and NVMe state traffic as the engine runs them (" +
           std::to_string(o.chunks) + " chunks in " + s.nvme_path + ")");
  STRATA_ASSIGN_OR_RETURN(std::vector<offload::ResourceTime> alone, offload::TimeResourcesAlone(o));
  for (const offload::ResourceTime& r : alone) {
    if (r.seconds <= 0) continue;
    if (r.name == "nvme_read") rates.nvme_read_bytes_per_second = double(r.bytes) / r.seconds;
    if (r.name == "nvme_write") rates.nvme_write_bytes_per_second = double(r.bytes) / r.seconds;
    if (r.name == "cpu_adam") {
      rates.optimizer_params_per_second = double(o.chunks) * chunk_params / r.seconds;
    }
  }
  return rates;
}

}  // namespace strata::tools
