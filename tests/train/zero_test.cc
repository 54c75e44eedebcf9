#include "switchyard/train/zero.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "testing/random.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::RandomTensor;

constexpr float kMaxNorm = 1.5f;
constexpr int kSteps = 3;

struct Spec {
  std::string name;
  Shape shape;
  ParamOptions options;
};

// N = 35 + 3 + 1 + 45 + 11 = 95 trainable elements: not divisible by 2, 3 or 4; "tiny.bias" is
// smaller than every group; decay and no-decay mixed; one buffer in the middle.
std::vector<Spec> Specs() {
  return {
      {"embed.weight", {7, 5}, {.weight_decay = true}},
      {"blocks.0.norm.weight", {3}, {}},
      {"tiny.bias", {1}, {}},
      {"rope.cache", {4}, {.trainable = false}},
      {"blocks.0.mlp.weight", {5, 9}, {.weight_decay = true}},
      {"head.bias", {11}, {}},
  };
}
constexpr int64_t kN = 95;

void Build(ParameterSet& params) {
  uint64_t seed = 1;
  for (const Spec& s : Specs()) params.Add(s.name, RandomTensor(s.shape, seed++), s.options);
}

std::vector<Parameter*> Pointers(ParameterSet& params) {
  std::vector<Parameter*> out;
  for (auto& p : params.all()) out.push_back(&p);
  return out;
}

// The gradient "backward" gives rank r of w at step s. Step 1 is small enough not to be clipped.
Tensor RankGrad(const Shape& shape, int k, int r, int s) {
  float scale = s == 1 ? 0.05f : 1.0f;
  return RandomTensor(shape, 10000 + 1000 * static_cast<uint64_t>(s) + 10 * k + r, -scale, scale);
}

void SetRankGrads(ParameterSet& params, int r, int s) {
  int k = 0;
  for (auto& p : params.all()) {
    if (p.options.trainable) p.grad.CopyFrom(RankGrad(p.value.shape(), k, r, s));
    ++k;
  }
}

float Lr(int s) { return 0.01f * static_cast<float>(s + 1); }

// The trainable values (or gradients) in flat order.
std::vector<float> Flat(const ParameterSet& params, bool grads = false) {
  std::vector<float> out;
  for (const auto& p : params.all()) {
    if (!p.options.trainable) continue;
    const Tensor& t = grads ? p.grad : p.value;
    out.insert(out.end(), t.data<float>(), t.data<float>() + t.numel());
  }
  return out;
}

// A plain AdamW on the gradients averaged over w ranks (summed in rank order, times 1/w).
struct Reference {
  explicit Reference(AdamWOptions options = {}) : opt(options) {}

  ParameterSet params;
  AdamW opt;
  std::vector<std::vector<float>> values;  // after each step
  std::vector<double> norms;               // squared norm of the averaged gradient, each step

  void Run(int w, int from, int to) {
    for (int s = from; s < to; ++s) {
      int k = 0;
      for (auto& p : params.all()) {
        if (p.options.trainable) {
          float* g = p.grad.data<float>();
          for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] = 0.0f;
          for (int r = 0; r < w; ++r) {
            Tensor gr = RankGrad(p.value.shape(), k, r, s);
            for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] += gr.data<float>()[i];
          }
          for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] *= 1.0f / static_cast<float>(w);
        }
        ++k;
      }
      double norm = GradSquaredNorm(params);
      norms.push_back(norm);
      ScaleGradients(params, ClipFactor(std::sqrt(norm), kMaxNorm));
      opt.Step(params, Lr(s));
      values.push_back(Flat(params));
    }
  }
};

// Sum of one double per rank, in rank order (AllGather of its bits: no float64 reductions).
double SumOverGroup(comm::Communicator& group, double mine) {
  std::vector<int64_t> all(static_cast<size_t>(group.size()));
  int64_t bits = std::bit_cast<int64_t>(mine);
  group.AllGather(&bits, all.data(), 1, DType::kInt64).Wait();
  double sum = 0;
  for (int64_t b : all) sum += std::bit_cast<double>(b);
  return sum;
}

int64_t CountNaN(const std::vector<float>& v) {
  int64_t n = 0;
  for (float x : v) n += std::isnan(x) ? 1 : 0;
  return n;
}

// What one rank saw.
struct RankRun {
  std::vector<std::vector<float>> values;  // full values after each step (gathered at stage 3)
  std::vector<double> total_norms;         // sum over the group of OwnGradSquaredNorm
  std::vector<int64_t> nan_grads;          // NaN gradients after ReduceGradients
  std::vector<int64_t> nan_values;         // NaN values after Step, before any gather
  std::vector<float> buffer;               // "rope.cache" at the end
  int64_t own = 0;
  int64_t state_elements = 0;
  TensorMap state;
  int64_t step = 0;
};

