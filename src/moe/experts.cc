#include "switchyard/moe/experts.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "moe/activation.h"
#include "moe/parallel_for.h"
#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/grouped_gemm.h"

namespace switchyard::moe {
namespace {

using kernels::GemmProblem;
using kernels::Trans;

// Rows of one pipeline task: fc1 -> activation -> fc2 (forward) and fc2' -> activation' -> fc1'
// (backward) run on one chunk of a group's rows at a time, so the [rows, H] intermediates are read
// back while they are still in cache instead of in separate passes over the whole [*, H] tensors.
// A group is split into ceil(rows / kMaxChunkRows) chunks of equal size: many small experts get
// one chunk each (their [rows, H] block stays in L2), large groups keep GEMMs of >= 512 rows
// (measured on config A: 256-row chunks cost ~3 % in GEMM rate, more than the traffic they save,
// docs/PERFORMANCE.md). The chunks depend only on the groups (not on the thread count), so
// reductions over chunks give the same bits for any thread count.
constexpr int64_t kMaxChunkRows = 1024;

// The [*, H] intermediates hold only the groups' rows, back to back (compact), so capacity
// padding costs no memory there: group g starts at compact row CompactBegin(groups)[g].
std::vector<int64_t> CompactBegin(const ExpertGroups& groups) {
  std::vector<int64_t> begin(groups.rows.size());
  int64_t next = 0;
  for (size_t g = 0; g < groups.rows.size(); ++g) {
    begin[g] = next;
    next += groups.rows[g];
  }
  return begin;
}

// A contiguous range of rows inside one group.
struct RowChunk {
  int64_t group;
  int64_t begin;    // row of the [rows, M] buffers
  int64_t compact;  // row of the compact [*, H] intermediates
  int64_t rows;
};

std::vector<RowChunk> Chunks(const ExpertGroups& groups) {
  std::vector<RowChunk> chunks;
  const std::vector<int64_t> compact = CompactBegin(groups);
  for (size_t g = 0; g < groups.begin.size(); ++g) {
    const int64_t n = (groups.rows[g] + kMaxChunkRows - 1) / kMaxChunkRows;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = groups.rows[g] * i / n, end = groups.rows[g] * (i + 1) / n;
      chunks.push_back({static_cast<int64_t>(g), groups.begin[g] + r, compact[g] + r, end - r});
    }
  }
  return chunks;
}

// fn(chunk_index, chunk) for every chunk, spread over `threads` threads.
template <typename Fn>
void ForEachChunk(const std::vector<RowChunk>& chunks, int threads, Fn&& fn) {
  ParallelFor(static_cast<int64_t>(chunks.size()), threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i, chunks[static_cast<size_t>(i)]);
  });
}

// fn(chunk_index, chunk) for every chunk as one task each, handed out dynamically to the
// calling thread's pool of `threads` threads. With one thread the tasks run in order on the
// caller (outside any pool task, so a GEMM inside may still use the process's GEMM threads).
template <typename Fn>
void ForEachTask(const std::vector<RowChunk>& chunks, int threads, Fn&& fn) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, chunks[static_cast<size_t>(i)]);
    return;
  }
  LocalPool(threads).Run(n, [&](int64_t i) { fn(i, chunks[static_cast<size_t>(i)]); });
}

// One product through the grouped GEMM's choice of kernel (moe/grouped_gemm.h), alpha = 1.
void RunOne(Trans trans_a, Trans trans_b, float beta, const GemmProblem& p) {
  ExpertGroupedGemm(trans_a, trans_b, 1.0f, beta, std::span<const GemmProblem>(&p, 1), 1);
}

// The fc1 bias and the activation on a region of a chunk's [rows, H] blocks (a GEMM epilogue,
// kernels::TileEpilogue): ActivationForwardBlock on rows [row, row + rows), columns [col, col +
// cols) of pre1 (pre3) -> hidden.
struct ActivationTiles {
  kernels::Activation act;
  const float* bias;  // [H] or null
  float* pre1;
  float* pre3;  // null: not gated
  float* hidden;
  int64_t ld;
  bool save_scales;
  static void Run(void* ctx, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const auto* t = static_cast<const ActivationTiles*>(ctx);
    const int64_t at = row * t->ld + col;
    ActivationForwardBlock(t->act, rows, cols, t->ld, t->bias ? t->bias + col : nullptr,
                           t->pre1 + at, t->pre3 ? t->pre3 + at : nullptr, t->hidden + at,
                           t->save_scales);
  }
};

