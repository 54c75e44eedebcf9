#include "switchyard/train/parallel_context.h"

#include <fmt/format.h>

#include "switchyard/core/error.h"

namespace switchyard::train {
namespace {

// "8 ranks = tp 2 (sequence parallel) x dp 2 x pp 2; experts: ep 4 (megatron arrangement), ZeRO
// stage 1".
std::string Describe(int world, const parallel::Mesh& mesh, const TensorParallelOptions& tp_options,
                     const ContextParallelOptions& cp_options, const LayoutNotes& notes) {
  std::string tp = fmt::format("tp {}", mesh.tp());
  if (mesh.tp() > 1 && tp_options.sequence_parallel) {
    tp += tp_options.comm_overlap ? " (sequence parallel, comm-GEMM overlap)"
                                  : " (sequence parallel)";
  }
  std::string experts;
  if (notes.experts) {
    experts = fmt::format(
        "; experts: ep {}{} ({} arrangement), ZeRO stage {}", mesh.ep(),
        mesh.shards() > 1 ? fmt::format(" x {} H-shards", mesh.shards()) : std::string(),
        mesh.arrangement() == parallel::Arrangement::kMegatron ? "megatron" : "deepspeed",
        notes.zero_stage);
  } else {
    experts = fmt::format("; ZeRO stage {}", notes.zero_stage);
  }
  std::string pp = mesh.pp() > 1 ? fmt::format(" x pp {}", mesh.pp()) : std::string();
  if (mesh.cp() > 1) {
    pp += fmt::format(" x cp {} ({})", mesh.cp(),
                      cp_options.algorithm == CpAlgorithm::kUlysses ? "ulysses" : "ring");
  }
  return fmt::format("{} rank{} = {} x dp {}{}{}", world, world == 1 ? "" : "s", tp, mesh.dp(), pp,
                     experts);
}

}  // namespace

ParallelContext MakeParallelContext(const parallel::ProcessGroups& groups, int ranks_in_process,
                                    const TensorParallelOptions& tp,
                                    const ContextParallelOptions& cp, const LayoutNotes& notes) {
  const parallel::Mesh& mesh = groups.mesh();
  const parallel::RankCoords& coords = groups.coords();
  SY_REQUIRE(tp.sequence_parallel == mesh.sequence_parallel() || mesh.tp() == 1, InvalidArgument,
             "parallel context: the model's sequence parallelism ({}) is not the mesh's ({})",
             tp.sequence_parallel, mesh.sequence_parallel());
  ParallelContext c;
  c.rank = groups.world().rank();
  c.world_size = groups.world().size();
  c.ranks_in_process = ranks_in_process;
  c.data_rank = coords.dp_rank;
  c.data_size = mesh.dp();
  c.tp_rank = coords.tp_rank;
  c.tp_size = mesh.tp();
  c.cp_rank = coords.cp_rank;
  c.cp_size = mesh.cp();
  c.pp_rank = coords.pp_rank;
  c.pp_size = mesh.pp();
  c.reports_loss = coords.tp_rank == 0;
  c.reports_routing = coords.tp_rank == 0 || mesh.sequence_parallel();
  c.routing_replicas = mesh.data_shards();
  c.pipeline = &groups.Get(parallel::GroupKind::kPipeline);  // one rank with pp 1
  if (mesh.tp() > 1) c.tensor_parallel = {&groups.Get(parallel::GroupKind::kTensor), tp};
  if (mesh.cp() > 1) c.context_parallel = {&groups.Get(parallel::GroupKind::kContext), cp};
  c.description = Describe(c.world_size, mesh, tp, cp, notes);
  return c;
}

}  // namespace switchyard::train