// Steps [from, to) as the trainer does, with values checked through the poisoning mode.
void TrainSteps(ShardedAdamW& zero, ParameterSet& params, comm::Communicator& group, int from,
                int to, RankRun& run) {
  const int w = group.size();
  for (int s = from; s < to; ++s) {
    zero.GatherParameters();                // before the forward (no-op below stage 3)
    SetRankGrads(params, group.rank(), s);  // the backward
    zero.ReleaseParameters();
    zero.ReduceGradients(1.0f / static_cast<float>(w));
    run.nan_grads.push_back(CountNaN(Flat(params, /*grads=*/true)));
    double total = SumOverGroup(group, zero.OwnGradSquaredNorm());
    run.total_norms.push_back(total);
    zero.ScaleGradients(ClipFactor(std::sqrt(total), kMaxNorm));
    zero.Step(Lr(s));
    run.nan_values.push_back(CountNaN(Flat(params)));
    zero.GatherParameters();
    run.values.push_back(Flat(params));
  }
  run.own = zero.own_end() - zero.own_begin();
  run.state_elements = zero.state_elements();
  run.step = zero.step();
  run.buffer = std::vector<float>(params.Get("rope.cache").value.data<float>(),
                                  params.Get("rope.cache").value.data<float>() + 4);
}

void ExpectStateClose(const TensorMap& got, const TensorMap& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": " << name << " missing";
    ASSERT_EQ(it->second.shape(), t.shape()) << what << ": " << name;
    ASSERT_EQ(it->second.dtype(), DType::kFloat32) << what << ": " << name;
    EXPECT_TRUE(::switchyard::testing::AllClose(it->second.data<float>(), t.data<float>(),
                                                static_cast<size_t>(t.numel()), 1e-5, 1e-9))
        << what << ": " << name;
  }
}

void ExpectStateEqual(const TensorMap& got, const TensorMap& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": " << name << " missing";
    ASSERT_EQ(it->second.shape(), t.shape()) << what << ": " << name;
    for (int64_t i = 0; i < t.numel(); ++i) {
      ASSERT_EQ(it->second.data<float>()[i], t.data<float>()[i])
          << what << ": " << name << "[" << i << "]";
    }
  }
}

class ShardedAdamWTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ShardedAdamWTest, EqualsAdamWOnAveragedGradientsAndResumesOnAnotherWorld) {
  const auto [w, stage] = GetParam();
  const AdamWOptions options{.weight_decay = 0.2f};
  const std::string where = "W=" + std::to_string(w) + " stage " + std::to_string(stage);

  Reference ref(options);
  Build(ref.params);
  const std::vector<float> buffer0(ref.params.Get("rope.cache").value.data<float>(),
                                   ref.params.Get("rope.cache").value.data<float>() + 4);
  ref.Run(w, 0, kSteps);

  std::vector<RankRun> runs(static_cast<size_t>(w));
  comm::RunInProcess(w, [&](comm::Communicator& group) {
    ParameterSet params;
    Build(params);
    ShardedAdamW zero(Pointers(params), group, stage, options, {.poison_non_owned = true});
    EXPECT_EQ(zero.num_elements(), kN);
    RankRun& run = runs[static_cast<size_t>(group.rank())];
    TrainSteps(zero, params, group, 0, kSteps, run);
    run.state = zero.FullState();
  });

  const int64_t chunk = (kN + w - 1) / w;
  int64_t owned = 0;
  for (int r = 0; r < w; ++r) {
    const RankRun& run = runs[static_cast<size_t>(r)];
    const std::string who = where + " rank " + std::to_string(r);
    owned += run.own;
    EXPECT_LE(run.own, chunk) << who;
    EXPECT_EQ(run.step, kSteps) << who;
    EXPECT_EQ(run.buffer, buffer0) << who << ": a buffer was changed";
    // State: full at stage 0, the own range (<= ceil(N / W)) else.
    EXPECT_EQ(run.state_elements, stage == 0 ? 2 * kN : 2 * run.own) << who;
    for (int s = 0; s < kSteps; ++s) {
      const std::string at = who + " step " + std::to_string(s);
      EXPECT_TRUE(::switchyard::testing::AllClose(run.values[static_cast<size_t>(s)],
                                                  ref.values[static_cast<size_t>(s)], 1e-6, 1e-7))
          << at;
      EXPECT_NEAR(run.total_norms[static_cast<size_t>(s)], ref.norms[static_cast<size_t>(s)],
                  1e-6 * ref.norms[static_cast<size_t>(s)])
          << at;
      // Poisoning proves what is (not) valid: stages 2/3 hold only the own gradients, stage 3
      // only the own values after Step.
      EXPECT_EQ(run.nan_grads[static_cast<size_t>(s)], stage >= 2 ? kN - run.own : 0) << at;
      EXPECT_EQ(run.nan_values[static_cast<size_t>(s)], stage == 3 ? kN - run.own : 0) << at;
    }
    if (w <= 2) {
      // One or two summands: the reduction is exact, so is the equality.
      EXPECT_EQ(run.values.back(), ref.values.back()) << who;
    }
    ExpectStateClose(run.state, ref.opt.StateTensors(), who + " FullState");
  }
  EXPECT_EQ(owned, kN) << where << ": the own ranges must partition the flat vector";

