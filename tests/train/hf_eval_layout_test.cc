// `eval` in every parallel layout equals `eval` on one rank (docs/models.md, "Exchange with
// Hugging Face"): the tiny
// Mixtral, OLMoE and Qwen2-MoE directories of tests/models/make_tiny_hf.py evaluated with the
// logits, the three losses and every gradient compared; per-rank reads of the weights equal the
// slices of the full tensors bit for bit and read about 1/tp of a sharded tensor; a layout that
// does not fit the model is a clear error (exit 2) with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli/run_switchyard.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/train/hf_eval.h"
#include "switchyard/train/hf_names.h"
#include "train/temp_dir.h"

namespace switchyard::train::hf {
namespace {

using switchyard::testing::RunSwitchyard;
using testing::TempDir;

class HfEvalLayout : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    // The directories only (no PyTorch reference: these tests compare layouts with one rank).
    const std::string make = std::string(SY_SYSTEM_PYTHON3) + " " + SY_MAKE_TINY_HF + " --out " +
                             dir_->path() +
                             " --family mixtral --family olmoe --family qwen2_moe "
                             "--max-shard-bytes 30000 --no-reference > " +
                             dir_->path() + "/log.txt 2>&1";
    made_ = std::system(make.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(made_) << ReadTextFile(*dir_ / "log.txt"); }
  static std::string Dir(const std::string& family) { return *dir_ / family; }

  static TempDir* dir_;
  static bool made_;
};
TempDir* HfEvalLayout::dir_ = nullptr;
bool HfEvalLayout::made_ = false;

// [4, 8] token ids of a 64-token vocabulary, OLMoE's pad_token_id 1 among them (as an input on
// two ranks' rows and as a label).
Tensor Tokens() {
  Tensor t = Tensor::Empty({4, 8}, DType::kInt32);
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + 11) % 64);
  }
  t.data<int32_t>()[5] = t.data<int32_t>()[29] = 1;
  return t;
}

struct Layout {
  const char* name;
  int64_t ranks, tp, ep, pp, cp;
  bool sp;
  int64_t etp = 1;
  bool megatron = false;
};

// The layout's result on rank 0 (every rank's must be the same: checked too).
EvalResult RunLayout(TrainConfig c, const Layout& l, const RankWeightLoader& load,
                     const Tensor& tokens, double coef, bool grads = true) {
  c.ranks = l.ranks;
  c.tp = l.tp;
  c.ep = l.ep;
  c.pp = l.pp;
  c.cp = l.cp;
  c.sequence_parallel = l.sp;
  c.etp = l.etp;
  if (l.megatron) c.arrangement = ArrangementChoice::kMegatron;
  ValidateTrainConfig(c);
  std::vector<EvalResult> results(static_cast<size_t>(l.ranks));
  comm::CreateInProcessLauncher(static_cast<int>(l.ranks))->Run([&](comm::Communicator& world) {
    results[static_cast<size_t>(world.rank())] =
        EvaluateOnRank(c, &world, static_cast<int>(l.ranks), load, tokens,
                       EvalOptions{.aux_coef = coef, .grads = grads, .threads = 1});
  });
  for (const EvalResult& r : results) {
    EXPECT_EQ(r.loss, results[0].loss) << l.name;
    EXPECT_EQ(0, std::memcmp(r.logits.raw(), results[0].logits.raw(), r.logits.nbytes()));
  }
  return results[0];
}

double MaxAbs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(double{t.data<float>()[i]}));
  return m;
}

