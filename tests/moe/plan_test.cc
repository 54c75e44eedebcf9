// Capacity, slot order, drop policies and combine weights on hand-made routings, with the
// expected slots worked out by hand from docs/moe.md, "Slots and capacity".
#include "switchyard/moe/plan.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::moe {
namespace {

LayerConfig Config(int64_t e, int64_t k) {
  LayerConfig c;
  c.model_dim = 4;
  c.hidden_dim = 4;
  c.num_experts = e;
  c.top_k = k;
  return c;
}

// A routing: experts[t * k + j]; gates default to 1/k, scores to the gates.
GateResult Routing(int64_t e, int64_t k, std::vector<int32_t> experts,
                   std::vector<float> scores = {}) {
  GateResult g;
  g.num_experts = e;
  g.top_k = k;
  g.num_tokens = static_cast<int64_t>(experts.size()) / k;
  g.experts = std::move(experts);
  if (scores.empty()) scores.assign(g.experts.size(), 1.0f / static_cast<float>(k));
  g.choice_scores = scores;
  g.gates = scores;
  g.routed.assign(g.experts.size(), 1);
  g.priority.assign(static_cast<size_t>(g.num_tokens), 0.0f);
  return g;
}

TEST(Capacity, TutelFormula) {
  LayerConfig c = Config(4, 2);
  c.capacity_factor = 1.25f;  // spe = ceil(13 / 4) = 4; floor(1.25 * 4) = 5; C = 2 * 5
  EXPECT_EQ(ComputeCapacity(c, 13, 0), 10);
  c.capacity_factor = 0.3f;  // floor(1.2) = 1 -> 2
  EXPECT_EQ(ComputeCapacity(c, 13, 0), 2);
  c.capacity_factor = 0.0f;  // the max load
  EXPECT_EQ(ComputeCapacity(c, 13, 9), 9);
  c.capacity_factor = -1.0f;  // min(max load, 2 * floor(4))
  EXPECT_EQ(ComputeCapacity(c, 13, 9), 8);
  EXPECT_EQ(ComputeCapacity(c, 13, 3), 3);
  c.min_capacity = 5;
  EXPECT_EQ(ComputeCapacity(c, 13, 3), 5);
  c.alignment = 4;
  EXPECT_EQ(ComputeCapacity(c, 13, 3), 8);
  c.capacity = 3;  // explicit: only rounded to the alignment
  EXPECT_EQ(ComputeCapacity(c, 13, 100), 4);
  c.alignment = 1;
  EXPECT_EQ(ComputeCapacity(c, 13, 100), 3);
}

// A factor whose capacity does not fit an int32 is an error naming the factor, whichever formula;
// a negative factor that large caps nothing (C = the largest load). Before, 1e30 gave C = 0.
TEST(Capacity, FactorsThatOverflowAreErrors) {
  for (CapacityFormula f : {CapacityFormula::kTutel, CapacityFormula::kDeepSpeed}) {
    LayerConfig c = Config(4, 2);
    c.capacity_formula = f;
    for (float cf : {1e30f, 3e18f, 3e9f, std::numeric_limits<float>::max()}) {
      c.capacity_factor = cf;
      try {
        ComputeCapacity(c, 13, 5);
        ADD_FAILURE() << "cf " << cf << " gave no error";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("capacity from capacity_factor"), std::string::npos)
            << e.what();
      }
    }
    for (float cf : {-1e30f, -3e18f, -std::numeric_limits<float>::max()}) {
      c.capacity_factor = cf;
      EXPECT_EQ(ComputeCapacity(c, 13, 5), 5) << cf;
    }
    // The largest capacity that fits, then alignment pushing it over.
    c.capacity_factor = 0;
    c.capacity = std::numeric_limits<int32_t>::max();
    EXPECT_EQ(ComputeCapacity(c, 13, 5), std::numeric_limits<int32_t>::max());
    c.alignment = 2;
    EXPECT_THROW(ComputeCapacity(c, 13, 5), InvalidArgument);
  }
}

