#include "cli/layout_flags.h"

#include <nlohmann/json.hpp>

#include "cli/flags.h"
#include "switchyard/core/error.h"
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

int64_t ModelLayoutFlags::ranks() const {
  return int64_t{tp} * int64_t{cp} * int64_t{pp} * int64_t{dp};
}

std::string ModelLayoutFlags::KeysJson() const {
  const nlohmann::json j = {{"ranks", ranks()}, {"tp", tp},           {"sequence_parallel", sp},
                            {"ep", ep},         {"etp", etp},         {"pp", pp},
                            {"cp", cp},         {"cp_algo", cp_algo}, {"arrangement", arrangement}};
  return j.dump();
}

void AddModelLayoutFlags(CLI::App& app, ModelLayoutFlags* f) {
  AddIntOption(app, "--tp", &f->tp, 1, 4096, "tensor-parallel size (train's tp)");
  app.add_flag("--sp,--sequence-parallel", f->sp,
               "sequence parallelism over the tp ranks (train's sequence_parallel)");
  AddIntOption(app, "--ep", &f->ep, 0, 4096,
               "expert-parallel size (default: as large as the arrangement allows)");
  AddIntOption(app, "--etp", &f->etp, 1, 4096,
               "expert tensor-parallel size (megatron arrangement)");
  AddIntOption(app, "--pp", &f->pp, 1, 4096, "pipeline stages");
  AddIntOption(app, "--cp", &f->cp, 1, 4096, "context-parallel size");
  app.add_option("--cp-algo", f->cp_algo, "context-parallel attention: ring | ulysses")
      ->check(CLI::IsMember({"ring", "ulysses"}));
  AddIntOption(app, "--dp", &f->dp, 1, 4096, "data-parallel size (ranks = tp x cp x pp x dp)");
  app.add_option("--arrangement", f->arrangement, "experts beside tp: auto | deepspeed | megatron")
      ->check(CLI::IsMember({"auto", "deepspeed", "megatron"}));
}

}  // namespace switchyard::cli
