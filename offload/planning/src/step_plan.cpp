#include "strata/offload/step_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "engine/host_memory.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/offload/chunk_layout.h"

namespace strata::offload {
namespace {

/// Adds a resource's time for `amount` at `rate`; an unknown rate is recorded, not guessed.
class ResourceTally {
 public:
  explicit ResourceTally(StepPrediction& prediction) : p_(prediction) {}

  double Add(const std::string& name, double amount, double rate, const std::string& rate_name) {
    if (amount <= 0.0) return 0.0;
    if (rate <= 0.0) {
      if (std::find(p_.unknown.begin(), p_.unknown.end(), rate_name) == p_.unknown.end()) {
        p_.unknown.push_back(rate_name);
      }
      return 0.0;
    }
    const double seconds = amount / rate;
    auto it = std::find_if(p_.resources.begin(), p_.resources.end(),
                           [&](const ResourceSeconds& r) { return r.name == name; });
    if (it == p_.resources.end()) {
      p_.resources.push_back({name, seconds});
    } else {
      it->seconds += seconds;
    }
    return seconds;
  }

 private:
  StepPrediction& p_;
};

/// The share of a step's NVMe state reads the engine's staging buffers can hold read ahead of
/// backward, as the engine sizes them by default (host_memory.h); all when the node's host
/// memory is not known.
double StateReadAheadShare(const PlanInput& in, const PlanRow& row, const MachineMemory& memory) {
  const double chunk_params = double(in.chunk_bytes) / DTypeSize(in.working_dtype);
  const double chunk_states = chunk_params * OptimizerBytesPerParam(in.optimizer, in.working_dtype);
  if (!(row.nvme.optimizer_states > 0) || !(chunk_states > 0)) return 1.0;
  const double chunks = std::ceil(row.nvme.optimizer_states / chunk_states);
  const uint64_t buffer = AlignUp(ChunkStateBytes(size_t(chunk_params)), kHostAlignment);
  // A rank's share of the engine's automatic budget, after the host-kept state it holds.
  const double budget =
      double(kAutomaticHostBudgetPercent) / 100 * memory.host_bytes / in.gpus - row.host.total();
  const uint64_t free = memory.host_bytes > 0 ? uint64_t(std::max(0.0, budget)) : UINT64_MAX;
  // What speculative updates of gated steps keep in host memory instead: a second buffer of
  // the host-kept states, and the parameters from before of NVMe-kept chunks on the device.
  double speculation = 0.0;
  if (in.speculative_updates && (in.gradient_clipping > 0 || in.working_dtype == DType::kFp16)) {
    speculation = row.host.optimizer_states;
    if (row.params == Tier::kDevice) {
      speculation += row.nvme.optimizer_states / chunk_states * double(in.chunk_bytes);
    }
  }
  const int buffers = StateBufferCount(HostOptions{}, size_t(chunks), buffer,
                                       StateStagingRoom(free, uint64_t(speculation)));
  return std::min(1.0, double(buffers - 1) / chunks);
}

std::string Over(const char* tier, double need, double budget) {
  return std::string(tier) + " needs " + FormatBytes(uint64_t(need)) + " of " +
         FormatBytes(uint64_t(budget));
}

}  // namespace

StepPrediction PredictStep(const PlanInput& in, const PlanRow& row, const MachineRates& rates,
                           const MachineMemory& memory) {
  StepPrediction p;
  ResourceTally tally(p);
  const double psi = in.params;
  const double n = in.gpus;
  const double w = DTypeSize(in.working_dtype);
  const bool offload_optimizer = row.optimizer_states != Tier::kDevice;
  const bool offload_params = row.params != Tier::kDevice;

  const double compute = std::max(0.0, rates.compute_seconds);
  if (compute > 0.0) p.resources.push_back({"compute", compute});

  // Forward and backward: compute, fetches of offloaded parameters and collectives overlap.
  double fetch = 0.0;       // The longer of the two fetch paths, over both phases.
  double nvme_fetch = 0.0;  // Its NVMe reads.
  if (offload_params) {
    fetch = tally.Add("host_to_device", 2 * w * psi / n, rates.host_to_device_bytes_per_second,
                      "host->device");
    if (row.params == Tier::kNvme) {
      nvme_fetch = tally.Add("nvme", 2 * w * psi, rates.nvme_read_bytes_per_second, "nvme read");
      fetch = std::max(fetch, nvme_fetch);
    }
  }
  const double link =
      n > 1 ? tally.Add("link", row.comm_bytes, rates.link_bytes_per_second, "link") : 0.0;
  p.forward_seconds = std::max({compute / 3, fetch / 2, link / 2});
  p.backward_seconds = std::max({2 * compute / 3, fetch / 2, link / 2});

  const bool gated = in.working_dtype == DType::kFp16 || in.gradient_clipping > 0.0;
  const bool waits = gated && !in.speculative_updates;
  // The update pipeline of offloaded optimizer states costs its slowest stage.
  if (offload_optimizer) {
    const double d2h = tally.Add("device_to_host", w * psi / n,
                                 rates.device_to_host_bytes_per_second, "device->host");
    const double cpu =
        tally.Add("cpu_optimizer", psi, rates.optimizer_params_per_second, "optimizer params/s");
    // The new working parameters of device-home chunks go up in the pipeline, each as soon as
    // its chunk is updated.
    double h2d = 0.0;
    if (!offload_params) {
      h2d = tally.Add("host_to_device", w * psi / n, rates.host_to_device_bytes_per_second,
                      "host->device");
    }
    // Backward's parameter reads share the drives with the states' traffic.
    double nvme = nvme_fetch / 2;
    double read_ahead = 0.0;  // State reads that can run before the first gradients land.
    if (row.optimizer_states == Tier::kNvme) {
      // Every rank's share that lives there (a split placement keeps part in host memory).
      const double states = n * row.nvme.optimizer_states;
      const double reads = tally.Add("nvme", states, rates.nvme_read_bytes_per_second, "nvme read");
      nvme += reads + tally.Add("nvme", states, rates.nvme_write_bytes_per_second, "nvme write");
      read_ahead = reads * StateReadAheadShare(in, row, memory);
    }
    if (row.params == Tier::kNvme) {
      nvme += tally.Add("nvme", w * psi, rates.nvme_write_bytes_per_second, "nvme write");
    }
    // Reads ahead run while the drives would idle: during forward, and during backward too
    // when the update waits for its end. What is left of the drives' work follows.
    const double before_update = waits ? p.forward_seconds + p.backward_seconds : p.forward_seconds;
    nvme -= std::min(read_ahead, before_update);
    p.update_seconds = std::max({d2h, cpu, h2d, nvme});
  }
  if (in.delayed_update && offload_optimizer) {
    // The update has a whole step to run in: from its gradients to the next step's.
    p.step_seconds =
        std::max(p.forward_seconds + p.backward_seconds, p.update_seconds) + p.commit_seconds;
  } else {
    p.step_seconds = p.forward_seconds +
                     (waits ? p.backward_seconds + p.update_seconds
                            : std::max(p.backward_seconds, p.update_seconds)) +
                     p.commit_seconds;
  }
  double most = 0.0;
  for (const ResourceSeconds& r : p.resources) {
    if (r.seconds > most) {
      most = r.seconds;
      p.bound_by = r.name;
    }
  }
  // No overlap makes a step shorter than the busiest resource's own work.
  p.step_seconds = std::max(p.step_seconds, most);

  const double device_need = row.device.total();
  const double host_need = n * row.host.total();
  const double nvme_need = kNvmeShadowFactor * n * row.nvme.total();
  std::vector<std::string> over;
  if (memory.device_bytes > 0 && device_need > memory.device_bytes) {
    over.push_back(Over("GPU", device_need, memory.device_bytes));
  }
  if (memory.host_bytes > 0 && host_need > memory.host_bytes) {
    over.push_back(Over("host", host_need, memory.host_bytes));
  }
  if (memory.nvme_bytes > 0 && nvme_need > memory.nvme_bytes) {
    over.push_back(Over("nvme", nvme_need, memory.nvme_bytes));
  }
  p.fits = over.empty();
  for (size_t i = 0; i < over.size(); ++i) p.why_not += (i ? "; " : "") + over[i];
  return p;
}

int ChoosePlacement(const std::vector<StepPrediction>& predictions) {
  // A step time with a rate missing is a lower bound: it only competes when no complete one fits.
  for (bool need_known : {true, false}) {
    int best = -1;
    for (int i = 0; i < int(predictions.size()); ++i) {
      const StepPrediction& p = predictions[i];
      if (!p.fits || (need_known && !p.unknown.empty())) continue;
      if (best < 0 || p.step_seconds < 0.98 * predictions[best].step_seconds) best = i;
    }
    if (best >= 0) return best;
  }
  return -1;
}

}  // namespace strata::offload
