// `strata train`'s setup: the model and the engine's options from the flags and a config, and
// the checks of its output paths that come before anything is created.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "scratch_dir.h"
#include "strata/core/config.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/examples/byte_lm_trainer.h"
#include "train_flags.h"

namespace strata::tools {

/// The built-in model --model names, with --layers, --width and --context over it.
Result<examples::ByteLmConfig> ModelConfig(const TrainFlags& f);

/// The engine's options: the config file's (`config`, read and validated by the caller, as
/// `strata config check` reads it), then the flags given over them, then the demo's defaults
/// for what neither said. `scratch` makes the NVMe swap folder when none is given; `ranks`:
/// the data-parallel ranks (the device budget counts the padding sharding adds to chunks).
Result<EngineOptions> EngineOptionsFor(const TrainFlags& f,
                                       const std::optional<LoadedConfig>& config,
                                       ScratchDir& scratch, const examples::ByteLmConfig& model,
                                       int ranks);

/// A checkpoint replaces its folder whole, so it may not hold a swap folder, whose files would
/// only appear once training runs (the save would then refuse the folder after the last step),
/// nor the training corpus (refused anyway as not Strata's; said here in so many words).
/// Checked before anything is created, with links resolved.
Status CheckCheckpointApart(const std::string& checkpoint, const std::vector<std::string>& nvme,
                            const std::string& data);

}  // namespace strata::tools