// Every layout's logits, losses and gradients equal the one-rank evaluation's up to float
// summation order: tensor parallelism splits the GEMMs' inner sums, the all-reduces add the
// ranks' partial sums in another order, so single-precision results differ in the last bits of
// each sum. Tolerance: 1e-5 of the tensor's largest entry (plus 1e-6 of the entry itself) for
// logits and gradients, 1e-6 for the losses (values of order 1-4).
TEST_F(HfEvalLayout, EveryLayoutEqualsOneRank) {
  const Layout layouts[] = {
      {"tp 2", 2, 2, 1, 1, 1, false},        {"tp 2 + sp", 2, 2, 1, 1, 1, true},
      {"ep 2 (dp 2)", 2, 1, 2, 1, 1, false}, {"pp 2", 2, 1, 1, 2, 1, false},
      {"cp 2", 2, 1, 1, 1, 2, false},        {"tp 2 x dp 2, ep 2", 4, 2, 2, 1, 1, false},
  };
  const Tensor tokens = Tokens();
  for (const char* family : {"mixtral", "olmoe", "qwen2_moe"}) {
    const ModelConfig mc = ReadModelConfig(Dir(family));
    TrainConfig tc = TrainConfigFromJson(TrainKeysJson(mc, Dir(family)));
    tc.model.seq_len = tokens.size(1);
    const TensorMap weights = ReadSwitchyardTensors(CheckpointReader(Dir(family)), mc);
    const double coef = 0.5;  // large, so that the aux loss's share of the gradients is visible
    const EvalResult one = EvaluateModel(tc, weights, tokens, coef, true);
    if (mc.pad_token_id) {  // nn.Embedding's padding_idx: the pad row gets no gradient
      ASSERT_EQ(tc.model.pad_token_id, *mc.pad_token_id);
      const Tensor& g = one.grads.at("embed.weight");
      for (int64_t j = 0; j < g.size(1); ++j) {
        ASSERT_EQ(g.data<float>()[tc.model.pad_token_id * g.size(1) + j], 0.0f) << family;
      }
    }
    std::set<std::string> parameters;
    for (const NameMapping& n : NameTable(mc)) parameters.insert(n.sy_name);
    ASSERT_EQ(one.grads.size(), parameters.size());
    for (const Layout& l : layouts) {
      const std::string what = std::string(family) + ", " + l.name;
      const EvalResult got = RunLayout(tc, l, SliceFullWeights(weights), tokens, coef);
      ASSERT_EQ(got.logits.shape(), one.logits.shape()) << what;
      const double lmax = MaxAbs(one.logits);
      for (int64_t i = 0; i < one.logits.numel(); ++i) {
        const double w = one.logits.data<float>()[i];
        ASSERT_NEAR(got.logits.data<float>()[i], w, 1e-5 * lmax + 1e-6 * std::abs(w))
            << what << " logits[" << i << "]";
      }
      EXPECT_NEAR(got.ce_loss, one.ce_loss, 1e-6) << what;
      EXPECT_NEAR(got.aux_loss, one.aux_loss, 1e-6) << what;
      EXPECT_NEAR(got.loss, one.loss, 1e-6) << what;
      ASSERT_EQ(got.grads.size(), one.grads.size()) << what;
      for (const auto& [name, g] : one.grads) {
        ASSERT_EQ(got.grads.count(name), 1u) << what << " " << name;
        const Tensor& h = got.grads.at(name);
        ASSERT_EQ(h.shape(), g.shape()) << what << " " << name;
        const double gmax = MaxAbs(g);
        ASSERT_GT(gmax, 0) << what << " " << name;
        for (int64_t i = 0; i < g.numel(); ++i) {
          const double w = g.data<float>()[i];
          ASSERT_NEAR(h.data<float>()[i], w, 1e-5 * gmax + 1e-6 * std::abs(w))
              << what << " grad " << name << "[" << i << "]";
        }
      }
    }
  }
}

