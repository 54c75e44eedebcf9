// `switchyard eval` on tiny Hugging Face directories (tests/models/make_tiny_hf.py) against the
// plain PyTorch reference it writes (logits, ce_loss, aux_loss, loss, grad.<name>), the name
// table of hf_names.h, gradients against finite differences, and bad input (exit 2, a message
// naming the file and the key, nothing written). Needs python3-torch: its absence fails.
#include "switchyard/train/hf_eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>

#include "cli/run_switchyard.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/train/hf_names.h"
#include "train/tiny_hf.h"

namespace switchyard::train::hf {
namespace {

using switchyard::testing::RunSwitchyard;

class HfEval : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    hf_.Make("--family mixtral --family olmoe --family qwen2_moe --max-shard-bytes 30000");
  }
  static void TearDownTestSuite() { hf_.dir.reset(); }
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(hf_.RequireMade()); }
  static std::string Dir(const std::string& family) { return *hf_.dir / family; }

  static testing::TinyHfDirs hf_;
};
testing::TinyHfDirs HfEval::hf_;

void ExpectClose(const Tensor& got, const Tensor& want, double atol, double rtol,
                 const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double w = want.data<float>()[i];
    ASSERT_NEAR(got.data<float>()[i], w, atol + rtol * std::abs(w)) << what << "[" << i << "]";
  }
}

// Every tensor of a family maps to a distinct place in switchyard's model, experts by global id.
TEST_F(HfEval, NameTableIsOneToOne) {
  for (const char* family : {"mixtral", "olmoe", "qwen2_moe"}) {
    const ModelConfig c = ReadModelConfig(Dir(family));
    std::set<std::string> places;
    for (const NameMapping& n : NameTable(c)) {
      EXPECT_TRUE(places.insert(n.sy_name + "#" + std::to_string(n.expert)).second) << n.hf_name;
    }
    EXPECT_EQ(places.size(), ParameterTable(c).size());
    // Reading and emitting again gives the directory's tensors bit for bit.
    const CheckpointReader reader(Dir(family));
    const TensorMap sy = ReadSwitchyardTensors(reader, c);
    int64_t seen = 0;
    ForEachHfTensor(
        c, [&](const std::string& name) { return sy.at(name); },
        [&](const std::string& name, const Tensor& t) {
          const Tensor want = reader.ReadFloat32(name, t.shape());
          ASSERT_EQ(0, std::memcmp(t.raw(), want.raw(), want.nbytes())) << name;
          ++seen;
        });
    EXPECT_EQ(seen, static_cast<int64_t>(ParameterTable(c).size()));
  }
}

