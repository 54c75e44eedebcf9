// The config table (config_keys.def) drives every form of a key: walks it and checks that each
// key round-trips through JSON and flags, has help and a category, sits in exactly the lists its
// row says (layout keys, resume-must-match keys, the MoE layer's keys) and that its range is
// enforced. A key added to the table alone passes all of it.
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/train/config.h"
#include "train/config_fields.h"

namespace switchyard::train {
namespace {

using nlohmann::json;

// A value of the field's type other than `v` (one that survives JSON).
template <typename T>
void MakeOther(T& v) {
  if constexpr (config_keys::IsChoice<T>::value) {
    for (auto e : ChoiceTraits<typename T::Enum>::kValues) {
      if (!(v == e)) {
        v = e;
        return;
      }
    }
    FAIL() << "a choice with one value";
  } else if constexpr (std::is_same_v<T, bool>) {
    v = !v;
  } else if constexpr (std::is_enum_v<T>) {
    v = static_cast<T>(static_cast<int>(v) + 1);  // NormKind, Activation, Recompute, Precision
  } else if constexpr (std::is_integral_v<T>) {
    v = static_cast<T>(v + 3);
  } else if constexpr (std::is_floating_point_v<T>) {
    v = static_cast<T>(v + 0.25);
  } else if constexpr (std::is_same_v<T, std::string>) {
    v = v.empty() ? "held.txt" : v + "_2";
  } else {
    v.push_back(3);
  }
}

// The command-line text of a key's value in `c` (strings bare, as a user types them).
std::string FlagText(const TrainConfig& c, const std::string& key) {
  const json value = json::parse(TrainConfigToJson(c)).at(key);
  return value.is_string() ? value.get<std::string>() : value.dump();
}

TEST(ConfigTableTest, EveryKeyHasOneRowWithHelpCategoryAndItsLists) {
  const std::vector<ConfigKeyInfo>& table = TrainConfigTable();
  const std::vector<ConfigKey> keys = TrainConfigKeys();
  ASSERT_EQ(keys.size(), table.size());
  std::set<std::string> names;
  std::vector<std::string> must_match;
  for (size_t i = 0; i < table.size(); ++i) {
    const ConfigKeyInfo& row = table[i];
    const std::string name = row.name;
    EXPECT_TRUE(names.insert(name).second) << "two rows for " << name;
    EXPECT_EQ(keys[i].name, name);
    EXPECT_EQ(keys[i].help, row.help);
    EXPECT_FALSE(keys[i].help.empty()) << name;
    EXPECT_FALSE(keys[i].type.empty()) << name;
    EXPECT_TRUE(row.category == KeyCategory::kModel || row.category == KeyCategory::kRun ||
                row.category == KeyCategory::kLayout)
        << name;
    EXPECT_EQ(FindConfigKey(name), &row);
    EXPECT_EQ(IsLayoutKey(name), row.category == KeyCategory::kLayout) << name;
    if (row.resume == KeyResume::kMustMatch) must_match.push_back(name);
    // The layout is where a run runs: never a value a resumed run must keep.
    EXPECT_FALSE(row.category == KeyCategory::kLayout && row.resume == KeyResume::kMustMatch)
        << name;
  }
  EXPECT_EQ(ResumeMustMatchKeys(), must_match);
  EXPECT_EQ(FindConfigKey("no_such_key"), nullptr);
  EXPECT_FALSE(IsLayoutKey("no_such_key"));
  // The JSON object has exactly the table's keys, and the fields are visited in its order.
  const json j = json::parse(TrainConfigToJson(TrainConfig{}));
  EXPECT_EQ(j.size(), table.size());
  for (const ConfigKeyInfo& row : table) EXPECT_TRUE(j.contains(row.name)) << row.name;
  TrainConfig c;
  size_t visited = 0;
  VisitFields(c, [&](const ConfigKeyInfo& info, auto&) {
    ASSERT_LT(visited, table.size());
    EXPECT_EQ(&info, &table[visited]);
    ++visited;
  });
  EXPECT_EQ(visited, table.size());
}

TEST(ConfigTableTest, EveryKeyRoundTripsThroughJsonAndFlags) {
  const TrainConfig defaults;
  const json default_json = json::parse(TrainConfigToJson(defaults));
  TrainConfig probe;
  VisitFields(probe, [&](const ConfigKeyInfo& info, auto& field) {
    const std::string key = info.name;
    const auto saved = field;
    MakeOther(field);
    TrainConfig changed = probe;
    field = saved;
    const json want = json::parse(TrainConfigToJson(changed));
    EXPECT_NE(want.at(key), default_json.at(key)) << key;
    // Through a JSON file.
    EXPECT_EQ(json::parse(TrainConfigToJson(TrainConfigFromJson(TrainConfigToJson(changed)))), want)
        << key;
    // Through the one-key JSON a --config file holds.
    json one = json::object();
    one[key] = want.at(key);
    EXPECT_EQ(json::parse(TrainConfigToJson(TrainConfigFromJson(one.dump()))), want) << key;
    // Through a flag's text.
    TrainConfig flagged;
    SetTrainConfigValue(flagged, key, FlagText(changed, key));
    EXPECT_EQ(json::parse(TrainConfigToJson(flagged)), want) << key;
  });
}

TEST(ConfigTableTest, EveryRangeIsEnforcedAndNamesTheKey) {
  ASSERT_NO_THROW(ValidateTrainConfig(TrainConfig{}));
  int ranged = 0;
  for (const ConfigKeyInfo& row : TrainConfigTable()) {
    if (!row.values.ranged) continue;
    ++ranged;
    const std::string key = row.name;
    std::vector<std::string> outside;
    const KeyValues& v = row.values;
    if (v.kind == KeyValues::Kind::kInt) {
      outside.push_back(std::to_string(v.int_lo - 1));
      if (v.int_hi != std::numeric_limits<int64_t>::max()) {
        outside.push_back(std::to_string(v.int_hi + 1));
      }
    } else if (v.kind == KeyValues::Kind::kFloat) {
      outside.push_back(json(v.float_lo - 1 - std::abs(v.float_lo)).dump());
      if (v.float_hi < 1e30) {
        outside.push_back(json(v.open_hi ? v.float_hi : v.float_hi * 2 + 1).dump());
      }
    } else if (v.kind == KeyValues::Kind::kList) {
      outside.push_back(fmt::format("[{}]", v.int_hi + 1));
    }
    ASSERT_FALSE(outside.empty()) << key;
    for (const std::string& text : outside) {
      TrainConfig c;
      std::string error;
      try {
        SetTrainConfigValue(c, key, text);
        ValidateTrainConfig(c);
      } catch (const InvalidArgument& e) {
        error = e.what();
      }
      EXPECT_NE(error.find("'" + key + "'"), std::string::npos)
          << key << " " << text << " was accepted or refused for another reason: " << error;
    }
  }
  EXPECT_GE(ranged, 30);
}

// Every choice key takes each of its names and refuses others at the boundary, naming the key
// and the names; its field compares as the enum.
TEST(ConfigTableTest, ChoiceKeysAreEnumsSpelledAsBefore) {
  TrainConfig c;
  SetTrainConfigValue(c, "cp_algo", "ulysses");
  EXPECT_TRUE(c.cp_algo == CpAlgorithm::kUlysses);
  SetTrainConfigValue(c, "pipeline_schedule", "zb-h1");
  EXPECT_TRUE(c.pipeline_schedule == parallel::ScheduleKind::kZeroBubbleH1);
  SetTrainConfigValue(c, "dispatch", "allgather");
  EXPECT_TRUE(c.dispatch == parallel::DispatchKind::kAllGather);
  SetTrainConfigValue(c, "arrangement", "megatron");
  EXPECT_TRUE(c.arrangement == ArrangementChoice::kMegatron);
  const json j = json::parse(TrainConfigToJson(c));
  EXPECT_EQ(j.at("pipeline_schedule"), "zb-h1");
  EXPECT_EQ(j.at("arrangement"), "megatron");
  try {
    SetTrainConfigValue(c, "cp_algo", "flash");
    ADD_FAILURE() << "cp_algo flash accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "config: 'cp_algo' must be \"ring\" or \"ulysses\", got \"flash\""),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(TrainConfigFromJson(R"({"nonfinite": 1})"), InvalidArgument);
  // A name assigned in code is parsed there; an unknown one waits for ValidateTrainConfig.
  TrainConfig assigned;
  assigned.a2a_algo = "2dh";
  EXPECT_TRUE(assigned.a2a_algo == A2aAlgo::k2dh);
  assigned.nonfinite = "later";
  EXPECT_FALSE(assigned.nonfinite.valid());
  EXPECT_THROW(ValidateTrainConfig(assigned), InvalidArgument);
}

// The rows with a layer_key hand their value to the MoE layer (MoeLayerConfig), the key added
// through the table alone (topk_scaling_factor) among them.
TEST(ConfigTableTest, LayerKeysReachTheMoeLayer) {
  TrainConfig probe;
  probe.num_experts = 8;
  int layer_keys = 0;
  VisitFields(probe, [&](const ConfigKeyInfo& info, auto& field) {
    if (*info.layer_key == '\0') return;
    ++layer_keys;
    const auto saved = field;
    MakeOther(field);
    TrainConfig changed = probe;
    field = saved;
    // Where MoeLayerConfig would refuse MakeOther's value: another value the layer accepts.
    const std::string_view name = info.name;
    if (name == "num_groups") {
      changed.num_groups = 2;
      changed.group_topk = 1;  // groups need group_topk
    } else if (name == "group_topk") {
      changed.group_topk = 1;
    } else if (name == "aux_loss") {
      changed.aux_loss = "global";
    }
    const json layer = json::parse(moe::ToJson(MoeLayerConfig(changed)));
    const json want = json::parse(TrainConfigToJson(changed)).at(info.name);
    const json& got = layer.at(info.layer_key);
    if (want.is_number_float()) {  // the layer holds floats
      EXPECT_NEAR(got.get<double>(), want.get<double>(), 1e-6) << info.name;
    } else {
      EXPECT_EQ(got, want) << info.name;
    }
  });
  EXPECT_EQ(layer_keys, 15);
  TrainConfig c;
  SetTrainConfigValue(c, "topk_scaling_factor", "2.5");
  EXPECT_EQ(MoeLayerConfig(c).topk_scaling_factor, 2.5f);
  EXPECT_EQ(MoeLayerConfig(TrainConfig{}).topk_scaling_factor, 1.0f);
  EXPECT_FALSE(IsLayoutKey("topk_scaling_factor"));
  SetTrainConfigValue(c, "topk_scaling_factor", "0");
  EXPECT_THROW(ValidateTrainConfig(c), InvalidArgument);
}

// The derived layout values, resolved in one place.
TEST(ConfigTableTest, ResolveLayoutDerivesEpArrangementAndAttentionCore) {
  TrainConfig c;
  c.tp = 2;
  ResolvedLayout l = ResolveLayout(c, 8);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.ep, 4);  // DeepSpeed: ranks / (tp x pp)
  EXPECT_EQ(l.arrangement, parallel::Arrangement::kDeepSpeed);
  EXPECT_EQ(l.attention_core, AttentionCore::kSoftmax);
  c.sequence_parallel = true;  // auto: Megatron with sequence parallelism
  c.cp = 2;
  l = ResolveLayout(c, 8);
  EXPECT_EQ(l.arrangement, parallel::Arrangement::kMegatron);
  EXPECT_EQ(l.ep, 8);  // Megatron: ranks / (etp x pp)
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.attention_core, AttentionCore::kFlash);
  c.ep = 2;
  EXPECT_EQ(ResolveLayout(c, 8).ep, 2);
  try {
    ResolveLayout(c, 6);
    ADD_FAILURE() << "tp 2 x cp 2 on 6 ranks accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'cp' 2 x 'tp' 2 x 'pp' 1 must divide 'ranks' 6"),
              std::string::npos)
        << e.what();
  }
}

