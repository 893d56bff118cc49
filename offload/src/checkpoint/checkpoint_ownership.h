// What a checkpoint directory proves about itself: its manifest read and checked (header,
// checksum), whether everything in it is the checkpoint's own (CheckReplaceable, in
// checkpoint_files.h), and the leftovers of crashed saves that may be removed. Private to
// checkpoint/; see "Ownership" in checkpoint_files.h.
#pragma once

#include <filesystem>
#include <system_error>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::offload::internal {

/// A manifest read and checked by ReadManifest.
struct CheckedManifest {
  nlohmann::json json;
  /// Written before manifests carried a checksum and a "contents" list: nothing vouches for
  /// its fields but the data files' own checksums, which Load still checks.
  bool legacy = false;
};

/// InvalidArgument unless `name` is a plain file name a data file may have (not the
/// manifest's).
Status ValidateFileName(std::string_view name);

/// Reads and checks the manifest at `path`: a regular file within the manifest's size limit
/// (OpenInputFile), valid JSON, a Strata header (format, version), then its checksum, before
/// anything else in it is used. A manifest with no "checksum" member at all is a legacy one.
Result<CheckedManifest> ReadManifest(const std::filesystem::path& path);

/// Checks the "format" and "version" fields. `where` names the manifest in messages.
Status CheckManifestHeader(const nlohmann::json& manifest, const std::string& where);

/// The names in `dir`, sorted.
Result<std::vector<std::string>> SortedEntries(const std::filesystem::path& dir);

/// Whether `staging` is a staging directory Strata made: it holds the marker Begin creates.
/// A staging directory that holds a manifest is a committed checkpoint moved aside (the previous
/// one after an exchange): it must also be nothing but that checkpoint.
bool IsStagingDirectory(const std::filesystem::path& staging);

/// The entries of `dir` in the order RemoveOwnedDirectory deletes them: every one but the
/// manifest and the staging marker, then the manifest, then the marker. A removal stopped after
/// any of them (the process killed) leaves a directory still provably Strata's
/// (IsStagingDirectory): the marker stays to the last, and while the manifest stays, so does
/// nothing it does not list. In directory order the marker could go first and leave a
/// manifest and data files that no later cleanup may remove.
std::vector<std::string> RemovalOrder(const std::filesystem::path& dir);

/// Removes `dir`, a checkpoint or staging directory proved Strata's, entry by entry in
/// RemovalOrder, then the directory itself.
std::error_code RemoveOwnedDirectory(const std::filesystem::path& dir);

/// Cleans up after crashed writers of `dir`: removes "<name>.tmp-<pid>" of dead pids, and for
/// "<name>.old-<pid>" of dead pids (left inside the fallback's window), puts the old checkpoint
/// back at `dir` if nothing is there, else removes it. Only what its content proves Strata's
/// (IsStagingDirectory, CheckReplaceable) is removed; anything else of such a name is left and
/// logged. Best effort; logs what it does.
void CleanUpLeftovers(const std::filesystem::path& parent, const std::filesystem::path& dir);

}  // namespace strata::offload::internal
