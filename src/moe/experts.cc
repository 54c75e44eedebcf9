#include "switchyard/moe/experts.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "moe/activation.h"
#include "moe/parallel_for.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/grouped_gemm.h"

namespace switchyard::moe {
namespace {

using kernels::GemmProblem;
using kernels::Trans;

// Rows handed to one thread at a time by the elementwise steps. Fixed (not derived from the thread
// count) so that reductions over chunks give the same bits for any thread count.
constexpr int64_t kChunkRows = 128;

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
    for (int64_t r = 0; r < groups.rows[g]; r += kChunkRows) {
      chunks.push_back({static_cast<int64_t>(g), groups.begin[g] + r, compact[g] + r,
                        std::min(kChunkRows, groups.rows[g] - r)});
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

// Rows of a group's C initialised with a bias row (bias [G, cols]); returns the GEMM beta.
float FillBias(const Tensor& bias, const Tensor& out, const std::vector<RowChunk>& chunks,
               int threads) {
  if (!bias.defined()) return 0.0f;
  const int64_t cols = out.size(1);
  const float* b = bias.data<float>();
  float* o = out.data<float>();
  ForEachChunk(chunks, threads, [&](int64_t, const RowChunk& c) {
    for (int64_t r = c.begin; r < c.begin + c.rows; ++r) {
      std::memcpy(o + r * cols, b + c.group * cols, static_cast<size_t>(cols) * sizeof(float));
    }
  });
  return 1.0f;
}

// Forward-style problems: C[rows_g, n] (+)= A[rows_g, k] · op(W_g), one per non-empty group;
// group g's rows start at a_begin[g] in A and c_begin[g] in C.
std::vector<GemmProblem> RowProblems(const ExpertGroups& groups, const float* a,
                                     const std::vector<int64_t>& a_begin, int64_t lda,
                                     const float* w, int64_t w_stride, int64_t ldw, float* c,
                                     const std::vector<int64_t>& c_begin, int64_t ldc, int64_t n,
                                     int64_t k) {
  std::vector<GemmProblem> ps;
  for (size_t g = 0; g < groups.begin.size(); ++g) {
    if (groups.rows[g] == 0) continue;
    ps.push_back({groups.rows[g], n, k, a + a_begin[g] * lda, lda,
                  w + static_cast<int64_t>(g) * w_stride, ldw, c + c_begin[g] * ldc, ldc});
  }
  return ps;
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
  const std::vector<int64_t> compact = CompactBegin(groups);
  const int64_t used = groups.total_rows();

  Tensor pre1 = Tensor::Empty({used, h_dim});
  Tensor pre3 = options.gated ? Tensor::Empty({used, h_dim}) : Tensor();
  Tensor hidden = Tensor::Empty({used, h_dim});
  Tensor out = Tensor::Empty({rows, m_dim});
  const float* x = input.data<float>();

  // fc1 bias is added by the activation pass (one pass over [rows, H] instead of two).
  auto p1 = RowProblems(groups, x, groups.begin, m_dim, w.fc1_weight.data<float>(), h_dim * m_dim,
                        m_dim, pre1.data<float>(), compact, h_dim, h_dim, m_dim);
  ExpertGroupedGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f, p1, threads);
  if (options.gated) {
    auto p3 = RowProblems(groups, x, groups.begin, m_dim, w.fc3_weight.data<float>(), h_dim * m_dim,
                          m_dim, pre3.data<float>(), compact, h_dim, h_dim, m_dim);
    ExpertGroupedGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f, p3, threads);
  }
  const float* b1 = w.fc1_bias.defined() ? w.fc1_bias.data<float>() : nullptr;
  ForEachChunk(chunks, threads, [&](int64_t, const RowChunk& c) {
    int64_t off = c.compact * h_dim;
    ActivationForwardRows(options.activation, c.rows, h_dim, b1 ? b1 + c.group * h_dim : nullptr,
                          pre1.data<float>() + off,
                          options.gated ? pre3.data<float>() + off : nullptr,
                          hidden.data<float>() + off);
  });
  float beta2 = FillBias(w.fc2_bias, out, chunks, threads);
  auto p2 = RowProblems(groups, hidden.data<float>(), compact, h_dim, w.fc2_weight.data<float>(),
                        m_dim * h_dim, h_dim, out.data<float>(), groups.begin, m_dim, m_dim, h_dim);
  ExpertGroupedGemm(Trans::kNo, Trans::kYes, 1.0f, beta2, p2, threads);
  ZeroPadding(out, groups);