// The default ep (ep 0) with experts that do not fit the ranks: the largest ep dividing both
// (6 experts on 4 ranks: ep 2, 3 experts per rank), which the expert checks accept; experts that
// fit keep the largest ep (fewer experts than ranks: H-shards), and an explicit ep is kept.
TEST(ConfigTableTest, DefaultEpDividesTheExpertsAndTheRanks) {
  TrainConfig c;
  c.model.moe_every = 2;
  c.num_experts = 6;
  ResolvedLayout l = ResolveLayout(c, 4);
  EXPECT_EQ(l.ep, 2);
  EXPECT_EQ(l.expert_shards, 1);
  EXPECT_NO_THROW(ValidateExpertLayout(c, l));
  c.tp = 2;
  EXPECT_EQ(ResolveLayout(c, 16).ep, 2);  // 8 ranks per tp rank, 6 experts
  c.tp = 1;
  c.num_experts = 9;
  EXPECT_EQ(ResolveLayout(c, 6).ep, 3);
  c.num_experts = 2;
  EXPECT_EQ(ResolveLayout(c, 4).ep, 4);  // 2 experts, each over 2 ranks
  c.num_experts = 8;
  EXPECT_EQ(ResolveLayout(c, 4).ep, 4);
  c.num_experts = 6;
  c.ep = 4;  // explicit: kept, and refused by the expert checks
  l = ResolveLayout(c, 4);
  EXPECT_EQ(l.ep, 4);
  EXPECT_THROW(ValidateExpertLayout(c, l), InvalidArgument);
  parallel::MeshConfig m;  // the mesh's own default
  m.world_size = 4;
  m.num_experts = 6;
  EXPECT_EQ(parallel::ResolvedExpertParallel(m), 2);
  EXPECT_EQ(parallel::Mesh(m).ep(), 2);
  m.num_experts = 0;
  EXPECT_EQ(parallel::ResolvedExpertParallel(m), 4);
}

