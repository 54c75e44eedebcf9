// The mesh: group layouts of DeepSpeed (with its documented examples) and Megatron-Core's
// folding, the dense dimensions (tp, cp, dp, pp) in any rank order with Megatron-Core's
// documented examples, expert placement, and clear errors naming the constraint that fails.
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
  // DeepSpeed's documented example (docs/parallel.md, "The mesh"): 16 ranks, ep_size 4 -> ep groups
  // [0..3], [4..7], ...; ep_dp [0,4,8,12], ...
  Mesh mesh = ExpertMesh(DeepSpeed(16, 1, 4), 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens).size(), 1u);
  EXPECT_EQ(LocalExperts(mesh, 8), 2);
  EXPECT_EQ(mesh.shards(), 1);
  EXPECT_EQ(mesh.data_shards(), 16);
}

TEST(Mesh, DeepSpeedTensorParallelBuildsEpGroupsFromSameTpRank) {
  // DeepSpeed with tensor parallel: tp 2, 8 ranks, ep 4: ep groups [0,2,4,6], [1,3,5,7].
  Mesh mesh = ExpertMesh(DeepSpeed(8, 2, 4), 4, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kData), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertHolders), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.data_shards(), 4);
  EXPECT_TRUE(mesh.tp_duplicates_tokens());
}

TEST(Mesh, DeepSpeedDocumentedExpertModelDataExample) {
  // deepspeed/utils/groups.py, _get_expert_parallel_ranks: world 16, model 2, expert 4.
  Mesh mesh = ExpertMesh(DeepSpeed(16, 2, 4), 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kData),
            (Groups{{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
}

TEST(Mesh, TutelShardedExpertsWhenFewerExpertsThanRanks) {
  Mesh mesh = ExpertMesh(DeepSpeed(8, 1, 0), 2, 64);
  EXPECT_EQ(mesh.shards(), 4);
  EXPECT_EQ(LocalExperts(mesh, 2), 1);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertTensor), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  RankCoords c = mesh.Coords(6);
  EXPECT_EQ(c.expert_position, 1);
  EXPECT_EQ(c.expert_shard, 2);
  moe::LayerConfig layer;
  layer.num_experts = 2;
  layer.hidden_dim = 64;
  layer.model_dim = 10;
  ShardSpec s = ShardOf(mesh, 6, layer);
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
  Mesh mesh = ExpertMesh(c, 8, 64);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertTensor).front(), (std::vector<int>{0, 1}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertParallel).front(), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData).front(), (std::vector<int>{0, 8}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor).front(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens).size(), 1u);  // sequence parallel: all ranks
  EXPECT_EQ(mesh.data_shards(), 16);
  EXPECT_EQ(LocalExperts(mesh, 8), 2);
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
    Mesh mesh = ExpertMesh(c, 4, 64);
    for (GroupKind kind : kAllGroupKinds) {
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
      Mesh mesh = ExpertMesh(c, e, h);
    } catch (const InvalidArgument& err) {
      return err.what();
    }
    return "";
  };
  EXPECT_NE(message(DeepSpeed(4, 1, 4), 6, 64).find("num_experts 6 is not divisible by ep 4"),
            std::string::npos);
  EXPECT_NE(message(DeepSpeed(6, 1, 6), 4, 64).find("ep 6 is not a multiple of num_experts 4"),
            std::string::npos);
  EXPECT_NE(
      message(DeepSpeed(8, 3, 0), 8, 64).find("world 8 is not divisible by tp 3 × pp 1 × cp 1"),
      std::string::npos);
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

// ---- The dense dimensions, pipeline and context parallelism, rank order ----

MeshConfig Dense(int w, int tp, int pp, int cp, std::string order = "tp-cp-ep-dp-pp") {
  MeshConfig c;
  c.world_size = w;
  c.tp = tp;
  c.pp = pp;
  c.cp = cp;
  c.order = std::move(order);
  return c;
}

// Every rank is in exactly one group of each kind (kEmbedding: at most one).
void ExpectPartitions(const Mesh& mesh) {
  for (GroupKind kind : kAllGroupKinds) {
    std::vector<int> seen(static_cast<size_t>(mesh.world_size()), 0);
    for (const auto& g : mesh.Groups(kind)) {
      for (int r : g) ++seen[static_cast<size_t>(r)];
    }
    for (int r = 0; r < mesh.world_size(); ++r) {
      if (kind == GroupKind::kEmbedding) {
        const int stage = mesh.Coords(r).pp_rank;
        const bool holds = stage == 0 || stage == mesh.pp() - 1;
        EXPECT_EQ(seen[static_cast<size_t>(r)], holds ? 1 : 0) << "embedding, rank " << r;
        EXPECT_EQ(mesh.GroupOf(kind, r).empty(), !holds) << "rank " << r;
      } else {
        EXPECT_EQ(seen[static_cast<size_t>(r)], 1) << GroupKindName(kind) << ", rank " << r;
        EXPECT_FALSE(mesh.GroupOf(kind, r).empty());
      }
    }
  }
}

