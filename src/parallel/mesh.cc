#include "switchyard/parallel/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "switchyard/core/error.h"

namespace switchyard::parallel {

namespace {

// The five dimensions, in the default order.
enum Dim : uint8_t { kTp = 0, kCp = 1, kEp = 2, kDp = 3, kPp = 4 };
constexpr std::array<std::string_view, 5> kDimNames = {"tp", "cp", "ep", "dp", "pp"};
using DimMask = uint8_t;
constexpr DimMask Bit(Dim d) { return static_cast<DimMask>(1u << d); }

// Parses an order string; throws InvalidArgument naming the bad part. Returns the dimension at
// each position, left-out ones appended in the default order (`named` tells which were named).
std::array<uint8_t, 5> ParseOrder(std::string_view order, std::array<bool, 5>* named) {
  named->fill(false);
  std::array<uint8_t, 5> dims{};
  size_t count = 0;
  size_t begin = 0;
  for (;;) {
    const size_t end = std::min(order.find('-', begin), order.size());
    const std::string_view token = order.substr(begin, end - begin);
    const auto it = std::find(kDimNames.begin(), kDimNames.end(), token);
    SY_REQUIRE(it != kDimNames.end(), InvalidArgument,
               "order '{}': '{}' is not a dimension; expected names from tp, cp, ep, dp, pp "
               "separated by '-' (e.g. '{}')",
               order, token, kDefaultMeshOrder);
    const auto d = static_cast<Dim>(it - kDimNames.begin());
    SY_REQUIRE(!(*named)[d], InvalidArgument, "order '{}': '{}' is named twice", order, token);
    (*named)[d] = true;
    dims[count++] = d;
    if (end == order.size()) break;
    begin = end + 1;
  }
  for (int d = 0; d < 5; ++d) {
    if (!(*named)[static_cast<size_t>(d)]) dims[count++] = static_cast<uint8_t>(d);
  }
  return dims;
}

// Color (index over the unmasked dimensions) and key (index over the masked ones) of `rank` in a
// grid of `sizes` (by order position; first fastest), as Megatron-Core's masked rank groups.
void MaskedColorKey(const std::array<int, 5>& sizes, const std::array<uint8_t, 5>& dims,
                    DimMask mask, int rank, int* color, int* key) {
  int c = 0, k = 0, cmul = 1, kmul = 1;
  for (size_t p = 0; p < 5; ++p) {
    const int coord = rank % sizes[p];
    rank /= sizes[p];
    if ((mask & (1u << dims[p])) != 0) {
      k += coord * kmul;
      kmul *= sizes[p];
    } else {
      c += coord * cmul;
      cmul *= sizes[p];
    }
  }
  *color = c;
  *key = k;
}

// Groups from (color, key) of every rank: ranks in key order, groups by smallest rank.
template <typename F>
std::vector<std::vector<int>> CollectGroups(int world, const F& color_key) {
  std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
  for (int r = 0; r < world; ++r) {
    int color = 0, key = 0;
    color_key(r, &color, &key);
    if (color >= 0) by_color[color].emplace_back(key, r);
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

}  // namespace

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
    case GroupKind::kPipeline: return "pp";
    case GroupKind::kContext: return "cp";
    case GroupKind::kTensorContext: return "tp_cp";
    case GroupKind::kDataContext: return "dp_cp";
    case GroupKind::kModel: return "mp";
    case GroupKind::kEmbedding: return "embedding";
  }
  return "?";
}

int ResolvedExpertParallel(const MeshConfig& c) {
  if (c.ep > 0) return c.ep;
  const int per = c.arrangement == Arrangement::kMegatron ? c.etp * c.pp : c.tp * c.pp;
  const int most = std::max(1, per > 0 ? c.world_size / per : 1);
  const int64_t e = c.num_experts;
  if (e <= 0 || e % most == 0 || most % e == 0) return most;
  return static_cast<int>(std::gcd(static_cast<int64_t>(most), e));
}

Mesh::Mesh(const MeshConfig& config) : config_(config) {
  const int w = config.world_size, t = config.tp, npp = config.pp, ncp = config.cp;
  SY_REQUIRE(w >= 1, InvalidArgument, "world size: expected >= 1, got {}", w);
  for (const auto& [name, v] : {std::pair<const char*, int>{"tp", t}, {"pp", npp}, {"cp", ncp}}) {
    SY_REQUIRE(v >= 1, InvalidArgument, "{}: expected >= 1, got {}", name, v);
  }
  SY_REQUIRE(w % (t * npp * ncp) == 0, InvalidArgument,
             "world {} is not divisible by tp {} × pp {} × cp {}: the data-parallel size is world "
             "/ (tp × pp × cp)",
             w, t, npp, ncp);
  dp_ = w / (t * npp * ncp);
  SY_REQUIRE(config.ep >= 0, InvalidArgument,
             "ep: expected >= 0 (0 = as large as possible), got {}", config.ep);
  SY_REQUIRE(config.etp >= 1, InvalidArgument, "etp: expected >= 1, got {}", config.etp);
  const bool megatron = config.arrangement == Arrangement::kMegatron;
  sequence_parallel_ = t > 1 && config.sequence_parallel.value_or(megatron);
  if (t > 1 && config.sequence_parallel.has_value()) {
    SY_REQUIRE(*config.sequence_parallel == megatron, InvalidArgument,
               "sequence parallel {} with tp {}: the {} arrangement {}",
               *config.sequence_parallel ? "on" : "off", t, ArrangementName(config.arrangement),
               megatron ? "needs it on (the MoE part takes every rank's own tokens)"
                        : "builds its EP groups from tp ranks holding the same tokens, so it "
                          "needs it off");
  }
  shards_ = config.etp;
  ep_ = ResolvedExpertParallel(config);
  int nedp = 1;
  if (!megatron) {
    const int d = dp_ * ncp;
    SY_REQUIRE(d % ep_ == 0, InvalidArgument,
               "ep {} does not divide the {} data-parallel ranks (dp {} × cp {}) of each tp rank "
               "and stage: EP groups are built from the ranks with the same tp rank",
               ep_, d, dp_, ncp);
    SY_REQUIRE(ep_ % shards_ == 0, InvalidArgument,
               "etp {} does not divide ep {}: the DeepSpeed arrangement splits each expert over "
               "etp consecutive members of its EP group",
               shards_, ep_);
    expert_group_size_ = ep_;
    nedp = d / ep_;
  } else {
    SY_REQUIRE(w % (shards_ * npp) == 0, InvalidArgument,
               "world {} is not divisible by etp {} × pp {}: the expert mesh is etp × ep × edp × "
               "pp",
               w, shards_, npp);
    SY_REQUIRE(w % (shards_ * ep_ * npp) == 0, InvalidArgument,
               "world {} is not divisible by etp {} × ep {} × pp {}: the expert mesh is etp × ep × "
               "edp × pp",
               w, shards_, ep_, npp);
    expert_group_size_ = shards_ * ep_;
    nedp = w / (shards_ * ep_ * npp);
  }

  std::array<bool, 5> named{};
  order_dims_ = ParseOrder(config.order, &named);
  const std::array<int, 5> dense_by_dim = {t, ncp, 1, dp_, npp};
  const std::array<int, 5> expert_by_dim = {megatron ? shards_ : 1, 1, megatron ? ep_ : 1, nedp,
                                            npp};
  for (size_t d = 0; d < 5; ++d) {
    const int size = std::max(dense_by_dim[d], megatron ? expert_by_dim[d] : 1);
    SY_REQUIRE(named[d] || size == 1, InvalidArgument,
               "order '{}' leaves out {} (size {}); only dimensions of size 1 may be left out",
               config.order, kDimNames[d], size);
  }
  order_.clear();
  for (size_t p = 0; p < 5; ++p) {
    dense_sizes_[p] = dense_by_dim[order_dims_[p]];
    expert_sizes_[p] = expert_by_dim[order_dims_[p]];
    order_ += fmt::format("{}{}", p ? "-" : "", kDimNames[order_dims_[p]]);
  }
  if (megatron && npp > 1) {
    // The MoE part of a stage must sit on the ranks of that stage.
    auto stages = [&](const std::array<int, 5>& sizes) {
      return CollectGroups(
          w, [&](int r, int* c, int* k) { MaskedColorKey(sizes, order_dims_, Bit(kPp), r, c, k); });
    };
    SY_REQUIRE(stages(dense_sizes_) == stages(expert_sizes_), InvalidArgument,
               "order '{}': the expert mesh (etp {} × ep {} × edp {} × pp {}) puts the pipeline "
               "stages on other ranks than the dense mesh (tp {} × cp {} × dp {} × pp {}); put pp "
               "last in the order or make etp × ep × edp equal tp × cp × dp position by position",
               order_, shards_, ep_, nedp, npp, t, ncp, dp_, npp);
  }
}

int Mesh::edp() const {
  if (config_.arrangement == Arrangement::kMegatron) {
    return config_.world_size / (shards_ * ep_ * config_.pp);
  }
  return dp_ * config_.cp / ep_;
}

int Mesh::data_shards() const { return dp_ * config_.cp * (sequence_parallel_ ? config_.tp : 1); }

bool Mesh::SameLayout(const Mesh& other) const {
  if (config_.world_size != other.config_.world_size || shards_ != other.shards_ ||
      config_.arrangement != other.config_.arrangement ||
      sequence_parallel_ != other.sequence_parallel_) {
    return false;
  }
  for (GroupKind kind : kAllGroupKinds) {
    if (Groups(kind) != other.Groups(kind)) return false;
  }
  return true;
}

void Mesh::ColorKey(GroupKind kind, int r, int* color, int* key) const {
  auto dense = [&](DimMask mask) {
    MaskedColorKey(dense_sizes_, order_dims_, mask, r, color, key);
  };
  auto expert = [&](DimMask mask) {
    MaskedColorKey(expert_sizes_, order_dims_, mask, r, color, key);
  };
  switch (kind) {
    case GroupKind::kTensor: return dense(Bit(kTp));
    case GroupKind::kData: return dense(Bit(kDp));
    case GroupKind::kPipeline: return dense(Bit(kPp));
    case GroupKind::kContext: return dense(Bit(kCp));
    case GroupKind::kTensorContext: return dense(Bit(kTp) | Bit(kCp));
    case GroupKind::kDataContext: return dense(Bit(kDp) | Bit(kCp));
    case GroupKind::kModel: return dense(Bit(kTp) | Bit(kPp));
    case GroupKind::kTokens:
      return dense(Bit(kDp) | Bit(kCp) | (sequence_parallel_ ? Bit(kTp) : 0));
    case GroupKind::kEmbedding: {
      const int stages = config_.pp;
      dense(Bit(kPp));
      if (stages > 1) {
        if (*key == stages - 1) {
          *key = 1;
        } else if (*key != 0) {
          *color = -1;
        }
      }
      return;
    }
    default: break;
  }
  if (config_.arrangement == Arrangement::kMegatron) {
    switch (kind) {
      case GroupKind::kExpert: return expert(Bit(kTp) | Bit(kEp));
      case GroupKind::kExpertParallel: return expert(Bit(kEp));
      case GroupKind::kExpertTensor: return expert(Bit(kTp));
      case GroupKind::kExpertData:
      case GroupKind::kExpertHolders: return expert(Bit(kDp));
      default: break;
    }
  } else {
    // EP groups: chunks of ep consecutive members of the dp-cp group (same tp rank and stage).
    int dc_color = 0, d = 0;
    MaskedColorKey(dense_sizes_, order_dims_, Bit(kDp) | Bit(kCp), r, &dc_color, &d);
    const int chunks = dp_ * config_.cp / ep_;
    const int c = d / ep_, j = d % ep_, q = j / shards_, i = j % shards_;
    int stage = 0, unused = 0;
    MaskedColorKey(dense_sizes_, order_dims_, Bit(kPp), r, &unused, &stage);
    switch (kind) {
      case GroupKind::kExpert:
      case GroupKind::kExpertParallel: *color = dc_color * chunks + c, *key = j; return;
      case GroupKind::kExpertTensor:
        *color = (dc_color * chunks + c) * positions() + q, *key = i;
        return;
      case GroupKind::kExpertData: *color = dc_color * ep_ + j, *key = c; return;
      case GroupKind::kExpertHolders: *color = stage * ep_ + j, *key = r; return;
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
  int color = 0;
  ColorKey(GroupKind::kTensor, r, &color, &c.tp_rank);
  ColorKey(GroupKind::kContext, r, &color, &c.cp_rank);
  ColorKey(GroupKind::kData, r, &color, &c.dp_rank);
  ColorKey(GroupKind::kPipeline, r, &color, &c.pp_rank);
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
  return CollectGroups(config_.world_size,
                       [&](int r, int* color, int* key) { ColorKey(kind, r, color, key); });
}

std::vector<int> Mesh::GroupOf(GroupKind kind, int rank) const {
  for (std::vector<int>& g : Groups(kind)) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  }
  SY_CHECK(kind == GroupKind::kEmbedding, "rank {} is in no {} group", rank, GroupKindName(kind));
  return {};
}

std::vector<GroupKind> Mesh::DescribedKinds() const {
  std::vector<GroupKind> kinds{GroupKind::kTensor};
  if (config_.cp > 1) kinds.push_back(GroupKind::kContext);
  kinds.push_back(GroupKind::kData);
  if (config_.pp > 1) kinds.push_back(GroupKind::kPipeline);
  if (config_.cp > 1) {
    kinds.push_back(GroupKind::kTensorContext);
    kinds.push_back(GroupKind::kDataContext);
  }
  if (config_.pp > 1) {
    kinds.push_back(GroupKind::kModel);
    kinds.push_back(GroupKind::kEmbedding);
  }
  if (config_.cp > 1 || config_.pp > 1 || sequence_parallel_) kinds.push_back(GroupKind::kTokens);
  kinds.push_back(GroupKind::kExpert);
  if (config_.arrangement == Arrangement::kMegatron) {
    kinds.push_back(GroupKind::kExpertParallel);
    kinds.push_back(GroupKind::kExpertTensor);
  } else if (shards_ > 1) {
    kinds.push_back(GroupKind::kExpertTensor);
  }
  kinds.push_back(GroupKind::kExpertData);
  return kinds;
}

namespace {

std::string_view KindTitle(GroupKind kind, Arrangement a) {
  switch (kind) {
    case GroupKind::kTensor: return "tensor parallel (dense)";
    case GroupKind::kData: return "data parallel (dense)";
    case GroupKind::kTokens: return "token shards of a stage's batch";
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
    case GroupKind::kPipeline: return "pipeline stages of one replica";
    case GroupKind::kContext: return "context parallel (chunks of the same sequences)";
    case GroupKind::kTensorContext: return "tensor x context parallel";
    case GroupKind::kDataContext: return "data x context parallel (dense gradients)";
    case GroupKind::kModel: return "model parallel (tensor x pipeline: one replica)";
    case GroupKind::kEmbedding: return "first and last stage (tied embeddings)";
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
      "arrangement {}: world {}, tp {}{}, cp {}, dp {}, pp {}, order {}; ep {}, {} expert "
      "position(s){}, expert group of {} ranks, {} data shard(s) per stage\n",
      ArrangementName(config_.arrangement), config_.world_size, config_.tp,
      sequence_parallel_ ? " (sequence parallel)" : "", config_.cp, dp_, config_.pp, order_, ep_,
      positions(),
      shards_ > 1 ? fmt::format(", each expert split along H over {} ranks", shards_)
                  : std::string(),
      expert_group_size_, data_shards());
  for (GroupKind kind : DescribedKinds()) {
    std::vector<std::vector<int>> groups = Groups(kind);
    out += fmt::format("{:<9} {} x {}  {}:", GroupKindName(kind), groups.size(),
                       groups.empty() ? 0 : groups[0].size(), KindTitle(kind, config_.arrangement));
    // Appended piece by piece: `" " + Join(g)` (a prepend) trips a GCC 12 -Wrestrict false
    // positive.
    for (const auto& g : groups) out.append(" ").append(Join(g));
    out += "\n";
  }
  return out;
}

}  // namespace switchyard::parallel
