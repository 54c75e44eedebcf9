#include "cli/layout_flags.h"

#include "cli/flags.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/schedule.h"

namespace switchyard::cli {

parallel::ParallelOptions MoeLayoutFlags::Options(int world_size) const {
  parallel::ParallelOptions p;
  p.mesh.world_size = world_size;
  p.mesh.tp = tp;
  p.mesh.ep = ep;
  p.mesh.etp = etp;
  p.mesh.arrangement = parallel::ArrangementFromName(arrangement);
  p.dispatch = parallel::DispatchKindFromName(dispatch);
  p.adaptive_r = parallel::AdaptiveRFromString(adaptive_r);
  p.hierarchical_ranks_per_node = hierarchical;
  p.tp_dedup = !no_tp_dedup;
  p.dispatch_dedup = !no_dispatch_dedup;
  p.batch_scope = parallel::BatchScopeFromName(scope);
  p.overlap_degree = overlap_degree;
  p.smart_group = parallel::SmartGroupFromString(smart);
  p.shadow = parallel::ShadowFromString(shadow);
  return p;
}

void AddMoeLayoutFlags(CLI::App& app, MoeLayoutFlags* f, std::string_view trace_help) {
  AddIntOption(app, "--tp", &f->tp, 1, 4096, "dense tensor-parallel degree");
  AddIntOption(app, "--ep", &f->ep, 0, 4096,
               "expert-parallel size (default: as large as possible)");
  AddIntOption(app, "--etp", &f->etp, 1, 4096, "expert tensor parallel (Megatron arrangement)");
  app.add_option("--arrangement", f->arrangement, "deepspeed | megatron")
      ->check(CLI::IsMember({"deepspeed", "megatron"}));
  app.add_option("--dispatch", f->dispatch, "alltoall | alltoallv | allgather")
      ->check(CLI::IsMember({"alltoall", "alltoallv", "allgather"}));
  app.add_option("--adaptive-r", f->adaptive_r, "R (0 or a divisor of the H shards) or auto");
  AddIntOption(app, "--2dh", &f->hierarchical, 0, 4096,
               "hierarchical all-to-all with this many ranks/node");
  app.add_flag("--no-tp-dedup", f->no_tp_dedup, "DeepSpeed arrangement: no TP de-duplication");
  app.add_flag("--no-dispatch-dedup", f->no_dispatch_dedup,
               "alltoallv: send a token once per kept (token, choice), not once per destination "
               "rank");
  app.add_option("--scope", f->scope,
                 "global (capacity, slots and l_aux over the batch: equals the single-rank run) | "
                 "per_rank (Tutel/DeepSpeed default)")
      ->check(CLI::IsMember({"global", "per_rank"}));
  app.add_option("--transport", f->transport, "auto (mpi when started by mpirun) | inproc | mpi")
      ->check(CLI::IsMember({"auto", "inproc", "mpi"}));
  AddIntOption(app, "--overlap-degree", &f->overlap_degree, 1, 1024,
               "Tutel's a2a-FFN overlap: pipeline the token all-to-alls in D chunks");
  app.add_option("--smart-schedule", f->smart,
                 "FasterMoE's pair-wise schedule: off | auto | group size g");
  app.add_option("--shadow", f->shadow, "FasterMoE's shadow experts: none | auto | E1,E2,...");
  app.add_option("--trace", f->trace_path, std::string(trace_help));
}

}  // namespace switchyard::cli
