#include "switchyard/parallel/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "switchyard/core/error.h"

namespace switchyard::parallel {

std::string_view ArrangementName(Arrangement arrangement) {
  return arrangement == Arrangement::kDeepSpeed ? "deepspeed" : "megatron";
}

Arrangement ArrangementFromName(std::string_view name) {
  if (name == "deepspeed") return Arrangement::kDeepSpeed;
  if (name == "megatron") return Arrangement::kMegatron;
  throw InvalidArgument(
      fmt::format("arrangement: expected 'deepspeed' or 'megatron', got '{}'", name));
}

std::string_view GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTensor: return "tp";
    case GroupKind::kData: return "dp";
    case GroupKind::kTokens: return "tokens";
    case GroupKind::kExpert: return "expert";
    case GroupKind::kExpertParallel: return "ep";
    case GroupKind::kExpertTensor: return "etp";
    case GroupKind::kExpertData: return "ep_dp";
    case GroupKind::kExpertHolders: return "expert_holders";
  }
  return "?";
}

Mesh::Mesh(const MeshConfig& config, int64_t num_experts, int64_t hidden_dim)
    : config_(config), num_experts_(num_experts), hidden_dim_(hidden_dim) {
  const int w = config.world_size, t = config.tp;
  SY_REQUIRE(w >= 1, InvalidArgument, "world size: expected >= 1, got {}", w);
  SY_REQUIRE(t >= 1 && w % t == 0, InvalidArgument,
             "tp {} does not divide the world size {} (expected a divisor)", t, w);
  SY_REQUIRE(num_experts >= 1, InvalidArgument, "num_experts: expected >= 1, got {}", num_experts);
  SY_REQUIRE(config.ep >= 0, InvalidArgument,
             "ep: expected >= 0 (0 = as large as possible), got {}", config.ep);
  SY_REQUIRE(config.etp >= 1, InvalidArgument, "etp: expected >= 1, got {}", config.etp);
  if (config.arrangement == Arrangement::kDeepSpeed) {
    SY_REQUIRE(config.etp == 1, InvalidArgument,
               "etp {}: expert tensor parallelism is Megatron's folding (--arrangement megatron); "
               "the DeepSpeed arrangement shards experts along H only when num_experts < ep",
               config.etp);
    const int d = w / t;
    ep_ = config.ep > 0 ? config.ep : d;
    SY_REQUIRE(d % ep_ == 0, InvalidArgument,
               "ep {} does not divide the {} data-parallel ranks (world {} / tp {}): EP groups are "
               "built from the ranks with the same tp rank",
               ep_, d, w, t);
    if (num_experts >= ep_) {
      SY_REQUIRE(num_experts % ep_ == 0, InvalidArgument,
                 "num_experts {} is not divisible by ep {}: every EP rank must hold the same "
                 "number of experts",
                 num_experts, ep_);
      shards_ = 1;
    } else {
      SY_REQUIRE(ep_ % num_experts == 0, InvalidArgument,
                 "ep {} is not a multiple of num_experts {}: with fewer experts than EP ranks each "
                 "expert is split over ep / num_experts ranks",
                 ep_, num_experts);
      shards_ = static_cast<int>(ep_ / num_experts);
    }
    expert_group_size_ = ep_;
  } else {
    shards_ = config.etp;
    SY_REQUIRE(w % shards_ == 0, InvalidArgument, "etp {} does not divide the world size {}",
               shards_, w);
    ep_ = config.ep > 0 ? config.ep : w / shards_;
    SY_REQUIRE(w % (shards_ * ep_) == 0, InvalidArgument,
               "etp {} x ep {} = {} does not divide the world size {}", shards_, ep_, shards_ * ep_,
               w);
    SY_REQUIRE(num_experts % ep_ == 0, InvalidArgument,
               "num_experts {} is not divisible by ep {}: every EP rank must hold the same number "
               "of experts",
               num_experts, ep_);
    expert_group_size_ = shards_ * ep_;
  }
  SY_REQUIRE(hidden_dim % shards_ == 0, InvalidArgument,
             "hidden_dim {} is not divisible by the {} H-shards of each expert", hidden_dim,
             shards_);
}

int Mesh::data_shards() const {
  return config_.arrangement == Arrangement::kDeepSpeed ? config_.world_size / config_.tp
                                                        : config_.world_size;
}

void Mesh::ColorKey(GroupKind kind, int r, int* color, int* key) const {
  const int t = config_.tp, n = shards_;
  const int u = r % t;
  if (kind == GroupKind::kTensor) {
    *color = r / t;
    *key = u;
    return;
  }
  if (kind == GroupKind::kData) {
    *color = u;
    *key = r / t;
    return;
  }
  if (config_.arrangement == Arrangement::kDeepSpeed) {
    const int d = r / t, c = d / ep_, j = d % ep_, q = j / n, i = j % n;
    switch (kind) {
      case GroupKind::kTokens: *color = u, *key = d; return;
      case GroupKind::kExpert:
      case GroupKind::kExpertParallel: *color = c * t + u, *key = j; return;
      case GroupKind::kExpertTensor: *color = (c * t + u) * positions() + q, *key = i; return;
      case GroupKind::kExpertData: *color = u * ep_ + j, *key = c; return;
      case GroupKind::kExpertHolders: *color = j, *key = r; return;
      default: break;
    }
  } else {
    const int p = expert_group_size_, m = r % p, edp = r / p, i = m % n, q = m / n;
    switch (kind) {
      case GroupKind::kTokens: *color = 0, *key = r; return;
      case GroupKind::kExpert: *color = edp, *key = m; return;
      case GroupKind::kExpertParallel: *color = edp * n + i, *key = q; return;
      case GroupKind::kExpertTensor: *color = edp * ep_ + q, *key = i; return;
      case GroupKind::kExpertData:
      case GroupKind::kExpertHolders: *color = m, *key = edp; return;
      default: break;
    }
  }
  SY_CHECK(false, "unhandled group kind {}", static_cast<int>(kind));
}

