// Collective test cases shared by the in-process and the MPI suites (gloo's harness: the same
// case definitions on every transport). A case is one collective call with deterministic inputs;
// RunCase runs it on a communicator and checks this rank's output against a naive reference
// computed from every rank's inputs (which each rank can regenerate).
//
// Inputs are small integers (exact in bfloat16 and float32 sums), so every algorithm must give
// bit-identical results whatever its summation order; outputs carry a guard zone that must stay
// untouched. RunBFloat16SumCase adds non-integer bfloat16 sums, where rounding per step and
// rounding once differ.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/types.h"

namespace switchyard::comm::testing {

struct Case {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  Algorithm algorithm = Algorithm::kAuto;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  size_t count = 0;
  int root = 0;
  int ranks_per_node = 0;  // hierarchical all-to-all
  bool in_place = false;   // allreduce with send == recv

  std::string Name() const;
};

// Element counts crossed by the suites: 0, 1, odd, and `large`.
std::vector<size_t> Counts(size_t large);

// Every algorithm of `kind` (kAuto included; kNative if native), x dtype x reduce op (for
// reductions) x Counts(large), on a group of w ranks.
std::vector<Case> CasesFor(CollectiveKind kind, int w, bool native, size_t large);

// The collectives the suites cover.
std::vector<CollectiveKind> CoveredKinds();

// Runs `c` on `comm` (every rank must call it with the same case) and checks this rank's result.
::testing::AssertionResult RunCase(Communicator& comm, const Case& c);

// A bfloat16 sum (kind: allreduce, reduce to root 0, or reduce_scatter; `count` output elements)
// with non-integer inputs for which rounding every partial sum to bfloat16 and rounding the exact
// sum once differ on most elements (checked for W >= 3, count >= 37). The result must be the
// float64 sum rounded once to bfloat16, bit for bit: bfloat16 reductions accumulate in float32.
::testing::AssertionResult RunBFloat16SumCase(Communicator& comm, CollectiveKind kind,
                                              Algorithm algorithm, size_t count);

}  // namespace switchyard::comm::testing
