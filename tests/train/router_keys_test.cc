// The router keys of a training run (docs/moe.md, docs/observability.md): num_groups, group_topk,
// topk_scaling_factor, aux_loss and expert_bias_update_rate reach every MoE block over the
// moe_layer_config file's values (unset keys keep the file's); router_trace, router_trace_steps and
// router_replay record and replay routes; malformed values are errors naming the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/config.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/trainer.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

std::string ErrorOf(const TrainConfig& c) {
  try {
    ValidateTrainConfig(c);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

ResolvedTrainConfig Resolve(const TrainConfig& defaults,
                            std::map<std::string, std::string> flags = {}) {
  TrainConfigSources s;
  s.defaults = defaults;
  s.flags = std::move(flags);
  return ResolveTrainConfig(s);
}

std::string ResolveError(const TrainConfig& defaults, std::map<std::string, std::string> flags) {
  try {
    Resolve(defaults, std::move(flags));
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

// Each router key is a row of config_keys.def with a layer_key: MoeLayerConfig always hands the
// run's value to the layer, and ResolveTrainConfig takes the moe_layer_config file's value for a
// key no flag or config sets; a flag that sets it to another value is a conflict naming both.
TEST(RouterKeysTest, ReachTheLayerOverTheLayerFile) {
  TempDir dir;
  TrainConfig c = testing::TinyMoeConfig(dir);
  c.num_experts = 8;
  {  // Without a file the layer gets the run's values, the layer's defaults by default.
    const moe::LayerConfig layer_default;
    moe::LayerConfig l = MoeLayerConfig(c);
    EXPECT_EQ(l.num_groups, layer_default.num_groups);
    EXPECT_EQ(l.group_topk, layer_default.group_topk);
    EXPECT_EQ(l.aux_loss, layer_default.aux_loss);
    EXPECT_EQ(l.expert_bias_update_rate, layer_default.expert_bias_update_rate);
    EXPECT_EQ(l.topk_scaling_factor, layer_default.topk_scaling_factor);
  }
  WriteTextFileAtomic(dir / "layer.json",
                      R"({"num_groups": 4, "group_topk": 2, "topk_scaling_factor": 1.5})");
  c.moe_layer_config = dir / "layer.json";
  // No flag: the file's values.
  ResolvedTrainConfig r = Resolve(c);
  EXPECT_EQ(r.config.num_groups, 4);
  EXPECT_EQ(r.config.group_topk, 2);
  EXPECT_EQ(r.config.topk_scaling_factor, 1.5);
  moe::LayerConfig l = MoeLayerConfig(r.config);
  EXPECT_EQ(l.num_groups, 4);
  EXPECT_EQ(l.group_topk, 2);
  EXPECT_FLOAT_EQ(l.topk_scaling_factor, 1.5f);
  EXPECT_EQ(l.aux_loss, moe::AuxLoss::kGShard);
  // Flags for keys the file does not set win; flags equal to the file's values are accepted.
  r = Resolve(c,
              {{"aux_loss", "global"}, {"expert_bias_update_rate", "0.05"}, {"num_groups", "4"}});
  l = MoeLayerConfig(r.config);
  EXPECT_EQ(l.num_groups, 4);
  EXPECT_EQ(l.group_topk, 2);
  EXPECT_EQ(l.aux_loss, moe::AuxLoss::kGlobal);
  EXPECT_FLOAT_EQ(l.expert_bias_update_rate, 0.05f);
  // A flag that disagrees with the file is an error naming the key, both sources and values.
  for (const auto& [key, value] : std::map<std::string, std::string>{
           {"num_groups", "2"}, {"group_topk", "1"}, {"topk_scaling_factor", "2.5"}}) {
    const std::string e = ResolveError(c, {{key, value}});
    EXPECT_NE(e.find("'" + key + "': --" + key + " gives " + value), std::string::npos) << e;
    EXPECT_NE(e.find("layer.json"), std::string::npos) << e;
  }
  // Without the file, the flags reach the layer.
  c.moe_layer_config.clear();
  r = Resolve(c, {{"num_groups", "2"},
                  {"group_topk", "1"},
                  {"topk_scaling_factor", "2.5"},
                  {"aux_loss", "global"}});
  l = MoeLayerConfig(r.config);
  EXPECT_EQ(l.num_groups, 2);
  EXPECT_EQ(l.group_topk, 1);
  EXPECT_FLOAT_EQ(l.topk_scaling_factor, 2.5f);
  EXPECT_EQ(l.aux_loss, moe::AuxLoss::kGlobal);
  TrainConfig back = TrainConfigFromJson(TrainConfigToJson(r.config));
  EXPECT_EQ(back.aux_loss, "global");
  EXPECT_EQ(back.num_groups, 2);
  SetTrainConfigValue(back, "router_trace_steps", "every:5");
  EXPECT_EQ(back.router_trace_steps, "every:5");
}

// The layer accepts the router keys' values with expert_bias off (the default run).
TEST(RouterKeysTest, RateAndGroupsValidWithoutExpertBias) {
  TempDir dir;
  TrainConfig c = testing::TinyMoeConfig(dir);
  c.num_experts = 8;
  c.expert_bias_update_rate = 0.25;
  c.num_groups = 4;
  c.group_topk = 2;
  c.aux_loss = "none";
  ValidateTrainConfig(c);
  const moe::LayerConfig l = MoeBlockLayerConfig(c, c.model.moe_every - 1);
  EXPECT_FALSE(l.expert_bias);
  EXPECT_FLOAT_EQ(l.expert_bias_update_rate, 0.25f);
  EXPECT_EQ(l.aux_loss, moe::AuxLoss::kNone);
}

TEST(RouterKeysTest, MalformedValuesAreErrorsNamingTheKey) {
  TempDir dir;
  const TrainConfig base = testing::TinyMoeConfig(dir);
  TrainConfig c = base;
  c.aux_loss = "balanced";
  EXPECT_NE(ErrorOf(c).find("'aux_loss' must be"), std::string::npos) << ErrorOf(c);
  c = base;
  c.router_trace = dir / "t";
  for (const char* steps : {"1,,2", "every:0", "0", "x", "every:"}) {
    c.router_trace_steps = steps;
    EXPECT_NE(ErrorOf(c).find("'router_trace_steps'"), std::string::npos)
        << steps << ": " << ErrorOf(c);
  }
  c = base;
  c.router_trace_steps = "1,2";
  EXPECT_NE(ErrorOf(c).find("'router_trace' (the directory) is not set"), std::string::npos);
  c = base;
  c.router_trace = c.router_replay = dir / "t";
  EXPECT_NE(ErrorOf(c).find("would overwrite"), std::string::npos) << ErrorOf(c);
  c = base;
  c.router_replay = dir / "missing";  // refused before a step runs, not inside step 1
  EXPECT_NE(ErrorOf(c).find("'router_replay'"), std::string::npos) << ErrorOf(c);
  c = base;
  WriteTextFileAtomic(dir / "a_file", "x");
  c.router_trace = dir / "a_file";
  EXPECT_NE(ErrorOf(c).find("is not a directory"), std::string::npos) << ErrorOf(c);
  c = base;
  c.group_topk = -2;
  EXPECT_NE(ErrorOf(c).find("'group_topk'"), std::string::npos) << ErrorOf(c);
  c = base;
  c.group_topk = -1;
  EXPECT_NE(ErrorOf(c).find("'group_topk'"), std::string::npos) << ErrorOf(c);
  c = base;
  c.num_groups = 0;
  EXPECT_NE(ErrorOf(c).find("'num_groups'"), std::string::npos) << ErrorOf(c);
  c = base;
  c.expert_bias_update_rate = -1;
  EXPECT_NE(ErrorOf(c).find("'expert_bias_update_rate'"), std::string::npos) << ErrorOf(c);
  c = base;
  c.aux_loss = "sequence";  // train hands the layer seq_len as its sequence length
  EXPECT_NE(ErrorOf(c).find("set 'sample_tokens' 0"), std::string::npos) << ErrorOf(c);
  c.sample_tokens = 0;  // samples feed partial sequences
  EXPECT_EQ(ErrorOf(c), "(accepted)");
  EXPECT_EQ(MoeLayerConfig(c).sequence_length, c.model.seq_len);
}

// router_trace with every:2 records steps 2 and 4 only; router_replay of those steps runs them and
// stops at a step the trace lacks.
TEST(RouterKeysTest, TraceKeysRecordTheChosenStepsAndReplayThem) {
  kernels::SetBlasThreads(1);
  TempDir dir;
  TrainConfig c = testing::TinyMoeConfig(dir);
  c.sample_tokens = 0;
  c.router_trace = dir / "trace";
  c.router_trace_steps = "every:2";
  {
    Trainer t(c);
    for (int s = 0; s < 4; ++s) t.Step();
  }
  for (int64_t step : {1, 2, 3, 4}) {
    EXPECT_EQ(std::filesystem::exists(RouterTrace::StepDirectory(c.router_trace, step)),
              step % 2 == 0)
        << "step " << step;
  }
  TrainConfig r = testing::TinyMoeConfig(dir);
  r.sample_tokens = 0;
  r.router_replay = dir / "trace";
  Trainer t(r);
  try {
    t.Step();
    FAIL() << "step 1 replayed from a trace without it";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no routes of step 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace switchyard::train

namespace switchyard::train {
namespace {

// Trace files hold int16 ids (int32 for huge layers, and in traces written before int16): both
// read back as the same int32 ids; anything else is not an ids tensor.
TEST(RouterTraceIds, Int16AndInt32ReadAsTheSameIds) {
  const Tensor i32 = Tensor::FromVector<int32_t>({0, 5, 32767, 3, 1, 2}, {3, 2});
  const Tensor i16 = i32.To(DType::kInt16);
  ASSERT_EQ(i16.dtype(), DType::kInt16);
  for (const Tensor& t : {i32, i16}) {
    const Tensor ids = TraceExpertIdsAsInt32(t);
    ASSERT_TRUE(ids.defined());
    ASSERT_EQ(ids.dtype(), DType::kInt32);
    ASSERT_EQ(ids.shape(), (Shape{3, 2}));
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(ids.data<int32_t>()[i], i32.data<int32_t>()[i]);
  }
  EXPECT_FALSE(TraceExpertIdsAsInt32(i32.To(DType::kFloat32)).defined());
  EXPECT_FALSE(TraceExpertIdsAsInt32(Tensor::FromVector<int32_t>({1, 2}, {2})).defined());
  EXPECT_THROW(Tensor::FromVector<int32_t>({40000}, {1}).To(DType::kInt16), InvalidArgument);
}

}  // namespace
}  // namespace switchyard::train
