// `strata info`: what this machine offers an offload engine, as a table or as JSON.
#include <tbb/version.h>
#include <xxhash.h>

#include <boost/version.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "flags.h"
#include "strata/core/bytes.h"
#include "strata/core/cuda_device.h"
#include "strata/core/filesystem.h"
#include "system_info.h"

namespace strata::tools {
namespace {

using nlohmann::ordered_json;

std::string LimitText(uint64_t bytes) {
  return bytes == UINT64_MAX ? "unlimited" : FormatBytes(bytes);
}

ordered_json LimitJson(uint64_t bytes) {
  return bytes == UINT64_MAX ? ordered_json("unlimited") : ordered_json(bytes);
}

ordered_json Versions() {
  ordered_json v;
  v["strata"] = STRATA_VERSION;
  v["compiler"] = __VERSION__;
  v["boost"] = std::to_string(BOOST_VERSION / 100000) + "." +
               std::to_string(BOOST_VERSION / 100 % 1000) + "." +
               std::to_string(BOOST_VERSION % 100);
  v["onetbb"] = TBB_runtime_version();
  v["liburing"] = STRATA_LIBURING_VERSION;
  const unsigned xxh = XXH_versionNumber();
  v["xxhash"] = std::to_string(xxh / 10000) + "." + std::to_string(xxh / 100 % 100) + "." +
                std::to_string(xxh % 100);
  v["eigen"] = STRATA_EIGEN_VERSION;
  v["nlohmann_json"] = std::to_string(NLOHMANN_JSON_VERSION_MAJOR) + "." +
                       std::to_string(NLOHMANN_JSON_VERSION_MINOR) + "." +
                       std::to_string(NLOHMANN_JSON_VERSION_PATCH);
  auto cuda = CudaVersionString();
  v["cuda"] = cuda.ok() ? *cuda : "not available";
  return v;
}

ordered_json CudaJson() {
  ordered_json j;
  j["built"] = BuiltWithCuda();
  auto devices = ListCudaDevices();
  j["available"] = devices.ok();
  if (!devices.ok()) {
    j["reason"] = devices.status().message();
    j["devices"] = ordered_json::array();
    return j;
  }
  for (const CudaDeviceInfo& d : *devices) {
    ordered_json dj;
    dj["index"] = d.index;
    dj["name"] = d.properties.name;
    dj["compute_capability"] = std::to_string(d.compute_capability_major) + "." +
                               std::to_string(d.compute_capability_minor);
    dj["total_memory_bytes"] = d.properties.total_memory_bytes;
    dj["free_memory_bytes"] = d.free_memory_bytes;
    dj["pci_bus_id"] = d.properties.pci_bus_id;
    dj["pcie_generation"] = d.properties.pcie_generation;
    dj["pcie_width"] = d.properties.pcie_width;
    j["devices"].push_back(dj);
  }
  return j;
}

/// Everything `strata info` shows, probed once and rendered as a table or as JSON.
struct Report {
  CpuInfo cpu;
  MemoryInfo memory;
  ordered_json json;
};

Report BuildReport(const std::string& path) {
  Report result{ProbeCpu(), ProbeMemory(), {}};
  ordered_json& report = result.json;
  const CpuInfo& cpu = result.cpu;
  const CpuFeatures& f = cpu.features;
  report["cpu"] = {{"model", cpu.model},
                   {"physical_cores", cpu.physical_cores},
                   {"logical_cpus", cpu.logical_cpus},
                   {"simd",
                    {{"avx2", f.avx2},
                     {"fma", f.fma},
                     {"f16c", f.f16c},
                     {"avx512f", f.avx512f},
                     {"avx512bw", f.avx512bw},
                     {"avx512vl", f.avx512vl},
                     {"avx512bf16", f.avx512bf16}}}};
  const MemoryInfo& memory = result.memory;
  report["memory"] = {{"total_bytes", memory.total_bytes},
                      {"available_bytes", memory.available_bytes},
                      {"memlock_soft", LimitJson(memory.memlock_soft_bytes)},
                      {"memlock_hard", LimitJson(memory.memlock_hard_bytes)}};
  const IoUringInfo uring = ProbeIoUring();
  report["io_uring"] = {{"available", uring.available},
                        {"reason", uring.reason},
                        {"single_issuer_defer_taskrun", uring.defer_taskrun}};
  if (!path.empty()) {
    auto fs = ProbeFilesystem(path);
    if (fs.ok()) {
      report["path"] = {{"path", fs->path},
                        {"filesystem", fs->type},
                        {"total_bytes", fs->total_bytes},
                        {"free_bytes", fs->free_bytes},
                        {"direct_io", fs->direct_io_supported},
                        {"direct_io_error", fs->direct_io_error},
                        {"direct_io_memory_alignment", fs->direct_io_memory_alignment},
                        {"direct_io_offset_alignment", fs->direct_io_offset_alignment},
                        {"alignment_source", fs->alignment_source}};
    } else {
      report["path"] = {{"path", path}, {"error", fs.status().message()}};
    }
  }
  report["cuda"] = CudaJson();
  report["versions"] = Versions();
  return result;
}

void PrintRow(const std::string& key, const std::string& value) {
  std::printf("  %-22s %s\n", key.c_str(), value.c_str());
}

std::string YesNo(bool b) { return b ? "yes" : "no"; }

void PrintTable(const Report& report) {
  const ordered_json& r = report.json;
  const CpuInfo& cpu = report.cpu;
  std::printf("CPU\n");
  PrintRow("model", r["cpu"]["model"]);
  PrintRow("cores", std::to_string(cpu.physical_cores) + " physical, " +
                        std::to_string(cpu.logical_cpus) + " logical");
  PrintRow("SIMD", CpuFeaturesString(cpu.features));

  const auto& m = r["memory"];
  std::printf("Memory\n");
  PrintRow("total", FormatBytes(m["total_bytes"].get<uint64_t>()));
  PrintRow("available", FormatBytes(m["available_bytes"].get<uint64_t>()));
  const MemoryInfo& memory = report.memory;
  PrintRow("RLIMIT_MEMLOCK", LimitText(memory.memlock_soft_bytes) + " (hard " +
                                 LimitText(memory.memlock_hard_bytes) + ")");

  const auto& u = r["io_uring"];
  std::printf("io_uring\n");
  PrintRow("available",
           u["available"].get<bool>() ? "yes" : "no: " + u["reason"].get<std::string>());
  PrintRow("defer_taskrun", YesNo(u["single_issuer_defer_taskrun"].get<bool>()));

  if (r.contains("path")) {
    const auto& p = r["path"];
    std::printf("Path %s\n", p["path"].get<std::string>().c_str());
    if (p.contains("error")) {
      PrintRow("error", p["error"]);
    } else {
      PrintRow("filesystem", p["filesystem"]);
      PrintRow("space", FormatBytes(p["free_bytes"].get<uint64_t>()) + " free of " +
                            FormatBytes(p["total_bytes"].get<uint64_t>()));
      PrintRow("O_DIRECT", p["direct_io"].get<bool>()
                               ? "yes"
                               : "no: " + p["direct_io_error"].get<std::string>());
      PrintRow("O_DIRECT alignment",
               std::to_string(p["direct_io_offset_alignment"].get<uint32_t>()) + " B offsets, " +
                   std::to_string(p["direct_io_memory_alignment"].get<uint32_t>()) + " B memory (" +
                   p["alignment_source"].get<std::string>() + ")");
    }
  }

  const auto& c = r["cuda"];
  std::printf("CUDA\n");
  PrintRow("built with CUDA", YesNo(c["built"].get<bool>()));
  if (!c["available"].get<bool>()) {
    PrintRow("devices", "none: " + c["reason"].get<std::string>());
  }
  for (const auto& d : c["devices"]) {
    std::string link = d["pcie_generation"].get<int>() > 0
                           ? ", PCIe gen " + std::to_string(d["pcie_generation"].get<int>()) +
                                 " x" + std::to_string(d["pcie_width"].get<int>())
                           : "";
    PrintRow("device " + std::to_string(d["index"].get<int>()),
             d["name"].get<std::string>() + ", " +
                 FormatBytes(d["total_memory_bytes"].get<uint64_t>()) + " (" +
                 FormatBytes(d["free_memory_bytes"].get<uint64_t>()) + " free), sm " +
                 d["compute_capability"].get<std::string>() + link);
  }

  std::printf("Libraries\n");
  for (const auto& [name, version] : r["versions"].items()) {
    PrintRow(name, version.get<std::string>());
  }
}

}  // namespace

int RunInfo(const std::vector<std::string>& args) {
  std::string path;
  bool json = false;
  FlagParser flags("strata info",
                   "Show the CPU, memory, io_uring, file-system and GPU facts that matter for "
                   "offloading training state.");
  flags.AddString("path", &path, "DIR", "also probe this directory (file system, O_DIRECT)");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (const std::optional<int> done = ParseFlags(flags, args, "strata info")) return *done;
  const Report report = BuildReport(path);
  if (json) {
    std::cout << report.json.dump(2) << "\n";
  } else {
    PrintTable(report);
  }
  if (report.json.contains("path") && report.json["path"].contains("error")) {
    return Fail(kExitFailure, report.json["path"]["error"].get<std::string>());
  }
  return kExitOk;
}

}  // namespace strata::tools
