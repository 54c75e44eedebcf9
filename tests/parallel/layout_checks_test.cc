// Checks that the layout options of the parallel MoE layer do what they claim, beyond output
// equivalence (which would also pass if an option were ignored):
//   - per-rank capacity with capacity_factor <= 0 takes the largest load over the EP group, not
//     over the world, in a layout whose EP groups do not span every token shard (ds_ep_replicas);
//   - the equivalence suite's inputs really hold experts and ranks without tokens;
//   - DeepSpeed's TP de-duplication halves the token bytes each rank puts on the wire;
//   - the 2DH option makes every all-to-all of the expert group run the hierarchical algorithm
//     (seen through a Communicator that records the options of each call it forwards).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::Layout;
using testing::MakeInputs;
using testing::MatchesReference;
using testing::SmallConfig;

// The layout of the given name from LayoutsFor (fails the test if there is none).
ParallelOptions LayoutNamed(int world_size, int64_t num_experts, const std::string& name) {
  for (const Layout& l : testing::LayoutsFor(world_size, num_experts)) {
    if (l.name == name) return l.options;
  }
  ADD_FAILURE() << "no layout " << name << " for W=" << world_size << " E=" << num_experts;
  return {};
}

// Start of each shard's tokens in a contiguous split.
std::vector<int64_t> Offsets(const std::vector<int64_t>& split) {
  std::vector<int64_t> offsets(split.size(), 0);
  for (size_t d = 1; d < split.size(); ++d) offsets[d] = offsets[d - 1] + split[d - 1];
  return offsets;
}

int64_t MaxOf(const std::vector<int64_t>& v) { return *std::max_element(v.begin(), v.end()); }
int64_t MinOf(const std::vector<int64_t>& v) { return *std::min_element(v.begin(), v.end()); }

// ---- 1. capacity_factor <= 0 in per-rank scope: the max load over the EP group ----

