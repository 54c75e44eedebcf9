// The Hugging Face format: config.json of each family (defaults, every key, refusals naming the
// file and key), the parameter tables against the directories tests/models/make_tiny_hf.py writes
// from the format's description (an independent spec of names and shapes), and sharded
// safetensors reading (F32, BF16, F16) and writing (Hugging Face's sharding rule, the index,
// temporary names).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/hf_checkpoint.h"
#include "switchyard/train/hf_config.h"
#include "train/grad_check.h"
#include "train/temp_dir.h"

namespace switchyard::train::hf {
namespace {

namespace fs = std::filesystem;
using testing::RandomTensor;
using testing::TempDir;

// Expects `fn` to throw E with every needle in its message.
template <typename E, typename Fn>
void ExpectError(Fn fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << *needles.begin();
  } catch (const E& e) {
    for (const std::string& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' not in: " << e.what();
    }
  }
}

TEST(HfConfig, MinimalConfigTakesTheFamilyDefaults) {
  ModelConfig m = ParseModelConfig(R"({"model_type": "mixtral"})", "m/config.json");
  EXPECT_EQ(m.family, Family::kMixtral);
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.num_key_value_heads, 8);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.moe_intermediate_size, 14336);  // Mixtral's experts are intermediate_size wide
  EXPECT_TRUE(m.norm_topk_prob);              // Mixtral always renormalizes
  EXPECT_DOUBLE_EQ(m.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(m.router_aux_loss_coef, 0.001);
  ModelConfig q = ParseModelConfig(R"({"model_type": "qwen2_moe"})", "q/config.json");
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.norm_topk_prob);
  EXPECT_EQ(q.moe_intermediate_size, 1408);
  EXPECT_EQ(q.shared_expert_intermediate_size, 5632);
  ModelConfig o = ParseModelConfig(R"({"model_type": "olmoe"})", "o/config.json");
  EXPECT_TRUE(o.qk_norm);
  EXPECT_EQ(o.num_key_value_heads, 16);  // None: = num_attention_heads
  EXPECT_EQ(o.pad_token_id, 1);
  EXPECT_DOUBLE_EQ(o.router_aux_loss_coef, 0.01);
  ModelConfig l = ParseModelConfig(R"({"model_type": "llama"})", "l/config.json");
  EXPECT_FALSE(l.is_moe());
  EXPECT_FALSE(l.IsMoeLayer(0));
}

TEST(HfConfig, QwenSparseStepAndMlpOnlyLayers) {
  ModelConfig q = ParseModelConfig(
      R"({"model_type": "qwen2_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]})",
      "config.json");
  std::vector<bool> moe;
  for (int64_t l = 0; l < 6; ++l) moe.push_back(q.IsMoeLayer(l));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
}

TEST(HfConfig, WritesEveryKeyAndReadsItBack) {
  for (const char* fam : {"mixtral", "qwen2_moe", "olmoe", "llama", "qwen2"}) {
    ModelConfig a = ParseModelConfig(
        fmt::format(R"({{"model_type": "{}", "hidden_size": 32, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 50,
                        "tie_word_embeddings": true, "rope_theta": 5000.5,
                        "rms_norm_eps": 1e-7}})",
                    fam),
        "config.json");
    ModelConfig b = ParseModelConfig(ModelConfigToJson(a), "written");
    EXPECT_EQ(ModelConfigToJson(a), ModelConfigToJson(b)) << fam;
    EXPECT_EQ(b.architectures, a.architectures);
    EXPECT_EQ(b.num_key_value_heads, 2);
    EXPECT_DOUBLE_EQ(b.rope_theta, 5000.5);
    EXPECT_DOUBLE_EQ(b.rms_norm_eps, 1e-7);
    EXPECT_TRUE(b.tie_word_embeddings);
  }
}

TEST(HfConfig, BadConfigsNameTheFileAndKey) {
  auto parse = [](std::string text) { return [text] { ParseModelConfig(text, "D/config.json"); }; };
  ExpectError<InvalidArgument>(parse(R"({"model_type": "gpt_neox"})"),
                               {"D/config.json", "model_type", "gpt_neox", "mixtral"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "deepseek_v2"})"), {"latent attention"});
  ExpectError<InvalidArgument>(parse(R"({"hidden_size": 8})"), {"model_type"});
  ExpectError<InvalidArgument>(
      parse(R"({"model_type": "mixtral", "num_attention_heads": 12, "num_key_value_heads": 5,
                "hidden_size": 48})"),
      {"D/config.json", "num_key_value_heads", "5", "12"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "mixtral", "sliding_window": 4096})"),
                               {"sliding_window", "sliding-window attention"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "qwen2", "use_sliding_window": true})"),
                               {"use_sliding_window"});
  ExpectError<InvalidArgument>(
      parse(R"({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}})"),
      {"rope_scaling"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "olmoe", "clip_qkv": 8.0})"), {"clip_qkv"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "llama", "hidden_act": "gelu"})"),
                               {"hidden_act", "gelu"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "mixtral", "hidden_size": "big"})"),
                               {"hidden_size", "expected an integer"});
  ExpectError<InvalidArgument>(parse(R"({"model_type": "olmoe", "rope_theta": -1})"),
                               {"rope_theta"});
  ExpectError<InvalidArgument>(
      parse(R"({"model_type": "qwen2_moe", "num_hidden_layers": 2, "mlp_only_layers": [5]})"),
      {"mlp_only_layers", "5"});
  ExpectError<InvalidArgument>(
      parse(R"({"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 8})"),
      {"num_experts_per_tok"});
}

