#include "cli/bench_routing.h"

#include <algorithm>
#include <cmath>

#include "switchyard/core/error.h"
#include "switchyard/core/rng.h"

namespace switchyard::cli {

std::vector<int32_t> ZipfRoutes(int64_t tokens, int64_t experts, int64_t k, double skew,
                                uint64_t seed) {
  SY_REQUIRE(k >= 1 && k <= experts, InvalidArgument,
             "--imbalance: top_k {} must be in [1, experts {}]", k, experts);
  std::vector<double> weight(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) {
    weight[static_cast<size_t>(e)] = std::pow(static_cast<double>(e + 1), -skew);
  }
  std::vector<int32_t> routes(static_cast<size_t>(tokens * k));
  std::vector<double> w;
  for (int64_t t = 0; t < tokens; ++t) {
    w = weight;
    double total = 0;
    for (double v : w) total += v;
    for (int64_t j = 0; j < k; ++j) {
      // A uniform draw per (token, choice), keyed by the pair (core/rng.h).
      const double u = CounterRng(seed, 0).Uniform(static_cast<uint64_t>(t * k + j)) * total;
      double acc = 0;
      int64_t pick = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (w[static_cast<size_t>(e)] <= 0) continue;
        pick = e;  // the last expert still available takes what rounding leaves
        acc += w[static_cast<size_t>(e)];
        if (u < acc) break;
      }
      routes[static_cast<size_t>(t * k + j)] = static_cast<int32_t>(pick);
      total -= w[static_cast<size_t>(pick)];
      w[static_cast<size_t>(pick)] = 0;
    }
  }
  return routes;
}

RouteVolume RouteVolumeOf(std::span<const int32_t> routes, int64_t k,
                          const parallel::LayerRunResult& run, const std::vector<int64_t>& split,
                          int64_t local_experts, int64_t model_dim) {
  RouteVolume v;
  const size_t ranks = run.ranks.size();
  v.pairs_out.assign(ranks, 0);
  v.pairs_in.assign(ranks, 0);
  v.predicted_bytes.assign(ranks, 0);
  v.rows_out.assign(ranks, 0);
  v.rows_in.assign(ranks, 0);
  v.predicted_dedup_bytes.assign(ranks, 0);
  // The rank holding each token shard (tp 1: one), and the rank of each expert position that
  // serves that shard's expert group.
  std::vector<size_t> rank_of_shard(split.size(), 0);
  for (size_t r = 0; r < ranks; ++r) {
    rank_of_shard[static_cast<size_t>(run.ranks[r].coords.token_shard)] = r;
  }
  int64_t token = 0, distinct = 0;
  for (size_t shard = 0; shard < split.size(); ++shard) {
    const parallel::RankCoords& mine = run.ranks[rank_of_shard[shard]].coords;
    for (int64_t i = 0; i < split[shard]; ++i, ++token) {
      std::vector<int> others;
      for (int64_t j = 0; j < k; ++j) {
        const int position =
            static_cast<int>(routes[static_cast<size_t>(token * k + j)] / local_experts);
        ++v.pairs;
        if (position == mine.expert_position) continue;
        ++v.pairs_off;
        ++v.pairs_out[rank_of_shard[shard]];
        // The rank of the same expert group at that position receives the pair (and the token
        // once, with its first pair there).
        const bool first = std::find(others.begin(), others.end(), position) == others.end();
        for (size_t r = 0; r < ranks; ++r) {
          const parallel::RankCoords& c = run.ranks[r].coords;
          if (c.expert_group == mine.expert_group && c.expert_position == position) {
            ++v.pairs_in[r];
            if (first) ++v.rows_in[r];
            break;
          }
        }
        if (first) {
          others.push_back(position);
          ++v.rows_out[rank_of_shard[shard]];
        }
      }
      distinct += static_cast<int64_t>(others.size());
    }
  }
  v.off_share = v.pairs > 0 ? static_cast<double>(v.pairs_off) / static_cast<double>(v.pairs) : 0;
  v.distinct_off_ranks = token > 0 ? static_cast<double>(distinct) / static_cast<double>(token) : 0;
  for (size_t r = 0; r < ranks; ++r) {
    v.predicted_bytes[r] = 2.0 * static_cast<double>(v.pairs_out[r] + v.pairs_in[r]) *
                           static_cast<double>(model_dim) * 4.0;
    v.predicted_dedup_bytes[r] = 2.0 * static_cast<double>(v.rows_out[r] + v.rows_in[r]) *
                                 static_cast<double>(model_dim) * 4.0;
  }
  return v;
}

}  // namespace switchyard::cli
