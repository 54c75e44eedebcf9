// The Hugging Face families' dense pieces (RoPE, RMSNorm with eps, SwiGLU, grouped-query
// attention with QK-norm and q/k/v bias): forward against plain double-precision loops written
// from the architectures' definitions, backward against finite differences of L = sum(y * r).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "switchyard/train/context_parallel.h"
#include "switchyard/train/gqa_attention.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/rope.h"
#include "switchyard/train/swiglu.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::CheckGradient;
using testing::Dot;
using testing::RandomTensor;

using Matrix = std::vector<std::vector<double>>;

void Randomize(ParameterSet& params, float scale, uint64_t seed) {
  for (auto& p : params.all()) {
    p.value.CopyFrom(RandomTensor(p.value.shape(), seed++, -scale, scale));
  }
}

Matrix ToMatrix(const Tensor& t) {
  Matrix m(static_cast<size_t>(t.size(0)), std::vector<double>(static_cast<size_t>(t.size(1))));
  for (int64_t i = 0; i < t.size(0); ++i) {
    for (int64_t j = 0; j < t.size(1); ++j) m[i][j] = t.data<float>()[i * t.size(1) + j];
  }
  return m;
}

// y = x W^T (+ b), W [out, in] as PyTorch's Linear.
Matrix RefLinear(const Matrix& x, const Tensor& w, const Tensor* b = nullptr) {
  const int64_t out = w.size(0), in = w.size(1);
  Matrix y(x.size(), std::vector<double>(static_cast<size_t>(out)));
  for (size_t t = 0; t < x.size(); ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b != nullptr ? b->data<float>()[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) s += x[t][i] * w.data<float>()[o * in + i];
      y[t][o] = s;
    }
  }
  return y;
}

// Hugging Face's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight.
Matrix RefRmsNorm(const Matrix& x, const Tensor& w, double eps) {
  Matrix y = x;
  for (auto& row : y) {
    double ss = 0;
    for (double v : row) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(row.size()) + eps);
    for (size_t j = 0; j < row.size(); ++j) row[j] *= r * w.data<float>()[j];
  }
  return y;
}

// apply_rotary_pos_emb with rotate_half: each head's halves rotated by pos / theta^(2i/d).
Matrix RefRope(const Matrix& x, const std::vector<int64_t>& pos, int64_t d, double theta) {
  Matrix y = x;
  for (size_t t = 0; t < x.size(); ++t) {
    for (size_t h = 0; h < x[t].size(); h += static_cast<size_t>(d)) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double angle = static_cast<double>(pos[t]) / std::pow(theta, 2.0 * i / d);
        const double a = x[t][h + i], b = x[t][h + i + d / 2];
        y[t][h + i] = a * std::cos(angle) - b * std::sin(angle);
        y[t][h + i + d / 2] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
  }
  return y;
}

void ExpectNear(const Tensor& got, const Matrix& want, double tol, const char* what) {
  ASSERT_EQ(got.size(0), static_cast<int64_t>(want.size())) << what;
  double worst = 0;
  for (int64_t i = 0; i < got.size(0); ++i) {
    for (int64_t j = 0; j < got.size(1); ++j) {
      worst = std::max(worst, std::abs(got.data<float>()[i * got.size(1) + j] - want[i][j]));
    }
  }
  EXPECT_LE(worst, tol) << what;
}

TEST(RopeTest, MatchesPlainRotationPerHead) {
  const int64_t d = 8;
  Tensor x = RandomTensor({5, 3 * d}, 1);
  const std::vector<int64_t> pos = {0, 1, 7, 100, 4095};
  for (double theta : {10000.0, 1e6}) {
    Tensor y = RopeForward(x, pos, d, theta);
    // float32 angles of a position up to 4095: |error| ~ 4095 * 2^-24 per radian.
    ExpectNear(y, RefRope(ToMatrix(x), pos, d, theta), 2e-3, "rope");
  }
  // Position 0 is the identity, bit for bit.
  Tensor y0 = RopeForward(x, std::vector<int64_t>(5, 0), d, 10000.0);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(y0.data<float>()[i], x.data<float>()[i]);
}