// ds_ep_replicas at W = 4: ep 2, so the EP groups {0, 1} and {2, 3} each see two of the four
// token shards. The split gives the first group many tokens and the second few, so the groups'
// largest loads differ and a world-wide maximum would give the second group a larger capacity.
// No rank drops a pair under either maximum (each rank's loads are at most its group's), so the
// outputs cannot tell them apart: the check is on each rank's capacity and its rows on the wire.
TEST(PerRankCapacity, MaxLoadIsTakenOverTheExpertGroupNotTheWorld) {
  const int w = 4;
  const ParallelOptions layout = LayoutNamed(w, 4, "ds_ep_replicas");
  // 0: capacity = the group's max load; -3: min(that, the cf 3 formula on the rank's own tokens),
  // which for the small shards lies between the two groups' maxima.
  for (float cf : {0.0f, -3.0f}) {
    SCOPED_TRACE("capacity_factor " + std::to_string(cf));
    const moe::LayerConfig config = SmallConfig(4, false, cf);
    const Inputs in = MakeInputs(config, 40, 41);
    const std::vector<int64_t> split = {17, 13, 6, 4};
    const std::vector<int64_t> offsets = Offsets(split);
    const Mesh mesh = ExpertMesh(layout.mesh, config.num_experts, config.hidden_dim);
    ASSERT_EQ(mesh.data_shards(), w);
    ASSERT_EQ(mesh.expert_group_size(), 2);

    // Reference: each shard's largest load on its own, the max over its EP group, the max over
    // the world, and the capacity each implies for each rank.
    moe::MoeLayer single(config);
    std::vector<int64_t> shard_max(split.size());
    for (size_t d = 0; d < split.size(); ++d) {
      moe::ForwardOptions fo;
      fo.global_token_offset = offsets[d];
      fo.save_for_backward = false;
      const moe::LayerOutput out =
          single.Forward(in.params, in.x.Slice(offsets[d], offsets[d] + split[d]), fo);
      shard_max[d] = MaxOf(out.expert_loads);
    }
    const int64_t world_max = MaxOf(shard_max);
    std::vector<int64_t> group_max(split.size()), want_capacity(split.size()),
        world_capacity(split.size());
    for (int r = 0; r < w; ++r) {
      const RankCoords c = mesh.Coords(r);
      int64_t m = 0;
      for (int peer : mesh.GroupOf(GroupKind::kExpert, r)) {
        m = std::max(m, shard_max[static_cast<size_t>(mesh.Coords(peer).token_shard)]);
      }
      const auto d = static_cast<size_t>(c.token_shard);
      group_max[d] = m;
      want_capacity[d] = moe::ComputeCapacity(config, split[d], m);
      world_capacity[d] = moe::ComputeCapacity(config, split[d], world_max);
    }
    ASSERT_NE(MinOf(group_max), MaxOf(group_max)) << "the EP groups' largest loads should differ";
    ASSERT_NE(want_capacity, world_capacity)
        << "a world-wide max load should give some rank another capacity";

    // The layer on 4 ranks: each rank's capacity, and the rows per expert on the wire (the
    // largest capacity of its EP group).
    ParallelOptions options = layout;
    options.batch_scope = BatchScope::kPerRank;
    std::vector<int64_t> capacity(w, -1), wire_rows(w, -1), shard_of(w, -1);
    comm::RunInProcess(w, [&](comm::Communicator& world) {
      ParallelMoeLayer layer(config, options, MakeLayerGroups(world, config, options));
      const RankCoords& c = layer.coords();
      const auto d = static_cast<size_t>(c.token_shard);
      ParallelForwardOptions fo;
      fo.global_token_offset = offsets[d];
      fo.save_for_backward = false;
      const ParallelOutput out = layer.Forward(layer.ShardParams(in.params),
                                               in.x.Slice(offsets[d], offsets[d] + split[d]), fo);
      capacity[static_cast<size_t>(c.rank)] = out.layer.capacity;
      wire_rows[static_cast<size_t>(c.rank)] = out.buffer_capacity;
      shard_of[static_cast<size_t>(c.rank)] = c.token_shard;
    });
    for (int r = 0; r < w; ++r) {
      const auto d = static_cast<size_t>(shard_of[static_cast<size_t>(r)]);
      EXPECT_EQ(capacity[static_cast<size_t>(r)], want_capacity[d])
          << "rank " << r << ": capacity from its EP group's max load " << group_max[d]
          << " (the world's max load " << world_max << " would give " << world_capacity[d] << ")";
      int64_t rows = 0;
      for (int peer : mesh.GroupOf(GroupKind::kExpert, r)) {
        rows = std::max(rows, want_capacity[static_cast<size_t>(mesh.Coords(peer).token_shard)]);
      }
      EXPECT_EQ(wire_rows[static_cast<size_t>(r)], rows) << "rank " << r;
    }

    // And the whole run (forward, backward, gradient sync) equals one layer per shard, each
    // given its EP group's max load.
    DriverOptions o;
    o.parallel = options;
    o.token_split = split;
    const testing::Reference ref = testing::PerShardReference(config, in, split, group_max);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o));
    EXPECT_TRUE(MatchesReference(run, ref));
    EXPECT_EQ(run.l_aux_per_shard, ref.l_aux_per_shard);
  }
}

// ---- 2. the equivalence inputs hold experts and ranks without tokens ----

// As equivalence_test.cc: its world cases, its inputs (37 tokens, seeds 11 and 12) and its
// uneven split (a copy: shard 1 gets no tokens).
struct WorldCase {
  int world_size;
  int64_t num_experts;
};

std::vector<int64_t> EquivalenceUnevenSplit(int64_t tokens, int shards) {
  if (shards == 1) return {tokens};
  std::vector<int64_t> split(static_cast<size_t>(shards), 0);
  int64_t left = tokens;
  for (int d = 1; d < shards; ++d) {
    int64_t part = d == 1 ? 0 : std::min<int64_t>(left, (tokens * d) / (shards * 2) + 1);
    split[static_cast<size_t>(d)] = part;
    left -= part;
  }
  split[0] = left;
  return split;
}

