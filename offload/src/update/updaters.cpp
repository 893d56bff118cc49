// The updaters the engine may use, in order of preference. An updater for states kept on a GPU
// (the optimizer step as device kernels) is registered here: a line in kRegistered.
#include "update/cpu_updater.h"
#include "update/updater.h"

#include <string>

namespace strata::offload {
namespace {

struct Registration {
  /// Whether it steps states kept in `tier` beside `device`.
  bool (*serves)(const Device& device, Tier tier);
  Result<std::unique_ptr<Updater>> (*make)(const UpdaterContext& context);
};

constexpr Registration kRegistered[] = {
    {&CpuUpdater::Serves, &CpuUpdater::Make},
};

const Registration* Serving(const Device& device, Tier tier) {
  for (const Registration& r : kRegistered) {
    if (r.serves(device, tier)) return &r;
  }
  return nullptr;
}

}  // namespace

Status Updaters::CheckDeviceStatesServed(const Device& device) {
  if (Serving(device, Tier::kDevice) != nullptr) return Status();
  const DeviceProperties& properties = device.properties();
  return Unavailable("optimizer steps over states kept in the memory of " + properties.name +
                     ", a " + std::string(DeviceKindName(properties.kind)) +
                     " device, are not built yet: no updater serves it (the GPU kernels come "
                     "with one); place optimizer states on host or nvme with offload_ratio 1");
}

Result<Updaters> Updaters::Create(const UpdaterContext& context) {
  Updaters updaters;
  const Registration* host = Serving(context.device, Tier::kHost);
  if (host == nullptr) return Internal("no updater serves host-kept states");
  STRATA_ASSIGN_OR_RETURN(updaters.host_, host->make(context));
  if (const Registration* device = Serving(context.device, Tier::kDevice); device != nullptr) {
    STRATA_ASSIGN_OR_RETURN(updaters.device_, device->make(context));
  }
  return updaters;
}

}  // namespace strata::offload
