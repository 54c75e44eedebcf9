// Token exchange between the ranks of an expert group for the all-to-all dispatchers (fixed
// capacity and variable size), with Tutel's adaptive r, DeepSpeed's TP de-duplication, Tutel's
// a2a-FFN overlap, FasterMoE's pair-wise smart schedule and shadowed experts. Private to
// src/parallel.
//
// Slices. The source's expert buffer (a DispatchPlan layout: expert e owns rows [offsets[e],
// offsets[e + 1]), its kept rows first) is cut, per expert, into S = t * g equal slices of its
// extent: slice s = [floor(s R / S), floor((s + 1) R / S)). TP rank u of t (t = 1 without
// de-duplication) sends only slices u * g .. u * g + g - 1. Expert-group member (q, i) with
// j = i / g and sigma = i % g receives slice u * g + sigma of the experts of position q, and
// computes them with H-part j (r = n / g copies of every row travel, one per part; their partial
// outputs are added on return). The rows of one slice for one (peer, local expert) are a "piece".
//
// Phases. The transfer is cut into K = steps x D phases, run as a pipeline (Pipeline below):
//   D (overlap degree, Tutel)  every piece's R kept rows are cut into D chunks, rows
//       [i R / D, (i + 1) R / D). Fixed capacity sends each chunk in a zero-padded block of B / D
//       rows: the bytes of Tutel's split of the capacity dimension into D slices of B / D slots,
//       but with the kept rows spread evenly over the chunks (slices of slots would leave the last
//       chunks mostly padding, and the pipeline's compute front-loaded, when experts are not full).
//   steps (smart schedule, FasterMoE)  with group size g' the P members form P / g' groups of g'
//       consecutive members; at step s a member sends only to the members of group (own + s) and
//       receives only from group (own - s) (mod P / g'). Without it: one step with every peer.
// Phase k = (step k / D, chunk k % D).
//
// Wire format per phase: fixed capacity sends zero-padded blocks of B / D rows per (peer, local
// expert) through one all-to-all (flat or 2DH) when every peer takes part and no expert is
// skipped, else through an all-to-all-v of those blocks; variable size sends exactly the kept
// rows through an all-to-all-v (smart steps: the linear algorithm, every message of the step posted
// at once, so that a pair's two directions travel together). A phase whose only traffic is to the
// rank itself (smart step 0 with g' = 1) is a local copy. The per-(peer, expert) row counts are
// exchanged once, at construction, so that experts are computed on kept rows only.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel::internal {

struct ExchangeSpec {
  int shards = 1;                 // n: members per expert position
  int r = 1;                      // copies of every row (parts of H)
  int64_t local_experts = 1;      // E_l
  int tp_shares = 1;              // t (1 without de-duplication)
  int tp_share = 0;               // u
  bool fixed = true;              // kAllToAll (padded blocks) vs kAllToAllV
  comm::AllToAllOptions options;  // flat or hierarchical (fixed capacity, every peer in a phase)
  int overlap_degree = 1;         // D; fixed capacity: must divide the block rows
  int smart_group = 0;            // g' > 0: pair-wise steps over groups of g' members; 0: none
  std::vector<char> skip;         // [E] or empty: experts whose rows are not sent (shadowed)
};

// Slice s of S of an expert's extent R: rows [SliceBegin(s), SliceBegin(s + 1)).
inline int64_t SliceBegin(int64_t s, int64_t slices, int64_t extent) { return s * extent / slices; }

class TokenExchange {
 public:
  // Exchanges the row counts (collective over `group`, the expert group). The plan's buffer must
  // be fixed-stride (plan.offsets evenly spaced by a multiple of S * D) when spec.fixed.
  TokenExchange(comm::Communicator& group, const ExchangeSpec& spec, const moe::DispatchPlan& plan,
                CommStats* stats);
  ~TokenExchange();

  int phases() const;
  // Rows this rank computes in phase k, ordered by local expert, then source rank; one group per
  // local expert.
  const moe::ExpertGroups& phase_groups(int k) const;
  // Rows per (peer, expert) block on the wire (fixed capacity, all phases of a piece together).
  int64_t block_rows() const { return block_; }

  // Computes phase k's rows [phase_groups(k).total_rows(), M] -> outputs of the same shape.
  using PhaseFn = std::function<Tensor(int k, const Tensor& rows)>;

  // The pipeline (Tutel's schedule; FasterMoE's S -> C -> R): the transfer of phase k + 1 to the
  // experts and the return of phase k - 1 are in flight while phase k computes. Issue order, the
  // same on every rank: S0, S1, [local_work], C0, S2, R0, C1, S3, R1, C2, ... (the communicator
  // runs them in that order on its progress thread, so the send the next compute needs goes before
  // the return that is only needed at the end). Returns the outputs in
  // the source buffer layout [plan.num_rows, M]: the r copies of a row added, rows of other tp
  // shares, skipped experts and padding zero. `local_work` (may be empty) runs once while the
  // first transfers travel. Trace events: "send cK", "experts cK", "return cK". Collective.
  Tensor Pipeline(const Tensor& buffer, const PhaseFn& compute,
                  const std::function<void()>& local_work, CommStats* stats) const;

 private:
  struct Piece {        // rows of the source buffer sent to one (peer, local expert)
    int64_t begin = 0;  // first buffer row
    int64_t rows = 0;   // kept rows in the slice
  };
  struct Phase;   // wire layout of one phase (exchange.cc)
  struct Flight;  // one transfer in flight

  Flight Send(int k, const Tensor& source_buffer) const;
  // Waits for a transfer; on_progress_thread: never runs it on the calling thread.
  void WaitFor(const Flight& f, bool on_progress_thread) const;
  Tensor ReceiveAtExperts(Flight& f, bool on_progress_thread, CommStats* stats) const;
  Flight Return(int k, const Tensor& rows) const;
  void ReceiveAtSource(Flight& f, const Tensor& out, bool on_progress_thread,
                       CommStats* stats) const;

  comm::Communicator& group_;
  ExchangeSpec spec_;
  int64_t num_rows_ = 0;              // source buffer rows
  int64_t block_ = 0;                 // fixed: rows per (peer, expert) block
  std::vector<Piece> send_;           // [P, E_l]
  std::vector<int64_t> recv_counts_;  // [P, E_l] rows received from each source per expert
  std::vector<Phase> phases_;
};

// DeepSpeed's TP de-duplication: fills the rows of `buffer` (a plan layout) that belong to the
// other tp shares from the tp ranks that computed them (all-gather over `tp`). Collective.
void GatherTpShares(comm::Communicator& tp, const moe::DispatchPlan& plan, const Tensor& buffer,
                    CommStats* stats);

// The groups of the kept rows of tp share u of t in each expert (the work of r = 0).
moe::ExpertGroups ShareGroups(const moe::DispatchPlan& plan, int shares, int share);

}  // namespace switchyard::parallel::internal