// Each rank reads only its part of the directory's tensors (LoadRankWeights), and what it reads
// equals the slice of the full tensors a resumed run takes (CheckpointLayout::Slice), bit for bit,
// in layouts that split the experts (ep, etp H-shards), the dense layers (tp) and the blocks (pp).
// The bytes a rank reads are exactly its parameters' (float32 files): at tp 2 a column- or
// row-parallel tensor is read half, not whole.
TEST_F(HfEvalLayout, PerRankReadsEqualSlicesOfTheFullTensors) {
  const Layout layouts[] = {
      {"tp 2", 2, 2, 1, 1, 1, false},
      {"tp 2 x dp 2, ep 2", 4, 2, 2, 1, 1, false},
      {"ep 4", 4, 1, 4, 1, 1, false},
      {"pp 2", 2, 1, 1, 2, 1, false},
  };
  const Tensor tokens = Tokens();
  for (const char* family : {"mixtral", "olmoe", "qwen2_moe"}) {
    const std::string dir = Dir(family);
    const ModelConfig mc = ReadModelConfig(dir);
    TrainConfig tc = TrainConfigFromJson(TrainKeysJson(mc, dir));
    tc.model.seq_len = tokens.size(1);
    const TensorMap weights = ReadSwitchyardTensors(CheckpointReader(dir), mc);
    int64_t model_elements = 0;
    for (const auto& [name, t] : weights) model_elements += t.numel();
    for (const Layout& l : layouts) {
      if (mc.num_experts % l.ep != 0) continue;  // qwen2_moe's 6 experts do not split over 4
      const std::string what = std::string(family) + ", " + l.name;
      // Per rank: bytes read, elements held; of the tp-split and the expert tensors, the
      // elements held and those of their full tensors.
      std::vector<int64_t> read(static_cast<size_t>(l.ranks)), held(read.size());
      std::vector<int64_t> split_held(read.size()), split_full(read.size());
      std::vector<int64_t> expert_held(read.size()), expert_full(read.size());
      std::vector<int> mismatches(read.size());
      const RankWeightLoader load = [&](ParameterSet& params, const CheckpointLayout& layout) {
        const CheckpointReader reader(dir);  // its own count of bytes read
        LoadRankWeights(reader, &mc, params, layout);
        TensorMap sliced = weights;
        layout.Slice(params, sliced, {""});
        const size_t rank = static_cast<size_t>(layout.world_rank());
        for (const Parameter& p : params.all()) {
          const Tensor& want = sliced.at(p.name);
          if (want.shape() != p.value.shape() ||
              std::memcmp(want.raw(), p.value.raw(), want.nbytes()) != 0) {
            ++mismatches[rank];
          }
          held[rank] += p.value.numel();
          const std::optional<CheckpointLayout::Part> part = layout.PartOf(p);
          if (!part) continue;
          int64_t full = 1;
          for (int64_t d : part->full_shape) full *= d;
          if (p.tp_shard.split()) {
            split_held[rank] += p.value.numel();
            split_full[rank] += full;
          }
          if (p.options.group == ParamGroup::kExpert) {
            expert_held[rank] += p.value.numel();
            expert_full[rank] += full;
          }
        }
        read[rank] = static_cast<int64_t>(reader.bytes_read());
      };
      RunLayout(tc, l, load, tokens, 0.0, /*grads=*/false);
      for (size_t r = 0; r < read.size(); ++r) {
        EXPECT_EQ(mismatches[r], 0) << what << ", rank " << r;
        EXPECT_EQ(read[r], 4 * held[r]) << what << ", rank " << r;
        if (l.tp > 1) {  // each tp-split tensor: 1/tp of it read
          EXPECT_GT(split_full[r], 0) << what;
          EXPECT_EQ(split_held[r] * l.tp, split_full[r]) << what << ", rank " << r;
        }
        if (l.ep > 1) {  // each MoE layer's experts: 1/ep of them read
          EXPECT_GT(expert_full[r], 0) << what;
          EXPECT_EQ(expert_held[r] * l.ep, expert_full[r]) << what << ", rank " << r;
        }
        EXPECT_LT(held[r], model_elements) << what << ", rank " << r;
      }
    }
  }
}

// The command line: `eval --tp 2 --dp 2 --ep 2` writes what one rank writes (up to the
// summation order, tolerances as above); a layout the model does not fit is exit 2 naming the
// key, with nothing written.
TEST_F(HfEvalLayout, CommandLineTakesTheLayoutFlags) {
  const std::string dir = Dir("mixtral");
  const std::string tokens = *dir_ / "tokens.json";
  {
    std::ofstream f(tokens);
    f << R"({"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16],)"
      << R"( [17, 18, 19, 20, 21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31, 63]]})";
  }
  const std::string one = *dir_ / "one.safetensors", four = *dir_ / "four.safetensors";
  const std::string eval = "eval --model " + dir + " --tokens " + tokens + " --grads --out ";
  auto r = RunSwitchyard(eval + one);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunSwitchyard(eval + four + " --tp 2 --dp 2 --ep 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const TensorMap a = ReadSafetensors(one), b = ReadSafetensors(four);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a.size(), 4 + ParameterTable(ReadModelConfig(dir)).size());
  for (const auto& [name, t] : a) {
    ASSERT_EQ(b.count(name), 1u) << name;
    ASSERT_EQ(b.at(name).shape(), t.shape()) << name;
    const double m = MaxAbs(t);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double w = t.data<float>()[i];
      ASSERT_NEAR(b.at(name).data<float>()[i], w, 1e-5 * m + 1e-6 * std::abs(w)) << name;
    }
  }
  // Layouts that do not fit: 4 heads over tp 3, 4 experts over ep 3, 4 sequences over dp 3,
  // experts split over one rank.
  const std::string bad = *dir_ / "bad.safetensors";
  for (const auto& [flags, key] :
       std::vector<std::pair<std::string, std::string>>{{"--tp 3", "tp"},
                                                        {"--dp 3 --ep 3", "ep"},
                                                        {"--dp 3 --ep 1", "data-parallel"},
                                                        {"--ep 2", "--ep 2"}}) {
    r = RunSwitchyard(eval + bad + " " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.err;
    EXPECT_NE(r.err.find(key), std::string::npos) << flags << ": " << r.err;
    EXPECT_FALSE(std::filesystem::exists(bad)) << flags;
  }
}

}  // namespace
}  // namespace switchyard::train::hf
