// `switchyard layer` end to end: files in, files out, compared with the layer run in-process;
// bad inputs give one line on stderr and exit code 2.
#include <gtest/gtest.h>
#include <sys/stat.h>
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
#include "switchyard/core/limits.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

using switchyard::testing::AllClose;
using switchyard::testing::RandomVector;

// The executable under test; the environment variable SY_SWITCHYARD_BIN runs the tests against
// another build (e.g. an older one, to see a test fail without its fix).
std::string Bin() {
  const char* env = std::getenv("SY_SWITCHYARD_BIN");
  return env != nullptr && *env != '\0' ? env : SY_SWITCHYARD_BIN;
}

struct RunResult {
  int exit_code = -1;
  std::string err;
};

class CliLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/sy_cli_layer_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  RunResult Run(const std::string& config_json, const TensorMap& tensors) {
    WriteInputs(config_json, tensors);
    return RunFlags("--out " + Path("out.safetensors"));
  }

  void WriteInputs(const std::string& config_json, const TensorMap& tensors) {
    WriteTextFileAtomic(Path("layer.json"), config_json);
    WriteSafetensors(Path("in.safetensors"), tensors);
  }

  // `switchyard layer --quiet --config layer.json --tensors in.safetensors <flags>`, run by
  // `bash -c '<prefix> exec switchyard ...'`; a death by signal gives 128 + the signal.
  RunResult RunFlags(const std::string& flags, const std::string& prefix = "") {
    std::string cmd = Bin() + " layer --quiet --config " + Path("layer.json") + " --tensors " +
                      Path("in.safetensors") + " " + flags;
    std::string script = prefix + " exec " + cmd + " 2> " + Path("stderr.txt");
    std::string quoted = "'";
    for (char ch : script) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    quoted += "'";
    int status = std::system(("bash -c " + quoted).c_str());
    RunResult r;
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) r.exit_code = 128 + WTERMSIG(status);
    std::ifstream in(Path("stderr.txt"));
    std::stringstream ss;
    ss << in.rdbuf();
    r.err = ss.str();
    return r;
  }

  // Entries of the test directory other than stderr.txt, sorted (to see temporaries left).
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      std::string n = e.path().filename().string();
      if (n != "stderr.txt") names.push_back(n);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Runs `switchyard layer` on `json` and `tokens` random tokens and expects every output equal
  // to the layer's in-process; returns the in-process forward.
  LayerOutput ExpectOutputsMatchTheLayerInProcess(const std::string& json, int64_t tokens);

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

LayerOutput CliLayerTest::ExpectOutputsMatchTheLayerInProcess(const std::string& json,
                                                              int64_t tokens) {
  LayerConfig c = LayerConfigFromJson(json);
  TensorMap in = Inputs(c, tokens);
  RunResult r = Run(json, in);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  if (r.exit_code != 0) return {};
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
  EXPECT_EQ(out.at("routing.topk_idx").shape(), (Shape{tokens, EffectiveTopK(c)}));
  EXPECT_EQ(Floats(out.at("routing.topk_idx")), Floats(want.topk_idx));
  EXPECT_EQ(out.at("routing.locations").dtype(), DType::kInt32);
  EXPECT_EQ(Floats(out.at("routing.locations")), Floats(want.locations));
  EXPECT_EQ(Floats(out.at("routing.gates")), Floats(want.gates));
  EXPECT_TRUE(AllClose(Floats(out.at("grad.x")), Floats(grads.x), 1e-6, 1e-6));
  for (auto& [name, g] : ParamsToMap(c, grads.params)) {
    EXPECT_TRUE(out.count("grad." + name)) << name;
    if (out.count("grad." + name) == 0) continue;
    EXPECT_TRUE(AllClose(Floats(out.at("grad." + name)), Floats(g), 1e-5, 1e-6)) << name;
  }
  return want;
}