// Every world case of the suite with E >= 4 (with E = 2 and top_k = 2 each token picks both
// experts, so no expert can go without tokens there) and W > 1 (a rank without tokens).
TEST(EquivalenceInputs, HaveExpertsAndRanksWithoutTokens) {
  for (const WorldCase wc :
       {WorldCase{2, 4}, WorldCase{3, 6}, WorldCase{4, 4}, WorldCase{4, 8}, WorldCase{8, 8}}) {
    // seed 11: GlobalScopeEqualsWholeBatch (dropless and capacity); 12: PerRankScope...
    for (const auto& [seed, dropless] :
         std::vector<std::pair<uint64_t, bool>>{{11, true}, {11, false}, {12, false}}) {
      SCOPED_TRACE("W=" + std::to_string(wc.world_size) + " E=" + std::to_string(wc.num_experts) +
                   " seed " + std::to_string(seed) + (dropless ? " dropless" : " capacity"));
      const moe::LayerConfig config = SmallConfig(wc.num_experts, dropless, 0.75f);
      const Inputs in = MakeInputs(config, 37, seed);
      const testing::Reference whole = testing::WholeBatchReference(config, in);
      EXPECT_EQ(MinOf(whole.output.expert_loads), 0)
          << "no expert without tokens in the whole batch";

      // The parallel run sees the same: an expert no rank routes a token to, and (uneven split)
      // a rank without tokens that still joins every collective.
      const ParallelOptions layout = LayoutNamed(wc.world_size, wc.num_experts, "ds_alltoall");
      const Mesh mesh = ExpertMesh(layout.mesh, config.num_experts, config.hidden_dim);
      DriverOptions o;
      o.parallel = layout;
      o.token_split = EquivalenceUnevenSplit(37, mesh.data_shards());
      ASSERT_EQ(o.token_split[1], 0);
      LayerRunResult run;
      ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o));
      EXPECT_TRUE(MatchesReference(run, whole));
      EXPECT_EQ(MinOf(run.output.expert_loads), 0);
      int empty_ranks = 0;
      for (const RankReport& r : run.ranks) {
        if (r.coords.token_shard == 1) {
          EXPECT_EQ(r.tokens, 0) << "rank " << r.coords.rank;
          EXPECT_GT(r.forward.collectives, 0) << "rank " << r.coords.rank;
          ++empty_ranks;
        }
      }
      EXPECT_GT(empty_ranks, 0);

      // Per-rank scope (PerRankScopeEqualsOneLayerPerShard): some shard with tokens routes
      // none of them to some expert.
      if (seed == 12) {
        const testing::Reference per_shard = testing::PerShardReference(config, in, o.token_split);
        EXPECT_EQ(MinOf(per_shard.output.expert_loads), 0);
      }
    }
  }
}

// ---- 3. DeepSpeed's TP de-duplication halves the token bytes ----