// eval's output equals the PyTorch reference: logits, the three losses, every gradient.
TEST_F(HfEval, EqualsThePyTorchReference) {
  // qwen2_moe's tiny model has the gated shared expert and a dense layer among its MoE layers.
  for (const char* family : {"mixtral", "olmoe", "qwen2_moe"}) {
    const std::string dir = Dir(family);
    const std::string out = *hf_.dir / (std::string(family) + "_eval.safetensors");
    const auto r = RunSwitchyard("eval --model " + dir + " --tokens " + dir +
                                 "/tokens.json --grads --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const TensorMap got = ReadSafetensors(out);
    const TensorMap ref = ReadSafetensors(dir + "/reference.safetensors");
    ASSERT_EQ(got.at("logits").shape(), ref.at("logits").shape()) << family;
    ExpectClose(got.at("logits"), ref.at("logits"), 2e-5, 0, std::string(family) + " logits");
    for (const char* loss : {"ce_loss", "aux_loss", "loss"}) {
      ExpectClose(got.at(loss), ref.at(loss), 2e-6, 0, std::string(family) + " " + loss);
    }
    const ModelConfig c = ReadModelConfig(dir);
    EXPECT_EQ(got.size(), 4 + ParameterTable(c).size()) << family;
    for (const TensorSpec& spec : ParameterTable(c)) {
      const std::string name = "grad." + spec.name;
      ASSERT_EQ(got.count(name), 1u) << name;
      ExpectClose(got.at(name), ref.at(name), 1e-5, 1e-3, std::string(family) + " " + name);
    }
  }
}

// The gradient EvaluateModel returns against central differences of its loss, for a sample of
// entries of every kind of parameter (embedding, attention, QK-norm, router, experts, head).
TEST_F(HfEval, GradientsMatchFiniteDifferences) {
  const std::string dir = Dir("olmoe");
  const ModelConfig c = ReadModelConfig(dir);
  TrainConfig tc = TrainConfigFromJson(TrainKeysJson(c, dir));
  tc.model.seq_len = 6;
  TensorMap w = ReadSwitchyardTensors(CheckpointReader(dir), c);
  Tensor tokens = Tensor::Empty({2, 6}, DType::kInt32);
  for (int64_t i = 0; i < 12; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 64);
  // A larger coefficient so that the aux loss's gradient is visible next to the ce loss's.
  const double coef = 0.5;
  const EvalResult base = EvaluateModel(tc, w, tokens, coef, true);
  int checked = 0;
  for (const auto& [name, grad] : base.grads) {
    Tensor value = w.at(name);
    for (int64_t i : {int64_t{0}, value.numel() / 2 + 1, value.numel() - 1}) {
      const float keep = value.data<float>()[i];
      const float h = 3e-3f;
      value.data<float>()[i] = keep + h;
      const double up = EvaluateModel(tc, w, tokens, coef, false).loss;
      value.data<float>()[i] = keep - h;
      const double down = EvaluateModel(tc, w, tokens, coef, false).loss;
      value.data<float>()[i] = keep;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(grad.data<float>()[i], fd, 2e-3 + 2e-2 * std::abs(fd)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 3 * 15);
}

// Bad input: exit 2, a message naming the file and the key, no output written.
TEST_F(HfEval, BadInputIsAClearError) {
  const std::string dir = Dir("mixtral");
  const std::string out = *hf_.dir / "bad.safetensors";
  auto run = [&](const std::string& model, const std::string& tokens, const std::string& o) {
    return RunSwitchyard("eval --model " + model + " --tokens " + tokens + " --out " + o);
  };
  // A non-rectangular tokens file.
  const std::string ragged = *hf_.dir / "ragged.json";
  {
    std::ofstream f(ragged);
    f << R"({"input_ids": [[1, 2, 3], [4, 5]]})";
  }
  auto r = run(dir, ragged, out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("ragged.json: key 'input_ids[1]'"), std::string::npos) << r.err;
  // A token outside the vocabulary.
  const std::string big = *hf_.dir / "big.json";
  {
    std::ofstream f(big);
    f << R"({"input_ids": [[1, 2, 64]]})";
  }
  r = run(dir, big, out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("outside the vocabulary"), std::string::npos) << r.err;
  // --out equal to the input directory.
  r = run(dir, dir + "/tokens.json", dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  // --out naming the tokens file.
  r = run(dir, dir + "/tokens.json", dir + "/tokens.json");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  // An index naming a shard that is not there.
  const std::string broken = *hf_.dir / "broken";
  std::filesystem::copy(dir, broken);
  ASSERT_TRUE(std::filesystem::remove(broken + "/model-00002-of-00002.safetensors"));
  r = run(broken, dir + "/tokens.json", out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("model.safetensors.index.json: key 'weight_map."), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// BF16 weights are converted on load: eval runs and its loss stays near the float32 one.
TEST_F(HfEval, Bf16WeightsAreConvertedOnLoad) {
  const std::string bf16 = *hf_.dir / "bf16";
  const std::string make = std::string(SY_SYSTEM_PYTHON3) + " " + SY_MAKE_TINY_HF + " --out " +
                           bf16 + " --family mixtral --dtype bf16 --no-reference > /dev/null 2>&1";
  ASSERT_EQ(std::system(make.c_str()), 0);
  const std::string out = *hf_.dir / "bf16.safetensors";
  const auto r = RunSwitchyard("eval --model " + bf16 + "/mixtral --tokens " + Dir("mixtral") +
                               "/tokens.json --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const TensorMap got = ReadSafetensors(out);
  const TensorMap ref = ReadSafetensors(Dir("mixtral") + "/reference.safetensors");
  EXPECT_NEAR(got.at("ce_loss").data<float>()[0], ref.at("ce_loss").data<float>()[0], 2e-2);
}

// A Mixtral-style run exported, a new run initialized from the export (learning rate 0, so its
// weights stay), exported again: the two exports hold the same tensors bit for bit. The run
// trained in ep 2 / tp 2 exports the same names and shapes, and its export evaluates like the
// checkpoint it came from.
TEST_F(HfEval, ExportInitFromExportRoundTripsBitForBit) {
  const std::string corpus = *hf_.dir / "corpus.txt";
  {
    std::ofstream f(corpus);
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  const std::string common =
      "train --plain --data " + corpus +
      " --arch mixtral --seq_len 16 --model_dim 32 --num_layers 2 --num_heads 4 --hidden_dim 48 "
      "--num_experts 4 --top_k 2 --batch_size 8 --log_every 1 --eval_every 0 --sample_tokens 0 "
      "--num_kv_heads 2 --threads 1 ";
  const std::string run = *hf_.dir / "run_a";
  auto r = RunSwitchyard(common + "--steps 2 --ranks 4 --ep 2 --tp 2 --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string hf1 = *hf_.dir / "export_1";
  r = RunSwitchyard("export --run " + run + " --to hf --out " + hf1 + " --max-shard-size 40KB");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(hf1 + "/model.safetensors.index.json"));
  const ModelConfig c = ReadModelConfig(hf1);
  EXPECT_EQ(c.family, Family::kMixtral);
  CheckpointReader(hf1).Validate(c);

  const std::string run_b = *hf_.dir / "run_b";
  r = RunSwitchyard(common + "--steps 1 --lr 0 --min_lr 0 --ranks 2 --ep 2 --init-from " + hf1 +
                    " --out " + run_b);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("initialized from"), std::string::npos) << r.out;
  const std::string hf2 = *hf_.dir / "export_2";
  r = RunSwitchyard("export --run " + run_b + " --to hf --out " + hf2);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const CheckpointReader a(hf1), b(hf2);
  ASSERT_EQ(a.Names(), b.Names());
  for (const TensorSpec& spec : ParameterTable(c)) {
    const Tensor x = a.ReadFloat32(spec.name, spec.shape), y = b.ReadFloat32(spec.name, spec.shape);
    ASSERT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << spec.name;
  }

  // The same run on one rank exports the same tensors up to float summation order.
  const std::string run_1 = *hf_.dir / "run_1";
  r = RunSwitchyard(common + "--steps 2 --ranks 1 --out " + run_1);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string hf_1 = *hf_.dir / "export_one_rank";
  r = RunSwitchyard("export --run " + run_1 + " --to hf --out " + hf_1);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const CheckpointReader one(hf_1);
  for (const TensorSpec& spec : ParameterTable(c)) {
    ExpectClose(a.ReadFloat32(spec.name, spec.shape), one.ReadFloat32(spec.name, spec.shape), 2e-4,
                0, "ranks 4 ep 2 tp 2 vs one rank: " + spec.name);
  }

  // eval takes the run directory itself: the same model as its export, so the same outputs.
  const std::string tokens = *hf_.dir / "run_tokens.json";
  {
    std::ofstream f(tokens);
    f << R"({"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]})";
  }
  const std::string from_run = *hf_.dir / "eval_run.safetensors";
  const std::string from_hf = *hf_.dir / "eval_hf.safetensors";
  r = RunSwitchyard("eval --model " + run + " --tokens " + tokens + " --grads --out " + from_run);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunSwitchyard("eval --model " + hf1 + " --tokens " + tokens + " --grads --out " + from_hf);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const TensorMap er = ReadSafetensors(from_run), eh = ReadSafetensors(from_hf);
  ASSERT_EQ(er.size(), eh.size());
  EXPECT_EQ(er.size(), 4 + ParameterTable(c).size());
  for (const auto& [name, t] : eh) {
    ASSERT_EQ(er.count(name), 1u) << name;
    ASSERT_EQ(er.at(name).shape(), t.shape()) << name;
    EXPECT_EQ(0, std::memcmp(er.at(name).raw(), t.raw(), t.nbytes())) << name;
  }
  // A run directory that does not exist: bad input for eval and export (exit 2), naming it.
  const std::string missing = *hf_.dir / "no_such_run";
  r = RunSwitchyard("eval --model " + missing + " --tokens " + tokens + " --out " + from_run);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no_such_run"), std::string::npos) << r.err;
  // ... and the message names every form --model takes, the Hugging Face directory too.
  EXPECT_NE(r.err.find("or a Hugging Face model directory"), std::string::npos) << r.err;
  r = RunSwitchyard("export --run " + missing + " --to hf --out " + (*hf_.dir / "export_x"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no_such_run"), std::string::npos) << r.err;
  r = RunSwitchyard(common + "--steps 1 --init-from " + missing + " --out " + (*hf_.dir / "run_x"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--init-from " + missing), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("or a Hugging Face model directory"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(*hf_.dir / "run_x"));

  // A flag that contradicts the directory's config is an error naming both.
  r = RunSwitchyard(common + "--steps 1 --rope_theta 5 --init-from " + hf1 + " --out " +
                    (*hf_.dir / "run_c"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("'rope_theta': --rope_theta gives 5"), std::string::npos) << r.err;
  // --out equal to the run directory.
  r = RunSwitchyard("export --run " + run + " --to hf --out " + run);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace switchyard::train::hf
