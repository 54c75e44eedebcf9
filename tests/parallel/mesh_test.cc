// The mesh: group layouts of DeepSpeed (with its documented examples) and Megatron-Core's
// folding, expert placement, and clear errors for layouts that do not divide.
#include "switchyard/parallel/mesh.h"

#include <gtest/gtest.h>

#include "switchyard/core/error.h"
#include "switchyard/parallel/expert_shard.h"

namespace switchyard::parallel {
namespace {

using Groups = std::vector<std::vector<int>>;

MeshConfig DeepSpeed(int w, int tp, int ep) {
  MeshConfig c;
  c.world_size = w;
  c.tp = tp;
  c.ep = ep;
  return c;
}

TEST(Mesh, DeepSpeedSixteenRanksEpFour) {
  // SPEC §2.1: 16 ranks, ep_size 4 -> ep groups [0..3], [4..7], ...; ep_dp [0,4,8,12], ...
  Mesh mesh(DeepSpeed(16, 1, 4), 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens).size(), 1u);
  EXPECT_EQ(mesh.local_experts(), 2);
  EXPECT_EQ(mesh.shards(), 1);
  EXPECT_EQ(mesh.data_shards(), 16);
}

TEST(Mesh, DeepSpeedTensorParallelBuildsEpGroupsFromSameTpRank) {
  // SPEC §2.1: tp 2, 8 ranks, ep 4: ep groups [0,2,4,6], [1,3,5,7].
  Mesh mesh(DeepSpeed(8, 2, 4), 4, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kData), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertHolders), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.data_shards(), 4);
  EXPECT_TRUE(mesh.tp_duplicates_tokens());
}

TEST(Mesh, DeepSpeedDocumentedExpertModelDataExample) {
  // deepspeed/utils/groups.py, _get_expert_parallel_ranks: world 16, model 2, expert 4.
  Mesh mesh(DeepSpeed(16, 2, 4), 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kData),
            (Groups{{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
}

TEST(Mesh, TutelShardedExpertsWhenFewerExpertsThanRanks) {
  Mesh mesh(DeepSpeed(8, 1, 0), 2, 64);
  EXPECT_EQ(mesh.shards(), 4);
  EXPECT_EQ(mesh.local_experts(), 1);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertTensor), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  RankCoords c = mesh.Coords(6);
  EXPECT_EQ(c.expert_position, 1);
  EXPECT_EQ(c.expert_shard, 2);
  ShardSpec s = ShardOf(mesh, 6, 10);
  EXPECT_EQ(s.first_expert, 1);
  EXPECT_EQ(s.shard_hidden(), 16);
  EXPECT_EQ(s.bias_chunk(), 3);  // ceil(10 / 4)
}

TEST(Mesh, MegatronFoldingExpertTensorFastest) {
  MeshConfig c;
  c.world_size = 16;
  c.tp = 4;
  c.etp = 2;
  c.ep = 4;
  c.arrangement = Arrangement::kMegatron;
  Mesh mesh(c, 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertTensor).front(), (std::vector<int>{0, 1}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertParallel).front(), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData).front(), (std::vector<int>{0, 8}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor).front(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens).size(), 1u);  // sequence parallel: all ranks
  EXPECT_EQ(mesh.data_shards(), 16);
  EXPECT_EQ(mesh.local_experts(), 2);
  EXPECT_FALSE(mesh.tp_duplicates_tokens());
}

TEST(Mesh, EveryGroupKindPartitionsTheWorld) {
  for (Arrangement a : {Arrangement::kDeepSpeed, Arrangement::kMegatron}) {
    MeshConfig c;
    c.world_size = 8;
    c.tp = 2;
    c.arrangement = a;
    c.ep = a == Arrangement::kDeepSpeed ? 2 : 2;
    c.etp = a == Arrangement::kMegatron ? 2 : 1;
    Mesh mesh(c, 4, 64);
    for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kTokens,
                           GroupKind::kExpert, GroupKind::kExpertParallel, GroupKind::kExpertTensor,
                           GroupKind::kExpertData, GroupKind::kExpertHolders}) {
      std::vector<int> seen(8, 0);
      for (const auto& g : mesh.Groups(kind)) {
        for (int r : g) ++seen[static_cast<size_t>(r)];
      }
      EXPECT_EQ(seen, std::vector<int>(8, 1)) << GroupKindName(kind);
    }
  }
}

TEST(Mesh, NonDividingLayoutsAreClearErrors) {
  auto message = [](const MeshConfig& c, int64_t e, int64_t h) -> std::string {
    try {
      Mesh mesh(c, e, h);
    } catch (const InvalidArgument& err) {
      return err.what();
    }
    return "";
  };
  EXPECT_NE(message(DeepSpeed(4, 1, 4), 6, 64).find("num_experts 6 is not divisible by ep 4"),
            std::string::npos);
  EXPECT_NE(message(DeepSpeed(6, 1, 6), 4, 64).find("ep 6 is not a multiple of num_experts 4"),
            std::string::npos);
  EXPECT_NE(message(DeepSpeed(8, 3, 0), 8, 64).find("tp 3 does not divide"), std::string::npos);
  EXPECT_NE(message(DeepSpeed(8, 1, 3), 8, 64).find("ep 3 does not divide"), std::string::npos);
  EXPECT_NE(message(DeepSpeed(8, 1, 8), 2, 6).find("hidden_dim 6 is not divisible"),
            std::string::npos);
  MeshConfig m;
  m.world_size = 8;
  m.etp = 2;
  m.arrangement = Arrangement::kMegatron;
  EXPECT_NE(message(m, 6, 64).find("num_experts 6 is not divisible by ep 4"), std::string::npos);
  MeshConfig bad = DeepSpeed(4, 1, 0);
  bad.etp = 2;
  EXPECT_NE(message(bad, 4, 64).find("Megatron"), std::string::npos);
}

TEST(Mesh, DescribeListsTheGroups) {
  Mesh mesh(DeepSpeed(16, 2, 4), 8, 64);
  std::string text = mesh.Describe();
  EXPECT_NE(text.find("[0,2,4,6]"), std::string::npos) << text;
  EXPECT_NE(text.find("ep_dp"), std::string::npos) << text;
}

}  // namespace
}  // namespace switchyard::parallel