// The activation's backward on a region of a chunk's dh block (the epilogue of dh = dY W2):
// ActivationBackwardBlock on rows [row, row + rows), columns [col, col + cols). The regions of
// one column come in row order, so the bias sums are those of ActivationBackwardRows.
struct ActivationGradTiles {
  const float* scale1;
  const float* scale3;  // null: not gated
  float* d;
  float* d_pre3;
  float* bias_grad;  // [H] or null
  int64_t ld;
  static void Run(void* ctx, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const auto* t = static_cast<const ActivationGradTiles*>(ctx);
    const int64_t at = row * t->ld + col;
    ActivationBackwardBlock(rows, cols, t->ld, t->scale1 + at, t->scale3 ? t->scale3 + at : nullptr,
                            t->d + at, t->d_pre3 ? t->d_pre3 + at : nullptr,
                            t->bias_grad ? t->bias_grad + col : nullptr);
  }
};

// c[row.., col..] += bias[col..] on a region (the epilogue of a product with a bias).
struct BiasTiles {
  const float* bias;
  float* c;
  int64_t ld;
  static void Run(void* ctx, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const auto* t = static_cast<const BiasTiles*>(ctx);
    for (int64_t r = row; r < row + rows; ++r) {
      float* cr = t->c + r * t->ld + col;
      const float* b = t->bias + col;
      for (int64_t j = 0; j < cols; ++j) cr[j] += b[j];
    }
  }
};

// Zeroes the rows of `t` [rows, cols] that belong to no group.
void ZeroPadding(const Tensor& t, const ExpertGroups& groups) {
  const int64_t cols = t.size(1);
  float* p = t.data<float>();
  std::vector<std::pair<int64_t, int64_t>> used;
  for (size_t g = 0; g < groups.begin.size(); ++g) {
    if (groups.rows[g] > 0) used.emplace_back(groups.begin[g], groups.begin[g] + groups.rows[g]);
  }
  std::sort(used.begin(), used.end());
  int64_t cursor = 0;
  auto zero = [&](int64_t b, int64_t e) {
    if (e > b) std::memset(p + b * cols, 0, static_cast<size_t>((e - b) * cols) * sizeof(float));
  };
  for (auto [b, e] : used) {
    zero(cursor, b);
    cursor = std::max(cursor, e);
  }
  zero(cursor, t.size(0));
}

// Weight-gradient problems: dW_g[m, n] = A_g^T [m, rows_g] · B_g [rows_g, n], every group
// (an empty group gets dW_g = 0).
std::vector<GemmProblem> WeightGradProblems(const ExpertGroups& groups, const float* a,
                                            const std::vector<int64_t>& a_begin, int64_t lda,
                                            const float* b, const std::vector<int64_t>& b_begin,
                                            int64_t ldb, float* dw, int64_t m, int64_t n) {
  std::vector<GemmProblem> ps;
  for (size_t g = 0; g < groups.begin.size(); ++g) {
    ps.push_back({m, n, groups.rows[g], a + a_begin[g] * lda, lda, b + b_begin[g] * ldb, ldb,
                  dw + static_cast<int64_t>(g) * m * n, n});
  }
  return ps;
}

// Sums per-chunk column sums `partial` [chunks, cols] into [groups, cols], in chunk order (so
// the result does not depend on the thread count).
Tensor ReduceChunkPartials(const std::vector<float>& partial, const std::vector<RowChunk>& chunks,
                           int64_t n_groups, int64_t cols) {
  Tensor out = Tensor::Zeros({n_groups, cols});
  float* o = out.data<float>();
  for (size_t i = 0; i < chunks.size(); ++i) {
    float* dst = o + chunks[i].group * cols;
    const float* src = partial.data() + i * static_cast<size_t>(cols);
    for (int64_t j = 0; j < cols; ++j) dst[j] += src[j];
  }
  return out;
}

// bias_grad[g, :] = column sums of the group's rows of d [rows, cols].
Tensor BiasGrad(const Tensor& d, const std::vector<RowChunk>& chunks, int64_t n_groups,
                int threads) {
  const int64_t cols = d.size(1);
  std::vector<float> partial(chunks.size() * static_cast<size_t>(cols), 0.0f);
  const float* dp = d.data<float>();
  ForEachChunk(chunks, threads, [&](int64_t i, const RowChunk& c) {
    float* acc = partial.data() + i * cols;
    for (int64_t r = c.begin; r < c.begin + c.rows; ++r) {
      const float* src = dp + r * cols;
      for (int64_t j = 0; j < cols; ++j) acc[j] += src[j];
    }
  });
  return ReduceChunkPartials(partial, chunks, n_groups, cols);
}