// The experts' H-shards (the mesh's etp) come from the keys and the world size alone, and the
// experts are checked against the layout in config_validate.cc.
TEST(ConfigTableTest, ResolveLayoutDerivesExpertShardsAndChecksTheExperts) {
  TrainConfig c;
  c.model.moe_every = 2;
  c.num_experts = 2;
  ResolvedLayout l = ResolveLayout(c, 8);
  EXPECT_EQ(l.ep, 8);
  EXPECT_EQ(l.expert_shards, 4);  // DeepSpeed, E < ep: each expert over ep / E ranks
  ValidateExpertLayout(c, l);
  c.num_experts = 16;
  EXPECT_EQ(ResolveLayout(c, 8).expert_shards, 1);
  c.num_experts = 2;
  c.model.moe_every = 0;  // a dense model has no H-shards
  EXPECT_EQ(ResolveLayout(c, 8).expert_shards, 1);
  c.model.moe_every = 2;
  c.sequence_parallel = true;  // Megatron: the 'etp' key
  c.tp = 2;
  c.etp = 2;
  EXPECT_EQ(ResolveLayout(c, 8).expert_shards, 2);
  auto message = [](const TrainConfig& config, int ranks) -> std::string {
    try {
      ValidateExpertLayout(config, ResolveLayout(config, ranks));
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  TrainConfig bad;
  bad.num_experts = 3;
  bad.ep = 4;  // explicit (the default ep takes the gcd, 1: DefaultEpDividesTheExpertsAndTheRanks)
  EXPECT_NE(message(bad, 4).find("'num_experts' 3 and 'ep' 4"), std::string::npos);
  bad.ep = 0;
  bad.num_experts = 4;
  bad.etp = 2;  // DeepSpeed
  EXPECT_NE(message(bad, 4).find("'etp' 2: expert tensor parallelism is Megatron's"),
            std::string::npos);
  bad.etp = 1;
  bad.ep = 3;
  EXPECT_NE(message(bad, 4).find("'ep' 3 must divide the number of ranks 4"), std::string::npos);
  // adaptive_r against the H-shards: 4 experts over 8 ranks are 2 H-shards each.
  TrainConfig r;
  r.model.moe_every = 2;
  r.num_experts = 4;
  r.adaptive_r = "2";
  ValidateAdaptiveR(r, ResolveLayout(r, 8));
  r.adaptive_r = "4";
  try {
    ValidateAdaptiveR(r, ResolveLayout(r, 8));
    ADD_FAILURE() << "adaptive_r 4 accepted with 2 H-shards";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("r = 4 is neither 0 nor a divisor of the 2"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace switchyard::train
