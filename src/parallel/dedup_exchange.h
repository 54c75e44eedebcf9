// The token exchange of DeepSeek-V3 / DeepEP: a token travels once per destination rank, not once
// per (token, choice) pair (docs/moe.md, "Device-limited routing and the all-to-all volume").
// Private to src/parallel.
//
// Forward: a source rank sends x[t] once to every rank d holding at least one of t's kept
// experts, with the routing of its k choices on d (local expert or -1, slot, combine weight) in a
// small routing all-to-all-v. The destination expands each received row into its local experts'
// inputs (a local gather; pre-score scales each by its weight), computes its experts on them,
// combines locally (the weighted sum over the token's choices on d, in choice order) and returns
// one partial output row per (token, rank); the source adds the partials of its destination ranks
// (in rank order). Backward mirrors it: dy[t] once per (token, rank) to the destination, which
// weights it per choice, computes the combine weights' gradients (where the expert outputs are),
// runs the experts backward, sums the input gradients of the token's choices and returns one row
// per (token, rank), with the weight gradients [rows, k] in a routing all-to-all-v.
//
// Slots and capacity are the plan's: the expert rows on the destination are ordered by local
// expert, then source rank, then slot, exactly as the per-pair exchange delivers them; only the
// transport is deduplicated. Token bytes each way and direction: the rows a rank sends to other
// ranks, sum over its tokens of the distinct other ranks holding a kept choice, times M x 4.
// Needs unsharded experts (n = 1), no TP de-duplication, one phase (overlap 1, no smart
// schedule) and no shadowed experts; the dispatcher falls back to the per-pair exchange
// otherwise.
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

class DedupExchange {
 public:
  // x [T, M] float32 and its plan (any layout: packed or fixed stride; kept pairs have
  // plan.rows >= 0). Sends the tokens and their routing over `group` (the expert group, E_l
  // experts per rank). `threads` run the per-row loops (results do not depend on it).
  // Collective.
  DedupExchange(comm::Communicator& group, int64_t local_experts, bool prescore, int threads,
                const moe::DispatchPlan& plan, const Tensor& x, CommStats* stats);

  // The rows this rank computes [rows, M], one group per local expert.
  const Tensor& expert_input() const { return input_; }
  const moe::ExpertGroups& groups() const { return groups_; }

  // Expert outputs [rows, M] -> this rank's y [T, M]: local combine, return, sum. Collective.
  Tensor Combine(const Tensor& expert_out, CommStats* stats) const;

  // dy [T, M] -> d expert outputs [rows, M]; keeps the post-score weight gradients. Collective.
  Tensor CombineBackward(const Tensor& dy, const Tensor& expert_out, CommStats* stats);

  struct Grads {
    Tensor x;                    // [T, M] gradient through the expert inputs
    std::vector<float> weights;  // [T, k] gradient of the combine weights
  };
  // d expert inputs [rows, M] -> this rank's gradients. Collective.
  Grads DispatchBackward(const Tensor& d_expert_in, CommStats* stats);

 private:
  // rows per peer on the wire: source -> destination (send_rows_) and back (recv_rows_).
  Tensor ToDestinations(const Tensor& rows_by_token, const char* name, CommStats* stats) const;
  Tensor ToSources(const Tensor& partial, const char* name, CommStats* stats) const;
  // fn(received row i, pair i * k + j, expert row) for every choice computed here, in choice
  // order per row; rows split over threads_ (each row on one thread).
  void ForEachPair(const std::function<void(int64_t i, size_t pair, int32_t row)>& fn) const;
  // Adds the partial rows [sum(send_rows_), C] returned by the destinations into out [T, C].
  void AddAtSource(const Tensor& returned, const Tensor& out) const;

  comm::Communicator& group_;
  bool prescore_;
  int threads_ = 1;
  int64_t num_tokens_ = 0, top_k_ = 0, model_dim_ = 0;
  // Source side: the token of each sent row, packed by destination rank.
  std::vector<int32_t> sent_tokens_;
  std::vector<int64_t> send_rows_, recv_rows_;  // [P]
  // Destination side.
  Tensor x_recv_;                    // [R, M] received tokens
  std::vector<int32_t> row_of_;      // [R, k] expert row of each received (token, choice), or -1
  std::vector<float> recv_weights_;  // [R, k] combine weights (0 where not on this rank)
  Tensor input_;                     // [rows, M]
  moe::ExpertGroups groups_;
  std::vector<float> d_weights_;  // [R, k] weight gradients computed here
};

}  // namespace switchyard::parallel::internal