// tp 2 at W = 4 (EP groups {0, 2} and {1, 3}, TP pairs holding the same tokens): with
// de-duplication each TP rank sends its half of every expert's rows, and a TP all-gather restores
// the rest.
TEST(TpDedup, HalvesTheTokenBytesOfEveryRank) {
  const int w = 4;
  const moe::LayerConfig config = SmallConfig(4, false, 1.0f);
  const Inputs in = MakeInputs(config, 48, 51);
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  for (DispatchKind dispatch : {DispatchKind::kAllToAll, DispatchKind::kAllToAllV}) {
    SCOPED_TRACE(std::string(DispatchKindName(dispatch)));
    std::map<bool, LayerRunResult> runs;
    for (bool dedup : {true, false}) {
      DriverOptions o;
      o.parallel = LayoutNamed(w, 4, "ds_tp2_nodedup");
      o.parallel.dispatch = dispatch;
      o.parallel.tp_dedup = dedup;
      // The per-pair exchange, whose rows TP de-duplication splits (without it, alltoallv would
      // send a token once per destination rank: dedup_dispatch_test.cc).
      o.parallel.dispatch_dedup = false;
      ASSERT_NO_THROW(runs[dedup] = RunLayerOnRanks(config, in.params, in.x, in.dy, o));
      EXPECT_TRUE(MatchesReference(runs[dedup], ref)) << "tp_dedup " << dedup;
    }
    const LayerRunResult &on = runs[true], &off = runs[false];
    ASSERT_EQ(on.ranks.size(), static_cast<size_t>(w));
    if (dispatch == DispatchKind::kAllToAll) {
      ASSERT_GT(off.buffer_capacity, 0);
      EXPECT_EQ(on.buffer_capacity, (off.buffer_capacity + 1) / 2 * 2);
    }
    double on_total = 0, off_total = 0;
    for (size_t r = 0; r < on.ranks.size(); ++r) {
      for (const auto& [what, a, b] :
           {std::tuple{"forward", &on.ranks[r].forward, &off.ranks[r].forward},
            std::tuple{"backward", &on.ranks[r].backward, &off.ranks[r].backward}}) {
        const double tokens_on = a->Bytes(Traffic::kTokens),
                     tokens_off = b->Bytes(Traffic::kTokens);
        EXPECT_GT(tokens_off, 0) << "rank " << r << " " << what;
        on_total += tokens_on;
        off_total += tokens_off;
        // Fixed capacity: C rows per expert and peer on the wire without de-duplication; with
        // it, C rounded up to even and each TP rank sending half of them.
        if (dispatch == DispatchKind::kAllToAll) {
          const auto c_off = static_cast<double>(off.buffer_capacity);
          const auto c_on = static_cast<double>(on.buffer_capacity);
          EXPECT_EQ(tokens_on * 2 * c_off, tokens_off * c_on) << "rank " << r << " " << what;
        }
        EXPECT_GT(a->Bytes(Traffic::kTensor), 0) << "rank " << r << " " << what;
        EXPECT_EQ(b->Bytes(Traffic::kTensor), 0) << "rank " << r << " " << what;
      }
    }
    // Variable size: the two TP ranks split each expert's rows between them, so the world's
    // token bytes halve exactly.
    if (dispatch == DispatchKind::kAllToAllV) {
      EXPECT_EQ(on_total * 2, off_total);
    }
  }
}

// ---- 4. the 2DH option runs the hierarchical all-to-all ----

// One collective call as a RecordingCommunicator saw it.
struct CallRecord {
  std::string group;
  int group_size = 0;
  comm::CollectiveKind kind = comm::CollectiveKind::kBarrier;
  comm::Algorithm algorithm = comm::Algorithm::kAuto;
  int ranks_per_node = 0;  // all-to-all only
  DType dtype = DType::kFloat32;
};

// The calls of one rank, on its world and every group split from it.
class CallLog {
 public:
  void Add(CallRecord record) {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back(std::move(record));
  }
  std::vector<CallRecord> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(records_, {});
  }

 private:
  std::mutex mu_;
  std::vector<CallRecord> records_;
};

// Forwards every call to `inner` (an in-process communicator) and records the collective and its
// options. Groups split from it are wrapped too, sharing the log.
class RecordingCommunicator final : public comm::Communicator {
 public:
  RecordingCommunicator(comm::Communicator& inner, std::unique_ptr<comm::Communicator> owned,
                        std::shared_ptr<CallLog> log)
      : inner_(inner), owned_(std::move(owned)), log_(std::move(log)) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const std::string& name() const override { return inner_.name(); }
  comm::Topology topology() const override { return inner_.topology(); }
  std::string_view transport_kind() const override { return inner_.transport_kind(); }
  comm::Milliseconds default_timeout() const override { return inner_.default_timeout(); }

  std::unique_ptr<comm::Communicator> Split(int color, int key, std::string name) override {
    std::unique_ptr<comm::Communicator> child = inner_.Split(color, key, std::move(name));
    if (!child) return nullptr;
    comm::Communicator& ref = *child;
    return std::make_unique<RecordingCommunicator>(ref, std::move(child), log_);
  }

