// Pipeline schedules as data (generators, validator, simulator), the executor on in-process
// ranks against the same computation on one rank, and the point-to-point Send/Recv it runs on:
// order, tags, interleaving with collectives, deadlines and dead peers.
#include "switchyard/parallel/pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel {
namespace {

using comm::Milliseconds;

ScheduleConfig Config(int p, int m, ScheduleKind kind, int v = 1) {
  return ScheduleConfig{p, m, v, kind};
}

template <typename Fn>
std::string ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineSchedule, EveryKindValidatesAndMatchesTheTheory) {
  for (int p = 1; p <= 5; ++p) {
    for (int m = 1; m <= 9; ++m) {
      for (ScheduleKind kind :
           {ScheduleKind::kFthenB, ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1}) {
        const ScheduleConfig c = Config(p, m, kind);
        const Schedule s = MakeSchedule(c);  // validated inside
        const ScheduleSimulation sim = SimulateSchedule(s);
        const std::string what = fmt::format("{} p {} m {}", ScheduleKindName(kind), p, m);
        if (kind != ScheduleKind::kZeroBubbleH1) {
          // F = 1, B = 2: the textbook bubble (p - 1) / (m + p - 1) exactly.
          EXPECT_NEAR(sim.bubble_fraction, TheoreticalBubbleFraction(c), 1e-12) << what;
          EXPECT_DOUBLE_EQ(sim.makespan, 3.0 * (m + p - 1)) << what;
        } else if (p > 1) {
          const double one_f_one_b =
              SimulateSchedule(MakeSchedule(Config(p, m, ScheduleKind::k1F1B))).bubble_fraction;
          EXPECT_LT(sim.bubble_fraction, one_f_one_b) << what;
        }
        for (int r = 0; r < p; ++r) {
          const int peak = sim.peak_in_flight[static_cast<size_t>(r)];
          if (kind == ScheduleKind::kFthenB) {
            EXPECT_EQ(peak, m) << what << " rank " << r;
          }
          if (kind == ScheduleKind::k1F1B) {
            EXPECT_EQ(peak, std::min(p - r, m)) << what << " rank " << r;
          }
        }
      }
      for (int v = 2; v <= 3 && m % p == 0; ++v) {
        const ScheduleConfig c = Config(p, m, ScheduleKind::kInterleaved1F1B, v);
        const ScheduleSimulation sim = SimulateSchedule(MakeSchedule(c));
        // Interleaving shrinks the bubble towards (p - 1) / (v m + p - 1) (F = 1, B = 2).
        EXPECT_LE(
            sim.bubble_fraction,
            SimulateSchedule(MakeSchedule(Config(p, m, ScheduleKind::k1F1B))).bubble_fraction +
                1e-12)
            << "p " << p << " m " << m << " v " << v;
        EXPECT_NEAR(sim.bubble_fraction, TheoreticalBubbleFraction(c), 0.06)
            << "p " << p << " m " << m << " v " << v;
      }
    }
  }
}