void CheckOne(std::string_view prefix, std::string_view name, const Tensor& t,
              std::initializer_list<int64_t> shape) {
  std::string full = std::string(prefix) + std::string(name);
  ExpectDType(full, t, DType::kFloat32);
  ExpectShape(full, t, shape);
}

}  // namespace

int64_t ExpertGroups::total_rows() const {
  int64_t n = 0;
  for (int64_t r : rows) n += r;
  return n;
}

ExpertGroups GroupsOf(const DispatchPlan& plan) {
  ExpertGroups g;
  g.begin.assign(plan.offsets.begin(), plan.offsets.end() - 1);
  g.rows = plan.counts;
  return g;
}

ExpertGroups FullCapacityGroups(int64_t num_groups, int64_t capacity) {
  ExpertGroups g;
  for (int64_t e = 0; e < num_groups; ++e) {
    g.begin.push_back(e * capacity);
    g.rows.push_back(capacity);
  }
  return g;
}

double ExpertFlops(int64_t rows, int64_t model_dim, int64_t hidden_dim, bool gated) {
  return static_cast<double>(rows) * 2.0 * static_cast<double>(model_dim) *
         static_cast<double>(hidden_dim) * (gated ? 3.0 : 2.0);
}

void CheckExpertWeights(std::string_view prefix, const ExpertWeights& w, int64_t groups,
                        int64_t model_dim, int64_t hidden_dim, const ExpertOptions& options,
                        bool bias) {
  CheckOne(prefix, "fc1.weight", w.fc1_weight, {groups, hidden_dim, model_dim});
  CheckOne(prefix, "fc2.weight", w.fc2_weight, {groups, model_dim, hidden_dim});
  if (bias) {
    CheckOne(prefix, "fc1.bias", w.fc1_bias, {groups, hidden_dim});
    CheckOne(prefix, "fc2.bias", w.fc2_bias, {groups, model_dim});
  } else {
    SY_REQUIRE(!w.fc1_bias.defined() && !w.fc2_bias.defined(), InvalidArgument,
               "{}fc1.bias / fc2.bias: given, but fc_bias is false", prefix);
  }
  if (options.gated) {
    CheckOne(prefix, "fc3.weight", w.fc3_weight, {groups, hidden_dim, model_dim});
  } else {
    SY_REQUIRE(!w.fc3_weight.defined(), InvalidArgument,
               "{}fc3.weight: given, but the experts are not gated (gated is false)", prefix);
  }
}

