#include "parallel/expert_weights.h"

#include <cstring>

#include "parallel/collectives.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel::internal {
namespace {

// All-gathers `part` over `c` into [a][b][cc][d] (a * b = ranks, each part [cc][d] floats) and
// moves the rank dimension b inward: the result [a][cc][b][d] has shape `out_shape`.
Tensor GatherSwap(comm::Communicator& c, const Tensor& part, Shape out_shape, int64_t a, int64_t b,
                  int64_t cc, int64_t d, CommStats* stats) {
  Tensor gathered = AllGather(c, part, Traffic::kWeights, stats);
  Tensor out = Tensor::Empty(std::move(out_shape));
  SwapMiddle(gathered.data<float>(), out.data<float>(), a, b, cc, d);
  return out;
}

// The inverse: full [a][cc][b][d] -> [a][b][cc][d] (a * b = ranks), reduce-scattered over `c`:
// this rank gets the sum of its [cc][d] block, shaped `part_shape`.
Tensor SwapReduceScatter(comm::Communicator& c, const Tensor& full, Shape part_shape, int64_t a,
                         int64_t b, int64_t cc, int64_t d, CommStats* stats) {
  Tensor swapped = Tensor::Empty({full.numel()});
  SwapMiddle(full.data<float>(), swapped.data<float>(), a, cc, b, d);
  Shape rs_shape = part_shape;
  rs_shape[0] *= c.size();
  Tensor out = ReduceScatter(c, swapped.Reshape(rs_shape), Traffic::kWeights, stats);
  return out.Reshape(std::move(part_shape));
}

// [rows, cols] -> [rows, new_cols]: truncated, or zero-padded.
Tensor ResizeCols(const Tensor& t, int64_t new_cols) {
  const int64_t rows = t.size(0), cols = t.size(1);
  Tensor out = Tensor::Zeros({rows, new_cols});
  const int64_t keep = std::min(cols, new_cols);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data<float>() + r * new_cols, t.data<float>() + r * cols,
                static_cast<size_t>(keep) * sizeof(float));
  }
  return out;
}

void ScaleInPlace(const Tensor& t, float s) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] *= s;
}

}  // namespace

moe::ExpertWeights GatherComputeWeights(ProcessGroups& groups, const moe::ExpertWeights& shard,
                                        const ShardSpec& s, int r, CommStats* stats) {
  const int64_t el = s.local_experts, hs = s.shard_hidden(), m = s.model_dim, n = s.shards;
  const int64_t mc = s.bias_chunk();
  moe::ExpertWeights w;
  if (r == 0) {
    comm::Communicator& g = groups.Get(GroupKind::kExpert);
    const int64_t q = g.size() / n, e = s.num_experts, h = s.hidden_dim;
    auto fc1_like = [&](const Tensor& t) {
      return t.defined() ? GatherSwap(g, t, {e, h, m}, q, n, el, hs * m, stats) : Tensor();
    };
    w.fc1_weight = fc1_like(shard.fc1_weight);
    w.fc3_weight = fc1_like(shard.fc3_weight);
    if (shard.fc1_bias.defined())
      w.fc1_bias = GatherSwap(g, shard.fc1_bias, {e, h}, q, n, el, hs, stats);
    w.fc2_weight = GatherSwap(g, shard.fc2_weight, {e, m, h}, q, n, el * m, hs, stats);
    if (shard.fc2_bias.defined()) {
      w.fc2_bias = ResizeCols(GatherSwap(g, shard.fc2_bias, {e, n * mc}, q, n, el, mc, stats), m);
    }
    return w;
  }
  SY_REQUIRE(r >= 1 && n % r == 0, InvalidArgument,
             "adaptive r {}: expected 0 or a divisor of the {} H-shards of each expert", r, n);
  const int64_t gsize = n / r;
  if (gsize == 1) {
    w.fc1_weight = shard.fc1_weight;
    w.fc3_weight = shard.fc3_weight;
    w.fc1_bias = shard.fc1_bias;
    w.fc2_weight = shard.fc2_weight;
  } else {
    comm::Communicator& zg = groups.ExpertTensorSubgroup(static_cast<int>(gsize));
    const int64_t hp = gsize * hs;
    auto fc1_like = [&](const Tensor& t) {
      return t.defined() ? GatherSwap(zg, t, {el, hp, m}, 1, gsize, el, hs * m, stats) : Tensor();
    };
    w.fc1_weight = fc1_like(shard.fc1_weight);
    w.fc3_weight = fc1_like(shard.fc3_weight);
    if (shard.fc1_bias.defined()) {
      w.fc1_bias = GatherSwap(zg, shard.fc1_bias, {el, hp}, 1, gsize, el, hs, stats);
    }
    w.fc2_weight = GatherSwap(zg, shard.fc2_weight, {el, m, hp}, 1, gsize, el * m, hs, stats);
  }
  if (shard.fc2_bias.defined()) {
    if (n == 1) {
      w.fc2_bias = shard.fc2_bias;
    } else {
      comm::Communicator& etp = groups.Get(GroupKind::kExpertTensor);
      w.fc2_bias =
          ResizeCols(GatherSwap(etp, shard.fc2_bias, {el, n * mc}, 1, n, el, mc, stats), m);
    }
    if (r > 1) {
      if (w.fc2_bias.SharesStorageWith(shard.fc2_bias)) w.fc2_bias = w.fc2_bias.Clone();
      ScaleInPlace(w.fc2_bias, 1.0f / static_cast<float>(r));
    }
  }
  return w;
}