std::string Python() { return SY_SYSTEM_PYTHON3; }

// Runs make_tiny_hf.py into `out` (all families, no PyTorch reference: this test is the format).
void MakeTiny(const std::string& out, const std::string& extra) {
  const std::string cmd = Python() + " " + SY_MAKE_TINY_HF + " --out " + out + " --no-reference " +
                          extra + " > " + out + "/log.txt 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << ReadTextFile(out + "/log.txt");
}

constexpr const char* kFamilies[] = {"mixtral", "qwen2_moe", "olmoe", "llama", "qwen2"};

// The C++ parameter tables equal the script's (written independently from the format spec),
// single file and sharded.
TEST(HfCheckpoint, ReadsTheScriptsDirectories) {
  for (const char* extra : {"", "--max-shard-bytes 20000"}) {
    TempDir tmp;
    MakeTiny(tmp.path(), extra);
    for (const char* fam : kFamilies) {
      const std::string dir = tmp / fam;
      ModelConfig c = ReadModelConfig(dir);
      EXPECT_EQ(FamilyName(c.family), fam);
      CheckpointReader reader(dir);
      EXPECT_NO_THROW(reader.Validate(c)) << dir;
      EXPECT_EQ(reader.Names().size(), ParameterTable(c).size()) << fam;
      const bool sharded = fs::exists(dir + "/" + kIndexFile);
      EXPECT_EQ(sharded, std::string(extra).size() > 0) << fam;
      for (const TensorSpec& s : ParameterTable(c)) {
        Tensor t = reader.ReadFloat32(s.name, s.shape);
        EXPECT_EQ(t.shape(), s.shape);
      }
    }
  }
}

// BF16 and F16 weights are converted to float32 on load: they equal the F32 weights rounded.
TEST(HfCheckpoint, HalfPrecisionWeightsConvertOnLoad) {
  TempDir f32, bf16, f16;
  MakeTiny(f32.path(), "--family olmoe");
  MakeTiny(bf16.path(), "--family olmoe --dtype bf16 --max-shard-bytes 9000");
  MakeTiny(f16.path(), "--family olmoe --dtype f16");
  ModelConfig c = ReadModelConfig(f32 / "olmoe");
  CheckpointReader a(f32 / "olmoe"), b(bf16 / "olmoe"), h(f16 / "olmoe");
  for (const TensorSpec& s : ParameterTable(c)) {
    Tensor x = a.ReadFloat32(s.name, s.shape);
    Tensor y = b.ReadFloat32(s.name, s.shape);
    Tensor z = h.ReadFloat32(s.name, s.shape);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float v = x.data<float>()[i];
      ASSERT_EQ(y.data<float>()[i], static_cast<float>(BFloat16(v))) << s.name << "[" << i << "]";
      ASSERT_NEAR(z.data<float>()[i], v, std::abs(v) * 1e-3 + 1e-7) << s.name << "[" << i << "]";
    }
  }
}

TEST(HfCheckpoint, HalfToFloatIsExact) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_EQ(std::signbit(HalfToFloat(0x8000)), true);
}

