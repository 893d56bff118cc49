// Checkpoint reads: the manifest checked, every file verified against its recorded size and
// XXH3-64 as it is read.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <memory>
#include <new>
#include <string>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/checkpoint_ownership.h"
#include "strata/core/input_file.h"
#include "strata/core/log.h"

namespace strata::offload::internal {

namespace fs = std::filesystem;

namespace {

constexpr size_t kDigestBufferBytes = size_t{1} << 20;

}  // namespace

Result<FileDigest> DigestFile(const fs::path& path) {
  STRATA_ASSIGN_OR_RETURN(InputFile file, OpenInputFile(path.string(), kCheckpointDataInput));
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[kDigestBufferBytes]);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (buffer == nullptr || state == nullptr) {
    return ResourceExhausted("out of memory while hashing " + path.string());
  }
  XXH3_64bits_reset(state.get());
  FileDigest digest;
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(const size_t n, file.Read(buffer.get(), kDigestBufferBytes));
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buffer.get(), n);
    digest.bytes += n;
  }
  digest.xxh3 = XXH3_64bits_digest(state.get());
  return digest;
}

// ------------------------------------------------------------------------------------------------
// CheckpointReader.

Result<CheckpointReader> CheckpointReader::Open(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return NotFound(dir.string() + " is not a Strata checkpoint: the directory does not exist");
    }
    return ErrnoError("cannot open checkpoint " + dir.string(), err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument(dir.string() +
                           " is not a Strata checkpoint: it is a file; a checkpoint is a "
                           "directory holding manifest.json");
  }
  const fs::path manifest_path = dir / std::string(kManifestFileName);
  try {
    Result<CheckedManifest> manifest = ReadManifest(manifest_path);
    if (!manifest.ok() && manifest.status().code() == StatusCode::kNotFound) {
      return NotFound(dir.string() + " is not a Strata checkpoint: its manifest " +
                      manifest_path.string() + " is missing");
    }
    STRATA_RETURN_IF_ERROR(manifest.status());
    if (manifest->legacy) {
      Log(LogLevel::kWarning, "checkpoint manifest " + manifest_path.string() +
                                  " has no checksum (written by an older Strata, or the checksum "
                                  "was removed by hand): its fields are taken as they are; the "
                                  "data files' checksums are still checked");
    }
    nlohmann::json checked = std::move(manifest->json);
    // The file layer's own members, verified and used here; the caller gets what it committed.
    checked.erase("checksum");
    checked.erase("contents");
    return CheckpointReader(dir, std::move(checked));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory while reading " + manifest_path.string());
  } catch (const std::exception& e) {
    return Internal("unexpected error while reading " + manifest_path.string() + ": " + e.what());
  }
}

Status CheckpointReader::ReadFile(std::string_view name, const FileDigest& expected,
                                  const ConsumeFn& consume, size_t piece_bytes) const {
  STRATA_RETURN_IF_ERROR(ValidateFileName(name));
  if (piece_bytes == 0) {
    return InvalidArgument("ReadFile of checkpoint file \"" + std::string(name) +
                           "\": piece_bytes must be positive");
  }
  const fs::path path = dir_ / std::string(name);
  Result<InputFile> file = OpenInputFile(path.string(), kCheckpointDataInput);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return DataLoss("checkpoint " + dir_.string() + " is incomplete: file " + std::string(name) +
                      " is missing");
    }
    return file.status().code() == StatusCode::kInvalidArgument ? DataLoss(file.status().message())
                                                                : file.status();
  }
  const std::string expected_text =
      std::to_string(expected.bytes) + " bytes with xxh3 " + Hex(expected.xxh3);
  if (file->size() != expected.bytes) {
    return DataLoss("checkpoint file " + path.string() + " is " +
                    (file->size() < expected.bytes ? "truncated" : "longer than written") +
                    ": it has " + std::to_string(file->size()) + " bytes, the manifest expects " +
                    expected_text);
  }
  ::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_SEQUENTIAL);

  const size_t buffer_bytes =
      static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(piece_bytes, expected.bytes)));
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[buffer_bytes]);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (buffer == nullptr || state == nullptr) {
    return ResourceExhausted("out of memory for a " + std::to_string(buffer_bytes) +
                             "-byte read buffer for " + path.string() + "; lower piece_bytes");
  }
  XXH3_64bits_reset(state.get());

  uint64_t offset = 0;
  while (offset < expected.bytes) {
    const size_t want =
        static_cast<size_t>(std::min<uint64_t>(buffer_bytes, expected.bytes - offset));
    Result<size_t> n = file->Read(buffer.get(), want);
    if (!n.ok()) return n.status().WithContext("at offset " + std::to_string(offset));
    if (*n < want) {  // Shrunk since fstat.
      return DataLoss("checkpoint file " + path.string() + " is truncated: it ended after " +
                      std::to_string(offset + *n) + " bytes, the manifest expects " +
                      expected_text);
    }
    XXH3_64bits_update(state.get(), buffer.get(), want);
    STRATA_RETURN_IF_ERROR(consume(std::span<const std::byte>(buffer.get(), want), offset));
    offset += want;
  }
  std::byte extra[1];
  STRATA_ASSIGN_OR_RETURN(const size_t tail, file->Read(extra, 1));
  if (tail > 0) {  // Grew since fstat.
    return DataLoss("checkpoint file " + path.string() +
                    " is longer than written: it has more than the " + expected_text +
                    " the manifest expects");
  }
  const uint64_t actual = XXH3_64bits_digest(state.get());
  if (actual != expected.xxh3) {
    return DataLoss("checkpoint file " + path.string() +
                    " is corrupt: its content does not match its checksum: expected " +
                    expected_text + ", found " + std::to_string(offset) + " bytes with xxh3 " +
                    Hex(actual));
  }
  return Status::Ok();
}

}  // namespace strata::offload::internal
