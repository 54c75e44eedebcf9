// Pipeline schedules as data (parallel/pipeline.h): the generators of the five kinds, the
// validator and the simulator.
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/parallel/pipeline.h"

namespace switchyard::parallel {

std::string_view ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kFthenB: return "fthenb";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved1F1B: return "interleaved";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
    case ScheduleKind::kForwardOnly: return "forward";
  }
  return "?";
}

ScheduleKind ScheduleKindFromName(std::string_view name) {
  for (ScheduleKind k : {ScheduleKind::kFthenB, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                         ScheduleKind::kZeroBubbleH1, ScheduleKind::kForwardOnly}) {
    if (name == ScheduleKindName(k)) return k;
  }
  throw InvalidArgument(fmt::format(
      "pipeline schedule \"{}\": expected fthenb, 1f1b, interleaved, zb-h1 or forward", name));
}

std::string_view OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kForward: return "F";
    case OpKind::kBackward: return "B";
    case OpKind::kBackwardInput: return "Bi";
    case OpKind::kBackwardWeight: return "W";
    case OpKind::kSendActivation: return "send_act";
    case OpKind::kRecvActivation: return "recv_act";
    case OpKind::kSendGradient: return "send_grad";
    case OpKind::kRecvGradient: return "recv_grad";
  }
  return "?";
}

void ValidateScheduleConfig(const ScheduleConfig& c) {
  SY_REQUIRE(c.stages >= 1, InvalidArgument, "pipeline schedule: stages must be >= 1, got {}",
             c.stages);
  SY_REQUIRE(c.microbatches >= 1, InvalidArgument,
             "pipeline schedule: microbatches must be >= 1, got {}", c.microbatches);
  SY_REQUIRE(c.virtual_stages >= 1, InvalidArgument,
             "pipeline schedule: virtual stages must be >= 1, got {}", c.virtual_stages);
  SY_REQUIRE(c.virtual_stages == 1 || c.kind == ScheduleKind::kInterleaved1F1B ||
                 c.kind == ScheduleKind::kForwardOnly,
             InvalidArgument,
             "pipeline schedule {}: {} virtual stages need the interleaved schedule",
             ScheduleKindName(c.kind), c.virtual_stages);
  SY_REQUIRE(c.kind != ScheduleKind::kInterleaved1F1B || c.microbatches % c.stages == 0,
             InvalidArgument,
             "pipeline schedule interleaved: microbatches {} must be a multiple of the stages {}",
             c.microbatches, c.stages);
}

namespace {

// Builds one rank's list with the sends and receives around each compute op.
class RankBuilder {
 public:
  RankBuilder(const ScheduleConfig& c, int rank) : c_(c), r_(rank) {}

  int Stage(int chunk) const { return chunk * c_.stages + r_; }
  int Last() const { return c_.stages * c_.virtual_stages - 1; }
  int Next() const { return (r_ + 1) % c_.stages; }
  int Prev() const { return (r_ + c_.stages - 1) % c_.stages; }

  void Forward(int mb, int chunk) {
    const int s = Stage(chunk);
    if (s > 0) ops_.push_back({OpKind::kRecvActivation, mb, chunk, Prev()});
    ops_.push_back({OpKind::kForward, mb, chunk, -1});
    if (s < Last()) ops_.push_back({OpKind::kSendActivation, mb, chunk, Next()});
  }
  // B, or Bi when `input_only`.
  void Backward(int mb, int chunk, bool input_only = false) {
    const int s = Stage(chunk);
    if (s < Last()) ops_.push_back({OpKind::kRecvGradient, mb, chunk, Next()});
    ops_.push_back({input_only ? OpKind::kBackwardInput : OpKind::kBackward, mb, chunk, -1});
    if (s > 0) ops_.push_back({OpKind::kSendGradient, mb, chunk, Prev()});
  }
  void Weight(int mb, int chunk) { ops_.push_back({OpKind::kBackwardWeight, mb, chunk, -1}); }

  std::vector<PipelineOp> Take() { return std::move(ops_); }