TEST_F(CliLayerTest, OutputsMatchTheLayerInProcess) {
  LayerOutput want = ExpectOutputsMatchTheLayerInProcess(kConfig, 21);
  EXPECT_EQ(want.topk_idx.shape(), (Shape{21, 2}));
  EXPECT_GT(want.dropped, 0);  // cf 0.75 drops: locations hold -1
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

// Runs a case that must fail with one line "switchyard: error: ..." containing `expect`.
#define EXPECT_ONE_LINE_ERROR(r, code, expect)                                 \
  do {                                                                         \
    EXPECT_EQ((r).exit_code, code) << (r).err;                                 \
    EXPECT_NE((r).err.find(expect), std::string::npos) << (r).err;             \
    EXPECT_TRUE((r).err.starts_with("switchyard: error: ")) << (r).err;        \
    EXPECT_EQ(std::count((r).err.begin(), (r).err.end(), '\n'), 1) << (r).err; \
  } while (0)

// ulimit -f: with SIGXFSZ ignored by the caller, and with it at its default (the CLI ignores
// it itself), a clear error (exit 1), the old output untouched and no temporary file left.
TEST_F(CliLayerTest, FileSizeLimitIsAClearErrorAndLeavesNothing) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  WriteInputs(kConfig, Inputs(c, 300));  // the output is ~40 KB; bash's ulimit -f 8 is 8 KiB
  WriteTextFileAtomic(Path("big.safetensors"), "old");
  for (const std::string prefix : {"trap '' XFSZ; ulimit -f 8;", "ulimit -f 8;"}) {
    RunResult r = RunFlags("--out " + Path("big.safetensors"), prefix);
    EXPECT_ONE_LINE_ERROR(r, 1,
                          "file size limit reached writing '" + Path("big.safetensors") + "'");
    EXPECT_EQ(ReadTextFile(Path("big.safetensors")), "old") << prefix;
    EXPECT_EQ(Entries(),
              (std::vector<std::string>{"big.safetensors", "in.safetensors", "layer.json"}))
        << prefix;
  }
}

// An output that names an input, however spelt, is refused (exit 2) and the input is unchanged.
TEST_F(CliLayerTest, OutputNamingAnInputIsRefused) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  WriteInputs(kConfig, Inputs(c, 5));
  const std::string tensors = ReadTextFile(Path("in.safetensors"));
  const std::string config = ReadTextFile(Path("layer.json"));
  std::filesystem::create_symlink(Path("in.safetensors"), Path("link.safetensors"));
  std::filesystem::create_directory(Path("sub"));
  struct Case {
    std::string flags, expect;
  };
  const std::vector<Case> cases = {
      {"--out " + Path("in.safetensors"),
       "--out '" + Path("in.safetensors") + "' names the same file as --tensors"},
      {"--out " + dir_ + "/./sub/../in.safetensors", "names the same file as --tensors"},
      {"--out " + Path("link.safetensors"), "names the same file as --tensors"},
      {"--out " + Path("layer.json"), "names the same file as --config"},
      {"--out " + Path("t.json") + " --trace " + dir_ + "/./t.json",
       "names the same file as --trace"},
      {"--out " + Path("o.safetensors") + " --trace " + Path("in.safetensors"),
       "--trace '" + Path("in.safetensors") + "' names the same file as --tensors"},
      {"--out " + Path("o.safetensors") + " --trace " + Path("layer.json"),
       "names the same file as --config"},
  };
  for (const Case& k : cases) {
    RunResult r = RunFlags(k.flags);
    EXPECT_ONE_LINE_ERROR(r, 2, k.expect);
    EXPECT_TRUE(ReadTextFile(Path("in.safetensors")) == tensors) << k.flags;
    EXPECT_TRUE(ReadTextFile(Path("layer.json")) == config) << k.flags;
  }
  EXPECT_EQ(Entries(),
            (std::vector<std::string>{"in.safetensors", "layer.json", "link.safetensors", "sub"}));
}

