// Any bytes as a checkpoint's manifest.json: Open gives a reader or a clear error (DataLoss,
// InvalidArgument), never a crash or an exception; a reader's files are then read by the names
// the manifest gives, which must stay inside the checkpoint directory; and what Load reads from
// it (ReadEngineManifest, for the layout of tests/offload/checkpoint_manifest_test.cpp) is a
// clear error or values in range. Each input is tried as it is (the checksum path: almost every
// mutation is refused there) and, when it is JSON, sealed again with its own checksum, so that
// the fields behind the checksum are fuzzed too. CheckReplaceable, which decides whether a save
// may replace the directory, answers OK or FailedPrecondition. Seed:
// tests/fuzz/corpus/manifest/engine.json.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_manifest.h"

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

/// A trained 64x64 weight in one chunk, a frozen bias in another (engine.json's layout).
const strata::offload::ChunkLayout& Layout() {
  static const strata::offload::ChunkLayout layout = [] {
    std::vector<strata::offload::ParameterSpec> specs(2);
    specs[0].name = "w";
    specs[0].shape = {64, 64};
    specs[1].name = "b";
    specs[1].shape = {64};
    specs[1].frozen = true;
    return std::move(strata::offload::ChunkLayout::Build(specs, strata::DType::kBf16, 8192))
        .value();
  }();
  return layout;
}

/// What Load would take from the manifest: an error, or values it can use as they are.
void CheckEngineFields(const nlohmann::json& manifest) {
  auto read = strata::offload::internal::ReadEngineManifest(manifest, Layout(),
                                                            strata::OptimizerType::kAdamW);
  if (!read.ok()) {
    const strata::StatusCode code = read.status().code();
    if (code != strata::StatusCode::kDataLoss && code != strata::StatusCode::kInvalidArgument) {
      __builtin_trap();
    }
    return;
  }
  if (read->step_count < 0 || read->step_count > (int64_t{1} << 53) ||
      !(read->scaler.scale > 0.0) || read->scaler.hysteresis_left < 1 ||
      read->chunks.size() != Layout().chunk_count() || read->world_size < 1 ||
      read->chunk_steps.size() != Layout().chunk_count()) {
    __builtin_trap();
  }
  for (int64_t steps : read->chunk_steps) {
    if (steps < 0 || steps > read->step_count) __builtin_trap();
  }
  // What Load's Scatter relies on: every file of a chunk the size its share of elements needs.
  for (const strata::offload::internal::SavedChunk& chunk : read->chunks) {
    if (chunk.files.empty() || chunk.files.size() != chunk.names.size() ||
        chunk.numel % chunk.files.size() != 0) {
      __builtin_trap();
    }
    const uint64_t per_file =
        chunk.numel / chunk.files.size() * sizeof(float) * (chunk.trained ? 3 : 1);
    for (const strata::offload::internal::FileDigest& file : chunk.files) {
      if (file.bytes != per_file) __builtin_trap();
    }
  }
}

void WriteManifest(const char* data, size_t size) {
  std::ofstream out(Dir() / "manifest.json", std::ios::binary | std::ios::trunc);
  out.write(data, std::streamsize(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  WriteManifest(reinterpret_cast<const char*>(data), size);
  auto reader = strata::offload::internal::CheckpointReader::Open(Dir());
  if (!reader.ok()) {
    const strata::StatusCode code = reader.status().code();
    if (code != strata::StatusCode::kDataLoss && code != strata::StatusCode::kInvalidArgument) {
      __builtin_trap();
    }
    // Sealed with its own checksum: the same content gets past it to the fields.
    nlohmann::json parsed = nlohmann::json::parse(data, data + size, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) return 0;
    const std::string checksum = strata::offload::internal::ManifestChecksum(parsed);
    parsed["checksum"] = checksum;
    std::string text;
    try {
      text = parsed.dump();
    } catch (const nlohmann::json::exception&) {
      return 0;  // Not UTF-8: never written by Commit.
    }
    WriteManifest(text.data(), text.size());
    reader = strata::offload::internal::CheckpointReader::Open(Dir());
    if (!reader.ok()) return 0;
  }
  const strata::StatusCode replaceable = strata::offload::internal::CheckReplaceable(Dir()).code();
  if (replaceable != strata::StatusCode::kOk &&
      replaceable != strata::StatusCode::kFailedPrecondition) {
    __builtin_trap();
  }
  const nlohmann::json& manifest = reader->manifest();
  CheckEngineFields(manifest);
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