 private:
  ScheduleConfig c_;
  int r_;
  std::vector<PipelineOp> ops_;
};

std::vector<PipelineOp> FthenB(const ScheduleConfig& c, int r) {
  RankBuilder b(c, r);
  for (int mb = 0; mb < c.microbatches; ++mb) b.Forward(mb, 0);
  for (int mb = 0; mb < c.microbatches; ++mb) b.Backward(mb, 0);
  return b.Take();
}

std::vector<PipelineOp> OneFOneB(const ScheduleConfig& c, int r, bool zero_bubble) {
  RankBuilder b(c, r);
  const int m = c.microbatches;
  const int warmup = std::min(c.stages - r - 1, m);
  for (int mb = 0; mb < warmup; ++mb) b.Forward(mb, 0);
  // ZB-H1: rank r may keep up to r W's pending (1F1B's rank r holds p - r micro-batches, so the
  // peak over ranks stays 1F1B's p): the later stages run their Bi at once and send the gradient
  // upstream sooner (Bi is shorter than B), and in the cool-down each pending W fills the time a
  // stage waits for its next gradient.
  const int delay = r;
  std::deque<int> pending;
  int next_b = 0;
  for (int mb = warmup; mb < m; ++mb) {
    b.Forward(mb, 0);
    b.Backward(next_b, 0, zero_bubble);
    if (zero_bubble) {
      pending.push_back(next_b);
      if (static_cast<int>(pending.size()) > delay) {
        b.Weight(pending.front(), 0);
        pending.pop_front();
      }
    }
    ++next_b;
  }
  for (; next_b < m; ++next_b) {
    if (zero_bubble && !pending.empty()) {
      b.Weight(pending.front(), 0);
      pending.pop_front();
    }
    b.Backward(next_b, 0, zero_bubble);
    if (zero_bubble) pending.push_back(next_b);
  }
  while (!pending.empty()) {
    b.Weight(pending.front(), 0);
    pending.pop_front();
  }
  return b.Take();
}

// Forward only: chunk by chunk, every micro-batch's forward (a rank's chunk c + 1 of micro-batch 0
// waits for the other ranks' chunk c of it only when m < p).
std::vector<PipelineOp> ForwardOnly(const ScheduleConfig& c, int r) {
  RankBuilder b(c, r);
  for (int chunk = 0; chunk < c.virtual_stages; ++chunk) {
    for (int mb = 0; mb < c.microbatches; ++mb) b.Forward(mb, chunk);
  }
  return b.Take();
}

// Megatron-LM's interleaved 1F1B: forward k of this rank is chunk (k / p) % v of micro-batch
// (k / (p v)) p + k % p; backwards run the chunks in reverse.
std::vector<PipelineOp> Interleaved(const ScheduleConfig& c, int r) {
  RankBuilder b(c, r);
  const int p = c.stages, v = c.virtual_stages, total = c.microbatches * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto f_chunk = [&](int k) { return (k / p) % v; };
  auto b_chunk = [&](int k) { return v - 1 - (k / p) % v; };
  const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
  for (int k = 0; k < warmup; ++k) b.Forward(mb_of(k), f_chunk(k));
  int next_b = 0;
  for (int k = warmup; k < total; ++k) {
    b.Forward(mb_of(k), f_chunk(k));
    b.Backward(mb_of(next_b), b_chunk(next_b));
    ++next_b;
  }
  for (; next_b < total; ++next_b) b.Backward(mb_of(next_b), b_chunk(next_b));
  return b.Take();
}

}  // namespace

uint64_t ScheduleMemoryBytes(const ScheduleConfig& c) {
  const long double passes = static_cast<long double>(std::max(c.stages, 0)) *
                             static_cast<long double>(std::max(c.microbatches, 0)) *
                             static_cast<long double>(std::max(c.virtual_stages, 0));
  const long double bytes = passes * kScheduleBytesPerPass;
  constexpr auto kMax = std::numeric_limits<uint64_t>::max();
  return bytes >= static_cast<long double>(kMax) ? kMax : static_cast<uint64_t>(bytes);
}