TEST(Mesh, MegatronDocumentedSixteenRanksTpTwoPpFour) {
  // Megatron-Core's initialize_model_parallel docstring: 16 GPUs, tp 2, pp 4 (so dp 2).
  Mesh mesh(Dense(16, 2, 4, 1));
  EXPECT_EQ(mesh.dp(), 2);
  EXPECT_EQ(mesh.Groups(GroupKind::kData),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kPipeline),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  // Tied embeddings: the first and last stage of each pipeline.
  EXPECT_EQ(mesh.Groups(GroupKind::kEmbedding), (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_TRUE(mesh.GroupOf(GroupKind::kEmbedding, 6).empty());
  // One model replica: tp x pp.
  EXPECT_EQ(mesh.Groups(GroupKind::kModel),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
  RankCoords c = mesh.Coords(13);
  EXPECT_EQ(c.tp_rank, 1);
  EXPECT_EQ(c.dp_rank, 0);
  EXPECT_EQ(c.pp_rank, 3);
  // The MoE part lives on each stage's ranks: EP over the 2 data-parallel ranks of a tp rank.
  EXPECT_EQ(mesh.ep(), 2);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens), mesh.Groups(GroupKind::kData));
  EXPECT_EQ(mesh.data_shards(), 2);
  ExpectPartitions(mesh);
}

TEST(Mesh, MegatronDocumentedOrderTpPpDp) {
  // generate_masked_orthogonal_rank_groups' docstring: 8 ranks, order tp-pp-dp, sizes 2-2-2:
  // dp groups [0,4], [1,5], [2,6], [3,7].
  Mesh mesh(Dense(8, 2, 2, 1, "tp-pp-dp"));
  EXPECT_EQ(mesh.order(), "tp-pp-dp-cp-ep");
  EXPECT_EQ(mesh.Groups(GroupKind::kData), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kPipeline), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kEmbedding), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  ExpectPartitions(mesh);
}

TEST(Mesh, MegatronDocumentedContextParallel) {
  // initialize_model_parallel's docstring: 8 GPUs, tp 4, cp 2: cp groups [0,4], [1,5], [2,6],
  // [3,7]; each chunk is processed by 4 GPUs (0-3 and 4-7).
  Mesh mesh(Dense(8, 4, 1, 2));
  EXPECT_EQ(mesh.dp(), 1);
  EXPECT_EQ(mesh.Groups(GroupKind::kContext), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensor), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensorContext), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  // Dense gradients are reduced over dp x cp: here the cp groups.
  EXPECT_EQ(mesh.Groups(GroupKind::kDataContext), mesh.Groups(GroupKind::kContext));
  EXPECT_EQ(mesh.Groups(GroupKind::kData).size(), 8u);
  // The cp ranks hold different tokens: they are the data shards and the EP groups.
  EXPECT_EQ(mesh.data_shards(), 2);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert), mesh.Groups(GroupKind::kContext));
  ExpectPartitions(mesh);
}

