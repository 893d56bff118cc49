// Any bytes as a checkpoint's manifest.json: Open gives a reader or a clear error (DataLoss,
// InvalidArgument), never a crash or an exception; a reader's files are then read by the names
// the manifest gives, which must stay inside the checkpoint directory.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint_files.h"

namespace {

const std::filesystem::path& Dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = std::filesystem::temp_directory_path() /
                              ("strata-manifest-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(Dir() / "manifest.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  auto reader = strata::offload::internal::CheckpointReader::Open(Dir());
  if (!reader.ok()) return 0;
  const nlohmann::json& manifest = reader->manifest();
  auto chunks = manifest.find("chunks");
  if (chunks == manifest.end() || !chunks->is_array()) return 0;
  for (const nlohmann::json& chunk : *chunks) {
    if (!chunk.is_object() || !chunk.contains("file") || !chunk["file"].is_string()) continue;
    // A name like "../x" or "/etc/passwd" must be refused as such, not opened.
    const std::string name = chunk["file"].get<std::string>();
    const strata::Status read =
        reader->ReadFile(name, {.bytes = 0, .xxh3 = 0},
                         [](std::span<const std::byte>, uint64_t) { return strata::Status(); });
    const bool unsafe = name.empty() || name == "." || name == ".." ||
                        name.find('/') != std::string::npos || name.find('\0') != std::string::npos;
    if (unsafe && read.code() != strata::StatusCode::kInvalidArgument) __builtin_trap();
  }
  return 0;
}