Tensor ExpertsForward(const ExpertOptions& options, const ExpertWeights& w, const Tensor& input,
                      const ExpertGroups& groups, ExpertActivations* saved, int threads) {
  SY_REQUIRE(w.fc1_weight.defined() && w.fc1_weight.dim() == 3, InvalidArgument,
             "fc1.weight: expected [G, H, M], got {}", w.fc1_weight.ToString());
  const int64_t n_groups = w.fc1_weight.size(0), h_dim = w.fc1_weight.size(1),
                m_dim = w.fc1_weight.size(2);
  CheckExpertWeights("", w, n_groups, m_dim, h_dim, options, w.fc1_bias.defined());
  ExpectDType("expert input", input, DType::kFloat32);
  ExpectShape("expert input", input, {kAnySize, m_dim});
  SY_REQUIRE(static_cast<int64_t>(groups.begin.size()) == n_groups &&
                 groups.rows.size() == groups.begin.size(),
             InvalidArgument, "expert groups: expected {} groups, got {}", n_groups,
             groups.begin.size());
  const int64_t rows = input.size(0);
  for (size_t g = 0; g < groups.begin.size(); ++g) {
    SY_REQUIRE(
        groups.begin[g] >= 0 && groups.rows[g] >= 0 && groups.begin[g] + groups.rows[g] <= rows,
        InvalidArgument, "expert group {}: rows [{}, {}) outside the buffer of {} rows", g,
        groups.begin[g], groups.begin[g] + groups.rows[g], rows);
  }
  const auto chunks = Chunks(groups);
  const int64_t used = groups.total_rows();

  Tensor pre1 = Tensor::Empty({used, h_dim});
  Tensor pre3 = options.gated ? Tensor::Empty({used, h_dim}) : Tensor();
  Tensor hidden = Tensor::Empty({used, h_dim});
  Tensor out = Tensor::Empty({rows, m_dim});
  const float* x = input.data<float>();

  // One task per chunk of a group's rows: fc1 (and fc3) GEMM with bias + activation as its
  // epilogue, fc2 GEMM reading the block from cache, with the fc2 bias as its epilogue.
  const float* w1 = w.fc1_weight.data<float>();
  const float* w3 = options.gated ? w.fc3_weight.data<float>() : nullptr;
  const float* w2 = w.fc2_weight.data<float>();
  const float* b1 = w.fc1_bias.defined() ? w.fc1_bias.data<float>() : nullptr;
  const float* b2 = w.fc2_bias.defined() ? w.fc2_bias.data<float>() : nullptr;
  float* o = out.data<float>();
  ForEachTask(chunks, threads, [&](int64_t, const RowChunk& c) {
    const int64_t off = c.compact * h_dim;
    const float* xc = x + c.begin * m_dim;
    const GemmProblem fc1{c.rows, h_dim,
                          m_dim,  xc,
                          m_dim,  w1 + c.group * h_dim * m_dim,
                          m_dim,  pre1.data<float>() + off,
                          h_dim};
    // The bias and activation are applied by the GEMM's epilogue, row block by row block while the
    // gate (and up) values are in cache: no separate pass over the chunk's [rows, H] blocks.
    ActivationTiles act{options.activation,
                        b1 ? b1 + c.group * h_dim : nullptr,
                        pre1.data<float>() + off,
                        options.gated ? pre3.data<float>() + off : nullptr,
                        hidden.data<float>() + off,
                        h_dim,
                        saved != nullptr};
    const kernels::TileEpilogue epilogue{&ActivationTiles::Run, &act};
    if (options.gated) {  // gate and up products in one pass over X
      ExpertGemmPair(Trans::kNo, Trans::kYes, 1.0f, 0.0f, fc1,
                     {c.rows, h_dim, m_dim, xc, m_dim, w3 + c.group * h_dim * m_dim, m_dim,
                      pre3.data<float>() + off, h_dim},
                     SharedOperand::kA, &epilogue);
    } else {
      ExpertGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f, fc1, &epilogue);
    }
    // fc2 with its bias added by the epilogue (no separate pass writing the bias rows first).
    BiasTiles bias{b2 ? b2 + c.group * m_dim : nullptr, o + c.begin * m_dim, m_dim};
    const kernels::TileEpilogue add_bias{&BiasTiles::Run, &bias};
    ExpertGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f,
               {c.rows, m_dim, h_dim, hidden.data<float>() + off, h_dim,
                w2 + c.group * m_dim * h_dim, h_dim, o + c.begin * m_dim, m_dim},
               b2 ? &add_bias : nullptr);
  });
  ZeroPadding(out, groups);

  if (saved) {
    saved->input = input;
    saved->dh_da1 = pre1;  // overwritten by the fc1 epilogue (save_scales)
    saved->dh_da3 = pre3;
    saved->hidden = hidden;
    saved->groups = groups;
  }
  return out;
}