TEST(RopeTest, BackwardIsTheAdjointAndScoresDependOnDistanceOnly) {
  const int64_t d = 16;
  Tensor x = RandomTensor({6, 2 * d}, 2), r = RandomTensor({6, 2 * d}, 3);
  const std::vector<int64_t> pos = {3, 0, 9, 2, 31, 5};
  EXPECT_NEAR(Dot(RopeForward(x, pos, d, 500.0), r), Dot(x, RopeBackward(r, pos, d, 500.0)), 1e-4);
  // q at m, k at n: q'·k' is a function of m - n (the point of RoPE).
  Tensor q = RandomTensor({1, d}, 4), k = RandomTensor({1, d}, 5);
  auto score = [&](int64_t m, int64_t n) {
    return Dot(RopeForward(q, std::vector<int64_t>{m}, d, 10000.0),
               RopeForward(k, std::vector<int64_t>{n}, d, 10000.0));
  };
  EXPECT_NEAR(score(7, 3), score(14, 10), 1e-5);
  EXPECT_NEAR(score(0, 0), score(20, 20), 1e-5);
}

TEST(RopeTest, RejectsBadArguments) {
  Tensor x = RandomTensor({2, 8}, 1);
  EXPECT_THROW(RopeForward(x, std::vector<int64_t>{0}, 8, 1e4), InvalidArgument);
  EXPECT_THROW(RopeForward(x, std::vector<int64_t>{0, -1}, 8, 1e4), InvalidArgument);
  EXPECT_THROW(RopeForward(x, std::vector<int64_t>{0, 1}, 3, 1e4), InvalidArgument);
  EXPECT_THROW(RopeForward(x, std::vector<int64_t>{0, 1}, 8, 0.0), InvalidArgument);
}

// Context parallelism: a rank rotating its shard with the global positions of its rows equals
// the shard of the single-rank rotation.
TEST(RopeTest, ShardWithGlobalPositionsEqualsSingleRank) {
  const int64_t batch = 2, seq = 8, d = 4;
  Tensor x = RandomTensor({batch * seq, 2 * d}, 6);
  Tensor full = RopeForward(x, SequencePositions(batch, seq), d, 10000.0);
  for (int rank = 0; rank < 2; ++rank) {
    SequenceSplit split(SequenceSplitKind::kZigzag, seq, 2, rank);
    std::vector<int64_t> pos;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t p : split.Positions()) pos.push_back(p);
    }
    Tensor local = RopeForward(split.Shard(x, batch), pos, d, 10000.0);
    Tensor want = split.Shard(full, batch);
    for (int64_t i = 0; i < want.numel(); ++i) {
      ASSERT_EQ(local.data<float>()[i], want.data<float>()[i]) << "rank " << rank << " at " << i;
    }
  }
}

TEST(RmsNormTest, EpsIsTheModelsAndGradientsMatch) {
  ParameterSet params;
  const float eps = 0.5f;  // large, so a wrong eps shows
  Norm norm(params, "n.", 6, NormKind::kRmsNorm, eps);
  Randomize(params, 1.0f, 3);
  Tensor x = RandomTensor({4, 6}, 1, -0.3f, 0.3f);
  NormCache cache;
  Tensor y = norm.Forward(x, &cache);
  ExpectNear(y, RefRmsNorm(ToMatrix(x), params.Get("n.weight").value, eps), 1e-6, "rmsnorm");
  Tensor r = RandomTensor({4, 6}, 2);
  params.ZeroGrad();
  Tensor dx = norm.Backward(cache, r);
  auto loss = [&] { return Dot(norm.Forward(x, nullptr), r); };
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  EXPECT_TRUE(CheckGradient("dw", loss, params.Get("n.weight").value, params.Get("n.weight").grad));
  EXPECT_THROW(Norm(params, "bad.", 6, NormKind::kRmsNorm, 0.0f), InvalidArgument);
}

