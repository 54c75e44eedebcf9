// `switchyard groups`: prints the process groups of a layout (parallel/mesh.h, docs/parallel.md
// "The mesh"): the dense tp x cp x dp x pp mesh in a rank order, the MoE part in the DeepSpeed
// arrangement or Megatron-Core's folding, and where each rank's experts live.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "switchyard/core/limits.h"
#include "switchyard/parallel/expert_shard.h"

namespace switchyard::cli {
namespace {

struct GroupsOptions {
  int world = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 0;
  int etp = 1;
  int64_t experts = 0;  // 0: ep experts (one per EP rank)
  int64_t hidden = 0;   // 0: any multiple of the shards
  std::string arrangement = "auto";
  std::string order = std::string(parallel::kDefaultMeshOrder);
  std::string sequence_parallel = "default";  // default | on | off
  bool all = false;
  bool json = false;
};

// Memory per rank of the world for the groups of every kind and their JSON (measured: 1.2 KB with
// --all --json at --world 2^20, 1.2 GB in all).
constexpr uint64_t kGroupsBytesPerRank = 2048;

int RunGroups(const GroupsOptions& o) {
  RequireMemory(
      static_cast<uint64_t>(o.world) * kGroupsBytesPerRank,
      fmt::format("groups: --world {} (the groups of every kind, about {} bytes per rank)", o.world,
                  kGroupsBytesPerRank));
  parallel::MeshConfig c;
  c.world_size = o.world;
  c.tp = o.tp;
  c.pp = o.pp;
  c.cp = o.cp;
  c.ep = o.ep;
  c.etp = o.etp;
  c.order = o.order;
  if (o.sequence_parallel != "default") {
    c.sequence_parallel = o.sequence_parallel == "on" || o.sequence_parallel == "true";
  }
  // "auto" as train's key: megatron with sequence parallelism, deepspeed otherwise.
  c.arrangement = o.arrangement != "auto" ? parallel::ArrangementFromName(o.arrangement)
                  : c.sequence_parallel.value_or(false) ? parallel::Arrangement::kMegatron
                                                        : parallel::Arrangement::kDeepSpeed;
  // Default: one expert per EP rank.
  const int64_t experts = o.experts > 0 ? o.experts : parallel::ResolvedExpertParallel(c);
  const int64_t hidden = o.hidden > 0 ? o.hidden : int64_t{1} << 20;
  // The degrees with the experts' H-shards (DeepSpeed: ep / E when E < ep), checked against them.
  const parallel::Mesh mesh = parallel::ExpertMesh(c, experts, hidden);
  std::vector<parallel::GroupKind> kinds = mesh.DescribedKinds();
  if (o.all) kinds.assign(parallel::kAllGroupKinds.begin(), parallel::kAllGroupKinds.end());
  if (!o.json) {
    fmt::print("{}{}", mesh.Describe(), parallel::DescribeExperts(mesh, experts));
    if (o.all) {
      for (parallel::GroupKind kind : kinds) {
        fmt::print("{:<14}", parallel::GroupKindName(kind));
        for (const std::vector<int>& g : mesh.Groups(kind)) {
          fmt::print(" [{}]", fmt::join(g, ","));
        }
        fmt::print("\n");
      }
    }
    return 0;
  }
  nlohmann::json j = {{"arrangement", parallel::ArrangementName(c.arrangement)},
                      {"world", o.world},
                      {"tp", o.tp},
                      {"pp", o.pp},
                      {"cp", o.cp},
                      {"dp", mesh.dp()},
                      {"order", mesh.order()},
                      {"sequence_parallel", mesh.sequence_parallel()},
                      {"ep", mesh.ep()},
                      {"etp", mesh.etp()},
                      {"edp", mesh.edp()},
                      {"experts", experts},
                      {"local_experts", parallel::LocalExperts(mesh, experts)},
                      {"expert_shards", mesh.shards()},
                      {"data_shards", mesh.data_shards()}};
  for (parallel::GroupKind kind : kinds) {
    j["groups"][std::string(parallel::GroupKindName(kind))] = mesh.Groups(kind);
  }
  fmt::print("{}\n", j.dump());
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "groups",
    "Print the process groups of a layout (tp, cp, dp, pp and their combinations; the MoE part's "
    "ep, etp, ep_dp)",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<GroupsOptions>();
      AddIntOption(app, "--world", &o->world, 1, 1 << 20, "number of ranks")->required();
      AddIntOption(app, "--tp", &o->tp, 1, 1 << 20, "dense tensor-parallel degree");
      AddIntOption(app, "--pp", &o->pp, 1, 1 << 20, "pipeline stages");
      AddIntOption(app, "--cp", &o->cp, 1, 1 << 20, "context-parallel degree");
      app.add_option("--order", o->order,
                     "rank order, first = fastest-varying: tp, cp, ep, dp, pp joined by '-' "
                     "(dimensions of size 1 may be left out)");
      app.add_option("--sequence-parallel", o->sequence_parallel,
                     "sequence parallel as tp's mode: on/true (alone: on) | off/false | default "
                     "(the arrangement's: deepspeed off, megatron on), as train's flag")
          ->expected(0, 1)
          ->default_str("on")
          ->check(CLI::IsMember({"default", "on", "off", "true", "false"}));
      app.add_flag("--all", o->all, "list the groups of every kind");
      AddIntOption(app, "--ep", &o->ep, 0, 1 << 20,
                   "expert-parallel size (default: as large as possible)");
      AddIntOption(app, "--etp", &o->etp, 1, 1 << 20,
                   "expert tensor-parallel degree (Megatron arrangement)");
      AddIntOption(app, "--experts", &o->experts, int64_t{0}, int64_t{1} << 30,
                   "number of experts (default: one per EP rank)");
      AddIntOption(app, "--hidden", &o->hidden, int64_t{0}, int64_t{1} << 40,
                   "expert hidden size, to check it divides (optional)");
      app.add_option("--arrangement", o->arrangement,
                     "auto (megatron with --sequence-parallel, else deepspeed) | deepspeed | "
                     "megatron")
          ->check(CLI::IsMember({"auto", "deepspeed", "megatron"}));
      app.add_flag("--json", o->json, "print one JSON object");
      return [o] { return RunGroups(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
