// The scratch folder of a command that needs NVMe swap and was given no --nvme-path:
// "$TMPDIR/strata-train-<pid>-XXXXXX", holding a marker file that proves it Strata's.
//
// It is removed when the command ends, however it ends short of a second signal or a kill -9;
// what such a run leaves is removed by the next command that makes one, once the owner's pid
// is gone: only folders of that exact name with the marker in them, and in them only the
// marker and swap files ("strata-swap-*.bin"). Anything else found there stays.
#pragma once

#include <string>

#include "strata/core/status.h"

namespace strata::tools {

class ScratchDir {
 public:
  ScratchDir() = default;
  /// Remove().
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  /// Removes dead runs' scratch folders under `prefix`'s directory, then makes this one.
  /// `prefix`: "strata-train" makes "$TMPDIR/strata-train-<pid>-XXXXXX".
  Result<std::string> Make(const std::string& prefix);

  /// Removes the folder: the marker and the folder itself, which the swap space (destroyed
  /// first) has emptied. Left, with a warning, if anything else is in it. Once.
  void Remove();

 private:
  std::string path_;
};

}  // namespace strata::tools