TEST(SwiGluTest, MatchesPlainLoopsAndFiniteDifferences) {
  ParameterSet params;
  SwiGluMlp mlp(params, "mlp.", 6, 10, 0.02f, 0.02f, 1);
  Randomize(params, 0.5f, 11);
  EXPECT_EQ(params.Get("mlp.gate_proj.weight").value.shape(), (Shape{10, 6}));
  EXPECT_EQ(params.Get("mlp.up_proj.weight").value.shape(), (Shape{10, 6}));
  EXPECT_EQ(params.Get("mlp.down_proj.weight").value.shape(), (Shape{6, 10}));
  EXPECT_EQ(params.Find("mlp.gate_proj.bias"), nullptr);
  Tensor x = RandomTensor({5, 6}, 2);
  SwiGluCache cache;
  Tensor y = mlp.Forward(x, &cache);
  Matrix g = RefLinear(ToMatrix(x), params.Get("mlp.gate_proj.weight").value);
  Matrix u = RefLinear(ToMatrix(x), params.Get("mlp.up_proj.weight").value);
  for (size_t t = 0; t < g.size(); ++t) {
    for (size_t j = 0; j < g[t].size(); ++j) g[t][j] = g[t][j] / (1 + std::exp(-g[t][j])) * u[t][j];
  }
  ExpectNear(y, RefLinear(g, params.Get("mlp.down_proj.weight").value), 1e-5, "swiglu");
  Tensor r = RandomTensor({5, 6}, 3);
  params.ZeroGrad();
  Tensor dx = mlp.Backward(cache, r);
  auto loss = [&] { return Dot(mlp.Forward(x, nullptr), r); };
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (const char* name : {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
    EXPECT_TRUE(CheckGradient(name, loss, params.Get(name).value, params.Get(name).grad));
  }
}

// Qwen2-MoE's shared expert: sigmoid(x · w_g^T) * SwiGLU(x).
TEST(GatedSharedExpertTest, MatchesPlainLoopsAndFiniteDifferences) {
  ParameterSet params, mlp_only;
  GatedSharedExpert shared(params, "mlp.", 6, 8, 0.02f, 0.02f, 1);
  SwiGluMlp plain(mlp_only, "mlp.shared_expert.", 6, 8, 0.02f, 0.02f, 1);
  Randomize(params, 0.5f, 4);
  for (auto& p : mlp_only.all()) p.value.CopyFrom(params.Get(p.name).value);
  EXPECT_EQ(params.Get("mlp.shared_expert_gate.weight").value.shape(), (Shape{1, 6}));
  Tensor x = RandomTensor({5, 6}, 2);
  GatedSharedExpertCache cache;
  Tensor y = shared.Forward(x, &cache);
  Tensor mlp_y = plain.Forward(x, nullptr);
  Matrix logit = RefLinear(ToMatrix(x), params.Get("mlp.shared_expert_gate.weight").value);
  Matrix want = ToMatrix(mlp_y);
  for (size_t t = 0; t < want.size(); ++t) {
    for (double& v : want[t]) v *= 1.0 / (1.0 + std::exp(-logit[t][0]));
  }
  ExpectNear(y, want, 1e-6, "gated shared expert");
  Tensor r = RandomTensor({5, 6}, 3);
  params.ZeroGrad();
  Tensor dx = shared.Backward(cache, r);
  auto loss = [&] { return Dot(shared.Forward(x, nullptr), r); };
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (auto& p : params.all()) EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad));
}

