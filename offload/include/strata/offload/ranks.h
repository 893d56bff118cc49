// Ranks: which data-parallel rank this process is, read from the launcher that started it.
//
// Strata starts no processes of its own: mpirun, srun and torchrun do, and each says in the
// environment who a process is. This reads what they set, so that a trainer (and `strata
// train`) finds its rank, the world size and its place on the node without flags.
#pragma once

#include <cstdlib>
#include <functional>
#include <string>

#include "strata/core/status.h"

namespace strata::offload {

/// One process's place among the data-parallel ranks.
struct RankInfo {
  int rank = 0;        ///< 0 .. size - 1.
  int size = 1;        ///< Ranks in the job.
  int local_rank = 0;  ///< 0 .. local_size - 1, among the ranks on this node.
  int local_size = 1;  ///< Ranks on this node: they share its memory, cores and drives.
  /// "mpirun" (Open MPI), "torchrun", "srun" (Slurm), "pmix", or "none" for a lone process.
  std::string launcher = "none";
};

/// Reads the rank from the environment, through `getenv` (the process's by default; tests pass
/// their own). The innermost launcher wins, checked in this order:
///   torchrun: when TORCHELASTIC_RUN_ID is set (torchrun under mpirun or srun): RANK,
///             WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
///   mpirun:   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
///   others that set RANK (DeepSpeed's launcher): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
///   srun:     a job step's SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, and this node's
///             count in SLURM_STEP_TASKS_PER_NODE ("2(x3),1": two on each of the first three
///             nodes, one on the fourth) at SLURM_NODEID. A batch script's own environment
///             (SLURM_NTASKS without a step) names the allocation, not ranks: one process.
///   PMIx:     PMIX_RANK, with the size from OMPI_COMM_WORLD_SIZE (PMIx defines no size
///             variable; Open MPI 5's launcher sets these two)
/// Where the local rank or size is not given, every rank counts as on this node (local rank =
/// rank, local size = size): per-node shares of memory and cores then err on the small side.
/// Errors: InvalidArgument naming the variable when one is not a number in range (a rank not
/// below the size, a size below 1), or the size or rank is missing where the launcher's mark
/// is set.
Result<RankInfo> DetectRanks(const std::function<const char*(const char*)>& getenv =
                                 [](const char* name) { return std::getenv(name); });

}  // namespace strata::offload