// Evaluation's schedule: every chunk's forwards chunk by chunk, no backward and no gradient
// message; the bubble is the textbook (p - 1) / (v m + p - 1) whenever m >= p (or v = 1), and no
// activation is held for a backward.
TEST(PipelineSchedule, ForwardOnlyValidatesAndMatchesTheTheory) {
  EXPECT_EQ(ScheduleKindFromName("forward"), ScheduleKind::kForwardOnly);
  for (int p = 1; p <= 5; ++p) {
    for (int m = 1; m <= 9; ++m) {
      for (int v = 1; v <= 3; ++v) {
        const ScheduleConfig c = Config(p, m, ScheduleKind::kForwardOnly, v);
        const Schedule s = MakeSchedule(c);  // validated inside
        const std::string what = fmt::format("p {} m {} v {}", p, m, v);
        for (int r = 0; r < p; ++r) {
          int forwards = 0;
          for (const PipelineOp& op : s.ops[static_cast<size_t>(r)]) {
            EXPECT_TRUE(op.kind == OpKind::kForward || op.kind == OpKind::kSendActivation ||
                        op.kind == OpKind::kRecvActivation)
                << what << " rank " << r << ": " << OpKindName(op.kind);
            forwards += op.kind == OpKind::kForward ? 1 : 0;
          }
          EXPECT_EQ(forwards, m * v) << what << " rank " << r;
        }
        const ScheduleSimulation sim = SimulateSchedule(s);
        for (int peak : sim.peak_in_flight) EXPECT_EQ(peak, 0) << what;
        if (v == 1 || m >= p) {
          EXPECT_DOUBLE_EQ(sim.makespan, static_cast<double>(v * m + p - 1)) << what;
          EXPECT_NEAR(sim.bubble_fraction, TheoreticalBubbleFraction(c), 1e-12) << what;
        } else {
          EXPECT_GE(sim.bubble_fraction, TheoreticalBubbleFraction(c) - 1e-12) << what;
        }
      }
    }
  }
  // A backward has no place in it; a training schedule still needs its backwards.
  Schedule s = MakeSchedule(Config(2, 2, ScheduleKind::kForwardOnly));
  s.ops[1].push_back({OpKind::kBackward, 0, 0, -1});
  EXPECT_NE(ErrorOf([&] { ValidateSchedule(s); }).find("forward-only"), std::string::npos);
  Schedule training = MakeSchedule(Config(2, 2, ScheduleKind::kForwardOnly));
  training.config.kind = ScheduleKind::kFthenB;
  EXPECT_NE(ErrorOf([&] { ValidateSchedule(training); }).find("misses part"), std::string::npos);
}

TEST(PipelineSchedule, ZeroBubbleKeepsOneFOneBsMemoryAndCutsTheBubble) {
  const ScheduleConfig c = Config(4, 8, ScheduleKind::kZeroBubbleH1);
  ScheduleCosts costs;  // F 1, Bi 1, W 1: B = Bi + W = 2 as for 1F1B
  const ScheduleSimulation zb = SimulateSchedule(MakeSchedule(c), costs);
  const ScheduleSimulation ofob = SimulateSchedule(MakeSchedule(Config(4, 8, ScheduleKind::k1F1B)));
  // Idle time per rank 4 units against 1F1B's 9 (the paper's ZB-H1: 3).
  EXPECT_LT(zb.bubble_fraction, 0.6 * ofob.bubble_fraction);
  EXPECT_GE(zb.bubble_fraction, TheoreticalBubbleFraction(c) - 1e-12);
  std::printf("bubble fraction p 4 m 8 (F 1, B 2 = Bi 1 + W 1): 1F1B %.3f, ZB-H1 %.3f\n",
              ofob.bubble_fraction, zb.bubble_fraction);
  // The peak over ranks is 1F1B's (p micro-batches on the first stage).
  const int zb_peak = *std::max_element(zb.peak_in_flight.begin(), zb.peak_in_flight.end());
  const int ofob_peak = *std::max_element(ofob.peak_in_flight.begin(), ofob.peak_in_flight.end());
  EXPECT_EQ(zb_peak, ofob_peak);
}

