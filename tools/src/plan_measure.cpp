#include "plan_measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <string>
#include <vector>

#include "copy_bench.h"
#include "strata/core/bytes.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/pipeline_benchmark.h"

namespace strata::tools {
namespace {

/// A small model is measured on this much state traffic per direction (short passes on a shared
/// disk are noise), its own chunks' NVMe states round after round; a large one on at most
/// kMaxMeasuredParams of it.
constexpr double kMinMeasuredStateBytes = 256.0 * kMiB;
constexpr double kMaxMeasuredParams = 32.0 * kMiB;

/// Bytes per second the ranks' collectives cover, as the plan counts them (a reduce-scatter or
/// all-gather of a chunk counts the chunk's bytes): rounds of a reduce-scatter and an all-gather
/// of one chunk, as the engine runs them each step, timed from a common start to the slowest
/// rank's end.
Result<double> MeasureLink(offload::Communicator& comm, uint64_t chunk_bytes, DType dtype) {
  const size_t ranks = size_t(comm.size());
  const size_t element = DTypeSize(dtype);
  const size_t shard = std::max<size_t>(1, chunk_bytes / element / ranks);
  const size_t bytes = shard * ranks * element;
  const int rounds = int(std::clamp<uint64_t>(256 * kMiB / bytes, 4, 64));
  std::vector<std::byte> whole(bytes, std::byte{0}), part(shard * element, std::byte{0});
  std::vector<double> clock = {0.0};
  STRATA_RETURN_IF_ERROR(comm.AllReduceNow(clock, offload::ReduceOp::kMax));  // A common start.
  const auto start = std::chrono::steady_clock::now();
  std::promise<Status> finished;
  std::future<Status> done = finished.get_future();
  int left = 2 * rounds;
  Status first;
  auto count = [&](Status status) {  // On the communicator's thread, one at a time.
    if (first.ok()) first = status;
    if (--left == 0) finished.set_value(first);
  };
  for (int r = 0; r < rounds; ++r) {
    comm.ReduceScatter(whole.data(), part.data(), shard, dtype, offload::ReduceOp::kSum, {}, count);
    comm.AllGather(part.data(), whole.data(), shard, dtype, {}, count);
  }
  if (Status status = done.get(); !status.ok()) {
    // A collective that timed out may still complete and write them: they stay, as the MPI
    // communicator keeps its own (the process exits on this error).
    static_cast<void>(new std::vector<std::byte>(std::move(whole)));
    static_cast<void>(new std::vector<std::byte>(std::move(part)));
    return status;
  }
  clock[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  STRATA_RETURN_IF_ERROR(comm.AllReduceNow(clock, offload::ReduceOp::kMax));
  return clock[0] > 0 ? 2.0 * rounds * double(bytes) / clock[0] : 0.0;
}

}  // namespace

Result<offload::MachineRates> MeasureRates(const MeasureSettings& s) {
  auto progress = [&](const std::string& line) {
    if (s.progress) s.progress(line);
  };
  offload::MachineRates rates;

  if (s.ranks != nullptr && s.ranks->size() > 1) {
    progress("measuring the link: reduce-scatters and all-gathers of " +
             FormatBytes(s.chunk_bytes) + " across " + std::to_string(s.ranks->size()) + " ranks");
    STRATA_ASSIGN_OR_RETURN(rates.link_bytes_per_second,
                            MeasureLink(*s.ranks, s.chunk_bytes, s.working_dtype));
  }
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
  const double model_chunks = std::ceil(std::min(s.params, kMaxMeasuredParams) / chunk_params);
  o.chunks = int(std::clamp(
      std::max(model_chunks, std::ceil(kMinMeasuredStateBytes / chunk_state_bytes)), 4.0, 1024.0));
  // The model's own states are what the engine cycles through each step: on a drive whose cache
  // holds a small model's (a virtual disk's, an SSD's), cycling through more is slower.
  o.nvme_working_set_chunks = int(std::clamp(model_chunks, 1.0, double(o.chunks)));
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
