#include "switchyard/parallel/expert_shard.h"

#include <fmt/format.h>

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

MeshConfig ExpertMeshConfig(MeshConfig mesh, int64_t num_experts) {
  SY_REQUIRE(num_experts >= 1, InvalidArgument, "num_experts: expected >= 1, got {}", num_experts);
  if (mesh.arrangement == Arrangement::kMegatron) return mesh;
  const int ep = ResolvedExpertParallel(mesh);
  int shards = 1;
  if (num_experts < ep) {
    SY_REQUIRE(ep % num_experts == 0, InvalidArgument,
               "ep {} is not a multiple of num_experts {}: with fewer experts than EP ranks each "
               "expert is split over ep / num_experts ranks",
               ep, num_experts);
    shards = static_cast<int>(ep / num_experts);
  }
  SY_REQUIRE(mesh.etp == 1 || mesh.etp == shards, InvalidArgument,
             "etp {}: expert tensor parallelism is Megatron's folding (arrangement megatron); "
             "the DeepSpeed arrangement shards experts along H only when num_experts < ep",
             mesh.etp);
  mesh.etp = shards;
  return mesh;
}

void CheckExpertsFit(const Mesh& mesh, int64_t num_experts, int64_t hidden_dim) {
  SY_REQUIRE(num_experts >= 1, InvalidArgument, "num_experts: expected >= 1, got {}", num_experts);
  const int n = mesh.shards(), ep = mesh.ep();
  if (mesh.arrangement() == Arrangement::kDeepSpeed) {
    const int64_t want = num_experts >= ep ? 1 : ep / num_experts;
    SY_REQUIRE(n == want, InvalidArgument,
               "{} experts over ep {} with {} H-shard(s) per expert: the DeepSpeed arrangement "
               "splits each expert over ep / num_experts ranks when num_experts < ep, else not",
               num_experts, ep, n);
  }
  SY_REQUIRE(num_experts % mesh.positions() == 0, InvalidArgument,
             "num_experts {} is not divisible by ep {}: every EP rank must hold the same number "
             "of experts",
             num_experts, mesh.positions());
  SY_REQUIRE(hidden_dim % n == 0, InvalidArgument,
             "hidden_dim {} is not divisible by the {} H-shards of each expert", hidden_dim, n);
}

Mesh ExpertMesh(const MeshConfig& mesh, int64_t num_experts, int64_t hidden_dim) {
  Mesh m(ExpertMeshConfig(mesh, num_experts));
  CheckExpertsFit(m, num_experts, hidden_dim);
  return m;
}

int64_t LocalExperts(const Mesh& mesh, int64_t num_experts) {
  SY_CHECK(num_experts % mesh.positions() == 0, "{} experts over {} positions", num_experts,
           mesh.positions());
  return num_experts / mesh.positions();
}

ShardSpec ShardOf(const Mesh& mesh, int rank, const moe::LayerConfig& config) {
  CheckExpertsFit(mesh, config.num_experts, config.hidden_dim);
  RankCoords c = mesh.Coords(rank);
  ShardSpec s;
  s.num_experts = config.num_experts;
  s.local_experts = LocalExperts(mesh, config.num_experts);
  s.first_expert = static_cast<int64_t>(c.expert_position) * s.local_experts;
  s.model_dim = config.model_dim;
  s.hidden_dim = config.hidden_dim;
  s.shards = mesh.shards();
  s.shard = c.expert_shard;
  return s;
}

std::string DescribeExperts(const Mesh& mesh, int64_t num_experts) {
  const int n = mesh.shards();
  const int64_t el = LocalExperts(mesh, num_experts);
  std::string out =
      fmt::format("{} experts ({} per expert position{}); ", num_experts, el,
                  n > 1 ? fmt::format(", each split along H over {} ranks", n) : std::string());
  out += "experts of each expert-group member (position: experts, H-shard):";
  for (int m = 0; m < mesh.expert_group_size(); ++m) {
    const int64_t first = (m / n) * el;
    out += fmt::format(" {}:", m);
    out += el == 1 ? fmt::format("e{}", first) : fmt::format("e{}-{}", first, first + el - 1);
    if (n > 1) out += fmt::format("/h{}", m % n);
  }
  return out + "\n";
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
