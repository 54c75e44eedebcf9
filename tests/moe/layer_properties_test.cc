// Properties of the layer beyond the reference comparison: equivalences between modes,
// independence from the thread count and from how a batch is split over ranks, bfloat16, and
// the errors users see.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "moe/activation.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/reduce.h"
#include "switchyard/kernels/reference.h"
#include "switchyard/moe/dispatch.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/plan.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

using switchyard::testing::AllClose;
using switchyard::testing::RandomVector;

LayerConfig MediumConfig() {
  LayerConfig c;
  c.model_dim = 16;
  c.hidden_dim = 24;
  c.num_experts = 8;
  c.top_k = 2;
  c.aux_loss_coef = 0.1f;
  c.z_loss_coef = 0.01f;
  c.seed = 3;
  return c;
}

Tensor RandomX(int64_t t, int64_t m, uint64_t seed) {
  return Tensor::FromVector(RandomVector(static_cast<size_t>(t * m), seed), {t, m});
}

std::vector<float> Floats(const Tensor& t) {
  Tensor f = t.dtype() == DType::kFloat32 ? t : t.To(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

// Every gradient of `a` and `b` is close.
void ExpectGradientsClose(const LayerConfig& c, const LayerGradients& a, const LayerGradients& b,
                          double rtol, double atol) {
  EXPECT_TRUE(AllClose(Floats(a.x), Floats(b.x), rtol, atol)) << "grad.x";
  NamedTensors ga = ParamsToMap(c, a.params), gb = ParamsToMap(c, b.params);
  ASSERT_EQ(ga.size(), gb.size());
  for (auto& [name, t] : ga) {
    EXPECT_TRUE(AllClose(Floats(t), Floats(gb.at(name)), rtol, atol)) << "grad." << name;
  }
}

TEST(LayerProperties, CapacityWithoutDropsEqualsDropless) {
  for (bool gated : {false, true}) {
    LayerConfig cap = MediumConfig();
    cap.gated = gated;
    cap.capacity_factor = 0.0f;  // C = max load: nothing dropped
    LayerConfig dropless = cap;
    dropless.dropless = true;
    LayerParams params = InitParams(cap, 5);
    Tensor x = RandomX(77, cap.model_dim, 6);
    Tensor dy = RandomX(77, cap.model_dim, 7);
    MoeLayer l1(cap), l2(dropless);
    LayerOutput o1 = l1.Forward(params, x), o2 = l2.Forward(params, x);
    EXPECT_EQ(o1.dropped, 0);
    EXPECT_TRUE(AllClose(Floats(o1.y), Floats(o2.y), 1e-6, 1e-6));
    EXPECT_EQ(o1.expert_counts, o2.expert_counts);
    EXPECT_EQ(Floats(o1.locations.To(DType::kFloat32)), Floats(o2.locations.To(DType::kFloat32)));
    ExpectGradientsClose(cap, l1.Backward(params, o1, dy), l2.Backward(params, o2, dy), 1e-5, 1e-6);
  }
}

TEST(LayerProperties, ResultsDoNotDependOnThreads) {
  for (bool dropless : {false, true}) {
    LayerConfig c = MediumConfig();
    c.dropless = dropless;
    c.capacity_factor = 1.0f;
    LayerParams params = InitParams(c, 5);
    Tensor x = RandomX(300, c.model_dim, 8);
    Tensor dy = RandomX(300, c.model_dim, 9);
    MoeLayer layer(c);
    ForwardOptions one, three;
    three.threads = 3;
    LayerOutput o1 = layer.Forward(params, x, one), o3 = layer.Forward(params, x, three);
    EXPECT_EQ(Floats(o1.y), Floats(o3.y));  // bitwise
    LayerGradients g1 = layer.Backward(params, o1, dy, 1), g3 = layer.Backward(params, o3, dy, 3);
    ExpectGradientsClose(c, g1, g3, 0, 0);  // bitwise
  }
}

// Noise and random choices are keyed by the global token index: running a batch in two pieces
// with the right offsets (as two ranks would) gives what one rank gives for the whole batch.
TEST(LayerProperties, SplitBatchWithOffsetsEqualsWholeBatch) {
  for (NoiseKind noise : {NoiseKind::kTutelNormal, NoiseKind::kJitter, NoiseKind::kGumbelSecond}) {
    LayerConfig c = MediumConfig();
    c.dropless = true;
    c.noise = noise;
    c.noise_std = 3.0f;
    c.jitter_eps = 0.2f;
    c.random_routing = true;
    LayerParams params = InitParams(c, 5);
    const int64_t t = 40, cut = 17;
    Tensor x = RandomX(t, c.model_dim, 10);
    MoeLayer layer(c);
    ForwardOptions whole_opt;
    whole_opt.global_token_offset = 1000;
    whole_opt.step = 4;
    LayerOutput whole = layer.Forward(params, x, whole_opt);
    ForwardOptions a_opt = whole_opt, b_opt = whole_opt;
    b_opt.global_token_offset = 1000 + cut;
    LayerOutput a = layer.Forward(params, x.Slice(0, cut).Clone(), a_opt);
    LayerOutput b = layer.Forward(params, x.Slice(cut, t).Clone(), b_opt);
    std::vector<float> joined = Floats(a.y), yb = Floats(b.y);
    joined.insert(joined.end(), yb.begin(), yb.end());
    EXPECT_TRUE(AllClose(joined, Floats(whole.y), 1e-6, 1e-6)) << NoiseKindName(noise);
    // Another step draws other noise.
    ForwardOptions next = whole_opt;
    next.step = 5;
    EXPECT_NE(Floats(layer.Forward(params, x, next).gates), Floats(whole.gates));
  }
}

// Routing is keyed by the global token index, not by the row: the batch's rows in another order
// (as context-parallel ranks hold them), each with its global index, route exactly as the batch
// in order, with binding capacity and every order-dependent option (position / random drops,
// batch-prioritized routing, noise, random routing); the outputs and gradients are the permuted
// ones. The identity index changes nothing, bit for bit.
TEST(LayerProperties, RowsInAnyOrderWithTheirGlobalIndexRouteAsInOrder) {
  struct Case {
    const char* name;
    void (*edit)(LayerConfig&);
  };
  const Case cases[] = {
      {"position drops", [](LayerConfig&) {}},
      {"random drops", [](LayerConfig& c) { c.drop_policy = DropPolicy::kRandom; }},
      {"probs drops, token order",
       [](LayerConfig& c) {
         c.drop_policy = DropPolicy::kProbs;
         c.slot_order = SlotOrder::kTokenOrder;
       }},
      {"batch-prioritized", [](LayerConfig& c) { c.batch_prioritized_routing = true; }},
      {"tutel noise, random routing",
       [](LayerConfig& c) {
         c.noise = NoiseKind::kTutelNormal;
         c.noise_std = 3.0f;
         c.random_routing = true;
       }},
      {"jitter, renormalize",
       [](LayerConfig& c) {
         c.noise = NoiseKind::kJitter;
         c.jitter_eps = 0.2f;
         c.renormalize_after_drop = true;
       }},
      {"gumbel, k 3",
       [](LayerConfig& c) {
         c.noise = NoiseKind::kGumbelSecond;
         c.top_k = 3;
       }},
  };
  const int64_t t = 48, offset = 96;
  std::vector<int64_t> perm(static_cast<size_t>(t));  // row r holds token perm[r]
  for (int64_t r = 0; r < t; ++r) perm[static_cast<size_t>(r)] = (r * 29 + 7) % t;
  for (const Case& k : cases) {
    LayerConfig c = MediumConfig();
    c.capacity_factor = 0.75f;
    k.edit(c);
    LayerParams params = InitParams(c, 5);
    MoeLayer layer(c);
    const int64_t m = c.model_dim, top = layer.top_k();
    Tensor x = RandomX(t, m, 10), dy = RandomX(t, m, 11);
    Tensor px = Tensor::Empty({t, m}), pdy = Tensor::Empty({t, m});
    std::vector<int64_t> index(static_cast<size_t>(t));
    for (int64_t r = 0; r < t; ++r) {
      const int64_t tok = perm[static_cast<size_t>(r)];
      std::copy_n(x.data<float>() + tok * m, m, px.data<float>() + r * m);
      std::copy_n(dy.data<float>() + tok * m, m, pdy.data<float>() + r * m);
      index[static_cast<size_t>(r)] = offset + tok;
    }
    ForwardOptions o;
    o.global_token_offset = offset;
    o.step = 2;
    const LayerOutput want = layer.Forward(params, x, o);
    ASSERT_GT(want.dropped, 0) << k.name;  // capacity binds
    ForwardOptions po = o;
    po.token_index = index;
    const LayerOutput got = layer.Forward(params, px, po);
    EXPECT_EQ(got.dropped, want.dropped) << k.name;
    EXPECT_EQ(got.capacity, want.capacity) << k.name;
    EXPECT_EQ(got.expert_counts, want.expert_counts) << k.name;
    EXPECT_FLOAT_EQ(got.l_aux, want.l_aux) << k.name;
    auto row_of = [&](const Tensor& a, int64_t r, int64_t width) {
      std::vector<float> v = Floats(a);
      return std::vector<float>(v.begin() + r * width, v.begin() + (r + 1) * width);
    };
    const Tensor wl = want.locations.To(DType::kFloat32), gl = got.locations.To(DType::kFloat32);
    const LayerGradients wg = layer.Backward(params, want, dy),
                         gg = layer.Backward(params, got, pdy);
    for (int64_t r = 0; r < t; ++r) {
      const int64_t tok = perm[static_cast<size_t>(r)];
      EXPECT_EQ(row_of(gl, r, top), row_of(wl, tok, top)) << k.name << " row " << r;
      EXPECT_EQ(row_of(got.combine_weights, r, top), row_of(want.combine_weights, tok, top))
          << k.name << " row " << r;
      EXPECT_TRUE(AllClose(row_of(got.y, r, m), row_of(want.y, tok, m), 1e-5, 1e-6))
          << k.name << " row " << r;
      EXPECT_TRUE(AllClose(row_of(gg.x, r, m), row_of(wg.x, tok, m), 1e-4, 1e-5))
          << k.name << " row " << r;
    }
    LayerGradients unpermuted = gg;
    unpermuted.x = wg.x;  // rows compared above
    ExpectGradientsClose(c, unpermuted, wg, 1e-4, 1e-5);
    // The identity index is the offset's order: bit for bit.
    std::vector<int64_t> identity(static_cast<size_t>(t));
    for (int64_t r = 0; r < t; ++r) identity[static_cast<size_t>(r)] = offset + r;
    ForwardOptions io = o;
    io.token_index = identity;
    const LayerOutput same = layer.Forward(params, x, io);
    EXPECT_EQ(Floats(same.y), Floats(want.y)) << k.name;
    EXPECT_EQ(Floats(same.gates), Floats(want.gates)) << k.name;
  }
  // A token index of the wrong length is an error naming it.
  MoeLayer layer(MediumConfig());
  ForwardOptions bad;
  std::vector<int64_t> short_index(3, 0);
  bad.token_index = short_index;
  try {
    layer.Forward(InitParams(MediumConfig(), 5), RandomX(4, 16, 1), bad);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("token_index: expected 4 entries"), std::string::npos)
        << e.what();
  }
}

TEST(LayerProperties, BFloat16ActivationsComputeInFloat32) {
  LayerConfig c = MediumConfig();
  c.capacity_factor = 1.0f;
  LayerParams params = InitParams(c, 5);
  Tensor x32 = RandomX(50, c.model_dim, 11);
  Tensor dy32 = RandomX(50, c.model_dim, 12);
  Tensor x16 = x32.To(DType::kBFloat16), dy16 = dy32.To(DType::kBFloat16);
  MoeLayer layer(c);
  LayerOutput o16 = layer.Forward(params, x16);
  LayerOutput o32 = layer.Forward(params, x16.To(DType::kFloat32));
  ASSERT_EQ(o16.y.dtype(), DType::kBFloat16);
  // Same float32 computation on the same (rounded) inputs; only the output is rounded.
  EXPECT_EQ(Floats(o16.y), Floats(o32.y.To(DType::kBFloat16)));
  LayerGradients g16 = layer.Backward(params, o16, dy16);
  LayerGradients g32 = layer.Backward(params, o32, dy16.To(DType::kFloat32));
  ASSERT_EQ(g16.x.dtype(), DType::kBFloat16);
  EXPECT_EQ(Floats(g16.x), Floats(g32.x.To(DType::kBFloat16)));
  EXPECT_EQ(g16.params.gate_weight.dtype(), DType::kFloat32);
  EXPECT_EQ(Floats(g16.params.experts.fc1_weight), Floats(g32.params.experts.fc1_weight));
}

TEST(LayerProperties, EmptyBatch) {
  LayerConfig c = MediumConfig();
  LayerParams params = InitParams(c, 5);
  MoeLayer layer(c);
  Tensor x = Tensor::Zeros({0, c.model_dim});
  LayerOutput out = layer.Forward(params, x);
  EXPECT_EQ(out.y.shape(), (Shape{0, c.model_dim}));
  LayerGradients g = layer.Backward(params, out, x);
  EXPECT_EQ(g.x.shape(), (Shape{0, c.model_dim}));
  for (float v : Floats(g.params.experts.fc1_weight)) EXPECT_EQ(v, 0.0f);
}

// Capacity mode: computing every slot (what a receiver without counts does) gives the same
// outputs on the filled slots and the same gradients as computing the filled slots only.
TEST(LayerProperties, ExpertsOverFullCapacityEqualFilledSlots) {
  LayerConfig c = MediumConfig();
  c.capacity_factor = 2.0f;  // plenty of padding
  c.gated = true;
  LayerParams params = InitParams(c, 5);
  Tensor x = RandomX(40, c.model_dim, 14);
  GateResult gate = GateForward(c, x, params.gate_weight, Tensor(), {});
  DispatchPlan plan = MakeDispatchPlan(c, gate, {});
  ASSERT_GT(plan.num_rows, 40 * 2);
  Tensor in = Dispatch(plan, x, false);
  ExpertOptions eo{c.activation, c.gated};
  ExpertActivations filled, full;
  Tensor y_filled = ExpertsForward(eo, params.experts, in, GroupsOf(plan), &filled, 2);
  Tensor y_full = ExpertsForward(eo, params.experts, in,
                                 FullCapacityGroups(c.num_experts, plan.capacity), &full, 2);
  Tensor dy = RandomX(plan.num_rows, c.model_dim, 15);
  for (int64_t r = 0; r < plan.num_rows; ++r) {
    bool pad = plan.row_tokens[static_cast<size_t>(r)] < 0;
    for (int64_t j = 0; j < c.model_dim; ++j) {
      int64_t i = r * c.model_dim + j;
      if (pad) {
        EXPECT_EQ(y_filled.data<float>()[i], 0.0f);
        dy.data<float>()[i] = 0.0f;  // padding receives no gradient
      } else {
        EXPECT_NEAR(y_full.data<float>()[i], y_filled.data<float>()[i], 1e-6);
      }
    }
  }
  ExpertGradients g_filled = ExpertsBackward(eo, params.experts, filled, dy, 2);
  ExpertGradients g_full = ExpertsBackward(eo, params.experts, full, dy, 2);
  EXPECT_TRUE(AllClose(Floats(g_full.input), Floats(g_filled.input), 1e-5, 1e-6));
  for (auto [a, b] : {std::pair{g_full.weights.fc1_weight, g_filled.weights.fc1_weight},
                      {g_full.weights.fc1_bias, g_filled.weights.fc1_bias},
                      {g_full.weights.fc2_weight, g_filled.weights.fc2_weight},
                      {g_full.weights.fc2_bias, g_filled.weights.fc2_bias},
                      {g_full.weights.fc3_weight, g_filled.weights.fc3_weight}}) {
    EXPECT_TRUE(AllClose(Floats(a), Floats(b), 1e-5, 1e-6));
  }
}

TEST(LayerProperties, ExpertBiasUpdate) {
  Tensor bias = Tensor::Zeros({4});
  UpdateExpertBias(std::vector<int64_t>{10, 2, 4, 4}, 0.5f, bias);  // mean load 5
  EXPECT_EQ(Floats(bias), (std::vector<float>{-0.5f, 0.5f, 0.5f, 0.5f}));
  UpdateExpertBias(std::vector<int64_t>{5, 5, 5, 5}, 0.5f, bias);  // balanced: no change
  EXPECT_EQ(Floats(bias), (std::vector<float>{-0.5f, 0.5f, 0.5f, 0.5f}));
}

// The expert bias changes choices but not gate values.
TEST(LayerProperties, ExpertBiasAffectsChoiceOnly) {
  LayerConfig c = MediumConfig();
  c.expert_bias = true;
  c.normalize_gate = false;
  LayerParams params = InitParams(c, 5);
  Tensor x = RandomX(30, c.model_dim, 13);
  MoeLayer layer(c);
  params.expert_bias.Fill(0.0);
  params.expert_bias.data<float>()[5] = 10.0f;  // expert 5 always chosen first
  LayerOutput out = layer.Forward(params, x);
  GateResult g = GateForward(c, x, params.gate_weight, params.expert_bias, {});
  for (int64_t t = 0; t < 30; ++t) {
    EXPECT_EQ(out.topk_idx.data<int32_t>()[t * 2], 5);
    EXPECT_FLOAT_EQ(out.gates.data<float>()[t * 2], g.scores.data<float>()[t * 8 + 5]);
  }
}

TEST(LayerProperties, ErrorsNameTheProblem) {
  LayerConfig c = MediumConfig();
  c.check_finite = true;
  LayerParams params = InitParams(c, 5);
  MoeLayer layer(c);
  auto message = [](auto fn) -> std::string {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  Tensor x = RandomX(5, c.model_dim, 1);
  x.data<float>()[2 * c.model_dim + 3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(message([&] { layer.Forward(params, x); }),
            "x: element [2, 3] is nan (check_finite is on)");
  EXPECT_EQ(message([&] { layer.Forward(params, RandomX(5, c.model_dim + 1, 1)); }),
            "x: expected shape [*, 16], got [5, 17]");
  LayerParams bad = params;
  bad.experts.fc2_weight = Tensor::Zeros({8, 24, 16});
  EXPECT_EQ(message([&] { layer.Forward(bad, RandomX(5, c.model_dim, 1)); }),
            "experts.fc2.weight: expected shape [8, 16, 24], got [8, 24, 16]");
  NamedTensors named = ParamsToMap(c, params);
  named.erase("experts.fc1.bias");
  EXPECT_EQ(message([&] { ParamsFromMap(c, named); }),
            "missing tensor 'experts.fc1.bias' (expected shape [8, 24], needed by the layer "
            "config)");
  named = ParamsToMap(c, params);
  named["gate.weight"] = named["gate.weight"].To(DType::kBFloat16);  // converted, accepted
  EXPECT_EQ(ParamsFromMap(c, named).gate_weight.dtype(), DType::kFloat32);
  named["gate.weight"] = Tensor::Zeros({8, 16}, DType::kInt32);
  EXPECT_NE(message([&] { ParamsFromMap(c, named); }).find("gate.weight: expected dtype"),
            std::string::npos);

  ForwardOptions inference;
  inference.save_for_backward = false;
  Tensor ok = RandomX(5, c.model_dim, 1);
  LayerOutput out = layer.Forward(params, ok, inference);
  EXPECT_NE(message([&] { layer.Backward(params, out, ok); }).find("save_for_backward"),
            std::string::npos);
  out = layer.Forward(params, ok);
  Tensor dy = RandomX(5, c.model_dim, 2);
  dy.data<float>()[0] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(message([&] { layer.Backward(params, out, dy); }),
            "dy: element [0, 0] is inf (check_finite is on)");
}

// The fused activation kernels against kernels::ref, over ordinary and extreme inputs.
TEST(FusedActivation, MatchesReference) {
  std::vector<float> x = RandomVector(1000, 21, -6.0f, 6.0f);
  for (float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 20.0f, -20.0f, 90.0f, -90.0f, 1e30f, -1e30f}) {
    x.push_back(v);
  }
  const auto n = static_cast<int64_t>(x.size());
  std::vector<float> gate3 = RandomVector(x.size(), 22);
  std::vector<float> bias = {0.25f};
  for (auto act :
       {kernels::Activation::kRelu, kernels::Activation::kGelu, kernels::Activation::kSilu}) {
    SCOPED_TRACE(std::string(kernels::ActivationName(act)));
    // Rows of one column, so the bias broadcast is a scalar. Inference (no saved derivatives):
    // pre1 keeps the biased input.
    std::vector<float> pre = x, gate = gate3, hidden(x.size()), want(x.size()), shifted(x.size());
    ActivationForwardRows(act, n, 1, bias.data(), pre.data(), gate.data(), hidden.data(), false);
    for (size_t i = 0; i < x.size(); ++i) shifted[i] = x[i] + 0.25f;
    EXPECT_EQ(pre, shifted);
    EXPECT_EQ(gate, gate3);
    kernels::ref::ActivationForward(act, shifted.data(), want.data(), n);
    std::vector<float> act_val = want;
    for (size_t i = 0; i < x.size(); ++i) want[i] *= gate3[i];
    EXPECT_TRUE(AllClose(hidden, want, 2e-6, 1e-6));

    // Training: the same output bits, and the buffers now hold dh/da1 = act'(a1) * a3, dh/da3 =
    // act(a1).
    std::vector<float> scale1 = x, scale3 = gate3, hidden_t(x.size());
    ActivationForwardRows(act, n, 1, bias.data(), scale1.data(), scale3.data(), hidden_t.data(),
                          true);
    EXPECT_EQ(hidden_t, hidden);
    std::vector<float> ones(x.size(), 1.0f), want_grad(x.size());
    kernels::ref::ActivationBackward(act, shifted.data(), ones.data(), want_grad.data(), n);
    for (size_t i = 0; i < x.size(); ++i) want_grad[i] *= gate3[i];
    EXPECT_TRUE(AllClose(scale1, want_grad, 2e-6, 1e-6));
    EXPECT_TRUE(AllClose(scale3, act_val, 2e-6, 1e-6));

    std::vector<float> dh = RandomVector(x.size(), 23), d = dh, d3(x.size()), want_d(x.size());
    std::vector<float> bias_grad = {0.0f};
    ActivationBackwardRows(n, 1, scale1.data(), scale3.data(), d.data(), d3.data(),
                           bias_grad.data());
    std::vector<float> dgated(x.size());
    for (size_t i = 0; i < x.size(); ++i) dgated[i] = dh[i] * gate3[i];
    kernels::ref::ActivationBackward(act, shifted.data(), dgated.data(), want_d.data(), n);
    EXPECT_TRUE(AllClose(d, want_d, 2e-6, 1e-6));
    double sum = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_NEAR(d3[i], dh[i] * act_val[i], 2e-6 * std::abs(dh[i] * act_val[i]) + 1e-6);
      sum += d[i];
    }
    EXPECT_NEAR(bias_grad[0], sum, 1e-3);

    // Not gated: dh/da1 = act'(a1) alone.
    std::vector<float> plain = x, hidden_p(x.size());
    ActivationForwardRows(act, n, 1, bias.data(), plain.data(), nullptr, hidden_p.data(), true);
    kernels::ref::ActivationBackward(act, shifted.data(), ones.data(), want_grad.data(), n);
    EXPECT_TRUE(AllClose(plain, want_grad, 2e-6, 1e-6));
    EXPECT_TRUE(AllClose(hidden_p, act_val, 2e-6, 1e-6));
  }
}

// Rows wider than a vector (37 columns: vector bodies and a remainder) with a bias per column: the
// training forward gives the inference forward's bits, and the backward (gated or not) the
// reference gradients, bias gradient included.
TEST(FusedActivation, WideRowsMatchReference) {
  const int64_t rows = 5, cols = 37, n = rows * cols;
  const auto size = static_cast<size_t>(n);
  std::vector<float> x = RandomVector(size, 31, -5.0f, 5.0f), gate3 = RandomVector(size, 32);
  std::vector<float> bias = RandomVector(static_cast<size_t>(cols), 33);
  std::vector<float> shifted(size);
  for (int64_t i = 0; i < n; ++i)
    shifted[static_cast<size_t>(i)] =
        x[static_cast<size_t>(i)] + bias[static_cast<size_t>(i % cols)];
  for (auto act : {kernels::Activation::kRelu, kernels::Activation::kGelu,
                   kernels::Activation::kSilu, kernels::Activation::kIdentity}) {
    for (bool gated : {false, true}) {
      SCOPED_TRACE(std::string(kernels::ActivationName(act)) + (gated ? " gated" : ""));
      std::vector<float> pre = x, q = gate3, hidden(size);
      ActivationForwardRows(act, rows, cols, bias.data(), pre.data(), gated ? q.data() : nullptr,
                            hidden.data(), false);
      std::vector<float> s1 = x, s3 = gate3, hidden_t(size);
      ActivationForwardRows(act, rows, cols, bias.data(), s1.data(), gated ? s3.data() : nullptr,
                            hidden_t.data(), true);
      EXPECT_EQ(hidden_t, hidden);

      std::vector<float> act_val(size), want_d(size), dh = RandomVector(size, 34);
      kernels::ref::ActivationForward(act, shifted.data(), act_val.data(), n);
      std::vector<float> dgated = dh;
      if (gated) {
        for (size_t i = 0; i < size; ++i) dgated[i] *= gate3[i];
      }
      kernels::ref::ActivationBackward(act, shifted.data(), dgated.data(), want_d.data(), n);
      std::vector<float> d = dh, d3(size), bias_grad(static_cast<size_t>(cols), 0.0f);
      ActivationBackwardRows(rows, cols, s1.data(), gated ? s3.data() : nullptr, d.data(),
                             gated ? d3.data() : nullptr, bias_grad.data());
      EXPECT_TRUE(AllClose(d, want_d, 2e-6, 1e-6));
      for (int64_t j = 0; j < cols; ++j) {
        double sum = 0;
        for (int64_t r = 0; r < rows; ++r) sum += want_d[static_cast<size_t>(r * cols + j)];
        EXPECT_NEAR(bias_grad[static_cast<size_t>(j)], sum, 1e-5);
      }
      if (gated) {
        for (size_t i = 0; i < size; ++i) {
          EXPECT_NEAR(d3[i], dh[i] * act_val[i], 2e-6 * std::abs(dh[i] * act_val[i]) + 1e-6);
        }
      }
    }
  }
}

TEST(FusedActivation, DotMatchesPlainSum) {
  for (int64_t n : {0, 1, 7, 8, 9, 100}) {
    auto a = RandomVector(static_cast<size_t>(n), 1), b = RandomVector(static_cast<size_t>(n), 2);
    double want = 0;
    for (int64_t i = 0; i < n; ++i) want += static_cast<double>(a[i]) * b[i];
    EXPECT_NEAR(kernels::Dot(a.data(), b.data(), n), want, 1e-5);  // what dispatch uses
  }
}

}  // namespace
}  // namespace switchyard::moe