  // Resume from rank 0's FullState and final values on another world size and stage, one more
  // step: the same as the plain AdamW continuing (from its own state) on that world's gradients.
  const int w2 = w % 4 + 1;
  const int stage2 = (stage + 1) % 4;
  const TensorMap saved = runs[0].state;
  const std::vector<float> saved_values = runs[0].values.back();
  ref.Run(w2, kSteps, kSteps + 1);
  std::vector<RankRun> resumed(static_cast<size_t>(w2));
  std::vector<TensorMap> reloaded(static_cast<size_t>(w2));
  comm::RunInProcess(w2, [&](comm::Communicator& group) {
    ParameterSet params;
    Build(params);
    size_t i = 0;
    for (auto& p : params.all()) {
      if (!p.options.trainable) continue;
      std::copy_n(saved_values.begin() + static_cast<ptrdiff_t>(i), p.value.numel(),
                  p.value.data<float>());
      i += static_cast<size_t>(p.value.numel());
    }
    ShardedAdamW zero(Pointers(params), group, stage2, options, {.poison_non_owned = true});
    zero.LoadFullState(saved, kSteps);
    reloaded[static_cast<size_t>(group.rank())] = zero.FullState();
    RankRun& run = resumed[static_cast<size_t>(group.rank())];
    TrainSteps(zero, params, group, kSteps, kSteps + 1, run);
    run.state = zero.FullState();
  });
  for (int r = 0; r < w2; ++r) {
    const RankRun& run = resumed[static_cast<size_t>(r)];
    const std::string who = "resumed from " + where + " on W=" + std::to_string(w2) + " stage " +
                            std::to_string(stage2) + " rank " + std::to_string(r);
    ExpectStateEqual(reloaded[static_cast<size_t>(r)], saved, who + " (load then FullState)");
    EXPECT_EQ(run.step, kSteps + 1) << who;
    EXPECT_TRUE(::switchyard::testing::AllClose(run.values.back(), ref.values.back(), 1e-6, 1e-7))
        << who;
    ExpectStateClose(run.state, ref.opt.StateTensors(), who + " FullState");
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndStages, ShardedAdamWTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& p) {
                           return fmt::format("W{}_stage{}", std::get<0>(p.param),
                                              std::get<1>(p.param));
                         });

TEST(ShardedAdamWTest, PlainAdamWCheckpointLoadsIntoEveryStage) {
  // AdamW::StateTensors of a plain run is a valid ZeRO state, and comes back unchanged.
  Reference ref;
  Build(ref.params);
  ref.Run(1, 0, 2);
  const TensorMap plain = ref.opt.StateTensors();
  for (int stage = 0; stage <= 3; ++stage) {
    std::mutex mu;
    std::vector<TensorMap> got;
    comm::RunInProcess(3, [&](comm::Communicator& group) {
      ParameterSet params;
      Build(params);
      ShardedAdamW zero(Pointers(params), group, stage);
      EXPECT_TRUE(zero.FullState().empty()) << "no state before the first step, as AdamW";
      zero.LoadFullState(plain, 2);
      EXPECT_EQ(zero.step(), 2);
      TensorMap state = zero.FullState();
      std::lock_guard lock(mu);
      got.push_back(std::move(state));
    });
    for (const TensorMap& state : got) {
      ExpectStateEqual(state, plain, "stage " + std::to_string(stage));
    }
  }
}