TEST(Mesh, DataContextGroupsFollowTheOrder) {
  // 16 ranks, tp 2, cp 2, dp 4 in the default order (tp fastest, then cp, then dp):
  // rank = tp + 2 cp + 4 dp.
  Mesh mesh(Dense(16, 2, 1, 2));
  EXPECT_EQ(mesh.Groups(GroupKind::kDataContext),
            (Groups{{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kData),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTensorContext),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  // EP groups of 8 = the dp-cp group; of 4: its consecutive halves.
  MeshConfig c = Dense(16, 2, 1, 2);
  c.ep = 4;
  Mesh ep4(c);
  EXPECT_EQ(ep4.Groups(GroupKind::kExpert),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(ep4.Groups(GroupKind::kExpertData).front(), (std::vector<int>{0, 8}));
  ExpectPartitions(ep4);
  // Order dp-tp-cp: dp fastest.
  Mesh other(Dense(16, 2, 1, 2, "dp-tp-cp"));
  EXPECT_EQ(other.Groups(GroupKind::kData),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(other.Groups(GroupKind::kTensor).front(), (std::vector<int>{0, 4}));
  EXPECT_EQ(other.Groups(GroupKind::kContext).front(), (std::vector<int>{0, 8}));
  ExpectPartitions(other);
}

TEST(Mesh, DeepSpeedExpertGroupsStayInsideAStage) {
  MeshConfig c = Dense(8, 1, 2, 1);
  c.ep = 2;
  Mesh mesh(c);
  EXPECT_EQ(mesh.Groups(GroupKind::kPipeline), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertHolders), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh.Coords(6).token_shard, 2);
  EXPECT_EQ(mesh.Coords(6).expert_member, 0);
  ExpectPartitions(mesh);
}

TEST(Mesh, MegatronFoldingWithPipelineStages) {
  // 16 ranks, tp 2 (sequence parallel), pp 2: dense dp 4; experts: etp 1 x ep 4 x edp 2 per
  // stage, rank = ep + 4 edp + 8 stage in the default order.
  MeshConfig c = Dense(16, 2, 2, 1);
  c.arrangement = Arrangement::kMegatron;
  c.ep = 4;
  Mesh mesh(c);
  EXPECT_TRUE(mesh.sequence_parallel());
  EXPECT_EQ(mesh.edp(), 2);
  EXPECT_EQ(mesh.Groups(GroupKind::kExpert),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(mesh.Groups(GroupKind::kExpertData).front(), (std::vector<int>{0, 4}));
  EXPECT_EQ(mesh.Groups(GroupKind::kPipeline).front(), (std::vector<int>{0, 8}));
  EXPECT_EQ(mesh.Groups(GroupKind::kTokens),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(mesh.data_shards(), 8);
  ExpectPartitions(mesh);
  // Every order with pp last keeps the stages of both meshes on the same ranks.
  c.order = "ep-tp-dp-cp-pp";
  Mesh reordered(c);
  EXPECT_EQ(reordered.Groups(GroupKind::kExpertParallel).front(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(reordered.Groups(GroupKind::kTensor).front(), (std::vector<int>{0, 1}));
  ExpectPartitions(reordered);
}

TEST(Mesh, KeepsTheExistingGroupsForPpAndCpOne) {
  // The layouts of the MoE layer, spelled with and without the new dimensions, give the same
  // groups of every kind.
  for (Arrangement a : {Arrangement::kDeepSpeed, Arrangement::kMegatron}) {
    MeshConfig c = Dense(8, 2, 1, 1);
    c.arrangement = a;
    c.etp = a == Arrangement::kMegatron ? 2 : 1;
    c.ep = 2;
    MeshConfig explicit_order = c;
    explicit_order.order = "tp-cp-ep-dp-pp";
    MeshConfig short_order = c;
    short_order.order = a == Arrangement::kMegatron ? "tp-ep-dp" : "tp-dp";
    Mesh m1(c), m2(explicit_order), m3(short_order);
    for (GroupKind kind : kAllGroupKinds) {
      EXPECT_EQ(m1.Groups(kind), m2.Groups(kind)) << GroupKindName(kind);
      EXPECT_EQ(m1.Groups(kind), m3.Groups(kind)) << GroupKindName(kind);
    }
    EXPECT_TRUE(m1.SameLayout(m3));
  }
}

TEST(Mesh, ConstraintsAreNamed) {
  auto message = [](const MeshConfig& c) -> std::string {
    try {
      Mesh mesh(c);
    } catch (const InvalidArgument& err) {
      return err.what();
    }
    return "";
  };
  EXPECT_NE(message(Dense(12, 2, 4, 1)).find("world 12 is not divisible by tp 2 × pp 4 × cp 1"),
            std::string::npos);
  EXPECT_NE(message(Dense(8, 1, 1, 1, "tp-xp")).find("'xp' is not a dimension"), std::string::npos);
  EXPECT_NE(message(Dense(8, 1, 1, 1, "tp-tp")).find("'tp' is named twice"), std::string::npos);
  EXPECT_NE(message(Dense(8, 2, 2, 1, "tp-dp")).find("leaves out pp (size 2)"), std::string::npos);
  EXPECT_NE(message(Dense(8, 0, 1, 1)).find("tp: expected >= 1, got 0"), std::string::npos);
  MeshConfig megatron = Dense(8, 2, 2, 1, "tp-pp-ep-dp");
  megatron.arrangement = Arrangement::kMegatron;
  megatron.ep = 2;
  EXPECT_NE(message(megatron).find("puts the pipeline stages on other ranks"), std::string::npos)
      << message(megatron);
  megatron.order = "tp-cp-dp-pp";  // ep 2 must be named in the Megatron arrangement
  EXPECT_NE(message(megatron).find("leaves out ep (size 2)"), std::string::npos);
  MeshConfig fold = Dense(12, 1, 2, 1);
  fold.arrangement = Arrangement::kMegatron;
  fold.etp = 4;
  EXPECT_NE(message(fold).find("world 12 is not divisible by etp 4 × pp 2"), std::string::npos);
  MeshConfig sp = Dense(8, 2, 1, 1);
  sp.sequence_parallel = true;  // DeepSpeed's EP groups need tp ranks with the same tokens
  EXPECT_NE(message(sp).find("sequence parallel on with tp 2"), std::string::npos);
  MeshConfig ds = Dense(16, 2, 1, 1);
  ds.ep = 3;
  EXPECT_NE(message(ds).find("ep 3 does not divide the 8 data-parallel ranks (dp 8 × cp 1)"),
            std::string::npos);
}

TEST(Mesh, DescribeListsTheGroups) {
  Mesh mesh = ExpertMesh(DeepSpeed(16, 2, 4), 8, 64);
  std::string text = mesh.Describe();
  EXPECT_NE(text.find("[0,2,4,6]"), std::string::npos) << text;
  EXPECT_NE(text.find("ep_dp"), std::string::npos) << text;
  const std::string pipeline = Mesh(Dense(16, 2, 4, 1)).Describe();
  EXPECT_NE(pipeline.find("embedding"), std::string::npos) << pipeline;
  EXPECT_NE(pipeline.find("[0,12] [1,13] [2,14] [3,15]"), std::string::npos) << pipeline;
  // The experts are the layer's: 8 over the 4 positions of each EP group, 2 each.
  const std::string experts = DescribeExperts(mesh, 8);
  EXPECT_NE(experts.find(" 0:e0-1 1:e2-3 2:e4-5 3:e6-7"), std::string::npos) << experts;
  EXPECT_NE(DescribeExperts(ExpertMesh(DeepSpeed(8, 1, 0), 2, 64), 2).find(" 5:e1/h1"),
            std::string::npos);
}

// ---- The mesh is the degrees only; expert sharding is the layer's ----

TEST(Mesh, DegreesAloneGiveTheExpertLayoutsGroups) {
  // DeepSpeed with 2 experts over ep 8: the layer asks for etp = ep / E = 4 H-shards; a mesh
  // given that degree directly has the same groups.
  MeshConfig degrees = DeepSpeed(8, 1, 0);
  EXPECT_EQ(ExpertMeshConfig(degrees, 2).etp, 4);
  EXPECT_EQ(ExpertMeshConfig(degrees, 8).etp, 1);
  EXPECT_EQ(ExpertMeshConfig(degrees, 16).etp, 1);
  degrees.etp = 4;
  const Mesh mesh(degrees);
  EXPECT_TRUE(mesh.SameLayout(ExpertMesh(DeepSpeed(8, 1, 0), 2, 64)));
  EXPECT_EQ(mesh.positions(), 2);
  EXPECT_EQ(LocalExperts(mesh, 2), 1);
  EXPECT_EQ(LocalExperts(mesh, 4), 2);  // the mesh itself allows E_l > 1 at 4 H-shards
  // Megatron: etp is the key's; the experts only have to divide over ep.
  MeshConfig m = Dense(8, 2, 1, 1);
  m.arrangement = Arrangement::kMegatron;
  m.etp = 2;
  EXPECT_EQ(ExpertMeshConfig(m, 4).etp, 2);
}

TEST(Mesh, ExpertsThatDoNotFitAreTheLayersClearErrors) {
  auto message = [](const auto& f) -> std::string {
    try {
      f();
    } catch (const InvalidArgument& err) {
      return err.what();
    }
    return "";
  };
  MeshConfig four = DeepSpeed(8, 1, 0);
  four.etp = 4;
  const Mesh mesh(four);
  // A DeepSpeed mesh with 4 H-shards serves only ep / 4 = 2 experts.
  EXPECT_NE(message([&] { CheckExpertsFit(mesh, 8, 64); }).find("8 experts over ep 8 with 4"),
            std::string::npos);
  EXPECT_NE(message([&] { CheckExpertsFit(mesh, 2, 6); }).find("hidden_dim 6 is not divisible"),
            std::string::npos);
  MeshConfig two = DeepSpeed(8, 1, 0);
  two.etp = 2;  // neither 1 nor ep / E = 4
  EXPECT_NE(message([&] { (void)ExpertMeshConfig(two, 2); }).find("etp 2"), std::string::npos);
  EXPECT_NE(message([&] { (void)ExpertMeshConfig(two, 0); }).find("num_experts: expected >= 1"),
            std::string::npos);
  MeshConfig bad_etp = DeepSpeed(8, 1, 4);
  bad_etp.etp = 3;
  EXPECT_NE(message([&] { Mesh m(bad_etp); }).find("etp 3 does not divide ep 4"),
            std::string::npos);
}

}  // namespace
}  // namespace switchyard::parallel
