// `switchyard groups`: prints the process groups of an expert-parallel layout (SPEC §2.1), in the
// DeepSpeed arrangement or Megatron-Core's folding, and where each rank's experts live.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "switchyard/parallel/mesh.h"

namespace switchyard::cli {
namespace {

struct GroupsOptions {
  int world = 1;
  int tp = 1;
  int ep = 0;
  int etp = 1;
  int64_t experts = 0;  // 0: ep experts (one per EP rank)
  int64_t hidden = 0;   // 0: any multiple of the shards
  std::string arrangement = "deepspeed";
  bool json = false;
};

int RunGroups(const GroupsOptions& o) {
  parallel::MeshConfig c;
  c.world_size = o.world;
  c.tp = o.tp;
  c.ep = o.ep;
  c.etp = o.etp;
  c.arrangement = parallel::ArrangementFromName(o.arrangement);
  int64_t experts = o.experts;
  if (experts == 0) {
    int ep = o.ep > 0 ? o.ep
                      : (c.arrangement == parallel::Arrangement::kDeepSpeed ? o.world / o.tp
                                                                            : o.world / o.etp);
    experts = std::max(1, ep);
  }
  const int64_t hidden = o.hidden > 0 ? o.hidden : int64_t{1} << 20;
  parallel::Mesh mesh(c, experts, hidden);
  if (!o.json) {
    fmt::print("{}", mesh.Describe());
    return 0;
  }
  nlohmann::json j = {{"arrangement", parallel::ArrangementName(c.arrangement)},
                      {"world", o.world},
                      {"tp", o.tp},
                      {"ep", mesh.ep()},
                      {"experts", experts},
                      {"local_experts", mesh.local_experts()},
                      {"expert_shards", mesh.shards()},
                      {"data_shards", mesh.data_shards()}};
  for (parallel::GroupKind kind : mesh.DescribedKinds()) {
    j["groups"][std::string(parallel::GroupKindName(kind))] = mesh.Groups(kind);
  }
  fmt::print("{}\n", j.dump());
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "groups",
    "Print the process groups of an expert-parallel layout (tp, dp, ep, ep_dp; Megatron: etp, "
    "edp)",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<GroupsOptions>();
      app.add_option("--world", o->world, "number of ranks")
          ->required()
          ->check(CLI::Range(1, 1 << 20));
      app.add_option("--tp", o->tp, "dense tensor-parallel degree")->check(CLI::Range(1, 1 << 20));
      app.add_option("--ep", o->ep, "expert-parallel size (default: as large as possible)")
          ->check(CLI::Range(0, 1 << 20));
      app.add_option("--etp", o->etp, "expert tensor-parallel degree (Megatron arrangement)")
          ->check(CLI::Range(1, 1 << 20));
      app.add_option("--experts", o->experts, "number of experts (default: one per EP rank)")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
      app.add_option("--hidden", o->hidden, "expert hidden size, to check it divides (optional)")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
      app.add_option("--arrangement", o->arrangement, "deepspeed | megatron")
          ->check(CLI::IsMember({"deepspeed", "megatron"}));
      app.add_flag("--json", o->json, "print one JSON object");
      return [o] { return RunGroups(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