  comm::Work Barrier(const comm::BarrierOptions& o) override {
    Record(comm::CollectiveKind::kBarrier, o.algorithm, 0, DType::kFloat32);
    return inner_.Barrier(o);
  }
  comm::Work Broadcast(void* buffer, size_t count, DType dtype,
                       const comm::BroadcastOptions& o) override {
    Record(comm::CollectiveKind::kBroadcast, o.algorithm, 0, dtype);
    return inner_.Broadcast(buffer, count, dtype, o);
  }
  comm::Work Reduce(const void* send, void* recv, size_t count, DType dtype,
                    const comm::ReduceOptions& o) override {
    Record(comm::CollectiveKind::kReduce, o.algorithm, 0, dtype);
    return inner_.Reduce(send, recv, count, dtype, o);
  }
  comm::Work AllReduce(const void* send, void* recv, size_t count, DType dtype,
                       const comm::AllReduceOptions& o) override {
    Record(comm::CollectiveKind::kAllReduce, o.algorithm, 0, dtype);
    return inner_.AllReduce(send, recv, count, dtype, o);
  }
  comm::Work AllGather(const void* send, void* recv, size_t count, DType dtype,
                       const comm::AllGatherOptions& o) override {
    Record(comm::CollectiveKind::kAllGather, o.algorithm, 0, dtype);
    return inner_.AllGather(send, recv, count, dtype, o);
  }
  comm::Work ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                           const comm::ReduceScatterOptions& o) override {
    Record(comm::CollectiveKind::kReduceScatter, o.algorithm, 0, dtype);
    return inner_.ReduceScatter(send, recv, count, dtype, o);
  }
  comm::Work AllToAll(const void* send, void* recv, size_t count, DType dtype,
                      const comm::AllToAllOptions& o) override {
    Record(comm::CollectiveKind::kAllToAll, o.algorithm, o.ranks_per_node, dtype);
    return inner_.AllToAll(send, recv, count, dtype, o);
  }
  comm::Work AllToAllV(const void* send, std::span<const int64_t> send_counts,
                       std::span<const int64_t> send_displs, void* recv,
                       std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                       DType dtype, const comm::AllToAllOptions& o) override {
    Record(comm::CollectiveKind::kAllToAllV, o.algorithm, o.ranks_per_node, dtype);
    return inner_.AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                            o);
  }
  comm::Work Scatter(const void* send, void* recv, size_t count, DType dtype,
                     const comm::RootedOptions& o) override {
    Record(comm::CollectiveKind::kScatter, o.algorithm, 0, dtype);
    return inner_.Scatter(send, recv, count, dtype, o);
  }
  comm::Work Gather(const void* send, void* recv, size_t count, DType dtype,
                    const comm::RootedOptions& o) override {
    Record(comm::CollectiveKind::kGather, o.algorithm, 0, dtype);
    return inner_.Gather(send, recv, count, dtype, o);
  }

 protected:
  // Not used by the parallel layer; the row form is protected in the inner communicator.
  comm::Work AllToAllVDynamicRows(const void*, std::span<const int64_t>, int64_t, const Shape&,
                                  DType, comm::AllToAllVResult*,
                                  const comm::AllToAllOptions&) override {
    throw InvalidArgument("RecordingCommunicator: AllToAllVDynamic is not forwarded");
  }

 private:
  void Record(comm::CollectiveKind kind, comm::Algorithm algorithm, int ranks_per_node,
              DType dtype) {
    log_->Add({inner_.name(), inner_.size(), kind, algorithm, ranks_per_node, dtype});
  }

  comm::Communicator& inner_;
  std::unique_ptr<comm::Communicator> owned_;  // null for the world (owned by RunInProcess)
  std::shared_ptr<CallLog> log_;
};

// The all-to-alls of one rank's forward and backward.
struct AllToAllCalls {
  std::vector<CallRecord> forward, backward;
};