Schedule MakeSchedule(const ScheduleConfig& config) {
  ValidateScheduleConfig(config);
  RequireMemory(ScheduleMemoryBytes(config),
                fmt::format("the pipeline schedule {} (p {} x m {} x v {} passes, about {} bytes "
                            "each)",
                            ScheduleKindName(config.kind), config.stages, config.microbatches,
                            config.virtual_stages, kScheduleBytesPerPass));
  Schedule s;
  s.config = config;
  for (int r = 0; r < config.stages; ++r) {
    switch (config.kind) {
      case ScheduleKind::kFthenB: s.ops.push_back(FthenB(config, r)); break;
      case ScheduleKind::k1F1B: s.ops.push_back(OneFOneB(config, r, false)); break;
      case ScheduleKind::kZeroBubbleH1: s.ops.push_back(OneFOneB(config, r, true)); break;
      case ScheduleKind::kInterleaved1F1B: s.ops.push_back(Interleaved(config, r)); break;
      case ScheduleKind::kForwardOnly: s.ops.push_back(ForwardOnly(config, r)); break;
    }
  }
  ValidateSchedule(s);
  return s;
}

namespace {

bool IsSend(OpKind k) { return k == OpKind::kSendActivation || k == OpKind::kSendGradient; }
bool IsRecv(OpKind k) { return k == OpKind::kRecvActivation || k == OpKind::kRecvGradient; }

double Cost(const ScheduleCosts& c, OpKind k) {
  switch (k) {
    case OpKind::kForward: return c.forward;
    case OpKind::kBackward: return c.backward;
    case OpKind::kBackwardInput: return c.backward_input;
    case OpKind::kBackwardWeight: return c.backward_weight;
    default: return 0;
  }
}

// The matching send of a receive: (sender, kind of send, microbatch, sender's chunk).
using MessageKey = std::tuple<int, int, int, int, int>;  // from, to, send kind, mb, from chunk

struct Located {
  int rank;
  size_t index;
};

std::string At(int rank, size_t index, const PipelineOp& op) {
  return fmt::format("rank {} op {} ({} of micro-batch {}, chunk {})", rank, index,
                     OpKindName(op.kind), op.microbatch, op.chunk);
}

// Runs the schedule in simulated time; `issue` gets the compute ops in order. Throws
// InvalidArgument naming a stuck receive when no rank can go on.
ScheduleSimulation Simulate(const Schedule& s, const ScheduleCosts& costs) {
  const ScheduleConfig& c = s.config;
  const int p = c.stages;
  ScheduleSimulation sim;
  sim.timeline.resize(static_cast<size_t>(p));
  sim.peak_in_flight.assign(static_cast<size_t>(p), 0);
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  std::vector<double> now(static_cast<size_t>(p), 0.0);
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  // Sends issued, by message: the times their messages arrive (FIFO per key).
  std::map<MessageKey, std::deque<double>> sent;
  auto stage = [&](int r, int chunk) { return chunk * p + r; };
  auto rank_of = [&](int st) { return st % p; };
  auto chunk_of = [&](int st) { return st / p; };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& ops = s.ops[static_cast<size_t>(r)];
      size_t& i = pc[static_cast<size_t>(r)];
      while (i < ops.size()) {
        const PipelineOp& op = ops[i];
        double& t = now[static_cast<size_t>(r)];
        if (IsSend(op.kind)) {
          const int st = stage(r, op.chunk);
          const int to_stage = op.kind == OpKind::kSendActivation ? st + 1 : st - 1;
          sent[{r, rank_of(to_stage), static_cast<int>(op.kind), op.microbatch, op.chunk}]
              .push_back(t + costs.send);
        } else if (IsRecv(op.kind)) {
          const int st = stage(r, op.chunk);
          const bool act = op.kind == OpKind::kRecvActivation;
          const int from_stage = act ? st - 1 : st + 1;
          const MessageKey key{
              rank_of(from_stage), r,
              static_cast<int>(act ? OpKind::kSendActivation : OpKind::kSendGradient),
              op.microbatch, chunk_of(from_stage)};
          auto it = sent.find(key);
          if (it == sent.end() || it->second.empty()) break;  // wait for the sender
          t = std::max(t, it->second.front());
          it->second.pop_front();
        } else {
          const double d = Cost(costs, op.kind);
          sim.timeline[static_cast<size_t>(r)].push_back({op, t, t + d});
          t += d;
          int& f = in_flight[static_cast<size_t>(r)];
          if (op.kind == OpKind::kForward && c.kind != ScheduleKind::kForwardOnly) ++f;
          if (op.kind == OpKind::kBackward || op.kind == OpKind::kBackwardWeight) --f;
          sim.peak_in_flight[static_cast<size_t>(r)] =
              std::max(sim.peak_in_flight[static_cast<size_t>(r)], f);
        }
        ++i;
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    const auto& ops = s.ops[static_cast<size_t>(r)];
    const size_t i = pc[static_cast<size_t>(r)];
    SY_REQUIRE(i == ops.size(), InvalidArgument,
               "pipeline schedule deadlocks: {} waits for a message no rank sends before it",
               At(r, i, ops[i]));
  }
  double busy = 0;
  for (int r = 0; r < p; ++r) {
    sim.makespan = std::max(sim.makespan, now[static_cast<size_t>(r)]);
    for (const TimedOp& t : sim.timeline[static_cast<size_t>(r)]) busy += t.end - t.start;
  }
  sim.bubble_fraction = sim.makespan > 0 ? 1.0 - busy / (p * sim.makespan) : 0.0;
  return sim;
}

}  // namespace