TEST(PipelineSchedule, BrokenSchedulesAreRejectedWithTheirPlace) {
  const Schedule good = MakeSchedule(Config(2, 3, ScheduleKind::k1F1B));
  {  // a dropped backward
    Schedule s = good;
    auto& ops = s.ops[1];
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == OpKind::kBackward) {
        ops.erase(ops.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    EXPECT_NE(ErrorOf([&] { ValidateSchedule(s); }).find("rank 1"), std::string::npos);
  }
  {  // a receive before its forward's input arrives, swapped after the forward
    Schedule s = good;
    auto& ops = s.ops[1];
    std::swap(ops[0], ops[1]);  // F before recv_act
    EXPECT_NE(ErrorOf([&] { ValidateSchedule(s); }).find("input activation"), std::string::npos);
  }
  {  // a deadlock: rank 0 waits for a gradient before sending the activation it depends on
    Schedule s;
    s.config = Config(2, 1, ScheduleKind::k1F1B);
    s.ops = {{{OpKind::kForward, 0, 0, -1},
              {OpKind::kRecvGradient, 0, 0, 1},
              {OpKind::kSendActivation, 0, 0, 1},
              {OpKind::kBackward, 0, 0, -1}},
             {{OpKind::kRecvActivation, 0, 0, 0},
              {OpKind::kForward, 0, 0, -1},
              {OpKind::kBackward, 0, 0, -1},
              {OpKind::kSendGradient, 0, 0, 0}}};
    EXPECT_NE(ErrorOf([&] { ValidateSchedule(s); }).find("deadlock"), std::string::npos);
  }
  {  // a send nobody receives
    Schedule s = good;
    s.ops[0].push_back({OpKind::kSendActivation, 0, 0, 1});
    EXPECT_NE(ErrorOf([&] { ValidateSchedule(s); }), "");
  }
  EXPECT_NE(ErrorOf([] { MakeSchedule(Config(0, 2, ScheduleKind::k1F1B)); }).find("stages"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { MakeSchedule(Config(2, 0, ScheduleKind::k1F1B)); }).find("microbatches"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { MakeSchedule(Config(2, 4, ScheduleKind::k1F1B, 2)); }).find("interleaved"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] {
              MakeSchedule(Config(4, 6, ScheduleKind::kInterleaved1F1B, 2));
            }).find("multiple"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { ScheduleKindFromName("gpipe"); }).find("fthenb"), std::string::npos);
}

// A toy model of S = p v virtual stages: stage s maps x -> x * (s + 2) + s (element-wise); the
// loss is the sum of the last stage's output. Run by the executor, its gradient of the input
// must be prod (s + 2) and every stage must see its micro-batch's values.
void RunToy(const ScheduleConfig& c) {
  const int p = c.stages, v = c.virtual_stages, m = c.microbatches, stages = p * v;
  const Schedule s = MakeSchedule(c);
  std::mutex mu;
  std::vector<double> final_out(static_cast<size_t>(m)), input_grad(static_cast<size_t>(m));
  comm::RunInProcess(p, [&](comm::Communicator& group) {
    const int r = group.rank();
    PipelineStageCallbacks cb;
    cb.input_shape = [](int, int) { return Shape{3}; };
    std::map<std::pair<int, int>, Tensor> grad_in_weight;
    cb.forward = [&](int mb, int chunk, const Tensor& input) {
      const int st = chunk * p + r;
      Tensor x = input.defined() ? input : Tensor::Full({3}, static_cast<float>(mb + 1));
      Tensor y = Tensor::Empty({3});
      for (int i = 0; i < 3; ++i) y.data<float>()[i] = x.data<float>()[i] * (st + 2) + st;
      if (st == stages - 1) {
        std::lock_guard<std::mutex> lock(mu);
        final_out[static_cast<size_t>(mb)] = y.data<float>()[0];
        return Tensor();
      }
      return y;
    };
    cb.backward = [&](int mb, int chunk, const Tensor& grad, bool) {
      const int st = chunk * p + r;
      Tensor g = grad.defined() ? grad : Tensor::Full({3}, 1.0f);
      Tensor dx = Tensor::Empty({3});
      for (int i = 0; i < 3; ++i) dx.data<float>()[i] = g.data<float>()[i] * (st + 2);
      if (st == 0) {
        std::lock_guard<std::mutex> lock(mu);
        input_grad[static_cast<size_t>(mb)] = dx.data<float>()[0];
        return Tensor();
      }
      return dx;
    };
    cb.backward_weight = [](int, int) {};
    const PipelineRunStats stats = RunSchedule(group, s, cb);
    EXPECT_GT(stats.peak_in_flight, 0);
  });
  for (int mb = 0; mb < m; ++mb) {
    double x = mb + 1, g = 1;
    for (int st = 0; st < stages; ++st) {
      x = x * (st + 2) + st;
      g *= st + 2;
    }
    EXPECT_DOUBLE_EQ(final_out[static_cast<size_t>(mb)], x) << "micro-batch " << mb;
    EXPECT_DOUBLE_EQ(input_grad[static_cast<size_t>(mb)], g) << "micro-batch " << mb;
  }
}

