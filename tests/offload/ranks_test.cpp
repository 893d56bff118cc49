#include "strata/offload/ranks.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace strata::offload {
namespace {

/// DetectRanks over a made-up environment.
Result<RankInfo> Detect(const std::map<std::string, std::string>& env) {
  return DetectRanks([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(RanksTest, ALoneProcessIsRankZeroOfOne) {
  auto info = Detect({{"HOME", "/root"}});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->rank, 0);
  EXPECT_EQ(info->size, 1);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_size, 1);
  EXPECT_EQ(info->launcher, "none");
}

TEST(RanksTest, EachLauncherIsRead) {
  auto mpi = Detect({{"OMPI_COMM_WORLD_RANK", "5"},
                     {"OMPI_COMM_WORLD_SIZE", "8"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  ASSERT_TRUE(mpi.ok()) << mpi.status().ToString();
  EXPECT_EQ(mpi->launcher, "mpirun");
  EXPECT_EQ(mpi->rank, 5);
  EXPECT_EQ(mpi->size, 8);
  EXPECT_EQ(mpi->local_rank, 1);
  EXPECT_EQ(mpi->local_size, 4);

  auto torch =
      Detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  ASSERT_TRUE(torch.ok()) << torch.status().ToString();
  EXPECT_EQ(torch->launcher, "torchrun");
  EXPECT_EQ(torch->rank, 3);
  EXPECT_EQ(torch->local_size, 2);

  // Seven tasks: two on each of the first three nodes, one on the fourth; this is the fourth.
  auto slurm = Detect({{"SLURM_PROCID", "6"},
                       {"SLURM_STEP_NUM_TASKS", "7"},
                       {"SLURM_LOCALID", "0"},
                       {"SLURM_NODEID", "3"},
                       {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}});
  ASSERT_TRUE(slurm.ok()) << slurm.status().ToString();
  EXPECT_EQ(slurm->launcher, "srun");
  EXPECT_EQ(slurm->rank, 6);
  EXPECT_EQ(slurm->size, 7);
  EXPECT_EQ(slurm->local_rank, 0);
  EXPECT_EQ(slurm->local_size, 1);
  auto second_node = Detect({{"SLURM_PROCID", "3"},
                             {"SLURM_STEP_NUM_TASKS", "7"},
                             {"SLURM_LOCALID", "1"},
                             {"SLURM_NODEID", "1"},
                             {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}});
  ASSERT_TRUE(second_node.ok()) << second_node.status().ToString();
  EXPECT_EQ(second_node->local_size, 2);

  auto pmix = Detect({{"PMIX_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"}});
  ASSERT_TRUE(pmix.ok()) << pmix.status().ToString();
  EXPECT_EQ(pmix->launcher, "pmix");
  EXPECT_EQ(pmix->rank, 2);
  EXPECT_EQ(pmix->size, 3);  // Open MPI 5: PMIX_RANK and OMPI_COMM_WORLD_SIZE, no PMIx size.
}

// torchrun under srun or mpirun starts several ranks per task: its own variables say who a
// process is. mpirun's come before those of other launchers that set RANK, and Slurm's.
TEST(RanksTest, TheLauncherThatStartedTheProcessWins) {
  auto torch_in_slurm = Detect({{"SLURM_PROCID", "0"},
                                {"SLURM_STEP_NUM_TASKS", "2"},
                                {"RANK", "3"},
                                {"WORLD_SIZE", "8"},
                                {"LOCAL_RANK", "3"},
                                {"LOCAL_WORLD_SIZE", "4"}});
  ASSERT_TRUE(torch_in_slurm.ok()) << torch_in_slurm.status().ToString();
  EXPECT_EQ(torch_in_slurm->launcher, "torchrun");
  EXPECT_EQ(torch_in_slurm->rank, 3);
  EXPECT_EQ(torch_in_slurm->size, 8);
  auto torch_in_mpi = Detect({{"OMPI_COMM_WORLD_RANK", "0"},
                              {"OMPI_COMM_WORLD_SIZE", "1"},
                              {"TORCHELASTIC_RUN_ID", "job7"},
                              {"RANK", "5"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_RANK", "5"},
                              {"LOCAL_WORLD_SIZE", "8"}});
  ASSERT_TRUE(torch_in_mpi.ok()) << torch_in_mpi.status().ToString();
  EXPECT_EQ(torch_in_mpi->launcher, "torchrun");
  EXPECT_EQ(torch_in_mpi->rank, 5);
  EXPECT_EQ(torch_in_mpi->size, 8);
  auto mpi_in_slurm = Detect({{"SLURM_PROCID", "1"},
                              {"SLURM_STEP_NUM_TASKS", "4"},
                              {"OMPI_COMM_WORLD_RANK", "2"},
                              {"OMPI_COMM_WORLD_SIZE", "4"}});
  ASSERT_TRUE(mpi_in_slurm.ok()) << mpi_in_slurm.status().ToString();
  EXPECT_EQ(mpi_in_slurm->launcher, "mpirun");
  EXPECT_EQ(mpi_in_slurm->rank, 2);
}

// Without the node's count every rank is taken to share this node: per-node shares are then
// too small, never too large.
TEST(RanksTest, AMissingLocalSizeCountsEveryRankAsLocal) {
  auto info = Detect({{"PMIX_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_size, 4);
  auto slurm =
      Detect({{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "3"}, {"SLURM_LOCALID", "0"}});
  ASSERT_TRUE(slurm.ok()) << slurm.status().ToString();
  EXPECT_EQ(slurm->local_rank, 0);
  EXPECT_EQ(slurm->local_size, 3);
}

// A batch script's own environment describes the allocation (SLURM_NTASKS, SLURM_PROCID 0):
// a process it runs without srun is one process, not rank 0 of many.
TEST(RanksTest, ASlurmBatchScriptIsNotAJobStep) {
  auto info = Detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->size, 1);
  EXPECT_EQ(info->launcher, "none");
}

TEST(RanksTest, BadValuesAreErrorsNamingTheVariable) {
  const std::map<std::string, std::string> cases[] = {
      {{"RANK", "4"}, {"WORLD_SIZE", "4"}},   // Rank not below the size.
      {{"RANK", "-1"}, {"WORLD_SIZE", "4"}},  // Negative.
      {{"RANK", "1x"}, {"WORLD_SIZE", "4"}},  // Not a number.
      {{"RANK", "0"}, {"WORLD_SIZE", "0"}},   // No ranks.
      {{"RANK", ""}, {"WORLD_SIZE", "2"}},    // Empty.
      {{"RANK", "0"}},                        // No size.
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}},  // Local rank missing.
      {{"SLURM_PROCID", "0"},
       {"SLURM_STEP_NUM_TASKS", "2"},
       {"SLURM_NODEID", "0"},
       {"SLURM_STEP_TASKS_PER_NODE", "2(x"}},
      {{"SLURM_STEP_NUM_TASKS", "2"}},  // A step without SLURM_PROCID.
  };
  const char* named[] = {"RANK",        "RANK",       "RANK",
                         "WORLD_SIZE",  "RANK",       "WORLD_SIZE",
                         "LOCAL_RANK",  "LOCAL_RANK", "SLURM_STEP_TASKS_PER_NODE",
                         "SLURM_PROCID"};
  for (size_t i = 0; i < std::size(cases); ++i) {
    auto info = Detect(cases[i]);
    ASSERT_FALSE(info.ok()) << "case " << i;
    EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument) << "case " << i;
    EXPECT_NE(info.status().message().find(named[i]), std::string::npos)
        << "case " << i << ": " << info.status().message();
  }
}

}  // namespace
}  // namespace strata::offload