// The attention written out as Hugging Face's modeling code does it, in double.
Matrix RefGqa(const ParameterSet& ps, const std::string& pre, const GqaOptions& o, const Tensor& x,
              int64_t batch, const std::vector<int64_t>& pos) {
  auto get = [&](const std::string& n) { return ps.Find(pre + n); };
  auto lin = [&](const Matrix& in, const std::string& n) {
    const Parameter* b = get(n + ".bias");
    return RefLinear(in, get(n + ".weight")->value, b != nullptr ? &b->value : nullptr);
  };
  Matrix xm = ToMatrix(x);
  Matrix q = lin(xm, "q_proj"), k = lin(xm, "k_proj"), v = lin(xm, "v_proj");
  if (o.qk_norm) {
    q = RefRmsNorm(q, get("q_norm.weight")->value, o.norm_eps);
    k = RefRmsNorm(k, get("k_norm.weight")->value, o.norm_eps);
  }
  const int64_t d = o.head_dim, heads = o.num_heads, rep = o.num_heads / o.num_kv_heads;
  q = RefRope(q, pos, d, o.rope_theta);
  k = RefRope(k, pos, d, o.rope_theta);
  const int64_t n = x.size(0), seq = n / batch;
  Matrix att(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(heads * d), 0.0));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kvh = h / rep;
      for (int64_t i = 0; i < seq; ++i) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c)
            dot += q[b * seq + i][h * d + c] * k[b * seq + j][kvh * d + c];
          s[j] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, s[j]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t c = 0; c < d; ++c) {
            att[b * seq + i][h * d + c] += s[j] / sum * v[b * seq + j][kvh * d + c];
          }
        }
      }
    }
  }
  return lin(att, "o_proj");
}

struct GqaCase {
  const char* name;
  int64_t heads, kv_heads;
  bool qkv_bias, qk_norm;
};

class GqaTest : public ::testing::TestWithParam<GqaCase> {};

TEST_P(GqaTest, MatchesReferenceAndFiniteDifferences) {
  const GqaCase& tc = GetParam();
  GqaOptions o;
  o.model_dim = 8;
  o.num_heads = tc.heads;
  o.num_kv_heads = tc.kv_heads;
  o.head_dim = 4;  // not model_dim / heads: Mixtral/Qwen configs may set head_dim apart
  o.rope_theta = 1000.0;
  o.qkv_bias = tc.qkv_bias;
  o.qk_norm = tc.qk_norm;
  o.norm_eps = 1e-5f;
  ParameterSet params;
  GroupedQueryAttention attn(params, "attn.", o);
  Randomize(params, 0.4f, 21);
  EXPECT_EQ(params.Get("attn.k_proj.weight").value.shape(), (Shape{tc.kv_heads * 4, 8}));
  EXPECT_EQ(params.Get("attn.o_proj.weight").value.shape(), (Shape{8, tc.heads * 4}));
  EXPECT_EQ(params.Find("attn.q_proj.bias") != nullptr, tc.qkv_bias);
  EXPECT_EQ(params.Find("attn.o_proj.bias"), nullptr);
  EXPECT_EQ(params.Find("attn.k_norm.weight") != nullptr, tc.qk_norm);
  if (tc.qk_norm) {
    EXPECT_EQ(params.Get("attn.k_norm.weight").value.shape(), (Shape{tc.kv_heads * 4}));
  }
  const int64_t batch = 2, seq = 5;
  Tensor x = RandomTensor({batch * seq, 8}, 5);
  // Positions as a cp rank would pass them: not 0.. in every sequence.
  std::vector<int64_t> pos = {0, 1, 2, 3, 4, 10, 11, 12, 13, 14};
  GqaCache cache;
  Tensor y = attn.Forward(x, batch, pos, &cache);
  ExpectNear(y, RefGqa(params, "attn.", attn.options(), x, batch, pos), 2e-5, tc.name);
  Tensor r = RandomTensor({batch * seq, 8}, 6);
  params.ZeroGrad();
  Tensor dx = attn.Backward(cache, r);
  auto loss = [&] { return Dot(attn.Forward(x, batch, pos, nullptr), r); };
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (auto& p : params.all()) {
    EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad)) << tc.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, GqaTest,
                         ::testing::Values(GqaCase{"mha", 2, 2, false, false},
                                           GqaCase{"gqa_mixtral", 4, 2, false, false},
                                           GqaCase{"mqa", 4, 1, false, false},
                                           GqaCase{"qwen2_bias", 4, 2, true, false},
                                           GqaCase{"olmoe_qk_norm", 2, 2, false, true},
                                           GqaCase{"gqa_qk_norm_bias", 4, 2, true, true}),
                         [](const ::testing::TestParamInfo<GqaCase>& param_info) {
                           return std::string(param_info.param.name);
                         });

