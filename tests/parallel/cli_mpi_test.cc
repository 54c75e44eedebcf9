// `switchyard layer --transport mpi` under `mpirun -np 4` (scripts/mpirun.sh) writes the same
// out.safetensors as the single-rank run, for the main layouts (label "mpi").
#include <gtest/gtest.h>

#include "parallel/cli_helpers.h"

namespace switchyard::parallel {
namespace {

using testing::RunCommand;
using testing::SameOutputs;

const char* kConfig = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "top_k": 2,
  "capacity_factor": 0.75, "z_loss_coef": 0.01, "aux_loss_coef": 0.1})";

TEST(CliLayerMpi, MainLayoutsWriteTheSingleRankOutputs) {
  const std::string dir = testing::TestDir("sy_cli_mpi");
  testing::WriteLayerInputs(dir, kConfig, 30);
  auto layer = [&](const std::string& out, const std::string& flags) {
    return std::string(SY_SWITCHYARD_BIN) + " layer --quiet --config " + dir + "/layer.json" +
           " --tensors " + dir + "/in.safetensors --out " + dir + "/" + out + " " + flags;
  };
  ASSERT_EQ(RunCommand(layer("single.safetensors", ""), dir).exit_code, 0);
  for (const char* flags : {"", "--dispatch alltoallv --tp 2", "--dispatch allgather", "--2dh 2",
                            "--arrangement megatron --etp 2 --dispatch alltoallv"}) {
    const std::string cmd = std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 4 " +
                            layer("mpi.safetensors", std::string("--transport mpi --ranks 4 ") +
                                                         "--threads 1 " + flags);
    testing::CommandResult r = RunCommand(cmd, dir);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    EXPECT_TRUE(SameOutputs(dir + "/mpi.safetensors", dir + "/single.safetensors")) << flags;
  }
}

TEST(CliLayerMpi, SchedulesUnderMpirunPickTheMpiTransportByThemselves) {
  // No --transport: started by mpirun, `switchyard layer` uses MPI. Rank 0 writes the trace of
  // every rank.
  const std::string dir = testing::TestDir("sy_cli_mpi");
  testing::WriteLayerInputs(dir, kConfig, 30);
  auto layer = [&](const std::string& out, const std::string& flags) {
    return std::string(SY_SWITCHYARD_BIN) + " layer --config " + dir + "/layer.json" +
           " --tensors " + dir + "/in.safetensors --out " + dir + "/" + out + " " + flags;
  };
  ASSERT_EQ(RunCommand(layer("single.safetensors", "--quiet"), dir).exit_code, 0);
  for (const char* flags : {"--overlap-degree 2", "--dispatch alltoallv --overlap-degree 2",
                            "--smart-schedule 1", "--shadow 0,1"}) {
    const std::string cmd = std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 4 " +
                            layer("mpi.safetensors", std::string("--ranks 4 --threads 1 --trace ") +
                                                         dir + "/trace.json " + flags);
    testing::CommandResult r = RunCommand(cmd, dir);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    EXPECT_NE(r.out.find("4 ranks (mpi)"), std::string::npos) << r.out;
    EXPECT_TRUE(SameOutputs(dir + "/mpi.safetensors", dir + "/single.safetensors")) << flags;
    const std::string trace = testing::ReadAll(dir + "/trace.json");
    EXPECT_NE(trace.find("rank 3 comm"), std::string::npos) << flags;
  }
}

}  // namespace
}  // namespace switchyard::parallel
