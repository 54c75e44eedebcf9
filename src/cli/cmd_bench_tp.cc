// `switchyard bench tp`: the dense tensor-parallel layers of train/tensor_parallel.h on one
// MLP-shaped block, P ranks as threads of this process over emulated links, in three modes:
//   tp          tensor parallelism: all-reduce after fc2 (forward) and after fc1 (backward)
//   sp          sequence parallelism: all-gather before fc1, reduce-scatter after fc2, and the
//               mirror in backward; the norm and the residual run on this rank's N/P tokens
//   overlap     sp with the all-gather / reduce-scatter as rings overlapped with per-block GEMMs
// The block: h -> LayerNorm -> fc1 [d -> h_mlp] column-parallel -> activation -> fc2 [h_mlp -> d]
// row-parallel -> + h (residual), forward + backward (and under sp the all-reduce of the norm's and
// fc2's bias gradients). Measured in the same run, interleaved per iteration and mode: the step,
// the same collectives alone (no GEMMs) and the same computation alone (no communication), so
// that the hidden fraction of the communication is (comm + compute - step) / comm (per iteration,
// then the median: the machine's speed drifts between iterations). Also the bytes
// each rank put on the wire (CommStats, Traffic::kTensor) against docs/tensor_parallel.md's closed
// form, and the activation bytes the norm/residual region and the tensor-parallel region keep for
// backward, read from the caches the layers filled.
//
//   switchyard bench tp                       # tp 2 and 4, every mode, default link
//   switchyard bench tp --tp 4 --modes overlap --intra-gbps 0.1 --json
//
// Each GEMM runs on one thread per rank (ranks beyond the cores time-share them).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/timing.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/tensor_parallel.h"

