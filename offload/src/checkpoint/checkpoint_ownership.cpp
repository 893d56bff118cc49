// Manifests read and checked, and what Strata may replace or remove: see "Ownership" in
// checkpoint_files.h.
#include "checkpoint/checkpoint_ownership.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <system_error>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_io.h"
#include "strata/core/input_file.h"
#include "strata/core/log.h"

namespace strata::offload::internal {

namespace fs = std::filesystem;

namespace {

/// If `name` is "<prefix><pid>" with a positive decimal pid, returns the pid, else 0.
pid_t LeftoverPid(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size();
  long long pid = 0;
  const auto [end, ec] = std::from_chars(first, last, pid);
  if (ec != std::errc() || end != last || *first == '+' || pid <= 0 ||
      pid > static_cast<long long>(INT32_MAX)) {
    return 0;
  }
  return static_cast<pid_t>(pid);
}

bool ProcessIsGone(pid_t pid) {
  if (pid == ::getpid()) return true;  // Our own leftover: one writer per dir at a time.
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

/// Every string a legacy manifest gives as a "file" (its chunks' and their shards'): the files
/// that Strata wrote there, which its "contents" lists in newer manifests.
void CollectFileNames(const nlohmann::json& value, std::vector<std::string>& names) {
  if (value.is_object()) {
    for (const auto& [key, member] : value.items()) {
      if (key == "file" && member.is_string()) names.push_back(member.get<std::string>());
      CollectFileNames(member, names);
    }
  } else if (value.is_array()) {
    for (const nlohmann::json& element : value) CollectFileNames(element, names);
  }
}

/// Up to five of `names`, quoted, for messages.
std::string SomeNames(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", \"" : "\"") + names[i] + "\"";
  if (names.size() > 5) out += " and " + std::to_string(names.size() - 5) + " more";
  return out;
}

}  // namespace

nlohmann::json NewManifest() {
  return nlohmann::json{{"format", std::string(kCheckpointFormat)},
                        {"version", kCheckpointFormatVersion}};
}

std::string ManifestChecksum(const nlohmann::json& manifest) {
  nlohmann::json body = manifest;
  if (body.is_object()) body.erase("checksum");
  const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016" PRIx64, XXH3_64bits(text.data(), text.size()));
  return "xxh3:" + std::string(hex);
}

Status CheckManifestHeader(const nlohmann::json& manifest, const std::string& where) {
  if (!manifest.is_object()) {
    return InvalidArgument(where + " must be a JSON object (start from NewManifest()), got " +
                           Show(manifest));
  }
  const auto format = manifest.find("format");
  if (format == manifest.end() || !format->is_string() ||
      format->get_ref<const std::string&>() != kCheckpointFormat) {
    return InvalidArgument(where + " is not a Strata checkpoint manifest: \"format\" is " +
                           (format == manifest.end() ? std::string("missing") : Show(*format)) +
                           ", expected \"" + std::string(kCheckpointFormat) +
                           "\" (start from NewManifest())");
  }
  const auto version = manifest.find("version");
  if (version == manifest.end() || !version->is_number_integer()) {
    return InvalidArgument(where + ": \"version\" must be an integer, got " +
                           (version == manifest.end() ? std::string("nothing") : Show(*version)));
  }
  const bool huge =
      version->is_number_unsigned() && version->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t number = huge ? INT64_MAX : version->get<int64_t>();
  if (number > kCheckpointFormatVersion) {
    return InvalidArgument(where + " has checkpoint format version " + Show(*version) +
                           ", but this build of Strata reads versions 1 to " +
                           std::to_string(kCheckpointFormatVersion) +
                           "; load it with the Strata release that wrote it or a newer one");
  }
  if (number < 1) {
    return InvalidArgument(where + " has checkpoint format version " + Show(*version) +
                           ", which does not exist; supported versions are 1 to " +
                           std::to_string(kCheckpointFormatVersion));
  }
  return Status::Ok();
}

Result<CheckedManifest> ReadManifest(const fs::path& path) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadInputFile(path.string(), kManifestInput));
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // A parse error, or a number beyond a double (1e400: out_of_range).
    std::string message = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (auto end = message.find("] ");
        !message.empty() && message[0] == '[' && end != std::string::npos) {
      message.erase(0, end + 2);
    }
    const auto* parse = dynamic_cast<const nlohmann::json::parse_error*>(&e);
    return DataLoss("checkpoint manifest " + path.string() + " is damaged: malformed JSON" +
                    (parse != nullptr ? " at byte " + std::to_string(parse->byte) : "") + ": " +
                    message);
  }
  if (!manifest.is_object()) {
    return DataLoss("checkpoint manifest " + path.string() +
                    " is damaged: expected a JSON object, got " + Show(manifest));
  }
  STRATA_RETURN_IF_ERROR(CheckManifestHeader(manifest, "checkpoint manifest " + path.string()));
  const auto checksum = manifest.find("checksum");
  if (checksum == manifest.end()) return CheckedManifest{std::move(manifest), /*legacy=*/true};
  if (!checksum->is_string()) {
    return DataLoss("checkpoint manifest " + path.string() + " is damaged: its checksum is " +
                    Show(*checksum) + ", not a string");
  }
  const std::string expected = ManifestChecksum(manifest);
  if (checksum->get_ref<const std::string&>() != expected) {
    return DataLoss("checkpoint manifest " + path.string() +
                    " is damaged or was edited: its checksum " + Show(*checksum) +
                    " does not match its content (" + expected +
                    "); a checkpoint's manifest is not to be changed by hand");
  }
  return CheckedManifest{std::move(manifest), /*legacy=*/false};
}