TEST(Capacity, ExpertBuffersThatCannotFitAreRefused) {
  LayerConfig c = Config(4, 2);
  c.model_dim = 6;
  c.hidden_dim = 10;
  EXPECT_NO_THROW(RequireExpertBufferMemory(c, 4, 1000));
  try {
    RequireExpertBufferMemory(c, 16, 130000000);  // 2.08e9 rows x 136 bytes: 263.5 GiB
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the expert buffer (num_experts 16 x capacity 130000000 "
                                         "rows of model_dim 6 and hidden_dim 10) needs 263.5 GiB"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(RequireExpertBufferMemory(c, 4, 1000000000), InvalidArgument);  // int32 rows
  EXPECT_THROW(RequireExpertBufferMemory(c, int64_t{1} << 40, int64_t{1} << 40), InvalidArgument);
}

TEST(Capacity, DeepSpeedFormulaInFloat32) {
  LayerConfig c = Config(3, 2);
  c.capacity_formula = CapacityFormula::kDeepSpeed;
  c.capacity_factor = 1.1f;  // ceil(float(10/3) * float(2.2)) = ceil(7.333) = 8
  EXPECT_EQ(ComputeCapacity(c, 10, 0), 8);
  c.num_experts = 4;
  c.capacity_factor = 0.4f;  // 1.25f * 0.8f = 1.0000000149 is 1.0f in float32: 1 (float64: 2)
  EXPECT_EQ(ComputeCapacity(c, 5, 0), 1);
  c.top_k = 1;
  c.capacity_factor = 1.0f;  // ceil(float(4/4) * 1) = 1 exactly, then min_capacity
  EXPECT_EQ(ComputeCapacity(c, 4, 0), 1);
  c.min_capacity = 4;
  EXPECT_EQ(ComputeCapacity(c, 4, 0), 4);
}

// docs/moe.md: `capacity_formula: deepspeed` with cf <= 0 follows the cf <= 0 rows of the capacity
// table with DeepSpeed's formula in place of Tutel's. E = 4, k = 2, T = 5: T / E = 1.25, spe = 2.
TEST(Capacity, DeepSpeedFormulaWithZeroOrNegativeFactor) {
  LayerConfig c = Config(4, 2);
  c.capacity_formula = CapacityFormula::kDeepSpeed;
  c.capacity_factor = 0.0f;  // the max load; the formula (which would give 0) plays no part
  EXPECT_EQ(ComputeCapacity(c, 5, 3), 3);
  EXPECT_EQ(ComputeCapacity(c, 5, 9), 9);
  EXPECT_EQ(ComputeCapacity(c, 5, 0), 0);
  // min(max load, ceil(1.25f * float(2 * 0.4f))): 1.25 * 0.80000001 = 1.0000000149 rounds to
  // 1.0f in float32, so 1 (float64 would give 2; Tutel's 2 * floor(0.4 * 2) gives 0).
  c.capacity_factor = -0.4f;
  EXPECT_EQ(ComputeCapacity(c, 5, 9), 1);
  EXPECT_EQ(ComputeCapacity(c, 5, 0), 0);
  // ceil(1.25 * 3) = 4 (Tutel: 2 * floor(1.5 * 2) = 6).
  c.capacity_factor = -1.5f;
  EXPECT_EQ(ComputeCapacity(c, 5, 9), 4);
  EXPECT_EQ(ComputeCapacity(c, 5, 3), 3);
  // Then min_capacity (DeepSpeed's 4) and the alignment, as for cf > 0.
  c.min_capacity = 4;
  EXPECT_EQ(ComputeCapacity(c, 5, 3), 4);
  c.capacity_factor = 0.0f;
  EXPECT_EQ(ComputeCapacity(c, 5, 3), 4);
  EXPECT_EQ(ComputeCapacity(c, 5, 5), 5);
  c.alignment = 3;
  EXPECT_EQ(ComputeCapacity(c, 5, 5), 6);
}

// The same through MakeDispatchPlan, where the max load is this rank's or the EP group's.
TEST(Plan, DeepSpeedFormulaWithZeroOrNegativeFactor) {
  LayerConfig c = Config(4, 2);
  c.capacity_formula = CapacityFormula::kDeepSpeed;
  c.capacity_factor = 0.0f;
  // 5 tokens. 1st choices 0, 0, 0, 1, 0; 2nd choices 1, 2, 3, 2, 1. Loads 4, 3, 2, 1.
  GateResult g = Routing(4, 2, {0, 1, 0, 2, 0, 3, 1, 2, 0, 1});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.loads, (std::vector<int64_t>{4, 3, 2, 1}));
  EXPECT_EQ(p.capacity, 4);
  EXPECT_EQ(p.dropped, 0);
  // Expert 0: 1st choices of t0, t1, t2, t4; expert 1: t3's 1st, then the 2nd of t0, t4;
  // expert 2: the 2nd of t1, t3; expert 3: t2's 2nd.
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, 1, 1, 0, 2, 0, 0, 1, 3, 2}));
  EXPECT_EQ(
      MakeDispatchPlan(c, g, {.global_token_offset = 0, .step = 0, .global_max_load = 7}).capacity,
      7);

  c.capacity_factor = -0.4f;  // min(4, 1) = 1: each expert keeps its first pair in slot order
  p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.capacity, 1);
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, -1, -1, 0, -1, 0, 0, -1, -1, -1}));
  EXPECT_EQ(p.counts, (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(p.dropped, 6);

  c.capacity_factor = -1.5f;  // min(group max 3, 4) = 3
  EXPECT_EQ(
      MakeDispatchPlan(c, g, {.global_token_offset = 0, .step = 0, .global_max_load = 3}).capacity,
      3);
  EXPECT_EQ(
      MakeDispatchPlan(c, g, {.global_token_offset = 0, .step = 0, .global_max_load = 9}).capacity,
      4);
}

TEST(Plan, ChoiceMajorSlots) {
  // 4 tokens, E = 3, k = 2. 1st choices: 0, 0, 1, 0; 2nd choices: 1, 2, 0, 1.
  LayerConfig c = Config(3, 2);
  c.capacity_factor = 0;  // no drops
  GateResult g = Routing(3, 2, {0, 1, 0, 2, 1, 0, 0, 1});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  // Expert 0: 1st choices of t0, t1, t3 -> 0, 1, 2; then t2's 2nd choice -> 3.
  // Expert 1: t2's 1st choice -> 0; 2nd choices of t0, t3 -> 1, 2. Expert 2: t1's 2nd -> 0.
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, 1, 1, 0, 0, 3, 2, 2}));
  EXPECT_EQ(p.loads, (std::vector<int64_t>{4, 3, 1}));
  EXPECT_EQ(p.capacity, 4);
  EXPECT_EQ(p.num_rows, 12);
  EXPECT_EQ(p.rows[3], 2 * 4 + 0);  // t1 2nd choice: expert 2, slot 0
  EXPECT_EQ(p.row_tokens[4 + 2], 3);
  EXPECT_EQ(p.row_pairs[4 + 2], 7);
  EXPECT_EQ(p.row_tokens[2 * 4 + 1], -1);  // padding
  EXPECT_EQ(p.dropped, 0);
}