void ValidateSchedule(const Schedule& s) {
  const ScheduleConfig& c = s.config;
  ValidateScheduleConfig(c);
  const int p = c.stages, v = c.virtual_stages, m = c.microbatches, last = p * v - 1;
  const bool backward = c.kind != ScheduleKind::kForwardOnly;
  SY_REQUIRE(static_cast<int>(s.ops.size()) == p, InvalidArgument,
             "pipeline schedule: {} ranks' lists for {} stages", s.ops.size(), p);
  // Per rank, in order: each op finds what it needs.
  std::map<MessageKey, std::deque<Located>> sends, recvs;
  for (int r = 0; r < p; ++r) {
    const auto& ops = s.ops[static_cast<size_t>(r)];
    std::set<std::pair<int, int>> forwarded, backwarded, input_only, weighted, have_act, have_grad,
        sent_act, sent_grad;
    for (size_t i = 0; i < ops.size(); ++i) {
      const PipelineOp& op = ops[i];
      SY_REQUIRE(op.microbatch >= 0 && op.microbatch < m && op.chunk >= 0 && op.chunk < v,
                 InvalidArgument, "pipeline schedule: {} is out of range (m {}, v {})",
                 At(r, i, op), m, v);
      const std::pair<int, int> key{op.microbatch, op.chunk};
      const int st = op.chunk * p + r;
      auto need = [&](bool ok, const char* what) {
        SY_REQUIRE(ok, InvalidArgument, "pipeline schedule: {}: {}", At(r, i, op), what);
      };
      need(backward || op.kind == OpKind::kForward || op.kind == OpKind::kSendActivation ||
               op.kind == OpKind::kRecvActivation,
           "a backward op in a forward-only schedule");
      switch (op.kind) {
        case OpKind::kForward:
          need(forwarded.insert(key).second, "a second forward");
          need(st == 0 || have_act.count(key), "its input activation was not received before");
          break;
        case OpKind::kBackward:
        case OpKind::kBackwardInput:
          need(forwarded.count(key), "backward before its forward");
          need(backwarded.insert(key).second, "a second backward");
          need(st == last || have_grad.count(key), "its gradient was not received before");
          if (op.kind == OpKind::kBackwardInput) input_only.insert(key);
          break;
        case OpKind::kBackwardWeight:
          need(input_only.count(key), "W without a Bi before it");
          need(weighted.insert(key).second, "a second W");
          break;
        case OpKind::kSendActivation:
          need(forwarded.count(key), "sends an activation its forward has not made");
          need(st < last, "the last virtual stage has no successor");
          need(op.peer == (r + 1) % p, "wrong peer (the next virtual stage's rank)");
          need(sent_act.insert(key).second, "a second send");
          break;
        case OpKind::kSendGradient:
          need(backwarded.count(key), "sends a gradient its backward has not made");
          need(st > 0, "the first virtual stage has no predecessor");
          need(op.peer == (r + p - 1) % p, "wrong peer (the previous virtual stage's rank)");
          need(sent_grad.insert(key).second, "a second send");
          break;
        case OpKind::kRecvActivation:
          need(st > 0, "the first virtual stage receives no activation");
          need(op.peer == (r + p - 1) % p, "wrong peer");
          need(have_act.insert(key).second, "a second receive");
          break;
        case OpKind::kRecvGradient:
          need(st < last, "the last virtual stage receives no gradient");
          need(op.peer == (r + 1) % p, "wrong peer");
          need(have_grad.insert(key).second, "a second receive");
          break;
      }
      if (IsSend(op.kind)) {
        sends[{r, op.peer, static_cast<int>(op.kind), op.microbatch, op.chunk}].push_back({r, i});
      }
      if (IsRecv(op.kind)) {
        const bool act = op.kind == OpKind::kRecvActivation;
        const int from_stage = act ? st - 1 : st + 1;
        recvs[{op.peer, r, static_cast<int>(act ? OpKind::kSendActivation : OpKind::kSendGradient),
               op.microbatch, from_stage / p}]
            .push_back({r, i});
      }
    }
    // Completeness: every (micro-batch, chunk) of this rank forward and backward (W after Bi;
    // forward-only: no backward), its activation and gradient sent on.
    for (int mb = 0; mb < m; ++mb) {
      for (int ch = 0; ch < v; ++ch) {
        const std::pair<int, int> key{mb, ch};
        const int st = ch * p + r;
        SY_REQUIRE(forwarded.count(key) && (!backward || backwarded.count(key)) &&
                       (!input_only.count(key) || weighted.count(key)) &&
                       (st == last || sent_act.count(key)) &&
                       (!backward || st == 0 || sent_grad.count(key)),
                   InvalidArgument,
                   "pipeline schedule: rank {} misses part of micro-batch {}, chunk {} (forward, "
                   "backward, W after Bi, or a send)",
                   r, mb, ch);
      }
    }
  }
  for (const auto& [key, list] : recvs) {
    auto it = sends.find(key);
    SY_REQUIRE(it != sends.end() && it->second.size() == list.size(), InvalidArgument,
               "pipeline schedule: {} has no matching send on rank {}",
               At(list.front().rank, list.front().index,
                  s.ops[static_cast<size_t>(list.front().rank)][list.front().index]),
               std::get<0>(key));
  }
  for (const auto& [key, list] : sends) {
    SY_REQUIRE(recvs.count(key), InvalidArgument,
               "pipeline schedule: {} has no matching receive on rank {}",
               At(list.front().rank, list.front().index,
                  s.ops[static_cast<size_t>(list.front().rank)][list.front().index]),
               std::get<1>(key));
  }
  Simulate(s, ScheduleCosts{});  // deadlock-freedom: every rank reaches its end
}

ScheduleSimulation SimulateSchedule(const Schedule& schedule, const ScheduleCosts& costs) {
  return Simulate(schedule, costs);
}

double TheoreticalBubbleFraction(const ScheduleConfig& c) {
  const double p = c.stages, m = c.microbatches, v = c.virtual_stages;
  switch (c.kind) {
    case ScheduleKind::kFthenB:
    case ScheduleKind::k1F1B: return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved1F1B: return (p - 1) / (v * m + p - 1);
    // Bubble time (p - 1)(F + Bi - W) = (p - 1) units with F = Bi = W = 1, over 3m + p - 1.
    case ScheduleKind::kZeroBubbleH1: return (p - 1) / (3 * m + p - 1);
    case ScheduleKind::kForwardOnly: return (p - 1) / (v * m + p - 1);
  }
  return 0;
}

}  // namespace switchyard::parallel