ExpertGradients ExpertsBackward(const ExpertOptions& options, const ExpertWeights& w,
                                const ExpertActivations& s, const Tensor& d_output, int threads) {
  const int64_t n_groups = w.fc1_weight.size(0), h_dim = w.fc1_weight.size(1),
                m_dim = w.fc1_weight.size(2);
  const int64_t rows = s.input.size(0);
  SY_REQUIRE(s.dh_da1.defined() && s.hidden.defined(), InvalidArgument,
             "ExpertsBackward: the forward saved no activations");
  ExpectDType("d expert output", d_output, DType::kFloat32);
  ExpectShape("d expert output", d_output, {rows, m_dim});
  const ExpertGroups& groups = s.groups;
  const auto chunks = Chunks(groups);
  const std::vector<int64_t> compact = CompactBegin(groups);
  const int64_t used = groups.total_rows();
  const float* dy = d_output.data<float>();
  const float* x = s.input.data<float>();
  ExpertGradients g;

  // fc2: dW2_g = dY_g^T · h_g; db2 = column sums of dY_g; dh = dY · W2.
  g.weights.fc2_weight = Tensor::Empty(w.fc2_weight.shape());
  auto pw2 = WeightGradProblems(groups, dy, groups.begin, m_dim, s.hidden.data<float>(), compact,
                                h_dim, g.weights.fc2_weight.data<float>(), m_dim, h_dim);
  ExpertGroupedGemm(Trans::kYes, Trans::kNo, 1.0f, 0.0f, pw2, threads);
  if (w.fc2_bias.defined()) g.weights.fc2_bias = BiasGrad(d_output, chunks, n_groups, threads);
  // One task per chunk of a group's rows: dh = dY W2 (into d_pre1), the activation's backward on
  // the block just written (still in cache: products with the saved derivatives; gated: d_pre3;
  // the fc1 bias gradient's partial sums),
  // then dX = d_pre1 W1 (+ d_pre3 W3) reading the block from cache.
  Tensor d_pre1 = Tensor::Empty({used, h_dim});
  Tensor d_pre3 = options.gated ? Tensor::Empty({used, h_dim}) : Tensor();
  const bool bias1 = w.fc1_bias.defined();
  std::vector<float> b1_partial(bias1 ? chunks.size() * static_cast<size_t>(h_dim) : 0, 0.0f);
  g.input = Tensor::Empty({rows, m_dim});
  const float* w1 = w.fc1_weight.data<float>();
  const float* w2 = w.fc2_weight.data<float>();
  const float* w3 = options.gated ? w.fc3_weight.data<float>() : nullptr;
  float* dx = g.input.data<float>();
  ForEachTask(chunks, threads, [&](int64_t i, const RowChunk& c) {
    const int64_t off = c.compact * h_dim;
    float* dp1 = d_pre1.data<float>() + off;
    float* dp3 = options.gated ? d_pre3.data<float>() + off : nullptr;
    // The activation's backward as the GEMM's epilogue, row block by row block while dh is in
    // cache.
    ActivationGradTiles act{s.dh_da1.data<float>() + off,
                            options.gated ? s.dh_da3.data<float>() + off : nullptr,
                            dp1,
                            dp3,
                            bias1 ? b1_partial.data() + i * h_dim : nullptr,
                            h_dim};
    const kernels::TileEpilogue epilogue{&ActivationGradTiles::Run, &act};
    ExpertGemm(Trans::kNo, Trans::kNo, 1.0f, 0.0f,
               {c.rows, h_dim, m_dim, dy + c.begin * m_dim, m_dim, w2 + c.group * m_dim * h_dim,
                h_dim, dp1, h_dim},
               &epilogue);
    RunOne(Trans::kNo, Trans::kNo, 0.0f,
           {c.rows, m_dim, h_dim, dp1, h_dim, w1 + c.group * h_dim * m_dim, m_dim,
            dx + c.begin * m_dim, m_dim});
    if (options.gated) {
      RunOne(Trans::kNo, Trans::kNo, 1.0f,
             {c.rows, m_dim, h_dim, dp3, h_dim, w3 + c.group * h_dim * m_dim, m_dim,
              dx + c.begin * m_dim, m_dim});
    }
  });
  if (bias1) g.weights.fc1_bias = ReduceChunkPartials(b1_partial, chunks, n_groups, h_dim);

  // fc1 (and fc3): dW_g = d_pre_g^T · X_g; db1 = column sums; dX = d_pre1 · W1 (+ d_pre3 · W3).
  g.weights.fc1_weight = Tensor::Empty(w.fc1_weight.shape());
  auto pw1 = WeightGradProblems(groups, d_pre1.data<float>(), compact, h_dim, x, groups.begin,
                                m_dim, g.weights.fc1_weight.data<float>(), h_dim, m_dim);
  if (options.gated) {  // dW1 and dW3 in one pass over X per group
    g.weights.fc3_weight = Tensor::Empty(w.fc3_weight.shape());
    auto pw3 = WeightGradProblems(groups, d_pre3.data<float>(), compact, h_dim, x, groups.begin,
                                  m_dim, g.weights.fc3_weight.data<float>(), h_dim, m_dim);
    ExpertGroupedGemmPairs(Trans::kYes, Trans::kNo, 1.0f, 0.0f, pw1, pw3, SharedOperand::kB,
                           threads);
  } else {
    ExpertGroupedGemm(Trans::kYes, Trans::kNo, 1.0f, 0.0f, pw1, threads);
  }
  ZeroPadding(g.input, groups);
  return g;
}

}  // namespace switchyard::moe