TEST(Plan, TokenOrderSlots) {
  LayerConfig c = Config(3, 2);
  c.capacity_factor = 0;
  c.slot_order = SlotOrder::kTokenOrder;
  GateResult g = Routing(3, 2, {0, 1, 0, 2, 1, 0, 0, 1});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  // Token by token: t0 -> e0:0, e1:0; t1 -> e0:1, e2:0; t2 -> e1:1, e0:2; t3 -> e0:3, e1:2.
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, 0, 1, 0, 1, 2, 3, 2}));
}

TEST(Plan, PositionDropsAndBothWeightConventions) {
  LayerConfig c = Config(3, 2);
  c.capacity = 2;
  GateResult g =
      Routing(3, 2, {0, 1, 0, 2, 1, 0, 0, 1}, {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f, 0.8f, 0.2f});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  // Expert 0 keeps t0, t1 (1st choices); t3's 1st and t2's 2nd choice overflow.
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, 1, 1, 0, 0, -1, -1, -1}));
  EXPECT_EQ(p.dropped, 3);
  EXPECT_EQ(p.counts, (std::vector<int64_t>{2, 2, 1}));
  // Tutel keeps g; dropped choices weigh 0.
  EXPECT_FLOAT_EQ(p.weights[4], 0.5f);
  EXPECT_FLOAT_EQ(p.weights[5], 0.0f);
  c.renormalize_after_drop = true;  // DeepSpeed: the survivor of t2 gets weight 1
  p = MakeDispatchPlan(c, g, {});
  EXPECT_FLOAT_EQ(p.weights[4], 1.0f);
  EXPECT_FLOAT_EQ(p.weights[0], 0.6f);
  EXPECT_FLOAT_EQ(p.weights[6], 0.0f);  // both of t3's choices dropped: nothing to renormalize
  EXPECT_FLOAT_EQ(p.weights[7], 0.0f);
}

