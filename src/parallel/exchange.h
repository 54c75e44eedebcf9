// Token exchange between the ranks of an expert group for the all-to-all dispatchers (fixed
// capacity and variable size), with Tutel's adaptive r and DeepSpeed's TP de-duplication.
// Private to src/parallel.
//
// The source's expert buffer (a DispatchPlan layout: expert e owns rows [offsets[e],
// offsets[e + 1]), its kept rows first) is cut, per expert, into S = t * g equal slices of its
// extent: slice s = [floor(s R / S), floor((s + 1) R / S)). TP rank u of t (t = 1 without
// de-duplication) sends only slices u * g .. u * g + g - 1. Expert-group member (q, i) with
// j = i / g and sigma = i % g receives slice u * g + sigma of the experts of position q, and
// computes them with H-part j (r = n / g copies of every row travel, one per part; their partial
// outputs are added on return).
//
// Wire format: fixed capacity (kAllToAll) sends blocks of R / S rows per (peer, expert), zero
// padded, through one all-to-all (flat or 2DH); variable size (kAllToAllV) sends only the kept rows
// through an all-to-all-v. Both first exchange the per-(peer, expert) row counts, so that experts
// are computed on kept rows only.
#pragma once

#include <cstdint>
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
  comm::AllToAllOptions options;  // flat or hierarchical
};

// Slice s of S of an expert's extent R: rows [SliceBegin(s), SliceBegin(s + 1)).
inline int64_t SliceBegin(int64_t s, int64_t slices, int64_t extent) { return s * extent / slices; }

class TokenExchange {
 public:
  // Exchanges the row counts (collective over `group`, the expert group). The plan's buffer must
  // be fixed-stride (plan.offsets evenly spaced by a multiple of S) when spec.fixed.
  TokenExchange(comm::Communicator& group, const ExchangeSpec& spec, const moe::DispatchPlan& plan,
                CommStats* stats);

  // Source buffer [plan.num_rows, M] -> this rank's expert rows [expert_rows(), M], ordered by
  // local expert, then source rank. Collective.
  Tensor ToExperts(const Tensor& buffer, CommStats* stats) const;
  // Expert rows [expert_rows(), M] -> source buffer [plan.num_rows, M]: the r copies of a row
  // added, rows of other tp shares and padding zero. Collective.
  Tensor FromExperts(const Tensor& rows, CommStats* stats) const;

  int64_t expert_rows() const { return recv_total_; }
  // One group per local expert.
  const moe::ExpertGroups& groups() const { return groups_; }
  // Rows per (peer, expert) block on the wire (fixed capacity).
  int64_t block_rows() const { return block_; }

 private:
  struct Piece {        // rows of the source buffer sent to one (peer, local expert)
    int64_t begin = 0;  // first buffer row
    int64_t rows = 0;   // kept rows in the slice
  };

  comm::Communicator& group_;
  ExchangeSpec spec_;
  int64_t num_rows_ = 0;              // source buffer rows
  int64_t block_ = 0;                 // fixed: rows per (peer, expert) block
  std::vector<Piece> send_;           // [P, E_l]
  std::vector<int64_t> recv_counts_;  // [P, E_l] rows received from each source per expert
  std::vector<int64_t> send_rows_, recv_rows_;  // [P] variable: rows per peer
  int64_t recv_total_ = 0;
  moe::ExpertGroups groups_;
};

// DeepSpeed's TP de-duplication: fills the rows of `buffer` (a plan layout) that belong to the
// other tp shares from the tp ranks that computed them (all-gather over `tp`). Collective.
void GatherTpShares(comm::Communicator& tp, const moe::DispatchPlan& plan, const Tensor& buffer,
                    CommStats* stats);

// The groups of the kept rows of tp share u of t in each expert (the work of r = 0).
moe::ExpertGroups ShareGroups(const moe::DispatchPlan& plan, int shares, int share);

}  // namespace switchyard::parallel::internal