// What each kind of output path gets (docs/formats.md, "Output paths").
TEST_F(CliLayerTest, OutputPathKinds) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  WriteInputs(kConfig, Inputs(c, 5));
  // A symbolic link: written through, the link stays a link.
  WriteTextFileAtomic(Path("target.safetensors"), "old");
  std::filesystem::create_symlink("target.safetensors", Path("link.safetensors"));
  RunResult r = RunFlags("--out " + Path("link.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::is_symlink(Path("link.safetensors")));
  EXPECT_TRUE(ReadSafetensors(Path("target.safetensors")).count("y"));
  // A FIFO: refused, still a FIFO (no reader is needed: nothing opens it).
  ASSERT_EQ(::mkfifo(Path("pipe").c_str(), 0600), 0);
  r = RunFlags("--out " + Path("pipe"));
  EXPECT_ONE_LINE_ERROR(r, 1, "cannot write '" + Path("pipe") + "': it is a FIFO (named pipe)");
  EXPECT_TRUE(std::filesystem::is_fifo(Path("pipe")));
  // A character device.
  r = RunFlags("--out /dev/null");
  EXPECT_ONE_LINE_ERROR(r, 1, "cannot write '/dev/null': it is a character device");
  EXPECT_TRUE(std::filesystem::is_character_file("/dev/null"));
  // A directory, and a missing directory.
  std::filesystem::create_directory(Path("d"));
  r = RunFlags("--out " + Path("d"));
  EXPECT_ONE_LINE_ERROR(r, 1, "a directory is in the way");
  r = RunFlags("--out " + Path("no/such/out.safetensors"));
  EXPECT_ONE_LINE_ERROR(r, 1, "its directory '" + Path("no/such") + "' cannot be used");
  EXPECT_EQ(Entries(),
            (std::vector<std::string>{"d", "in.safetensors", "layer.json", "link.safetensors",
                                      "pipe", "target.safetensors"}));
}

TEST_F(CliLayerTest, CapacityThatCannotBeAnIntegerIsAnError) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  for (const char* cf : {"1e30", "3e18", "3e9"}) {
    std::string config = fmt::format(
        R"({{"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "capacity_factor": {}}})", cf);
    RunResult r = Run(config, Inputs(c, 8));
    EXPECT_ONE_LINE_ERROR(r, 2, "capacity from capacity_factor");
    EXPECT_NE(r.err.find("expected an integer in [0, 2147483647]"), std::string::npos) << r.err;
  }
  for (const char* formula : {"tutel", "deepspeed"}) {
    std::string config = fmt::format(
        R"({{"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "capacity_factor": 1e30,
            "capacity_formula": "{}"}})",
        formula);
    EXPECT_EQ(Run(config, Inputs(c, 8)).exit_code, 2) << formula;
    // A negative factor caps the largest load: an enormous cap leaves it, nothing is dropped.
    std::string negative = fmt::format(
        R"({{"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "capacity_factor": -1e30,
            "capacity_formula": "{}"}})",
        formula);
    RunResult r = Run(negative, Inputs(c, 8));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    TensorMap out = ReadSafetensors(Path("out.safetensors"));
    int64_t max_load = 0;
    for (int64_t e = 0; e < 4; ++e) {
      max_load = std::max<int64_t>(max_load, out.at("routing.expert_loads").At(e));
    }
    EXPECT_EQ(out.at("capacity").At(0), max_load) << formula;
    EXPECT_EQ(Floats(out.at("routing.expert_loads")), Floats(out.at("routing.expert_counts")));
  }
}

TEST_F(CliLayerTest, SizesThatCannotFitAreRefusedUpFront) {
  // The case of docs/moe.md "Capacity limits": capacity 1e8 with 8 tokens and 4 experts needs 50.7
  // GiB (checked when this machine has less available), and one that no machine has (16 x 1.3e8
  // rows: 263 GiB).
  LayerConfig c = LayerConfigFromJson(kConfig);
  if (AvailableMemoryBytes() < (uint64_t{50} << 30)) {
    RunResult r =
        Run(R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "capacity": 100000000})",
            Inputs(c, 8));
    EXPECT_ONE_LINE_ERROR(r, 2, "the expert buffer (num_experts 4 x capacity 100000000 rows");
    EXPECT_NE(r.err.find("needs 50.7 GiB of memory but only"), std::string::npos) << r.err;
  }
  LayerConfig c16 = c;
  c16.num_experts = 16;
  RunResult r =
      Run(R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 16, "capacity": 130000000})",
          Inputs(c16, 8));
  EXPECT_ONE_LINE_ERROR(r, 2, "the expert buffer (num_experts 16 x capacity 130000000 rows");
  EXPECT_NE(r.err.find("needs 263.5 GiB of memory but only"), std::string::npos) << r.err;
  r = Run(R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "capacity": 2000000000})",
          Inputs(c, 8));
  EXPECT_ONE_LINE_ERROR(r, 2, "exceeds the int32 index range");
}

TEST_F(CliLayerTest, DuplicateKeysAndUnknownTensorsAreErrors) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  RunResult r =
      Run(R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 4, "top_k": 1, "top_k": 2})",
          Inputs(c, 4));
  EXPECT_ONE_LINE_ERROR(r, 2, Path("layer.json") + ": key 'top_k' appears twice");
  TensorMap in = Inputs(c, 4);
  in["dY"] = in.at("dy");
  in.erase("dy");
  in["extra"] = Tensor::Zeros({1});
  r = Run(kConfig, in);
  EXPECT_ONE_LINE_ERROR(r, 2,
                        Path("in.safetensors") +
                            ": unknown tensors 'dY', 'extra': this "
                            "layer config reads only x, dy, gate.weight, experts.fc1.weight");
}

