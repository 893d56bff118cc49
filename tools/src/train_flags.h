// What `strata train`'s command line asked for (train_command.cpp parses it; the setup and the
// report read it).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace strata::tools {

/// An integer flag's value when it was not given.
constexpr int64_t kNotGiven = std::numeric_limits<int64_t>::min();

/// Everything the command line asked for; empty/negative/NaN/kNotGiven means "not given".
struct TrainFlags {
  std::string config, model = "small", offload_optimizer, offload_params, nvme_path, device,
                      precision, checkpoint, resume, data = STRATA_CORPUS_PATH,
                      metrics_address = "127.0.0.1";
  int64_t layers = -1, width = -1, context = -1, steps = 150, batch = -1, seq = 128, seed = 1,
          checkpoint_every = 0, metrics_port = kNotGiven, eval_every = 50, zero_stage = -1,
          zero_quantized_gradient_bits = -1;
  uint64_t device_memory = 0, host_memory = 0, chunk_size = 0, max_states_in_host = 0;
  int64_t delayed_update_from = -1;
  double lr = std::numeric_limits<double>::quiet_NaN();
  double collective_timeout = std::numeric_limits<double>::quiet_NaN();
  bool json = false, delayed_update = false, zero_quantized_weights = false,
       zero_quantized_gradients = false;
};

}  // namespace strata::tools