TEST(Plan, ProbsAndRandomDropPolicies) {
  LayerConfig c = Config(2, 1);
  c.capacity = 2;
  c.drop_policy = DropPolicy::kProbs;
  // Everybody to expert 0; scores 0.1, 0.9, 0.5, 0.7: keep t1 and t3, slots in token order.
  GateResult g = Routing(2, 1, {0, 0, 0, 0}, {0.1f, 0.9f, 0.5f, 0.7f});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.slots, (std::vector<int32_t>{-1, 0, -1, 1}));

  c.drop_policy = DropPolicy::kRandom;
  DispatchPlan r = MakeDispatchPlan(c, g, {});
  int kept = 0;
  for (int32_t s : r.slots) kept += s >= 0;
  EXPECT_EQ(kept, 2);
  // Keyed by the global token index: shifting the offset changes which tokens survive for
  // some offset, and the same offset always gives the same choice.
  EXPECT_EQ(MakeDispatchPlan(c, g, {}).slots, r.slots);
  bool differs = false;
  for (int64_t off = 1; off < 20 && !differs; ++off) {
    differs = MakeDispatchPlan(c, g, {.global_token_offset = off, .step = 0, .global_max_load = {}})
                  .slots != r.slots;
  }
  EXPECT_TRUE(differs);
}

TEST(Plan, BatchPrioritizedRouting) {
  LayerConfig c = Config(2, 1);
  c.capacity = 2;
  c.batch_prioritized_routing = true;
  GateResult g = Routing(2, 1, {0, 0, 0, 0});
  g.priority = {0.2f, 0.9f, 0.5f, 0.9f};  // order t1, t3 (tie: lower first), t2, t0
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.slots, (std::vector<int32_t>{-1, 0, -1, 1}));
}

TEST(Plan, RandomRoutingRemovedChoicesTakeNoSlot) {
  LayerConfig c = Config(2, 2);
  c.capacity_factor = 0;
  GateResult g = Routing(2, 2, {0, 1, 1, 0});
  g.routed[1] = 0;  // t0's 2nd choice removed
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.slots, (std::vector<int32_t>{0, -1, 0, 1}));
  EXPECT_EQ(p.loads, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(p.dropped, 0);
}

TEST(Plan, GlobalMaxLoadSetsCapacity) {
  LayerConfig c = Config(2, 1);
  c.capacity_factor = 0;
  GateResult g = Routing(2, 1, {0, 0, 1});
  EXPECT_EQ(MakeDispatchPlan(c, g, {}).capacity, 2);
  EXPECT_EQ(
      MakeDispatchPlan(c, g, {.global_token_offset = 0, .step = 0, .global_max_load = 7}).capacity,
      7);
  c.capacity_factor = -1;  // min(global max, k * floor(1 * ceil(3 / 2)))
  EXPECT_EQ(
      MakeDispatchPlan(c, g, {.global_token_offset = 0, .step = 0, .global_max_load = 7}).capacity,
      2);
}

TEST(Plan, DroplessSortsByExpert) {
  LayerConfig c = Config(3, 2);
  c.dropless = true;
  GateResult g = Routing(3, 2, {0, 1, 0, 2, 1, 0, 0, 1});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  EXPECT_EQ(p.counts, (std::vector<int64_t>{4, 3, 1}));
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 4, 7, 8}));
  EXPECT_EQ(p.num_rows, 8);
  EXPECT_EQ(p.capacity, 4);
  EXPECT_EQ(p.row_tokens, (std::vector<int32_t>{0, 1, 3, 2, 2, 0, 3, 1}));
}

TEST(Plan, EveryTokenDroppedAndEmptyBatch) {
  LayerConfig c = Config(2, 2);
  c.capacity = 0;
  DispatchPlan p = MakeDispatchPlan(c, Routing(2, 2, {0, 1, 1, 0}), {});
  EXPECT_EQ(p.num_rows, 0);
  EXPECT_EQ(p.dropped, 4);
  for (float w : p.weights) EXPECT_EQ(w, 0.0f);
  c.capacity.reset();
  DispatchPlan empty = MakeDispatchPlan(c, Routing(2, 2, {}), {});
  EXPECT_EQ(empty.num_tokens, 0);
  EXPECT_EQ(empty.capacity, 0);
}

TEST(Plan, CombineWeightsBackwardRenormalized) {
  LayerConfig c = Config(3, 2);
  c.capacity_factor = 0;
  c.renormalize_after_drop = true;
  GateResult g = Routing(3, 2, {0, 1}, {0.6f, 0.2f});
  DispatchPlan p = MakeDispatchPlan(c, g, {});
  // w = g / (g0 + g1): dg_j = (dw_j - sum_i dw_i w_i) / S.
  std::vector<float> dw = {1.0f, 0.0f};
  std::vector<float> dg = CombineWeightsBackward(c, g, p, dw);
  EXPECT_NEAR(dg[0], (1.0f - 0.75f) / 0.8f, 1e-6);
  EXPECT_NEAR(dg[1], (0.0f - 0.75f) / 0.8f, 1e-6);
}

}  // namespace
}  // namespace switchyard::moe