// DeepSeek-V3's router from layer.json: sigmoid scores, group-limited routing, routed scaling and
// the sequence loss, as the layer computes them in-process; rows that are not whole sequences are
// a usage error naming sequence_length.
TEST_F(CliLayerTest, MegatronRouterKeysRunAsTheLayerInProcess) {
  const std::string json = R"({"model_dim": 6, "hidden_dim": 10, "num_experts": 8, "top_k": 4,
    "score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "topk_scaling_factor": 2.5,
    "aux_loss": "sequence", "sequence_length": 6, "aux_loss_coef": 0.1, "capacity_factor": 0})";
  LayerOutput want = ExpectOutputsMatchTheLayerInProcess(json, 18);
  EXPECT_GT(want.l_aux, 0.5f);

  LayerConfig c = LayerConfigFromJson(json);
  RunResult partial = Run(json, Inputs(c, 16));
  EXPECT_ONE_LINE_ERROR(partial, 2, "sequence_length: aux_loss sequence needs whole sequences");
}

TEST_F(CliLayerTest, NumericKeysAreRangeChecked) {
  LayerConfig c = LayerConfigFromJson(kConfig);
  const std::string base = R"("model_dim": 6, "hidden_dim": 10, "num_experts": 4)";
  struct Case {
    std::string keys, expect;
  };
  const std::vector<Case> cases = {
      {R"("model_dim": -6, "hidden_dim": 10, "num_experts": 4)",
       "key 'model_dim': expected an integer in [1, 16777216], got -6"},
      {base + R"(, "hidden_dim": 1e30)", "appears twice"},
      {R"("model_dim": 6, "hidden_dim": 1e30, "num_experts": 4)",
       "key 'hidden_dim': expected an integer in [1, 16777216], got 1e+30"},
      {base + R"(, "capacity_factor": 1e300)", "key 'capacity_factor': expected a finite"},
      {base + R"(, "capacity_factor": 1e400)", "number overflow parsing '1e400'"},
      {base + R"(, "aux_loss_coef": -0.5)",
       "key 'aux_loss_coef': expected a finite number >= 0, got -0.5"},
      {base + R"(, "z_loss_coef": -1)", "key 'z_loss_coef': expected a finite number >= 0"},
      {base + R"(, "noise_std": -1)", "key 'noise_std': expected a finite number >= 0"},
      {base + R"(, "expert_bias_update_rate": -1e-3)", "key 'expert_bias_update_rate'"},
      {base + R"(, "jitter_eps": 1)", "jitter_eps: expected a number in [0, 1), got 1"},
      {base + R"(, "min_capacity": -1)", "key 'min_capacity': expected an integer in [0, "},
      {base + R"(, "alignment": 0)", "key 'alignment': expected an integer in [1, "},
      {base + R"(, "capacity": 3000000000)", "key 'capacity': expected an integer in [0, "},
      {base + R"(, "seed": -1)", "key 'seed': expected a non-negative integer, got -1"},
      {base + R"(, "num_groups": 3, "group_topk": 1)",
       "num_groups: expected a divisor of num_experts = 4"},
      {base + R"(, "num_groups": 2, "group_topk": 3)",
       "group_topk: expected an integer in [0, num_groups = 2]"},
      {base + R"(, "topk_scaling_factor": 0)", "topk_scaling_factor: expected a finite number > 0"},
      {base + R"(, "aux_loss": "sequence")", "aux_loss: sequence needs sequence_length >= 1"},
      {R"("model_dim": 16777216, "hidden_dim": 16777216, "num_experts": 1048576)",
       "overflows a 64-bit integer"},
      {R"("model_dim": 65536, "hidden_dim": 65536, "num_experts": 65536)",
       "parameters per expert weight: expected at most 2^40"},
  };
  for (const Case& k : cases) {
    RunResult r = Run("{" + k.keys + "}", Inputs(c, 4));
    EXPECT_ONE_LINE_ERROR(r, 2, k.expect);
  }
}

}  // namespace
}  // namespace switchyard::moe
