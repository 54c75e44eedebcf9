// Starting ranks through comm::Launcher (threads of this process; the MPI launcher's refusal
// outside mpirun), and ProcessGroups built from a mesh: one communicator per distinct member list,
// the world reused, groups of one rank completing their collectives on the calling thread, and
// the embedding group only on the first and last pipeline stage.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/process_groups.h"

namespace switchyard::parallel {
namespace {

TEST(Launcher, InProcessRunsEveryRankAndRethrowsTheFirstError) {
  std::unique_ptr<comm::Launcher> launcher = comm::CreateInProcessLauncher(3);
  EXPECT_EQ(launcher->world_size(), 3);
  EXPECT_EQ(launcher->ranks_in_process(), 3);
  EXPECT_EQ(launcher->kind(), "inprocess");
  std::mutex mu;
  std::set<int> ranks;
  launcher->Run([&](comm::Communicator& world) {
    EXPECT_EQ(world.size(), 3);
    std::lock_guard<std::mutex> lock(mu);
    ranks.insert(world.rank());
  });
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  // Reusable; an error on one rank fails its peers' collectives and is rethrown.
  std::atomic<int> peer_errors{0};
  try {
    launcher->Run([&](comm::Communicator& world) {
      if (world.rank() == 1) throw InvalidArgument("rank 1 refuses");
      try {
        world.Barrier().Wait();
      } catch (const PeerError&) {
        ++peer_errors;
      }
    });
    ADD_FAILURE() << "the error of rank 1 was not rethrown";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 refuses"), std::string::npos) << e.what();
  }
  EXPECT_EQ(peer_errors.load(), 2);
  EXPECT_THROW(comm::CreateInProcessLauncher(0), InvalidArgument);
}

TEST(Launcher, MpiOutsideAnMpiJobIsRefused) {
  ASSERT_FALSE(comm::RunningUnderMpi()) << "this suite runs outside mpirun";
  try {
    comm::CreateMpiLauncher();
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(comm::MpiCompiledIn() ? "not started by an MPI launcher" : "SY_WITH_MPI"),
              std::string::npos)
        << what;
    EXPECT_EQ(what.find("--"), std::string::npos) << "a library error names no flag: " << what;
  }
}

MeshConfig Config(int w, int tp, int pp, int ep) {
  MeshConfig c;
  c.world_size = w;
  c.tp = tp;
  c.pp = pp;
  c.ep = ep;
  return c;
}

TEST(ProcessGroups, KindsWithTheSameMembersShareOneCommunicator) {
  // 4 ranks, ep 2: tp, etp, pp, cp, tp_cp, mp and embedding are the same single ranks; dp,
  // dp_cp and tokens are the world; expert = ep; ep_dp = expert_holders.
  const Mesh mesh(Config(4, 1, 1, 2));
  comm::RunInProcess(4, [&](comm::Communicator& world) {
    ProcessGroups groups(world, mesh);
    EXPECT_EQ(groups.communicator_count(), 3);  // singletons, expert, ep_dp
    EXPECT_EQ(&groups.Get(GroupKind::kData), &world);
    EXPECT_EQ(&groups.Get(GroupKind::kTokens), &world);
    EXPECT_EQ(&groups.Get(GroupKind::kDataContext), &world);
    comm::Communicator& single = groups.Get(GroupKind::kTensor);
    for (GroupKind kind : {GroupKind::kExpertTensor, GroupKind::kPipeline, GroupKind::kContext,
                           GroupKind::kTensorContext, GroupKind::kModel, GroupKind::kEmbedding}) {
      EXPECT_EQ(&groups.Get(kind), &single) << GroupKindName(kind);
    }
    EXPECT_EQ(single.size(), 1);
    EXPECT_EQ(&groups.Get(GroupKind::kExpertParallel), &groups.Get(GroupKind::kExpert));
    EXPECT_EQ(&groups.Get(GroupKind::kExpertHolders), &groups.Get(GroupKind::kExpertData));
    EXPECT_EQ(groups.Get(GroupKind::kExpert).size(), 2);
    EXPECT_EQ(groups.Get(GroupKind::kExpert).rank(), world.rank() % 2);
    EXPECT_EQ(groups.Get(GroupKind::kExpertData).rank(), world.rank() / 2);
    // A group of one rank runs its collective on the calling thread: done when the call returns.
    std::vector<float> in{1.0f + static_cast<float>(world.rank())}, out{0};
    comm::Work work = single.AllReduce(in.data(), out.data(), 1, DType::kFloat32);
    EXPECT_TRUE(work.IsCompleted());
    work.Wait();
    EXPECT_EQ(out[0], in[0]);
    // The shared expert group works as one group: a sum over its 2 members.
    std::vector<float> sum{0};
    groups.Get(GroupKind::kExpertParallel)
        .AllReduce(in.data(), sum.data(), 1, DType::kFloat32)
        .Wait();
    const int base = world.rank() / 2 * 2;
    EXPECT_EQ(sum[0], static_cast<float>(1 + base + 1 + base + 1));
  });
}

TEST(ProcessGroups, EmbeddingGroupOnlyOnTheFirstAndLastStage) {
  const Mesh mesh(Config(4, 1, 4, 0));  // 4 stages of one rank each
  comm::RunInProcess(4, [&](comm::Communicator& world) {
    ProcessGroups groups(world, mesh);
    EXPECT_EQ(&groups.Get(GroupKind::kPipeline), &world);
    const bool holds = world.rank() == 0 || world.rank() == 3;
    EXPECT_EQ(groups.Has(GroupKind::kEmbedding), holds);
    if (holds) {
      EXPECT_EQ(groups.Get(GroupKind::kEmbedding).size(), 2);
      EXPECT_EQ(groups.Get(GroupKind::kEmbedding).rank(), world.rank() == 0 ? 0 : 1);
    } else {
      try {
        groups.Get(GroupKind::kEmbedding);
        ADD_FAILURE() << "rank " << world.rank() << " got an embedding group";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("is in no embedding group"), std::string::npos)
            << e.what();
      }
    }
  });
}

TEST(ProcessGroups, WorldOfAnotherSizeIsRefused) {
  const Mesh mesh(Config(4, 1, 1, 2));
  comm::RunInProcess(2, [&](comm::Communicator& world) {
    EXPECT_THROW(ProcessGroups(world, mesh), InvalidArgument);
  });
}

}  // namespace
}  // namespace switchyard::parallel
