#include "switchyard/parallel/expert_shard.h"

#include <algorithm>
#include <cstring>

#include "switchyard/core/error.h"

namespace switchyard::parallel {
namespace {

// Copies a block: `rows` rows of `cols` floats from src (row stride src_ld) to dst (dst_ld).
void CopyBlock(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows,
               int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_ld, src + r * src_ld, static_cast<size_t>(cols) * sizeof(float));
  }
}

// Direction of a copy between the full tensor and the shard.
enum class Dir { kToShard, kToFull };

// full [E, R, C] <-> shard [E_l, r_len, c_len] taking rows [r0, r0 + r_len) and columns
// [c0, c0 + c_valid) of experts [e0, e0 + E_l); shard columns past c_valid are zero.
void Transfer(Dir dir, const Tensor& full, const Tensor& shard, int64_t e0, int64_t r0, int64_t c0,
              int64_t c_valid) {
  const int64_t el = shard.size(0);
  const int64_t r_len = shard.dim() == 3 ? shard.size(1) : 1;
  const int64_t c_len = shard.size(-1);
  const int64_t rows = full.dim() == 3 ? full.size(1) : 1, cols = full.size(-1);
  float* f = full.data<float>();
  float* s = shard.data<float>();
  for (int64_t e = 0; e < el; ++e) {
    float* fb = f + ((e0 + e) * rows + r0) * cols + c0;
    float* sb = s + e * r_len * c_len;
    if (dir == Dir::kToShard) {
      if (c_valid < c_len) std::memset(sb, 0, static_cast<size_t>(r_len * c_len) * sizeof(float));
      CopyBlock(fb, cols, sb, c_len, r_len, c_valid);
    } else {
      CopyBlock(sb, c_len, fb, cols, r_len, c_valid);
    }
  }
}

struct Shapes {
  Shape fc1, fc1_bias, fc2, fc2_bias;
};
Shapes ShardShapes(const ShardSpec& s) {
  const int64_t el = s.local_experts, hs = s.shard_hidden(), m = s.model_dim;
  return {{el, hs, m}, {el, hs}, {el, m, hs}, {el, s.bias_chunk()}};
}

}  // namespace

ShardSpec ShardOf(const Mesh& mesh, int rank, int64_t model_dim) {
  RankCoords c = mesh.Coords(rank);
  ShardSpec s;
  s.num_experts = mesh.num_experts();
  s.local_experts = mesh.local_experts();
  s.first_expert = static_cast<int64_t>(c.expert_position) * s.local_experts;
  s.model_dim = model_dim;
  s.hidden_dim = mesh.hidden_dim();
  s.shards = mesh.shards();
  s.shard = c.expert_shard;
  return s;
}

moe::ExpertWeights ShardExperts(const moe::ExpertWeights& full, const ShardSpec& s) {
  const Shapes sh = ShardShapes(s);
  const int64_t hs = s.shard_hidden(), h0 = s.shard * hs, mc = s.bias_chunk();
  const int64_t m0 = s.shard * mc, m_valid = std::max<int64_t>(0, std::min(mc, s.model_dim - m0));
  moe::ExpertWeights out;
  auto take = [&](const Tensor& f, const Shape& shape, int64_t r0, int64_t c0, int64_t c_valid) {
    if (!f.defined()) return Tensor();
    Tensor t = Tensor::Empty(shape);
    Transfer(Dir::kToShard, f, t, s.first_expert, r0, c0, c_valid);
    return t;
  };
  out.fc1_weight = take(full.fc1_weight, sh.fc1, h0, 0, s.model_dim);
  out.fc3_weight = take(full.fc3_weight, sh.fc1, h0, 0, s.model_dim);
  out.fc1_bias = take(full.fc1_bias, sh.fc1_bias, 0, h0, hs);
  out.fc2_weight = take(full.fc2_weight, sh.fc2, 0, h0, hs);
  out.fc2_bias = take(full.fc2_bias, sh.fc2_bias, 0, m0, m_valid);
  return out;
}

void PlaceShard(const moe::ExpertWeights& shard, const ShardSpec& s, moe::ExpertWeights* full) {
  const int64_t hs = s.shard_hidden(), h0 = s.shard * hs, mc = s.bias_chunk();
  const int64_t m0 = s.shard * mc, m_valid = std::max<int64_t>(0, std::min(mc, s.model_dim - m0));
  auto put = [&](const Tensor& sh, const Tensor& f, int64_t r0, int64_t c0, int64_t c_valid) {
    if (!sh.defined()) return;
    SY_CHECK(f.defined());
    Transfer(Dir::kToFull, f, sh, s.first_expert, r0, c0, c_valid);
  };
  put(shard.fc1_weight, full->fc1_weight, h0, 0, s.model_dim);
  put(shard.fc3_weight, full->fc3_weight, h0, 0, s.model_dim);
  put(shard.fc1_bias, full->fc1_bias, 0, h0, hs);
  put(shard.fc2_weight, full->fc2_weight, 0, h0, hs);
  put(shard.fc2_bias, full->fc2_bias, 0, m0, m_valid);
}

void CheckShard(const moe::ExpertWeights& w, const ShardSpec& s, bool gated, bool bias) {
  const Shapes sh = ShardShapes(s);
  auto check = [](std::string_view name, const Tensor& t, const Shape& shape) {
    ExpectDType(name, t, DType::kFloat32);
    ExpectShape(name, t, shape);
  };
  check("experts.fc1.weight (shard)", w.fc1_weight, sh.fc1);
  check("experts.fc2.weight (shard)", w.fc2_weight, sh.fc2);
  if (bias) {
    check("experts.fc1.bias (shard)", w.fc1_bias, sh.fc1_bias);
    check("experts.fc2.bias (shard)", w.fc2_bias, sh.fc2_bias);
  } else {
    SY_REQUIRE(!w.fc1_bias.defined() && !w.fc2_bias.defined(), InvalidArgument,
               "experts.fc1.bias / fc2.bias (shard): given, but fc_bias is false");
  }
  if (gated) {
    check("experts.fc3.weight (shard)", w.fc3_weight, sh.fc1);
  } else {
    SY_REQUIRE(!w.fc3_weight.defined(), InvalidArgument,
               "experts.fc3.weight (shard): given, but the experts are not gated");
  }
}

}  // namespace switchyard::parallel