moe::ExpertWeights ReduceComputeGrads(ProcessGroups& groups, const moe::ExpertWeights& grads,
                                      const ShardSpec& s, int r, CommStats* stats) {
  const int64_t el = s.local_experts, hs = s.shard_hidden(), m = s.model_dim, n = s.shards;
  const int64_t mc = s.bias_chunk();
  moe::ExpertWeights out;
  if (r == 0) {
    comm::Communicator& g = groups.Get(GroupKind::kExpert);
    const int64_t q = g.size() / n;
    auto fc1_like = [&](const Tensor& t) {
      return t.defined() ? SwapReduceScatter(g, t, {el, hs, m}, q, n, el, hs * m, stats) : Tensor();
    };
    out.fc1_weight = fc1_like(grads.fc1_weight);
    out.fc3_weight = fc1_like(grads.fc3_weight);
    if (grads.fc1_bias.defined()) {
      out.fc1_bias = SwapReduceScatter(g, grads.fc1_bias, {el, hs}, q, n, el, hs, stats);
    }
    out.fc2_weight = SwapReduceScatter(g, grads.fc2_weight, {el, m, hs}, q, n, el * m, hs, stats);
    if (grads.fc2_bias.defined()) {
      out.fc2_bias =
          SwapReduceScatter(g, ResizeCols(grads.fc2_bias, n * mc), {el, mc}, q, n, el, mc, stats);
    }
    return out;
  }
  const int64_t gsize = n / r;
  if (gsize == 1) {
    out.fc1_weight = grads.fc1_weight;
    out.fc3_weight = grads.fc3_weight;
    out.fc1_bias = grads.fc1_bias;
    out.fc2_weight = grads.fc2_weight;
  } else {
    comm::Communicator& zg = groups.ExpertTensorSubgroup(static_cast<int>(gsize));
    auto fc1_like = [&](const Tensor& t) {
      return t.defined() ? SwapReduceScatter(zg, t, {el, hs, m}, 1, gsize, el, hs * m, stats)
                         : Tensor();
    };
    out.fc1_weight = fc1_like(grads.fc1_weight);
    out.fc3_weight = fc1_like(grads.fc3_weight);
    if (grads.fc1_bias.defined()) {
      out.fc1_bias = SwapReduceScatter(zg, grads.fc1_bias, {el, hs}, 1, gsize, el, hs, stats);
    }
    out.fc2_weight =
        SwapReduceScatter(zg, grads.fc2_weight, {el, m, hs}, 1, gsize, el * m, hs, stats);
  }
  if (grads.fc2_bias.defined()) {
    // The forward used bias / r: its gradient is (1 / r) * sum of the output gradients.
    Tensor b = grads.fc2_bias.Clone();
    if (r > 1) ScaleInPlace(b, 1.0f / static_cast<float>(r));
    if (n == 1) {
      out.fc2_bias = b;
    } else {
      comm::Communicator& etp = groups.Get(GroupKind::kExpertTensor);
      out.fc2_bias = SwapReduceScatter(etp, ResizeCols(b, n * mc), {el, mc}, 1, n, el, mc, stats);
    }
  }
  return out;
}

}  // namespace switchyard::parallel::internal