RankCoords Mesh::Coords(int r) const {
  SY_REQUIRE(r >= 0 && r < config_.world_size, InvalidArgument,
             "rank {} outside the world of {} ranks", r, config_.world_size);
  RankCoords c;
  c.rank = r;
  c.tp_rank = r % config_.tp;
  int color = 0;
  ColorKey(GroupKind::kTokens, r, &color, &c.token_shard);
  ColorKey(GroupKind::kExpert, r, &color, &c.expert_member);
  ColorKey(GroupKind::kExpertData, r, &color, &c.expert_replica);
  c.expert_position = c.expert_member / shards_;
  c.expert_shard = c.expert_member % shards_;
  // Expert groups are numbered in order of their smallest rank.
  std::vector<std::vector<int>> groups = Groups(GroupKind::kExpert);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (std::find(groups[g].begin(), groups[g].end(), r) != groups[g].end()) {
      c.expert_group = static_cast<int>(g);
    }
  }
  return c;
}

std::vector<std::vector<int>> Mesh::Groups(GroupKind kind) const {
  std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
  for (int r = 0; r < config_.world_size; ++r) {
    int color = 0, key = 0;
    ColorKey(kind, r, &color, &key);
    by_color[color].emplace_back(key, r);
  }
  std::vector<std::vector<int>> groups;
  for (auto& [color, members] : by_color) {
    std::sort(members.begin(), members.end());
    std::vector<int> ranks;
    for (auto [key, r] : members) ranks.push_back(r);
    groups.push_back(std::move(ranks));
  }
  std::sort(groups.begin(), groups.end(), [](const std::vector<int>& a, const std::vector<int>& b) {
    return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
  });
  return groups;
}

std::vector<int> Mesh::GroupOf(GroupKind kind, int rank) const {
  for (std::vector<int>& g : Groups(kind)) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  }
  SY_CHECK(false, "rank {} is in no {} group", rank, GroupKindName(kind));
  return {};
}

std::vector<GroupKind> Mesh::DescribedKinds() const {
  if (config_.arrangement == Arrangement::kDeepSpeed) {
    std::vector<GroupKind> kinds{GroupKind::kTensor, GroupKind::kData, GroupKind::kExpert};
    if (shards_ > 1) kinds.push_back(GroupKind::kExpertTensor);
    kinds.push_back(GroupKind::kExpertData);
    return kinds;
  }
  return {GroupKind::kTensor,         GroupKind::kData,         GroupKind::kExpert,
          GroupKind::kExpertParallel, GroupKind::kExpertTensor, GroupKind::kExpertData};
}

namespace {

std::string_view KindTitle(GroupKind kind, Arrangement a) {
  switch (kind) {
    case GroupKind::kTensor: return "tensor parallel (dense)";
    case GroupKind::kData: return "data parallel (dense)";
    case GroupKind::kTokens: return "token shards of the global batch";
    case GroupKind::kExpert:
      return a == Arrangement::kDeepSpeed ? "expert parallel (EP groups: tokens are exchanged "
                                            "within)"
                                          : "expert tp x ep (tokens are exchanged within)";
    case GroupKind::kExpertParallel: return "expert parallel (same expert-tp rank)";
    case GroupKind::kExpertTensor: return "expert tensor parallel (H-shards of the same experts)";
    case GroupKind::kExpertData:
      return a == Arrangement::kDeepSpeed ? "expert data parallel (ep_dp: same experts)"
                                          : "expert data parallel (edp: same expert shard)";
    case GroupKind::kExpertHolders: return "every holder of the same expert shard";
  }
  return "";
}

std::string Join(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{}", i ? "," : "", v[i]);
  return s + "]";
}

}  // namespace

std::string Mesh::Describe() const {
  std::string out = fmt::format(
      "arrangement {}: world {}, tp {}, ep {}, {} experts ({} per EP rank{}), expert group of {} "
      "ranks, {} data shard(s)\n",
      ArrangementName(config_.arrangement), config_.world_size, config_.tp, ep_, num_experts_,
      local_experts(),
      shards_ > 1 ? fmt::format(", each split along H over {} ranks", shards_) : std::string(),
      expert_group_size_, data_shards());
  for (GroupKind kind : DescribedKinds()) {
    std::vector<std::vector<int>> groups = Groups(kind);
    out += fmt::format("{:<6} {} x {}  {}:", GroupKindName(kind), groups.size(),
                       groups.empty() ? 0 : groups[0].size(), KindTitle(kind, config_.arrangement));
    for (const auto& g : groups) out += " " + Join(g);
    out += "\n";
  }
  out += "experts of each expert-group member (position: experts, H-shard):";
  const int64_t el = local_experts();
  for (int m = 0; m < expert_group_size_; ++m) {
    int64_t first = (m / shards_) * el;
    out += fmt::format(" {}:", m);
    out += el == 1 ? fmt::format("e{}", first) : fmt::format("e{}-{}", first, first + el - 1);
    if (shards_ > 1) out += fmt::format("/h{}", m % shards_);
  }
  return out + "\n";
}

}  // namespace switchyard::parallel