// Runs forward and backward of the layer on W in-process ranks through RecordingCommunicators
// and returns each rank's all-to-all calls (their results are checked by the equivalence suite).
std::vector<AllToAllCalls> RecordAllToAlls(int w, const moe::LayerConfig& config,
                                           const ParallelOptions& options, const Inputs& in) {
  std::vector<AllToAllCalls> calls(static_cast<size_t>(w));
  auto only_alltoall = [](std::vector<CallRecord> all) {
    std::vector<CallRecord> out;
    for (CallRecord& c : all) {
      if (c.kind == comm::CollectiveKind::kAllToAll || c.kind == comm::CollectiveKind::kAllToAllV) {
        out.push_back(std::move(c));
      }
    }
    return out;
  };
  comm::RunInProcess(w, [&](comm::Communicator& world) {
    auto log = std::make_shared<CallLog>();
    RecordingCommunicator recording(world, nullptr, log);
    ParallelMoeLayer layer(config, options, MakeLayerGroups(recording, config, options));
    const std::vector<int64_t> split = EvenSplit(in.x.size(0), layer.mesh().data_shards());
    const auto d = static_cast<size_t>(layer.coords().token_shard);
    const int64_t start = Offsets(split)[d];
    const moe::LayerParams params = layer.ShardParams(in.params);
    ParallelForwardOptions fo;
    fo.global_token_offset = start;
    log->Take();  // the group splits
    const ParallelOutput out = layer.Forward(params, in.x.Slice(start, start + split[d]), fo);
    AllToAllCalls& mine = calls[static_cast<size_t>(world.rank())];
    mine.forward = only_alltoall(log->Take());
    layer.Backward(params, out, in.dy.Slice(start, start + split[d]));
    mine.backward = only_alltoall(log->Take());
  });
  return calls;
}

TEST(Hierarchical2DH, EveryExpertGroupAllToAllRunsHierarchical) {
  for (const auto& [w, e] : std::vector<std::pair<int, int64_t>>{{4, 4}, {8, 8}}) {
    SCOPED_TRACE("W=" + std::to_string(w) + " E=" + std::to_string(e));
    const moe::LayerConfig config = SmallConfig(e, false, 1.0f);
    const Inputs in = MakeInputs(config, 40, 61);
    const ParallelOptions flat = LayoutNamed(w, e, "ds_alltoall");
    const ParallelOptions two_dh = LayoutNamed(w, e, "ds_2dh");
    ASSERT_EQ(two_dh.hierarchical_ranks_per_node, 2);
    const std::vector<AllToAllCalls> flat_calls = RecordAllToAlls(w, config, flat, in);
    const std::vector<AllToAllCalls> hier_calls = RecordAllToAlls(w, config, two_dh, in);
    for (int r = 0; r < w; ++r) {
      const AllToAllCalls &f = flat_calls[static_cast<size_t>(r)],
                          &h = hier_calls[static_cast<size_t>(r)];
      for (const auto& [what, flat_list, hier_list] :
           {std::tuple{"forward", &f.forward, &h.forward},
            std::tuple{"backward", &f.backward, &h.backward}}) {
        SCOPED_TRACE("rank " + std::to_string(r) + " " + what);
        // The same all-to-alls in both runs (tokens to and from the experts at least: two of
        // float32), with the 2DH option each of them hierarchical with 2 ranks per node.
        ASSERT_EQ(hier_list->size(), flat_list->size());
        int token_alltoalls = 0;
        for (size_t i = 0; i < hier_list->size(); ++i) {
          const CallRecord &a = (*flat_list)[i], &b = (*hier_list)[i];
          EXPECT_EQ(b.kind, comm::CollectiveKind::kAllToAll) << "call " << i;
          EXPECT_EQ(b.group_size, w) << "call " << i << ": the expert group";
          EXPECT_EQ(b.algorithm, comm::Algorithm::kHierarchical)
              << "call " << i << " on " << b.group << ": " << comm::AlgorithmName(b.algorithm);
          EXPECT_EQ(b.ranks_per_node, 2) << "call " << i;
          EXPECT_NE(a.algorithm, comm::Algorithm::kHierarchical) << "call " << i;
          if (b.dtype == DType::kFloat32) ++token_alltoalls;
        }
        EXPECT_GE(token_alltoalls, 2);
      }
    }
  }
}

}  // namespace
}  // namespace switchyard::parallel