TEST(PipelineExecutor, EveryKindComputesTheOneRankResult) {
  RunToy(Config(2, 3, ScheduleKind::kFthenB));
  RunToy(Config(3, 5, ScheduleKind::k1F1B));
  RunToy(Config(3, 4, ScheduleKind::kZeroBubbleH1));
  RunToy(Config(2, 4, ScheduleKind::kInterleaved1F1B, 2));
  RunToy(Config(3, 3, ScheduleKind::kInterleaved1F1B, 3));
}

// The forward-only schedule through the executor: every micro-batch's last stage sees the toy
// model's value, and nothing is held for a backward.
TEST(PipelineExecutor, ForwardOnlyComputesTheOneRankForward) {
  for (const ScheduleConfig& c :
       {Config(1, 2, ScheduleKind::kForwardOnly), Config(3, 4, ScheduleKind::kForwardOnly),
        Config(2, 1, ScheduleKind::kForwardOnly, 3)}) {
    const int p = c.stages, v = c.virtual_stages, m = c.microbatches, stages = p * v;
    const Schedule s = MakeSchedule(c);
    std::mutex mu;
    std::vector<double> final_out(static_cast<size_t>(m), NAN);
    comm::RunInProcess(p, [&](comm::Communicator& group) {
      const int r = group.rank();
      PipelineStageCallbacks cb;
      cb.input_shape = [](int, int) { return Shape{3}; };
      cb.forward = [&](int mb, int chunk, const Tensor& input) {
        const int st = chunk * p + r;
        Tensor x = input.defined() ? input : Tensor::Full({3}, static_cast<float>(mb + 1));
        Tensor y = Tensor::Empty({3});
        for (int i = 0; i < 3; ++i) y.data<float>()[i] = x.data<float>()[i] * (st + 2) + st;
        if (st == stages - 1) {
          std::lock_guard<std::mutex> lock(mu);
          final_out[static_cast<size_t>(mb)] = y.data<float>()[0];
          return Tensor();
        }
        return y;
      };
      const PipelineRunStats stats = RunSchedule(group, s, cb);
      EXPECT_EQ(stats.peak_in_flight, 0);
    });
    for (int mb = 0; mb < m; ++mb) {
      double x = mb + 1;
      for (int st = 0; st < stages; ++st) x = x * (st + 2) + st;
      EXPECT_DOUBLE_EQ(final_out[static_cast<size_t>(mb)], x)
          << "p " << p << " v " << v << " micro-batch " << mb;
    }
  }
}

