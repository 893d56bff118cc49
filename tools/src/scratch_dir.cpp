#include "scratch_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <vector>

#include "commands.h"
#include "strata/core/log.h"
#include "strata/nvme/swap_space.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kMarker = ".strata-scratch";

/// The pid in "<prefix>-<pid>-XXXXXX" (six characters of mkdtemp's), else 0.
pid_t OwnerPid(std::string_view name, const std::string& prefix) {
  if (name.size() < prefix.size() + 1 + 1 + 7 || !name.starts_with(prefix) ||
      name[prefix.size()] != '-' || name[name.size() - 7] != '-') {
    return 0;
  }
  const char* first = name.data() + prefix.size() + 1;
  const char* last = name.data() + name.size() - 7;
  int64_t pid = 0;
  const auto [end, ec] = std::from_chars(first, last, pid);
  if (ec != std::errc() || end != last || pid <= 0 || pid > INT32_MAX) return 0;
  return static_cast<pid_t>(pid);
}

/// Removes a scratch folder's marker and swap files, then the folder if that emptied it.
/// False (and nothing more removed) when it has no marker, so is not provably Strata's.
bool RemoveScratch(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(dir / std::string(kMarker), ec))) return false;
  std::vector<fs::path> ours;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == kMarker || nvme::SwapFilePid(name) != 0) ours.push_back(it->path());
  }
  for (const fs::path& path : ours) fs::remove(path, ec);
  return fs::remove(dir, ec);  // Fails, leaving it, if anything else is in it.
}

void RemoveDeadRuns(const fs::path& parent, const std::string& prefix) {
  std::error_code ec;
  std::vector<fs::path> dead;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const pid_t pid = OwnerPid(it->path().filename().string(), prefix);
    if (pid > 0 && pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) {
      dead.push_back(it->path());
    }
  }
  for (const fs::path& dir : dead) {
    if (RemoveScratch(dir)) {
      Log(LogLevel::kWarning, "removed " + dir.string() +
                                  ", the scratch folder of a run that "
                                  "did not end cleanly");
    }
  }
}

}  // namespace

ScratchDir::~ScratchDir() { Remove(); }

void ScratchDir::Remove() {
  if (path_.empty()) return;
  if (!RemoveScratch(path_)) {
    Log(LogLevel::kWarning,
        "left the scratch folder " + path_ + ": it holds files Strata did not put there");
  }
  path_.clear();
}

Result<std::string> ScratchDir::Make(const std::string& prefix) {
  const std::string parent = TempDirectory();
  RemoveDeadRuns(parent, prefix);
  std::string pattern = parent + "/" + prefix + "-" + std::to_string(::getpid()) + "-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) return ErrnoError("cannot create " + pattern, errno);
  const std::string marker = pattern + "/" + std::string(kMarker);
  const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    ::rmdir(pattern.c_str());
    return ErrnoError("cannot create " + marker, err);
  }
  ::close(fd);
  path_ = pattern;
  return path_;
}

}  // namespace strata::tools