// The message of the InvalidArgument `fn` throws ("" if it throws nothing).
template <typename Fn>
std::string InvalidArgumentMessage(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(ShardedAdamWTest, BadStateIsAClearErrorAndChangesNothing) {
  Reference ref;
  Build(ref.params);
  ref.Run(1, 0, 1);
  const TensorMap good = ref.opt.StateTensors();
  comm::RunInProcess(2, [&](comm::Communicator& group) {
    ParameterSet params;
    Build(params);
    ShardedAdamW zero(Pointers(params), group, 2);
    zero.LoadFullState(good, 1);

    TensorMap missing = good;
    missing.erase("head.bias.exp_avg_sq");
    std::string msg = InvalidArgumentMessage([&] { zero.LoadFullState(missing, 5); });
    EXPECT_NE(msg.find("'head.bias.exp_avg_sq' is missing"), std::string::npos) << msg;

    TensorMap wrong_shape = good;
    wrong_shape["embed.weight.exp_avg"] = Tensor::Zeros({5, 7});
    msg = InvalidArgumentMessage([&] { zero.LoadFullState(wrong_shape, 5); });
    EXPECT_NE(msg.find("'embed.weight.exp_avg'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[7, 5]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[5, 7]"), std::string::npos) << msg;

    TensorMap wrong_dtype = good;
    wrong_dtype["tiny.bias.exp_avg"] = Tensor::Zeros({1}, DType::kInt32);
    msg = InvalidArgumentMessage([&] { zero.LoadFullState(wrong_dtype, 5); });
    EXPECT_NE(msg.find("tiny.bias.exp_avg"), std::string::npos) << msg;

    msg = InvalidArgumentMessage([&] { zero.LoadFullState(good, -1); });
    EXPECT_NE(msg.find("step must be >= 0"), std::string::npos) << msg;

    // Nothing changed by the failed loads.
    EXPECT_EQ(zero.step(), 1);
    ExpectStateEqual(zero.FullState(), good, "after failed loads");

    // bfloat16 state (a compact checkpoint) is accepted and converted.
    TensorMap bf16;
    for (const auto& [name, t] : good) bf16.emplace(name, t.To(DType::kBFloat16));
    zero.LoadFullState(bf16, 1);
    TensorMap back = zero.FullState();
    EXPECT_EQ(back.at("embed.weight.exp_avg").At(3), bf16.at("embed.weight.exp_avg").At(3));
  });
}

TEST(ShardedAdamWTest, RejectsBadArgumentsAndDisagreeingRanks) {
  comm::RunInProcess(1, [&](comm::Communicator& group) {
    ParameterSet params;
    Build(params);
    std::string msg =
        InvalidArgumentMessage([&] { ShardedAdamW zero(Pointers(params), group, 4); });
    EXPECT_NE(msg.find("stage must be 0..3, got 4"), std::string::npos) << msg;
    std::vector<Parameter*> twice = Pointers(params);
    twice.push_back(twice.front());
    msg = InvalidArgumentMessage([&] { ShardedAdamW zero(twice, group, 1); });
    EXPECT_NE(msg.find("'embed.weight' is given twice"), std::string::npos) << msg;
  });
  // Rank 1 passes the parameters in another order: every rank reports it, naming the rank.
  std::vector<std::string> messages(2);
  comm::RunInProcess(2, [&](comm::Communicator& group) {
    ParameterSet params;
    Build(params);
    std::vector<Parameter*> ptrs = Pointers(params);
    if (group.rank() == 1) std::swap(ptrs[0], ptrs[1]);
    messages[static_cast<size_t>(group.rank())] =
        InvalidArgumentMessage([&] { ShardedAdamW zero(ptrs, group, 2); });
  });
  for (const std::string& msg : messages) {
    EXPECT_NE(msg.find("rank 1 passed different parameters"), std::string::npos) << msg;
  }
}

TEST(ShardedAdamWTest, OnlyBuffersIsANoOp) {
  comm::RunInProcess(3, [&](comm::Communicator& group) {
    ParameterSet params;
    params.Add("rope.cache", RandomTensor({4}, 7), {.trainable = false});
    ShardedAdamW zero(Pointers(params), group, 3);
    EXPECT_EQ(zero.num_elements(), 0);
    zero.GatherParameters();
    zero.ReduceGradients(0.5f);
    EXPECT_EQ(zero.OwnGradSquaredNorm(), 0.0);
    zero.Step(0.1f);
    EXPECT_EQ(zero.state_elements(), 0);
    EXPECT_TRUE(zero.FullState().empty());
  });
}

TEST(ShardedAdamWTest, ExpertDataParallelSubgroups) {
  // W = 4 split into two groups of 2 (as ep_dp groups): each group averages its own parameters.
  const AdamWOptions options;
  Reference refs[2] = {Reference(options), Reference(options)};
  for (auto& ref : refs) Build(ref.params);
  // Group c holds world ranks c and c + 2; its ranks 0, 1 use gradients RankGrad(.., r, s).
  refs[0].Run(2, 0, 2);
  refs[1].Run(2, 0, 2);
  std::vector<std::vector<float>> values(4);
  comm::RunInProcess(4, [&](comm::Communicator& world) {
    auto group = world.Split(world.rank() % 2, world.rank(), "ep_dp");
    ParameterSet params;
    Build(params);
    ShardedAdamW zero(Pointers(params), *group, 2, options);
    RankRun run;
    TrainSteps(zero, params, *group, 0, 2, run);
    values[static_cast<size_t>(world.rank())] = run.values.back();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(values[static_cast<size_t>(r)], refs[r % 2].values.back()) << "world rank " << r;
  }
}

}  // namespace
}  // namespace switchyard::train
