// `switchyard layer` end to end: files in, files out, compared with the layer run in-process;
// bad inputs give one line on stderr and exit code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

using switchyard::testing::AllClose;
using switchyard::testing::RandomVector;

struct RunResult {
  int exit_code = -1;
  std::string err;
};

class CliLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/sy_cli_layer_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  RunResult Run(const std::string& config_json, const TensorMap& tensors) {
    WriteTextFileAtomic(Path("layer.json"), config_json);
    WriteSafetensors(Path("in.safetensors"), tensors);
    std::string cmd = std::string(SY_SWITCHYARD_BIN) + " layer --quiet --config " +
                      Path("layer.json") + " --tensors " + Path("in.safetensors") + " --out " +
                      Path("out.safetensors") + " 2> " + Path("stderr.txt");
    int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(Path("stderr.txt"));
    std::stringstream ss;
    ss << in.rdbuf();
    r.err = ss.str();
    return r;
  }

  std::string dir_;
};

const char* kConfig = R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "top_k": 2,
  "capacity_factor": 0.75, "renormalize_after_drop": true, "z_loss_coef": 0.01,
  "aux_loss_coef": 0.1, "check_finite": true})";

TensorMap Inputs(const LayerConfig& c, int64_t tokens) {
  TensorMap t = ParamsToMap(c, InitParams(c, 3));
  t["x"] = Tensor::FromVector(RandomVector(static_cast<size_t>(tokens * c.model_dim), 1),
                              {tokens, c.model_dim});
  t["dy"] = Tensor::FromVector(RandomVector(static_cast<size_t>(tokens * c.model_dim), 2),
                               {tokens, c.model_dim});
  return t;
}

std::vector<float> Floats(const Tensor& t) {
  Tensor f = t.To(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

TEST_F(CliLayerTest, OutputsMatchTheLayerInProcess) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  TensorMap in = Inputs(c, 21);
  RunResult r = Run(kConfig, in);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  TensorMap out = ReadSafetensors(Path("out.safetensors"));

  MoeLayer layer(c);
  LayerParams params = ParamsFromMap(c, in);
  LayerOutput want = layer.Forward(params, in.at("x"));
  LayerGradients grads = layer.Backward(params, want, in.at("dy"));
  EXPECT_TRUE(AllClose(Floats(out.at("y")), Floats(want.y), 1e-6, 1e-6));
  EXPECT_NEAR(out.at("l_aux").At(0), want.l_aux, 1e-6);
  EXPECT_NEAR(out.at("z_loss").At(0), want.z_loss, 1e-6);
  EXPECT_EQ(out.at("capacity").At(0), want.capacity);
  EXPECT_EQ(out.at("routing.topk_idx").dtype(), DType::kInt32);
  EXPECT_EQ(out.at("routing.topk_idx").shape(), (Shape{21, 2}));
  EXPECT_EQ(Floats(out.at("routing.topk_idx")), Floats(want.topk_idx));
  EXPECT_EQ(out.at("routing.locations").dtype(), DType::kInt32);
  EXPECT_EQ(Floats(out.at("routing.locations")), Floats(want.locations));
  EXPECT_GT(want.dropped, 0);  // cf 0.75 drops: locations hold -1
  EXPECT_EQ(Floats(out.at("routing.gates")), Floats(want.gates));
  EXPECT_TRUE(AllClose(Floats(out.at("grad.x")), Floats(grads.x), 1e-6, 1e-6));
  for (auto& [name, g] : ParamsToMap(c, grads.params)) {
    ASSERT_TRUE(out.count("grad." + name)) << name;
    EXPECT_TRUE(AllClose(Floats(out.at("grad." + name)), Floats(g), 1e-5, 1e-6)) << name;
  }
}

TEST_F(CliLayerTest, WithoutDyNoGradients) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  TensorMap in = Inputs(c, 5);
  in.erase("dy");
  RunResult r = Run(kConfig, in);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  TensorMap out = ReadSafetensors(Path("out.safetensors"));
  EXPECT_TRUE(out.count("y"));
  EXPECT_FALSE(out.count("grad.x"));
}

TEST_F(CliLayerTest, BadInputsGiveOneLineErrors) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  struct Case {
    std::string what;
    std::string config;
    TensorMap tensors;
    std::string expect;
  };
  std::vector<Case> cases;
  TensorMap no_x = Inputs(c, 4);
  no_x.erase("x");
  cases.push_back({"missing x", kConfig, no_x, "missing tensor 'x'"});
  TensorMap no_w = Inputs(c, 4);
  no_w.erase("experts.fc2.weight");
  cases.push_back({"missing weight", kConfig, no_w, "missing tensor 'experts.fc2.weight'"});
  TensorMap bad_shape = Inputs(c, 4);
  bad_shape["gate.weight"] = Tensor::Zeros({4, 7});
  cases.push_back(
      {"wrong shape", kConfig, bad_shape, "gate.weight: expected shape [4, 6], got [4, 7]"});
  TensorMap nan = Inputs(c, 4);
  nan["x"].data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  cases.push_back({"nan", kConfig, nan, "x: element [1, 1] is nan (check_finite is on)"});
  TensorMap bad_dy = Inputs(c, 4);
  bad_dy["dy"] = Tensor::Zeros({3, 6});
  cases.push_back({"dy shape", kConfig, bad_dy, "dy: expected shape [4, 6], got [3, 6]"});
  cases.push_back({"k = 0", R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "top_k": 0})",
                   Inputs(c, 4), "key 'top_k': expected an integer in [1,"});
  cases.push_back({"activation",
                   R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "activation": "elu"})",
                   Inputs(c, 4), "key 'activation': expected one of relu, gelu or silu"});
  for (const Case& k : cases) {
    RunResult r = Run(k.config, k.tensors);
    EXPECT_EQ(r.exit_code, 2) << k.what << ": " << r.err;
    EXPECT_NE(r.err.find(k.expect), std::string::npos) << k.what << ": " << r.err;
    EXPECT_TRUE(r.err.starts_with("switchyard: error: ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << k.what << ": " << r.err;
  }
}

}  // namespace
}  // namespace switchyard::moe
