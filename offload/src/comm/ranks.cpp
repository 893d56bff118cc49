#include "strata/offload/ranks.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

namespace strata::offload {
namespace {

using GetEnv = std::function<const char*(const char*)>;

constexpr int kMaxRanks = 1 << 24;

/// The variable's value as an int in [min, max]; nullopt when unset.
Result<std::optional<int>> ReadInt(const GetEnv& getenv, const char* name, int min, int max) {
  const char* text = getenv(name);
  if (text == nullptr) return std::optional<int>();
  const std::string_view value(text);
  int parsed = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (value.empty() || error != std::errc() || end != value.data() + value.size() || parsed < min ||
      parsed > max) {
    return InvalidArgument(std::string(name) + "=\"" + text + "\" is not a number in [" +
                           std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return std::optional<int>(parsed);
}

/// Reads a positive count off the front of `text`; nullopt when there is none.
std::optional<int> TakeCount(std::string_view& text) {
  int count = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), count);
  if (error != std::errc() || count < 1 || count > kMaxRanks) return std::nullopt;
  text.remove_prefix(size_t(end - text.data()));
  return count;
}

/// Slurm's task counts per node, "2(x3),1" -> {2, 2, 2, 1}; empty when malformed.
std::vector<int> ExpandTasksPerNode(std::string_view text) {
  std::vector<int> counts;
  while (!text.empty()) {
    const std::optional<int> count = TakeCount(text);
    if (!count) return {};
    std::optional<int> repeat = 1;
    if (text.starts_with("(x")) {
      text.remove_prefix(2);
      repeat = TakeCount(text);
      if (!repeat || !text.starts_with(")")) return {};
      text.remove_prefix(1);
    }
    if (counts.size() + size_t(*repeat) > size_t(kMaxRanks)) return {};
    counts.insert(counts.end(), size_t(*repeat), *count);
    if (text.starts_with(",")) {
      text.remove_prefix(1);
      if (text.empty()) return {};
    } else if (!text.empty()) {
      return {};
    }
  }
  return counts;
}

struct Launcher {
  const char* name;
  const char* trigger;  ///< Set in the environment of the processes it starts.
  const char* rank;
  const char* size;
  const char* local_rank;  ///< nullptr: not given by this launcher.
  const char* local_size;
};

constexpr Launcher kLaunchers[] = {
    {"torchrun", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"torchrun", "RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
     nullptr},
    // PMIx exports no size: Open MPI 5's launcher (PRRTE) sets PMIX_RANK and
    // OMPI_COMM_WORLD_SIZE, not always OMPI_COMM_WORLD_RANK.
    {"pmix", "PMIX_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", nullptr, nullptr},
};

}  // namespace

Result<RankInfo> DetectRanks(const GetEnv& getenv) {
  for (const Launcher& launcher : kLaunchers) {
    if (getenv(launcher.trigger) == nullptr) continue;
    RankInfo info;
    info.launcher = launcher.name;
    STRATA_ASSIGN_OR_RETURN(std::optional<int> size, ReadInt(getenv, launcher.size, 1, kMaxRanks));
    if (!size) {
      return InvalidArgument(std::string(launcher.trigger) + " is set but " + launcher.size +
                             " is not: cannot tell how many ranks there are");
    }
    info.size = *size;
    STRATA_ASSIGN_OR_RETURN(std::optional<int> rank,
                            ReadInt(getenv, launcher.rank, 0, info.size - 1));
    if (!rank) {
      return InvalidArgument(std::string(launcher.trigger) + " is set but " + launcher.rank +
                             " is not: cannot tell which rank this is");
    }
    info.rank = *rank;
    info.local_rank = info.rank;
    info.local_size = info.size;
    std::optional<int> local_size;
    std::string local_size_source = launcher.local_size ? launcher.local_size : "";
    if (launcher.local_size != nullptr) {
      STRATA_ASSIGN_OR_RETURN(local_size, ReadInt(getenv, launcher.local_size, 1, info.size));
    } else if (launcher.name == std::string_view("srun")) {
      const char* per_node = getenv("SLURM_STEP_TASKS_PER_NODE");
      STRATA_ASSIGN_OR_RETURN(std::optional<int> node,
                              ReadInt(getenv, "SLURM_NODEID", 0, kMaxRanks));
      const std::vector<int> counts = ExpandTasksPerNode(per_node ? per_node : "");
      if (per_node != nullptr && counts.empty()) {
        return InvalidArgument(std::string("SLURM_STEP_TASKS_PER_NODE=\"") + per_node +
                               "\" is not a list of counts such as \"2(x3),1\"");
      }
      if (node && size_t(*node) < counts.size()) local_size = std::min(counts[*node], info.size);
      local_size_source = "SLURM_STEP_TASKS_PER_NODE";
    }
    if (local_size) info.local_size = *local_size;
    if (launcher.local_rank != nullptr) {
      STRATA_ASSIGN_OR_RETURN(std::optional<int> local_rank,
                              ReadInt(getenv, launcher.local_rank, 0, info.local_size - 1));
      if (local_rank) {
        info.local_rank = *local_rank;
      } else if (local_size) {
        return InvalidArgument(local_size_source + " is set but " + launcher.local_rank +
                               " is not");
      }
    }
    return info;
  }
  return RankInfo{};
}

}  // namespace strata::offload