namespace switchyard::cli {
namespace {

using kernels::Trans;
using parallel::CommStats;
using parallel::Traffic;

enum class Mode : uint8_t { kTensor, kSequence, kOverlap };

Mode ModeFromName(const std::string& name) {
  if (name == "tp") return Mode::kTensor;
  if (name == "sp") return Mode::kSequence;
  if (name == "overlap") return Mode::kOverlap;
  throw InvalidArgument(
      fmt::format("bench tp: --modes: unknown mode '{}'; expected tp, sp or overlap", name));
}
const char* ModeName(Mode m) {
  return m == Mode::kTensor ? "tp" : m == Mode::kSequence ? "sp" : "overlap";
}
const char* ModeCollectives(Mode m) {
  return m == Mode::kTensor     ? "all-reduce"
         : m == Mode::kSequence ? "all-gather + reduce-scatter"
                                : "AG + RS as rings overlapped with the GEMMs";
}

struct BenchTpOptions {
  std::vector<int> tp = {2, 4};
  std::vector<std::string> modes = {"tp", "sp", "overlap"};
  int64_t tokens = 2048;
  int64_t model_dim = 512;
  int64_t hidden_dim = 2048;
  std::string activation = "gelu";
  BenchLoopFlags loop{.iters = 5, .warmup = 1};
  // Every message pays the link's latency and its bytes at its bandwidth (one port per sending
  // rank, messages serialized).
  UniformLinkFlags link;
};

// dst += src, elementwise (same number of elements).
void AddInto(const Tensor& dst, const Tensor& src) {
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

// Bytes one rank puts on the wire per step in the bus convention of parallel/comm_stats.h, from
// docs/tensor_parallel.md "Bytes per call": fc1 and fc2 move 4 (P-1)(N/P) d each way in every mode
// (tp: the all-reduces 8 (P-1)/P N d of fc2's forward and fc1's backward; sp and overlap: the
// all-gathers and reduce-scatters 4 (P-1)(N/P) d of both layers in both directions), and under
// sp the all-reduce 8 (P-1)/P x 3d of the norm's weight and bias and fc2's bias gradients.
double ClosedFormBytes(Mode mode, int64_t p, int64_t n, int64_t d) {
  const double activations = 16.0 * static_cast<double>((p - 1) * (n / p) * d);
  if (mode == Mode::kTensor) return activations;
  return activations + 2.0 * static_cast<double>(p - 1) / static_cast<double>(p) * 4.0 * 3.0 *
                           static_cast<double>(d);
}
std::string ClosedFormText(Mode mode) {
  return mode == Mode::kTensor ? "16 (P-1) (N/P) d" : "16 (P-1) (N/P) d + 8 (P-1)/P 3d";
}

// Activation bytes a rank keeps for backward, read from the caches of one forward.
struct RegionBytes {
  int64_t norm_residual = 0;    // the LayerNorm's cache (input, mean, rstd)
  int64_t tensor_parallel = 0;  // fc1's input, the activation's input, fc2's input
};

int64_t BytesOf(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

// One rank's block in one mode: the layers, this rank's input and output gradient in the mode's
// layout (all N tokens, or this rank's N/P), and the buffers the comm-only and compute-only runs
// use (their contents do not matter, their shapes do).
class MlpBlock {
 public:
  MlpBlock(comm::Communicator& group, const BenchTpOptions& o, Mode mode)
      : group_(group),
        mode_(mode),
        p_(group.size()),
        n_(o.tokens),
        d_(o.model_dim),
        li_(o.hidden_dim / group.size()),
        act_(kernels::ActivationFromName(o.activation)),
        norm_(params_, "ln.", o.model_dim, train::NormKind::kLayerNorm),
        fc1_(params_, "fc1.", o.model_dim, o.hidden_dim, /*bias=*/true, 0.02f, 1, group,
             Options(mode)),
        fc2_(params_, "fc2.", o.hidden_dim, o.model_dim, /*bias=*/true, 0.02f, 1, group,
             Options(mode)) {
    const Tensor x_full = RandomTensor({n_, d_}, 2);
    const Tensor dout_full = RandomTensor({n_, d_}, 3);
    const bool sharded = mode != Mode::kTensor;
    // A copy of the shard, so that the rank really holds only its tokens.
    x_ = sharded ? train::SequenceShard("bench tp input", x_full, group).Clone() : x_full;
    dout_ = sharded ? train::SequenceShard("bench tp dout", dout_full, group).Clone() : dout_full;
    x_full_ = x_full;
    dout_full_ = dout_full;
    sp_params_ = {&params_.Get("ln.weight"), &params_.Get("ln.bias"), &params_.Get("fc2.bias")};
    dw1_ = Tensor::Zeros({li_, d_});
    dw2_ = Tensor::Zeros({d_, li_});
    db1_ = Tensor::Zeros({li_});
    db2_ = Tensor::Zeros({d_});
    sp_grads_ = Tensor::Zeros({3 * d_});
    full_ = Tensor::Zeros({n_, d_});
    shard_ = Tensor::Zeros({n_ / p_, d_});
    full2_ = Tensor::Zeros({n_, d_});
  }

  // Forward + backward through the layers, the bytes counted in `stats`; the activation bytes
  // the forward kept in `*regions`.
  void Step(CommStats* stats, RegionBytes* regions) {
    train::NormCache nc;
    train::ColumnParallelCache c1;
    train::RowParallelCache c2;
    const Tensor u = norm_.Forward(x_, &nc);
    const Tensor a = fc1_.Forward(u, &c1, 1, stats);
    const Tensor g = Tensor::Empty(a.shape());
    kernels::ActivationForward(act_, a.data<float>(), g.data<float>(), a.numel());
    const Tensor out = fc2_.Forward(g, &c2, 1, stats);
    AddInto(out, x_);  // residual
    regions->norm_residual = BytesOf(nc.x) + BytesOf(nc.mean) + BytesOf(nc.rstd);
    regions->tensor_parallel = BytesOf(c1.x) + BytesOf(a) + BytesOf(c2.x);

    const Tensor dg = fc2_.Backward(c2, dout_, 1, stats);
    const Tensor da = Tensor::Empty(a.shape());
    kernels::ActivationBackward(act_, a.data<float>(), dg.data<float>(), da.data<float>(),
                                a.numel());
    const Tensor du = fc1_.Backward(c1, da, 1, stats);
    const Tensor dx = norm_.Backward(nc, du);
    AddInto(dx, dout_);  // residual
    if (mode_ != Mode::kTensor) train::AllReduceGrads(group_, sp_params_, stats);
  }

  // The step's collectives with nothing computed between them.
  void CommOnly() {
    if (mode_ == Mode::kTensor) {
      group_.AllReduce(full_).Wait();  // fc2 forward
      group_.AllReduce(full_).Wait();  // fc1 backward dx
      return;
    }
    if (mode_ == Mode::kSequence) {
      group_.AllGather(x_, full_).Wait();           // before fc1
      group_.ReduceScatter(full2_, shard_).Wait();  // after fc2
      group_.AllGather(dout_, full_).Wait();        // fc2 backward dy
      group_.ReduceScatter(full2_, shard_).Wait();  // fc1 backward dx
    } else {
      const train::BlockGemm nothing = [](int, const Tensor&) {};
      const train::BlockGemm zeros = [](int, const Tensor& out) { out.SetZero(); };
      train::RingAllGatherGemm(group_, x_, full_, nothing);
      train::RingGemmReduceScatter(group_, shard_, zeros);
      train::RingAllGatherGemm(group_, dout_, full_, nothing);
      train::RingGemmReduceScatter(group_, shard_, zeros);
    }
    group_.AllReduce(sp_grads_).Wait();  // the norm's and fc2's bias gradients
  }

  // The step's computation with no communication: the same norm, activation and residual, and the
  // same GEMMs as the layers' local work (shapes, transposes, one thread), split into P row
  // blocks in overlap mode as the rings split them. Where the step has a gathered tensor, a
  // buffer of that shape stands in for it. Returns the seconds of the GEMMs the rings run block
  // by block (fc1 and fc2 forward, and in backward their dx and weight gradients).
  double ComputeOnly() {
    const float* w1 = fc1_.local().weight().value.data<float>();
    const float* w2 = fc2_.local().weight().value.data<float>();
    train::NormCache nc;
    const Tensor u = norm_.Forward(x_, &nc);
    const Tensor in = mode_ == Mode::kTensor ? u : x_full_;  // fc1's [N, d] input
    const Tensor a = Tensor::Empty({n_, li_});
    FillRows(a, *fc1_.local().bias());
    double ring_gemms = BlockGemms(Trans::kYes, in, w1, d_, 1.0f, a);
    const Tensor g = Tensor::Empty(a.shape());
    kernels::ActivationForward(act_, a.data<float>(), g.data<float>(), a.numel());
    const Tensor partial = Tensor::Empty({n_, d_});
    ring_gemms += BlockGemms(Trans::kYes, g, w2, li_, 0.0f, partial);
    const Tensor out = partial.Slice(0, x_.size(0));  // stands in for the rows after the g op
    AddRows(out, *fc2_.bias());
    AddInto(out, x_);

    const Tensor dy = mode_ == Mode::kTensor ? dout_ : dout_full_;  // fc2's [N, d] output grad
    ColumnSums(dout_, db2_);                                        // fc2's bias gradient
    const Tensor dg = Tensor::Empty({n_, li_});
    ring_gemms += BlockGemms(Trans::kNo, dy, w2, li_, 0.0f, dg);
    // The weight gradients run inside the backward rings too (block by block there).
    auto t0 = std::chrono::steady_clock::now();
    kernels::Gemm(Trans::kYes, Trans::kNo, d_, li_, n_, 1.0f, dy.data<float>(), d_, g.data<float>(),
                  li_, 1.0f, dw2_.data<float>(), li_);
    ring_gemms += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Tensor da = Tensor::Empty(a.shape());
    kernels::ActivationBackward(act_, a.data<float>(), dg.data<float>(), da.data<float>(),
                                a.numel());
    const Tensor du = Tensor::Empty({n_, d_});
    ring_gemms += BlockGemms(Trans::kNo, da, w1, d_, 0.0f, du);
    t0 = std::chrono::steady_clock::now();
    kernels::Gemm(Trans::kYes, Trans::kNo, li_, d_, n_, 1.0f, da.data<float>(), li_,
                  in.data<float>(), d_, 1.0f, dw1_.data<float>(), d_);
    ring_gemms += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ColumnSums(da, db1_);  // fc1's bias gradient
    const Tensor dx = norm_.Backward(nc, du.Slice(0, x_.size(0)));
    AddInto(dx, dout_);
    return ring_gemms;
  }

 private:
  static train::TensorParallelOptions Options(Mode mode) {
    return {.sequence_parallel = mode != Mode::kTensor, .comm_overlap = mode == Mode::kOverlap};
  }
  static float* Row(const Tensor& t, int64_t row) { return t.data<float>() + row * t.size(1); }
  // c [N, cols] = a [N, k] . op(w) + beta c with w [cols, k] (kYes, ldw = k) or [k, cols] (kNo,
  // ldw = cols), as one GEMM or, in overlap mode, P GEMMs of N/P rows; returns the seconds.
  double BlockGemms(Trans trans_w, const Tensor& a, const float* w, int64_t ldw, float beta,
                    const Tensor& c) const {
    const int64_t blocks = mode_ == Mode::kOverlap ? p_ : 1, rows = n_ / blocks;
    const int64_t k = a.size(1), cols = c.size(1);
    const double t0 = NowSeconds();
    for (int64_t b = 0; b < blocks; ++b) {
      kernels::Gemm(Trans::kNo, trans_w, rows, cols, k, 1.0f, Row(a, b * rows), k, w, ldw, beta,
                    Row(c, b * rows), cols);
    }
    return NowSeconds() - t0;
  }
  static void FillRows(const Tensor& y, const train::Parameter& bias) {
    const float* b = bias.value.data<float>();
    for (int64_t i = 0; i < y.size(0); ++i) std::copy_n(b, y.size(1), Row(y, i));
  }
  static void AddRows(const Tensor& y, const train::Parameter& bias) {
    const float* b = bias.value.data<float>();
    for (int64_t i = 0; i < y.size(0); ++i) {
      float* r = Row(y, i);
      for (int64_t j = 0; j < y.size(1); ++j) r[j] += b[j];
    }
  }
  // sums [t.size(1)] += column sums of t.
  static void ColumnSums(const Tensor& t, const Tensor& sums) {
    float* s = sums.data<float>();
    for (int64_t i = 0; i < t.size(0); ++i) {
      const float* r = Row(t, i);
      for (int64_t j = 0; j < t.size(1); ++j) s[j] += r[j];
    }
  }

  comm::Communicator& group_;
  Mode mode_;
  int64_t p_, n_, d_, li_;
  kernels::Activation act_;
  train::ParameterSet params_;
  train::Norm norm_;
  train::ColumnParallelLinear fc1_;
  train::RowParallelLinear fc2_;
  std::vector<train::Parameter*> sp_params_;
  Tensor x_, dout_, x_full_, dout_full_;
  // Stand-ins: gradients of the compute-only run, buffers of the comm-only run.
  Tensor dw1_, dw2_, db1_, db2_, sp_grads_, full_, full2_, shard_;
};

int64_t ReduceInt(comm::Communicator& world, int64_t v, comm::ReduceOp op) {
  world.AllReduce(&v, &v, 1, DType::kInt64, {.reduce_op = op}).Wait();
  return v;
}

// What one mode measured at one tp (rank 0's view, maxima over ranks).
struct ModeResult {
  Mode mode = Mode::kTensor;
  std::vector<double> step, comm, compute, blocked, ran;
  // The GEMMs the rings split (fc1 and fc2 forward, their dx), within `compute`.
  std::vector<double> ring_gemms;
  int64_t bytes_max = 0, bytes_min = 0;  // per rank, the last step, rounded to whole bytes
  bool bytes_agree = false;              // every rank's exact count equals the closed form
  double closed_form = 0;
  RegionBytes regions;
};

std::vector<ModeResult> RunTp(const BenchTpOptions& o, int p, const std::vector<Mode>& modes) {
  std::unique_ptr<comm::Launcher> launcher = MakeUniformLinkLauncher(
      p, o.link, static_cast<uint64_t>(o.tokens * o.model_dim) * sizeof(float), "bench tp");
  std::vector<ModeResult> results(modes.size());
  launcher->Run([&](comm::Communicator& world) {
    std::vector<std::unique_ptr<MlpBlock>> blocks;
    for (Mode m : modes) blocks.push_back(std::make_unique<MlpBlock>(world, o, m));
    std::vector<ModeResult> mine(modes.size());
    const int rounds = o.loop.warmup + o.loop.iters;
    for (int it = 0; it < rounds; ++it) {
      const bool timed = it >= o.loop.warmup, last = it + 1 == rounds;
      for (size_t m = 0; m < modes.size(); ++m) {
        MlpBlock& block = *blocks[m];
        ModeResult& r = mine[m];
        CommStats stats;
        const double step = TimedOnAllRanks(world, [&] { block.Step(&stats, &r.regions); });
        const double comm = TimedOnAllRanks(world, [&] { block.CommOnly(); });
        double ring_gemms = 0;
        const double compute = TimedOnAllRanks(world, [&] { ring_gemms = block.ComputeOnly(); });
        ring_gemms = MaxOverRanks(world, ring_gemms);
        const double blocked = MaxOverRanks(world, stats.CommSeconds(Traffic::kTensor));
        const double ran = MaxOverRanks(world, stats.BusySeconds(Traffic::kTensor));
        if (timed) {
          r.step.push_back(step);
          r.comm.push_back(comm);
          r.compute.push_back(compute);
          r.blocked.push_back(blocked);
          r.ran.push_back(ran);
          r.ring_gemms.push_back(ring_gemms);
        }
        if (last) {
          const double bytes = stats.Bytes(Traffic::kTensor);
          r.mode = modes[m];
          r.closed_form = ClosedFormBytes(modes[m], p, o.tokens, o.model_dim);
          // Exact for P = 2 and 4; for other P the library's (P-1)/P is a rounded double.
          const bool agree = std::fabs(bytes - r.closed_form) <= 1e-12 * r.closed_form;
          const auto whole = static_cast<int64_t>(std::llround(bytes));
          r.bytes_max = ReduceInt(world, whole, comm::ReduceOp::kMax);
          r.bytes_min = ReduceInt(world, whole, comm::ReduceOp::kMin);
          r.bytes_agree = ReduceInt(world, agree ? 1 : 0, comm::ReduceOp::kMin) == 1;
        }
      }
    }
    if (world.rank() == 0) results = std::move(mine);
  });
  return results;
}

// An upper bound of the bytes this process holds for one tp, in float32: per rank and mode the
// inputs (4 [N, d]), the gathered and partial [N, d] tensors of the step and of the compute-only
// run (8), the [N, h/P] activations (8), parameters, gradients and stand-ins (6 d h / P).
uint64_t EstimateBytes(const BenchTpOptions& o, int p, size_t modes) {
  const double n = static_cast<double>(o.tokens), d = static_cast<double>(o.model_dim),
               h = static_cast<double>(o.hidden_dim) / p;
  const double floats = (12 * n * d + 8 * n * h + 6 * d * h) * p * static_cast<double>(modes);
  const double bytes = floats * 4;
  return bytes >= 0x1p62 ? uint64_t{1} << 62 : static_cast<uint64_t>(bytes);
}

// The sizes every tp must divide, and the memory of each, checked before anything runs.
void RequireTpSizes(const BenchTpOptions& o, size_t modes) {
  for (int p : o.tp) {
    SY_REQUIRE(o.tokens % p == 0, InvalidArgument,
               "bench tp: --tokens {} does not divide by --tp {}: sequence parallelism gives "
               "each rank N/P tokens; expected a multiple of {}",
               o.tokens, p, p);
    SY_REQUIRE(o.hidden_dim % p == 0, InvalidArgument,
               "bench tp: --hidden-dim {} does not divide by --tp {}: fc1's output columns and "
               "fc2's input columns are split over the ranks; expected a multiple of {}",
               o.hidden_dim, p, p);
    RequireMemory(EstimateBytes(o, p, modes),
                  fmt::format("bench tp: --tokens {} x --model-dim {} x --hidden-dim {} on --tp "
                              "{} rank(s), {} mode(s), estimated peak",
                              o.tokens, o.model_dim, o.hidden_dim, p, modes));
  }
}

void PrintTpPreamble(const BenchTpOptions& o, int cores) {
  fmt::print(
      "# switchyard bench tp: h -> LayerNorm -> fc1 [{} -> {}] column-parallel -> {} -> fc2 "
      "[{} -> {}] row-parallel -> + h, forward + backward, N {} tokens, float32\n",
      o.model_dim, o.hidden_dim, o.activation, o.hidden_dim, o.model_dim, o.tokens);
  fmt::print(
      "# ranks as threads (in-process), EMULATED links: {:g} us + {:g} GB/s per message; {} "
      "core(s), 1 GEMM thread per rank; median of {} iterations (each the max over ranks)\n",
      o.link.latency_us, o.link.gbps, cores, o.loop.iters);
  fmt::print(
      "# comm = the same collectives alone, compute = the same GEMMs, norm, activation alone, "
      "interleaved with the step; hidden = (comm + compute - step) / comm in [0, 1] and "
      "comm/cmp, each per iteration, then the median; blocked = time the step waited in "
      "collectives, ran = time they ran (hidden or not)\n");
  fmt::print(
      "# bound (overlap) = the most the rings can hide: (P-1)/P of the GEMMs they run block by "
      "block (fc1, fc2 forward; their dx and weight gradients in backward), over comm\n");
}

const TextTable& TpTable() {
  static const TextTable table("  ", {{"mode", 8, true},
                                      {"step ms", 8},
                                      {"comm ms", 8},
                                      {"compute ms", 10},
                                      {"comm/cmp", 8},
                                      {"hidden", 7},
                                      {"bound", 6},
                                      {"blocked", 7},
                                      {"ran", 7},
                                      {"MB/step", 9},
                                      {"closed form", 11},
                                      {"agree", 6},
                                      {"norm KiB", 9},
                                      {"tp-reg KiB", 9}});
  return table;
}

// One mode's figures at one tp: medians over the iterations, and the fractions computed per
// iteration (its step, comm and compute were measured back to back, so a drift of the machine's
// speed between iterations cancels), then their median. With one rank nothing is communicated:
// no fraction of it, no ratio.
struct ModeFigures {
  double step = 0, comm = 0, compute = 0, blocked = 0, ran = 0;
  std::optional<double> hidden, ratio, bound, overlappable, saving;
};
ModeFigures FiguresOf(const ModeResult& r, int p, const ModeResult* tp_mode) {
  ModeFigures f;
  f.step = Median(r.step);
  f.comm = Median(r.comm);
  f.compute = Median(r.compute);
  f.blocked = Median(r.blocked);
  f.ran = Median(r.ran);
  const bool communicates = r.closed_form > 0;
  const bool rings = r.mode == Mode::kOverlap && communicates;
  std::vector<double> hiddens, ratios, bounds, overlappables;
  for (size_t i = 0; communicates && i < r.step.size(); ++i) {
    if (const auto h = Quotient(r.comm[i] + r.compute[i] - r.step[i], r.comm[i])) {
      hiddens.push_back(std::clamp(*h, 0.0, 1.0));
    }
    if (const auto q = Quotient(r.comm[i], r.compute[i])) ratios.push_back(*q);
    // What the rings can hide at most: P - 1 hops, each overlapping one block's GEMM, so
    // (P - 1) / P of the split GEMMs; the rest of the computation runs with no hop in flight.
    if (!rings) continue;
    overlappables.push_back(r.ring_gemms[i] * (p - 1) / p);
    if (const auto b = Quotient(overlappables.back(), r.comm[i])) {
      bounds.push_back(std::min(*b, 1.0));
    }
  }
  f.hidden = MedianIfAny(hiddens);
  f.ratio = MedianIfAny(ratios);
  f.bound = MedianIfAny(bounds);
  f.overlappable = MedianIfAny(overlappables);
  if (tp_mode != nullptr) {
    f.saving = Quotient(static_cast<double>(tp_mode->regions.norm_residual),
                        static_cast<double>(r.regions.norm_residual));
  }
  return f;
}

void PrintModeJson(const BenchTpOptions& o, int p, int cores, const ModeResult& r,
                   const ModeFigures& f) {
  PrintJsonLine(
      {{"op", "tp"},
       {"tp", p},
       {"mode", ModeName(r.mode)},
       {"collectives", ModeCollectives(r.mode)},
       {"tokens", o.tokens},
       {"model_dim", o.model_dim},
       {"hidden_dim", o.hidden_dim},
       {"activation", o.activation},
       {"iters", o.loop.iters},
       {"cores", cores},
       {"gemm_threads_per_rank", 1},
       {"oversubscribed", p > cores},
       {"emulation", o.link.Json()},
       {"step_median_ms", f.step * 1e3},
       {"step_min_ms", SummarizeTimes(r.step).min_s * 1e3},
       {"comm_alone_ms", f.comm * 1e3},
       {"compute_alone_ms", f.compute * 1e3},
       {"comm_over_compute", JsonOf(f.ratio)},
       {"hidden_fraction", JsonOf(f.hidden)},
       {"overlappable_compute_ms", JsonOf(f.overlappable ? *f.overlappable * 1e3 : f.overlappable)},
       {"hidden_fraction_bound", JsonOf(f.bound)},
       {"blocked_ms", f.blocked * 1e3},
       {"collectives_ran_ms", f.ran * 1e3},
       {"bytes_per_rank_step", r.bytes_max},
       {"bytes_per_rank_step_min", r.bytes_min},
       {"closed_form_bytes", r.closed_form},
       {"closed_form", ClosedFormText(r.mode)},
       {"bytes_agree", r.bytes_agree},
       {"norm_region_activation_bytes", r.regions.norm_residual},
       {"tp_region_activation_bytes", r.regions.tensor_parallel},
       {"norm_region_saving", JsonOf(f.saving)}});
}

void PrintModeRow(const ModeResult& r, const ModeFigures& f) {
  TpTable().PrintRow(
      {ModeName(r.mode), fmt::format("{:.1f}", f.step * 1e3), fmt::format("{:.1f}", f.comm * 1e3),
       fmt::format("{:.1f}", f.compute * 1e3), Fixed2(f.ratio), Percent(f.hidden), Percent(f.bound),
       fmt::format("{:.1f}", f.blocked * 1e3), fmt::format("{:.1f}", f.ran * 1e3),
       fmt::format("{:.3f}", static_cast<double>(r.bytes_max) / 1e6),
       fmt::format("{:.3f}", r.closed_form / 1e6),
       r.bytes_agree && r.bytes_max == r.bytes_min ? "yes" : "NO",
       fmt::format("{:.1f}", static_cast<double>(r.regions.norm_residual) / 1024),
       fmt::format("{:.1f}", static_cast<double>(r.regions.tensor_parallel) / 1024)});
}

// Under sp and overlap, the norm/residual region's activation memory against tp's.
void PrintNormRegionSavings(const std::vector<ModeResult>& results, const ModeResult* tp_mode,
                            int p) {
  for (const ModeResult& r : results) {
    if (r.mode == Mode::kTensor || tp_mode == nullptr) continue;
    fmt::print(
        "  {}: the norm/residual region keeps {:.1f} KiB per rank for backward against {:.1f} "
        "KiB without sequence parallelism: 1/{} (tp {})\n",
        ModeName(r.mode), static_cast<double>(r.regions.norm_residual) / 1024,
        static_cast<double>(tp_mode->regions.norm_residual) / 1024,
        Fixed2(Quotient(static_cast<double>(tp_mode->regions.norm_residual),
                        static_cast<double>(r.regions.norm_residual))),
        p);
  }
}

int RunBenchTp(const BenchTpOptions& o) {
  std::vector<Mode> modes;
  for (const std::string& name : o.modes) {
    const Mode m = ModeFromName(name);
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  }
  RequireTpSizes(o, modes.size());
  const int cores = PrepareOneThreadPerRank();
  if (!o.loop.json) PrintTpPreamble(o, cores);
  for (int p : o.tp) {
    const std::vector<ModeResult> results = RunTp(o, p, modes);
    const ModeResult* tp_mode = nullptr;
    for (const ModeResult& r : results) {
      if (r.mode == Mode::kTensor) tp_mode = &r;
    }
    if (!o.loop.json) {
      fmt::print("\ntp {}{}\n", p,
                 OversubscribedNote(
                     p, cores,
                     fmt::format("the ranks' computation time-shares the cores, so compute and "
                                 "step are ~{:.0f}x one rank's",
                                 static_cast<double>(p) / cores)));
      TpTable().PrintHeader();
    }
    for (const ModeResult& r : results) {
      const ModeFigures f = FiguresOf(r, p, tp_mode);
      if (o.loop.json) {
        PrintModeJson(o, p, cores, r, f);
      } else {
        PrintModeRow(r, f);
      }
    }
    if (!o.loop.json) PrintNormRegionSavings(results, tp_mode, p);
  }
  if (!o.loop.json) {
    fmt::print(
        "\nbytes: per rank per step (CommStats, Traffic::kTensor), closed form with P = tp, N "
        "tokens, d model dim: tp {}, sp/overlap {} (docs/tensor_parallel.md)\n",
        ClosedFormText(Mode::kTensor), ClosedFormText(Mode::kSequence));
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "tp",
    "Dense tensor parallelism on an MLP block: tp (all-reduce), sp (AG + RS) and sp with "
    "comm-GEMM overlap; step, comm and compute time, hidden fraction, bytes, activation memory",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchTpOptions>();
      AddIntListOption(app, "--tp", &o->tp, 1, 256,
                       "tensor-parallel sizes to run, comma-separated (ranks as threads)");
      app.add_option("--modes", o->modes, "comma-separated: tp, sp, overlap")
          ->delimiter(',')
          ->check(CLI::IsMember({"tp", "sp", "overlap"}));
      AddIntOption(app, "--tokens", &o->tokens, int64_t{1}, int64_t{1} << 40,
                   "N, tokens of the sequence (divisible by every tp)");
      AddIntOption(app, "--model-dim", &o->model_dim, int64_t{1}, int64_t{1} << 40, "d");
      AddIntOption(app, "--hidden-dim", &o->hidden_dim, int64_t{1}, int64_t{1} << 40,
                   "the MLP's hidden size (divisible by every tp)");
      app.add_option("--activation", o->activation, "relu, gelu or silu")
          ->check(CLI::IsMember({"relu", "gelu", "silu"}));
      AddBenchLoopFlags(app, &o->loop, {.json_help = "one JSON line per tp and mode"});
      AddUniformLinkFlags(app, &o->link, "the tp ranks");
      return [o] { return RunBenchTp(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