// Without RoPE, norms or biases and with kv heads = heads, the layer is GPT-2's attention with
// the fused qkv weight = [q; k; v]: the same core, the same numbers.
TEST(GqaAttentionTest, MhaEqualsCausalSelfAttention) {
  GqaOptions o;
  o.model_dim = 8;
  o.num_heads = 2;
  o.rope = false;
  ParameterSet gp, cp;
  GroupedQueryAttention gqa(gp, "a.", o);
  CausalSelfAttention mha(cp, "a.", 8, 2, 0.02f, 0.02f, 1);
  Randomize(gp, 0.5f, 3);
  Tensor& qkv_w = cp.Get("a.qkv.weight").value;
  for (int part = 0; part < 3; ++part) {
    const char* n = part == 0   ? "a.q_proj.weight"
                    : part == 1 ? "a.k_proj.weight"
                                : "a.v_proj.weight";
    std::copy_n(gp.Get(n).value.data<float>(), 64, qkv_w.data<float>() + part * 64);
  }
  cp.Get("a.qkv.bias").value.Fill(0.0);
  cp.Get("a.proj.weight").value.CopyFrom(gp.Get("a.o_proj.weight").value);
  cp.Get("a.proj.bias").value.Fill(0.0);
  Tensor x = RandomTensor({6, 8}, 4);
  Tensor a = gqa.Forward(x, 2, {}, nullptr);
  Tensor b = mha.Forward(x, 2, 1, nullptr);
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data<float>()[i], b.data<float>()[i]) << i;
}

// ProjectQkv / ProjectQkvBackward around another core (the cp core on one rank) give the same
// output and input gradient as Forward/Backward.
TEST(GqaAttentionTest, ProjectionsAroundTheContextParallelCore) {
  GqaOptions o;
  o.model_dim = 8;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 4;  // q_dim 16
  o.qk_norm = true;
  ParameterSet params;
  GroupedQueryAttention attn(params, "a.", o);
  Randomize(params, 0.4f, 9);
  const int64_t batch = 2, seq = 4;
  Tensor x = RandomTensor({batch * seq, 8}, 4), r = RandomTensor({batch * seq, 8}, 5);
  GqaCache c1;
  Tensor y1 = attn.Forward(x, batch, {}, &c1);
  Tensor dx1 = attn.Backward(c1, r);

  ContextParallelAttention core(o.num_heads, seq);
  GqaCache c2;
  Tensor qkv = attn.ProjectQkv(x, SequencePositions(batch, seq), &c2);
  ContextParallelCache cc;
  Tensor att = core.Forward(qkv, batch, &cc);
  const Tensor& ow = params.Get("a.o_proj.weight").value;
  Matrix y2 = RefLinear(ToMatrix(att), ow);
  ExpectNear(y1, y2, 1e-5, "y");
  // datt = r · o_proj.weight
  Tensor datt = Tensor::Zeros({batch * seq, 16});
  for (int64_t t = 0; t < batch * seq; ++t) {
    for (int64_t j = 0; j < 16; ++j) {
      double s = 0;
      for (int64_t m = 0; m < 8; ++m)
        s += double(r.data<float>()[t * 8 + m]) * ow.data<float>()[m * 16 + j];
      datt.data<float>()[t * 16 + j] = static_cast<float>(s);
    }
  }
  Tensor dqkv_core = core.Backward(cc, datt);
  Tensor dqkv_ref = CausalAttentionBackward(c1.qkv, c1.probs, datt, batch, o.num_heads, 1);
  ExpectNear(dqkv_core, ToMatrix(dqkv_ref), 1e-5, "dqkv");
  Tensor dx2 = attn.ProjectQkvBackward(c2, dqkv_core);
  ExpectNear(dx2, ToMatrix(dx1), 1e-5, "dx");
}

TEST(GqaAttentionTest, KvHeadsMustDivideHeads) {
  ParameterSet params;
  GqaOptions o;
  o.model_dim = 12;
  o.num_heads = 4;
  o.num_kv_heads = 3;
  try {
    GroupedQueryAttention attn(params, "model.layers.0.self_attn.", o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn."), std::string::npos);
  }
}

}  // namespace
}  // namespace switchyard::train
