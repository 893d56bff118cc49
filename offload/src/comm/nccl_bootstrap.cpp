#include "comm/nccl_bootstrap.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>
#include <thread>

namespace strata::offload::internal {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

Result<std::vector<std::byte>> OverCommunicator(Communicator& bootstrap, int rank,
                                                std::span<const std::byte> id) {
  // Whole words, every rank's in rank order; rank 0's are the id.
  const size_t words = (id.size() + sizeof(uint64_t) - 1) / sizeof(uint64_t);
  std::vector<uint64_t> send(words, 0);
  if (rank == 0) std::memcpy(send.data(), id.data(), id.size());
  std::vector<uint64_t> all(words * size_t(bootstrap.size()));
  STRATA_RETURN_IF_ERROR(
      bootstrap.AllGatherNow(send, all).WithContext("sharing the NCCL id over the bootstrap"));
  std::vector<std::byte> shared(id.size());
  std::memcpy(shared.data(), all.data(), id.size());
  return shared;
}

Status WriteAtomically(const fs::path& file, std::span<const std::byte> id) {
  // Written beside it and renamed: a reader sees no file or the whole id, never part of it.
  const fs::path staged = file.string() + ".tmp-" + std::to_string(::getpid());
  std::FILE* out = std::fopen(staged.c_str(), "wb");
  if (out == nullptr) return ErrnoError("creating " + staged.string(), errno);
  const bool written = std::fwrite(id.data(), 1, id.size(), out) == id.size() &&
                       std::fflush(out) == 0 && ::fsync(::fileno(out)) == 0;
  const int err = errno;
  std::fclose(out);
  if (!written) {
    fs::remove(staged);
    return ErrnoError("writing " + staged.string(), err);
  }
  std::error_code error;
  fs::rename(staged, file, error);
  if (error) {
    fs::remove(staged);
    return IoError("renaming " + staged.string() + " to " + file.string() + ": " + error.message());
  }
  return Status();
}

Result<std::vector<std::byte>> ThroughFile(const IdExchange& how, size_t bytes) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(how.timeout_seconds);
  for (;;) {
    std::error_code error;
    if (fs::file_size(how.file, error) == bytes && !error) {
      std::vector<std::byte> id(bytes);
      std::ifstream in(how.file, std::ios::binary);
      if (!in.read(reinterpret_cast<char*>(id.data()), std::streamsize(bytes))) {
        return IoError("reading the NCCL id from " + how.file.string());
      }
      return id;
    }
    if (Clock::now() > deadline) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g s", how.timeout_seconds);
      return Unavailable("rank " + std::to_string(how.rank) + ": rank 0 did not write the NCCL " +
                         "id to " + how.file.string() + " within " + seconds +
                         " (every rank must see that path, and rank 0 must have started)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

Result<std::vector<std::byte>> ShareFromRankZero(const IdExchange& how,
                                                 std::span<const std::byte> id) {
  if (how.bootstrap != nullptr) return OverCommunicator(*how.bootstrap, how.rank, id);
  if (how.file.empty()) {
    return InvalidArgument(
        "NCCL needs its id shared from rank 0: give a bootstrap communicator (MPI) or a file "
        "every rank sees");
  }
  if (how.rank == 0) {
    STRATA_RETURN_IF_ERROR(WriteAtomically(how.file, id));
    return std::vector<std::byte>(id.begin(), id.end());
  }
  return ThroughFile(how, id.size());
}

}  // namespace strata::offload::internal