TEST(PipelineExecutor, RanksWithAnotherScheduleOrADeadStageFailWithinTheDeadline) {
  comm::InProcessOptions options;
  options.timeout = Milliseconds(2000);
  const auto t0 = std::chrono::steady_clock::now();
  std::mutex mu;
  std::vector<std::string> errors;
  comm::RunInProcess(
      2,
      [&](comm::Communicator& group) {
        const Schedule s = MakeSchedule(
            Config(2, group.rank() == 0 ? 2 : 3, ScheduleKind::k1F1B));  // rank 1 disagrees
        PipelineStageCallbacks cb;
        cb.input_shape = [](int, int) { return Shape{1}; };
        cb.forward = [](int, int, const Tensor&) { return Tensor::Zeros({1}); };
        cb.backward = [](int, int, const Tensor&, bool) { return Tensor::Zeros({1}); };
        std::string e = ErrorOf([&] { RunSchedule(group, s, cb); });
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e);
      },
      options);
  for (const std::string& e : errors) EXPECT_NE(e.find("another schedule"), std::string::npos) << e;
  // Stage 1 fails in its first forward: stage 0 waits for a gradient that never comes.
  errors.clear();
  comm::RunInProcess(
      2,
      [&](comm::Communicator& group) {
        const Schedule s = MakeSchedule(Config(2, 2, ScheduleKind::k1F1B));
        PipelineStageCallbacks cb;
        cb.input_shape = [](int, int) { return Shape{1}; };
        cb.forward = [&](int, int, const Tensor&) {
          if (group.rank() == 1) throw InvalidArgument("stage 1 failed");
          return Tensor::Zeros({1});
        };
        cb.backward = [](int, int, const Tensor&, bool) { return Tensor::Zeros({1}); };
        std::string e = ErrorOf([&] { RunSchedule(group, s, cb); });
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e);
      },
      options);
  ASSERT_EQ(errors.size(), 2u);
  bool timeout_or_peer = false;
  for (const std::string& e : errors) {
    timeout_or_peer |=
        e.find("recv") != std::string::npos || e.find("stage 1 failed") != std::string::npos;
  }
  EXPECT_TRUE(timeout_or_peer) << errors[0] << " | " << errors[1];
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(PointToPoint, OrderTagsCollectivesAndDeadlines) {
  comm::InProcessOptions options;
  options.timeout = Milliseconds(1500);
  comm::RunInProcess(
      2,
      [&](comm::Communicator& g) {
        const int peer = 1 - g.rank();
        // Several messages per tag keep their order; tags do not mix; zero-size and self sends.
        std::vector<float> out = {1, 2, 3, 4, 5, 6};
        std::vector<comm::Work> sends;
        for (int i = 0; i < 3; ++i) {
          sends.push_back(
              g.Send(&out[static_cast<size_t>(i)], 1, DType::kFloat32, peer, {.tag = 7}));
          sends.push_back(
              g.Send(&out[static_cast<size_t>(i + 3)], 1, DType::kFloat32, peer, {.tag = 9}));
        }
        sends.push_back(g.Send(nullptr, 0, DType::kFloat32, peer, {.tag = 3}));
        // A collective between the sends and the receives, in the other order on the two ranks'
        // sides of it, must not wait for the point-to-point messages.
        std::vector<float> sum = {1.0f};
        g.AllReduce(sum.data(), sum.data(), 1, DType::kFloat32).Wait();
        EXPECT_EQ(sum[0], 2.0f);
        float got = 0;
        for (int i = 0; i < 3; ++i) {
          g.Recv(&got, 1, DType::kFloat32, peer, {.tag = 9}).Wait();
          EXPECT_EQ(got, out[static_cast<size_t>(i + 3)]);
        }
        for (int i = 0; i < 3; ++i) {
          g.Recv(&got, 1, DType::kFloat32, peer, {.tag = 7}).Wait();
          EXPECT_EQ(got, out[static_cast<size_t>(i)]);
        }
        g.Recv(nullptr, 0, DType::kFloat32, peer, {.tag = 3}).Wait();
        float self = 0, mine = 42;
        comm::Work s = g.Send(&mine, 1, DType::kFloat32, g.rank(), {.tag = 1});
        g.Recv(&self, 1, DType::kFloat32, g.rank(), {.tag = 1}).Wait();
        s.Wait();
        EXPECT_EQ(self, 42.0f);
        for (comm::Work& w : sends) w.Wait();
        // A size mismatch and a message that never comes are errors naming the operation.
        if (g.rank() == 0) {
          float two[2] = {1, 2};
          const std::string e =
              ErrorOf([&] { g.Send(two, 2, DType::kFloat32, 1, {.tag = 5}).Wait(); });
          EXPECT_NE(e.find("does not fit"), std::string::npos) << e;
        } else {
          float one[1];
          const std::string e =
              ErrorOf([&] { g.Recv(one, 1, DType::kFloat32, 0, {.tag = 5}).Wait(); });
          EXPECT_NE(e.find("recv"), std::string::npos) << e;
        }
        const auto t0 = std::chrono::steady_clock::now();
        float never = 0;
        const std::string e = ErrorOf([&] {
          g.Recv(&never, 1, DType::kFloat32, peer, {.timeout = Milliseconds(200), .tag = 77})
              .Wait();
        });
        EXPECT_NE(e.find("tag 77"), std::string::npos) << e;
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
        EXPECT_NE(ErrorOf([&] { g.Send(&never, 1, DType::kFloat32, 5); }).find("peer 5"),
                  std::string::npos);
      },
      options);
}

}  // namespace
}  // namespace switchyard::parallel
