// The layout of one MoE layer on W ranks and its overlap schedules as flags (docs/parallel.md,
// docs/overlap.md), declared once for `switchyard layer`, `bench layer-parallel` and `bench layer
// --ranks W`: --tp --ep --etp --arrangement --dispatch --adaptive-r --2dh --no-tp-dedup
// --no-dispatch-dedup --scope --transport --overlap-degree --smart-schedule --shadow --trace.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <string_view>

#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::cli {

struct MoeLayoutFlags {
  int tp = 1, ep = 0, etp = 1;  // ep 0: as large as possible
  std::string arrangement = "deepspeed";
  std::string dispatch = "alltoall";
  std::string adaptive_r = "default";
  int hierarchical = 0;  // --2dh: ranks per node of the hierarchical all-to-all (0: off)
  bool no_tp_dedup = false;
  bool no_dispatch_dedup = false;  // alltoallv: one row per (token, choice), not per (token, rank)
  std::string scope = "global";
  std::string transport = "auto";  // auto: mpi when started by an MPI launcher, else inproc
  int overlap_degree = 1;
  std::string smart = "off";
  std::string shadow = "none";
  std::string trace_path;  // Chrome trace-event JSON of the parallel run ("": none)

  // The library's options for `world_size` ranks; the names are parsed here (InvalidArgument
  // naming the value for a bad one), in the order the flags are listed above.
  parallel::ParallelOptions Options(int world_size) const;
};

// Declares the flags on `app`, bound to *f; `trace_help` says which run --trace records.
void AddMoeLayoutFlags(CLI::App& app, MoeLayoutFlags* f, std::string_view trace_help);

// The layout of a whole model's ranks as `train` spells its keys, for the commands that build the
// model without training it (`eval`): --tp, --sp (train's --sequence-parallel), --ep, --etp,
// --pp, --cp, --cp-algo, --dp and --arrangement; ranks = tp x cp x pp x dp, ranks as threads.
struct ModelLayoutFlags {
  int tp = 1, ep = 0, etp = 1, pp = 1, cp = 1, dp = 1;  // ep 0: as large as possible
  bool sp = false;
  std::string cp_algo = "ring";
  std::string arrangement = "auto";

  int64_t ranks() const;
  // The TrainConfig keys of the layout (ranks, tp, sequence_parallel, ep, etp, pp, cp, cp_algo,
  // arrangement) as a JSON object for TrainConfigFromJson, which checks them as train does.
  std::string KeysJson() const;
};

void AddModelLayoutFlags(CLI::App& app, ModelLayoutFlags* f);

}  // namespace switchyard::cli
