// A program outside the Strata tree, built against an installed Strata.
#include <cstdio>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/host_device.h"

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
  std::printf("consumer ok: zero stage %d, %s\n", config->options.placement.zero_stage,
              (*device)->properties().name.c_str());
  return 0;
}
