// Routes for `bench layer --imbalance` (Zipf-distributed forced routes) and the volume they put on
// the token all-to-all: which (token, choice) pairs leave their rank, per rank, and how many
// distinct other ranks each token's choices reach (docs/moe.md, "Device-limited routing and the
// all-to-all volume").
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/parallel/driver.h"

namespace switchyard::cli {

// [tokens * k] token-major: k distinct experts per token, drawn without replacement from the
// Zipf distribution P(e) ∝ (e + 1)^-skew over the experts (skew 0: uniform). Deterministic (the
// seed). Needs k <= experts.
std::vector<int32_t> ZipfRoutes(int64_t tokens, int64_t experts, int64_t k, double skew,
                                uint64_t seed);

// The routing's traffic between the expert-parallel ranks of one run.
struct RouteVolume {
  // Per rank of the run (by world rank): pairs of its tokens sent to another rank, and pairs of
  // other ranks' tokens its experts receive.
  std::vector<int64_t> pairs_out, pairs_in;
  int64_t pairs = 0, pairs_off = 0;  // all (token, choice) pairs, and those that leave their rank
  double off_share = 0;              // pairs_off / pairs
  // Mean over tokens of the distinct ranks other than its own that its choices reach: the rows
  // per token of a dispatch that sends a token once per destination rank (DeepEP's).
  double distinct_off_ranks = 0;
  // The token all-to-all bytes of each rank in one forward + backward of a dispatch that sends
  // one float32 row of model_dim per kept pair (alltoallv, nothing dropped):
  // 2 x (pairs_out + pairs_in) x model_dim x 4 (dispatch and combine, each also in backward).
  std::vector<double> predicted_bytes;
  // Per rank: (token, destination rank) rows of its tokens sent to other ranks, and of other
  // ranks' tokens it receives; and the bytes of the dispatch that sends a token once per
  // destination rank (ParallelOptions::dispatch_dedup): 2 x (rows_out + rows_in) x model_dim x 4.
  std::vector<int64_t> rows_out, rows_in;
  std::vector<double> predicted_dedup_bytes;
};

// The volume of `routes` ([T * k], the whole batch in token order) on the ranks of `run` (their
// coordinates: token shards and expert positions; tensor parallelism 1), with `split` the tokens
// of each data shard and `local_experts` the experts per expert position.
RouteVolume RouteVolumeOf(std::span<const int32_t> routes, int64_t k,
                          const parallel::LayerRunResult& run, const std::vector<int64_t>& split,
                          int64_t local_experts, int64_t model_dim);

}  // namespace switchyard::cli