Result<std::vector<std::string>> SortedEntries(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return ErrnoError("cannot list " + dir.string(), ec.value());
  std::sort(names.begin(), names.end());
  return names;
}

bool IsStagingDirectory(const fs::path& staging) {
  struct stat st {};
  const fs::path marker = staging / std::string(kStagingMarkerName);
  const fs::path manifest = staging / std::string(kManifestFileName);
  return ::lstat(staging.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         ::lstat(marker.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         (::lstat(manifest.c_str(), &st) != 0 || CheckReplaceable(staging).ok());
}

std::vector<std::string> RemovalOrder(const fs::path& dir) {
  Result<std::vector<std::string>> entries = SortedEntries(dir);
  if (!entries.ok()) return {};
  std::vector<std::string> order;
  bool manifest = false;
  bool marker = false;
  for (std::string& name : *entries) {
    if (name == kManifestFileName) {
      manifest = true;
    } else if (name == kStagingMarkerName) {
      marker = true;
    } else {
      order.push_back(std::move(name));
    }
  }
  if (manifest) order.emplace_back(kManifestFileName);
  if (marker) order.emplace_back(kStagingMarkerName);
  return order;
}

std::error_code RemoveOwnedDirectory(const fs::path& dir) {
  std::error_code ec;
  for (const std::string& name : RemovalOrder(dir)) {
    fs::remove_all(dir / name, ec);
    if (ec) return ec;
  }
  fs::remove(dir, ec);
  return ec;
}

void CleanUpLeftovers(const fs::path& parent, const fs::path& dir) {
  const std::string name = dir.filename().string();
  const std::string staging_prefix = name + ".tmp-";
  const std::string old_prefix = name + ".old-";
  DIR* listing = ::opendir(parent.c_str());
  if (listing == nullptr) return;
  std::vector<std::string> stale_staging;
  std::vector<std::string> stale_old;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string entry_name = entry->d_name;
    if (const pid_t pid = LeftoverPid(entry_name, staging_prefix); pid > 0 && ProcessIsGone(pid)) {
      stale_staging.push_back(entry_name);
    } else if (const pid_t old_pid = LeftoverPid(entry_name, old_prefix);
               old_pid > 0 && ProcessIsGone(old_pid)) {
      stale_old.push_back(entry_name);
    }
  }
  ::closedir(listing);

  for (const std::string& entry_name : stale_old) {
    const fs::path old = parent / entry_name;
    if (const Status ours = CheckReplaceable(old); !ours.ok()) {
      Log(LogLevel::kWarning, "left " + old.string() + " in place: " + ours.message());
      continue;
    }
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 && errno == ENOENT) {
      if (::rename(old.c_str(), dir.c_str()) == 0) {
        SyncDirectory(parent).IgnoreError();
        Log(LogLevel::kWarning, "checkpoint " + dir.string() +
                                    " was missing after an interrupted save; restored the "
                                    "previous checkpoint from " +
                                    old.string());
        continue;
      }
    }
    if (const std::error_code ec = RemoveOwnedDirectory(old); !ec) {
      Log(LogLevel::kWarning,
          "removed " + old.string() + ", left by an interrupted checkpoint save");
    }
  }
  for (const std::string& entry_name : stale_staging) {
    const fs::path staging = parent / entry_name;
    if (::rmdir(staging.c_str()) == 0) continue;  // Empty: made, then the writer died.
    if (!IsStagingDirectory(staging)) {
      Log(LogLevel::kWarning, "left " + staging.string() +
                                  " in place: its name is that of a checkpoint's staging "
                                  "directory, but it holds what Strata did not write there");
      continue;
    }
    if (const std::error_code ec = RemoveOwnedDirectory(staging); !ec) {
      Log(LogLevel::kWarning,
          "removed " + staging.string() + ", left by an interrupted checkpoint save");
    }
  }
}

