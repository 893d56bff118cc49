// A program outside the Strata tree, built against an installed Strata.
#include <cstdio>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/host_device.h"
#include "strata/offload/engine.h"

int main() {
  auto config = strata::ParseConfig(R"({"zero_optimization": {"stage": 3}})");
  if (!config.ok()) {
    std::fprintf(stderr, "config: %s\n", config.status().ToString().c_str());
    return 1;
  }
  auto device = strata::CreateHostDevice();
  if (!device.ok()) return 1;
  std::vector<int> host = {1, 2, 3, 4}, back(4, 0);
  auto buffer = (*device)->Allocate(sizeof(int) * host.size());
  if (!buffer.ok()) return 1;
  if (!(*device)->CopyToDevice(buffer->data(), host.data(), buffer->size()).ok()) return 1;
  if (!(*device)
           ->CopyToHost(back.data(), buffer->data(), buffer->size(), strata::Stream::kHostToDevice)
           .ok()) {
    return 1;
  }
  if (!(*device)->SynchronizeStream(strata::Stream::kHostToDevice).ok() || back != host) return 1;
  // The offload engine on a one-parameter model, states on the host.
  strata::EngineOptions options;
  options.placement.chunk_bytes = 4096;
  const std::vector<float> init(1000, 0.5f);
  const std::vector<strata::offload::ParameterSpec> parameters = {{"w", {1000}, init}};
  auto engine = strata::offload::Engine::Create(options, **device, parameters);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::printf("consumer ok: zero stage %d, %s, %zu chunk(s)\n",
              config->options.placement.zero_stage, (*device)->properties().name.c_str(),
              (*engine)->chunk_count());
  return 0;
}