TEST(HfCheckpoint, WriterShardsLikeHuggingFaceAndRoundTrips) {
  TempDir tmp;
  TensorMap tensors;
  for (int i = 0; i < 7; ++i) {
    tensors[fmt::format("t.{}.weight", i)] = RandomTensor({10 + i, 8}, static_cast<uint64_t>(i));
  }
  // 1000 bytes per shard: tensors of 320..512 bytes, two or one to a shard, in the order given.
  CheckpointWriter w(tmp.path(), WriterOptions{1000, DType::kFloat32});
  for (const auto& [name, t] : tensors) w.Add(name, t);
  std::vector<std::string> files = w.Finish();
  ASSERT_EQ(files.back(), kIndexFile);
  EXPECT_EQ(files.front(), "model-00001-of-00004.safetensors");
  EXPECT_EQ(files.size(), 5u);
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  CheckpointReader r(tmp.path());
  EXPECT_EQ(r.FileOf("t.0.weight"), "model-00001-of-00004.safetensors");
  EXPECT_EQ(r.FileOf("t.1.weight"), "model-00001-of-00004.safetensors");
  EXPECT_EQ(r.FileOf("t.2.weight"), "model-00002-of-00004.safetensors");
  for (const auto& [name, t] : tensors) {
    Tensor back = r.ReadFloat32(name, t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(back.data<float>()[i], t.data<float>()[i]);
  }
  // Rewriting the directory as one file removes the now stale index; BF16 export rounds.
  CheckpointWriter one(tmp.path(), WriterOptions{1 << 20, DType::kBFloat16});
  one.Add("x", tensors["t.0.weight"]);
  EXPECT_EQ(one.Finish(), std::vector<std::string>{kSingleFile});
  EXPECT_FALSE(fs::exists(tmp / kIndexFile));
  CheckpointReader r1(tmp.path());
  EXPECT_EQ(r1.Names(), std::vector<std::string>{"x"});
  EXPECT_EQ(r1.ReadFloat32("x", {10, 8}).data<float>()[3],
            static_cast<float>(BFloat16(tensors["t.0.weight"].data<float>()[3])));
}

TEST(HfCheckpoint, WriterLeavesNothingWhenNotFinished) {
  TempDir tmp;
  {
    CheckpointWriter w(tmp.path(), WriterOptions{100, DType::kFloat32});
    w.Add("a", RandomTensor({8, 8}, 1));
    w.Add("b", RandomTensor({8, 8}, 2));  // flushes "a"
    EXPECT_THROW(w.Add("a", RandomTensor({2}, 3)), InvalidArgument);
  }
  EXPECT_TRUE(fs::is_empty(tmp.path()));
  EXPECT_THROW(CheckpointWriter(tmp.path(), WriterOptions{0, DType::kFloat32}), InvalidArgument);
}

TEST(HfCheckpoint, BadDirectoriesNameTheFileAndTensor) {
  TempDir tmp;
  MakeTiny(tmp.path(), "--family mixtral --max-shard-bytes 20000");
  const std::string dir = tmp / "mixtral";
  ModelConfig c = ReadModelConfig(dir);
  const std::string index = dir + "/" + kIndexFile;
  const std::string good_index = ReadTextFile(index);

  // An index naming a missing shard.
  fs::rename(dir + "/model-00002-of-00003.safetensors", dir + "/moved.safetensors");
  ExpectError<IoError>([&] { CheckpointReader r(dir); },
                       {kIndexFile, "model-00002-of-00003.safetensors", "does not exist"});
  fs::rename(dir + "/moved.safetensors", dir + "/model-00002-of-00003.safetensors");

  // An index naming a file outside the directory.
  WriteTextFileAtomic(index, R"({"weight_map": {"lm_head.weight": "../x.safetensors"}})");
  ExpectError<IoError>([&] { CheckpointReader r(dir); }, {"weight_map.lm_head.weight", "../x"});
  // An index mapping a tensor to a shard that lacks it.
  WriteTextFileAtomic(
      index, R"({"weight_map": {"model.norm.weight": "model-00001-of-00003.safetensors"}})");
  ExpectError<IoError>([&] { CheckpointReader r(dir); }, {"model.norm.weight", "has no tensor"});
  WriteTextFileAtomic(index, good_index);

  // A config that does not fit the weights: mis-shaped and missing tensors, named.
  ModelConfig wider = c;
  wider.intermediate_size = wider.moe_intermediate_size = 25;
  CheckpointReader r(dir);
  ExpectError<InvalidArgument>([&] { r.Validate(wider); },
                               {"experts.0.w1.weight", "[25, 16]", "[24, 16]"});
  ModelConfig deeper = c;
  deeper.num_hidden_layers = 3;
  ExpectError<InvalidArgument>([&] { r.Validate(deeper); },
                               {"model.layers.2.input_layernorm.weight", "missing"});
  ModelConfig shallower = c;
  shallower.num_hidden_layers = 1;
  ExpectError<InvalidArgument>([&] { r.Validate(shallower); },
                               {"model.layers.1.", "not a parameter"});
  ExpectError<InvalidArgument>([&] { r.ReadFloat32("model.norm.weight", {17}); },
                               {"model.norm.weight", "[17]", "[16]"});
  ExpectError<IoError>([&] { r.ReadFloat32("model.nope", {1}); }, {"model.nope", "missing"});
  ExpectError<IoError>([&] { CheckpointReader none(tmp.path()); }, {kSingleFile, kIndexFile});
}

}  // namespace
}  // namespace switchyard::train::hf