Status CheckReplaceable(const fs::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return ErrnoError("cannot examine " + dir.string(), errno);
  }
  const std::string refuse = "refusing to replace " + dir.string() + ": ";
  const std::string what_to_do =
      "; Strata replaces only an empty directory or a checkpoint it wrote, so choose a new "
      "path, or move those files away yourself";
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument(refuse + "it is not a directory (it is " +
                           std::string(FileTypeName(st.st_mode)) +
                           "); a checkpoint is a directory, so choose another path");
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> entries, SortedEntries(dir));
  if (entries.empty()) return Status::Ok();
  const bool has_manifest =
      std::find(entries.begin(), entries.end(), kManifestFileName) != entries.end();
  if (!has_manifest) {
    return FailedPrecondition(refuse + "it is not a Strata checkpoint (it has no " +
                              std::string(kManifestFileName) + ") and holds " + SomeNames(entries) +
                              what_to_do);
  }
  Result<CheckedManifest> manifest = ReadManifest(dir / std::string(kManifestFileName));
  if (!manifest.ok()) {
    return FailedPrecondition(refuse + "it is not a Strata checkpoint that can be verified (" +
                              manifest.status().message() + ")" + what_to_do);
  }
  std::vector<std::string> listed;
  const nlohmann::json& json = manifest->json;
  if (manifest->legacy) {
    CollectFileNames(json, listed);
  } else if (const auto files = json.find("contents"); files != json.end() && files->is_array()) {
    for (const nlohmann::json& name : *files) {
      if (name.is_string()) listed.push_back(name.get<std::string>());
    }
  } else {
    return FailedPrecondition(refuse +
                              "its manifest does not list the checkpoint's files, so "
                              "Strata cannot tell its own files from others" +
                              what_to_do);
  }
  std::vector<std::string> foreign;
  for (const std::string& name : entries) {
    if (name != kManifestFileName &&
        std::find(listed.begin(), listed.end(), name) == listed.end()) {
      foreign.push_back(name);
    }
  }
  if (!foreign.empty()) {
    return FailedPrecondition(refuse + "it is a Strata checkpoint, but it also holds " +
                              SomeNames(foreign) + ", which the checkpoint did not write" +
                              what_to_do);
  }
  return Status::Ok();
}

Status ValidateFileName(std::string_view name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find_first_of(std::string_view("/\0", 2)) != std::string_view::npos) {
    return InvalidArgument("checkpoint file name \"" + std::string(name) +
                           "\" is not a plain file name: it must be non-empty, not \".\" or "
                           "\"..\", and contain no '/'");
  }
  if (name == kManifestFileName) {
    return InvalidArgument("checkpoint file name \"" + std::string(name) +
                           "\" is reserved for the manifest; choose another name");
  }
  return Status::Ok();
}

}  // namespace strata::offload::internal