  if (saved) {
    saved->input = input;
    saved->pre1 = pre1;
    saved->pre3 = pre3;
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
  SY_REQUIRE(s.pre1.defined() && s.hidden.defined(), InvalidArgument,
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
  Tensor d_pre1 = Tensor::Empty({used, h_dim});
  auto ph = RowProblems(groups, dy, groups.begin, m_dim, w.fc2_weight.data<float>(), m_dim * h_dim,
                        h_dim, d_pre1.data<float>(), compact, h_dim, h_dim, m_dim);
  ExpertGroupedGemm(Trans::kNo, Trans::kNo, 1.0f, 0.0f, ph, threads);

  // Activation: d_pre1 = act'(pre1) * dh (* pre3); gated: d_pre3 = dh * act(pre1); the fc1
  // bias gradient is summed in the same pass.
  Tensor d_pre3 = options.gated ? Tensor::Empty({used, h_dim}) : Tensor();
  const bool bias1 = w.fc1_bias.defined();
  std::vector<float> b1_partial(bias1 ? chunks.size() * static_cast<size_t>(h_dim) : 0, 0.0f);
  ForEachChunk(chunks, threads, [&](int64_t i, const RowChunk& c) {
    int64_t off = c.compact * h_dim;
    ActivationBackwardRows(options.activation, c.rows, h_dim, s.pre1.data<float>() + off,
                           options.gated ? s.pre3.data<float>() + off : nullptr,
                           d_pre1.data<float>() + off,
                           options.gated ? d_pre3.data<float>() + off : nullptr,
                           bias1 ? b1_partial.data() + i * h_dim : nullptr);
  });
  if (bias1) g.weights.fc1_bias = ReduceChunkPartials(b1_partial, chunks, n_groups, h_dim);

  // fc1 (and fc3): dW_g = d_pre_g^T · X_g; db1 = column sums; dX = d_pre1 · W1 (+ d_pre3 · W3).
  g.weights.fc1_weight = Tensor::Empty(w.fc1_weight.shape());
  auto pw1 = WeightGradProblems(groups, d_pre1.data<float>(), compact, h_dim, x, groups.begin,
                                m_dim, g.weights.fc1_weight.data<float>(), h_dim, m_dim);
  ExpertGroupedGemm(Trans::kYes, Trans::kNo, 1.0f, 0.0f, pw1, threads);
  g.input = Tensor::Empty({rows, m_dim});
  auto px1 =
      RowProblems(groups, d_pre1.data<float>(), compact, h_dim, w.fc1_weight.data<float>(),
                  h_dim * m_dim, m_dim, g.input.data<float>(), groups.begin, m_dim, m_dim, h_dim);
  ExpertGroupedGemm(Trans::kNo, Trans::kNo, 1.0f, 0.0f, px1, threads);
  if (options.gated) {
    g.weights.fc3_weight = Tensor::Empty(w.fc3_weight.shape());
    auto pw3 = WeightGradProblems(groups, d_pre3.data<float>(), compact, h_dim, x, groups.begin,
                                  m_dim, g.weights.fc3_weight.data<float>(), h_dim, m_dim);
    ExpertGroupedGemm(Trans::kYes, Trans::kNo, 1.0f, 0.0f, pw3, threads);
    auto px3 =
        RowProblems(groups, d_pre3.data<float>(), compact, h_dim, w.fc3_weight.data<float>(),
                    h_dim * m_dim, m_dim, g.input.data<float>(), groups.begin, m_dim, m_dim, h_dim);
    ExpertGroupedGemm(Trans::kNo, Trans::kNo, 1.0f, 1.0f, px3, threads);
  }
  ZeroPadding(g.input, groups);
  return g;
}

}  // namespace switchyard::moe
