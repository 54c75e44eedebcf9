// The trainer's data (train/data.h: TrainingData) on tokenized data: the determinism rule at the
// trainer level (the first 100 global batches the trainer draws are the same for 1 rank, dp 4,
// tp 2 x dp 2, pp 2 and a run resumed at step 37), the tokenizer's vocabulary, bits per byte, and
// every bad input as an error naming the file before step 1 (docs/data.md, "Training on it").
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/data.h"
#include "switchyard/train/dataset/megatron.h"
#include "switchyard/train/dataset/tokenizer.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/trainer.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

// A Megatron dataset (uint16) of `docs` documents of pseudo-random ids below `max_id` (lengths
// 3..40) at dir/name; returns the prefix.
std::string WriteMegatron(const TempDir& dir, const std::string& name, int docs, uint32_t seed,
                          int32_t max_id = 256) {
  const std::string prefix = dir / name;
  dataset::MegatronWriter w(prefix, dataset::MegatronDtype::kUint16);
  uint32_t x = seed;
  auto next = [&] {
    x = x * 1103515245u + 12345u;
    return x >> 8;
  };
  for (int d = 0; d < docs; ++d) {
    std::vector<int32_t> doc(3 + next() % 38);
    for (int32_t& t : doc) t = static_cast<int32_t>(next() % static_cast<uint32_t>(max_id));
    w.AddDocument(doc);
  }
  w.Finish();
  return prefix;
}

// A small dense model: fast enough for 100 steps in every layout.
TrainConfig TinyDenseConfig(const std::string& data) {
  TrainConfig c;
  c.model.seq_len = 8;
  c.model.model_dim = 16;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.hidden_dim = 32;
  c.model.moe_every = 0;
  c.batch_size = 8;
  c.steps = 100;
  c.ranks = 1;
  c.threads = 1;
  c.sample_tokens = 0;
  c.data = data;
  c.val_fraction = 0.1;
  c.seed = 7;
  return c;
}

// (step, global row) -> the row's tokens then its targets.
using Drawn = std::map<std::pair<int64_t, int64_t>, std::vector<int32_t>>;

// Records what a trainer draws; rows drawn twice (tensor- or pipeline-parallel peers) must agree.
void Observe(Trainer& t, Drawn& drawn, std::mutex& mu) {
  t.set_batch_observer([&](int64_t step, const std::vector<int64_t>& row_begins,
                           const std::vector<Batch>& batches) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t k = 0; k < batches.size(); ++k) {
      const Batch& b = batches[k];
      const int64_t rows = b.tokens.size(0), len = b.tokens.size(1);
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<int32_t> row(b.tokens.data<int32_t>() + r * len,
                                 b.tokens.data<int32_t>() + (r + 1) * len);
        row.insert(row.end(), b.targets.data<int32_t>() + r * len,
                   b.targets.data<int32_t>() + (r + 1) * len);
        auto [it, fresh] = drawn.emplace(std::make_pair(step, row_begins[k] + r), row);
        EXPECT_TRUE(fresh || it->second == row) << "step " << step << " row " << row_begins[k] + r;
      }
    }
  });
}

Drawn DrawOnRanks(const TrainConfig& c) {
  Drawn drawn;
  std::mutex mu;
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size());
    Observe(rt.trainer(), drawn, mu);
    for (int64_t s = 0; s < c.steps; ++s) rt.trainer().Step();
  });
  return drawn;
}

TEST(TrainingDataRun, First100GlobalBatchesAreTheSameInEveryLayoutAndOnResume) {
  TempDir dir;
  const std::string a = WriteMegatron(dir, "a", 60, 1), b = WriteMegatron(dir, "b", 40, 2);
  const TrainConfig base = TinyDenseConfig("0.7 " + a + " 0.3 " + b);

  Drawn one;
  std::mutex mu;
  {
    Trainer t(base);
    ASSERT_FALSE(t.data().byte_text());
    Observe(t, one, mu);
    for (int s = 0; s < 100; ++s) t.Step();
  }
  ASSERT_EQ(one.size(), 100u * 8u);
  // Not a constant stream: rows differ, and both datasets' ids appear.
  EXPECT_NE(one.begin()->second, std::next(one.begin())->second);

  struct Layout {
    const char* name;
    int64_t ranks, tp, pp, microbatches;
  };
  for (const Layout& l : {Layout{"dp 4", 4, 1, 1, 1}, Layout{"tp 2 x dp 2", 4, 2, 1, 1},
                          Layout{"pp 2", 2, 1, 2, 2}}) {
    TrainConfig c = base;
    c.ranks = l.ranks;
    c.tp = l.tp;
    c.pp = l.pp;
    c.microbatches = l.microbatches;
    const Drawn got = DrawOnRanks(c);
    EXPECT_EQ(got.size(), one.size()) << l.name;
    EXPECT_TRUE(got == one) << l.name;
  }

  // Resumed at step 37: a checkpoint's state restored into a new trainer, which goes on to 100.
  Drawn resumed;
  {
    Trainer first(base);
    Observe(first, resumed, mu);
    for (int s = 0; s < 37; ++s) first.Step();
    const CheckpointData snap = first.Snapshot();
    const std::string saved = SaveCheckpoint(dir / "ckpt", snap);
    Trainer second(base);
    second.Restore(LoadCheckpoint(saved));
    ASSERT_EQ(second.step(), 37);
    Observe(second, resumed, mu);
    for (int s = 37; s < 100; ++s) second.Step();
  }
  EXPECT_TRUE(resumed == one);
}

TEST(TrainingDataRun, BlendFollowsItsWeightsAndHoldsOutTheLastDocuments) {
  TempDir dir;
  // Ids below 128 in a, at or above 128 in b: every row tells which dataset it came from.
  const std::string a = WriteMegatron(dir, "a", 200, 3, 128);
  std::string b;
  {
    b = dir / "b";
    dataset::MegatronWriter w(b, dataset::MegatronDtype::kUint16);
    for (int d = 0; d < 200; ++d) {
      std::vector<int32_t> doc(20, 128 + d / 2);
      w.AddDocument(doc);
    }
    w.Finish();
  }
  TrainingDataOptions o;
  o.data = "0.8\n" + a + "\n0.2\n" + b;  // the command line's form (one field a line)
  o.seq_len = 8;
  o.seed = 1;
  o.batch_size = 4;
  o.val_fraction = 0.1;
  TrainingData data(o);
  EXPECT_FALSE(data.byte_text());
  EXPECT_EQ(data.bytes_per_token(), 1.0);  // the byte tokenizer
  EXPECT_TRUE(std::isnan(data.unigram_entropy()));
  int from_a = 0;
  const int rows = 1000;
  const Batch batch = data.Sample(0, rows, 0, rows);
  for (int r = 0; r < rows; ++r) from_a += batch.tokens.data<int32_t>()[r * 8] < 128 ? 1 : 0;
  // A window may start in one dataset's stream only; 80 % within one sample.
  EXPECT_NEAR(from_a, 800, 1);
  // Held out: the last 20 documents of each (val_fraction 0.1): b's hold the ids 128 + 90..99,
  // which the held-out batches show and training rows never do.
  ASSERT_FALSE(data.eval_batches().empty());
  bool held_out_b = false;
  for (const Batch& e : data.eval_batches()) {
    for (int64_t i = 0; i < e.tokens.numel(); ++i) {
      held_out_b = held_out_b || e.tokens.data<int32_t>()[i] >= 128 + 90;
    }
  }
  EXPECT_TRUE(held_out_b);
  for (int64_t i = 0; i < batch.tokens.numel(); ++i) {
    const int32_t t = batch.tokens.data<int32_t>()[i];
    EXPECT_FALSE(t >= 128 + 90) << "a held-out document of b was drawn for training";
    if (t >= 128 + 90) break;
  }
}

// A trained SentencePiece model of 100 pieces.
std::string TrainTokenizer(const TempDir& dir) {
  std::string text;
  const char* words[] = {"the",   "expert", "router", "sends",   "tokens", "to",    "each",
                         "layer", "of",     "a",      "mixture", "model",  "while", "ranks",
                         "wait",  "for",    "their",  "peers",   "naive",  "cafe"};
  uint32_t x = 1;
  for (int l = 0; l < 400; ++l) {
    for (int w = 0; w < 12; ++w) {
      x = x * 1103515245u + 12345u;
      text += words[(x >> 16) % 20];
      text += w == 11 ? "\n" : " ";
    }
  }
  WriteTextFileAtomic(dir / "text.txt", text);
  return dataset::TrainSentencePiece({.inputs = {dir / "text.txt"}, .vocab_size = 100}, dir / "sp");
}

TEST(TrainingDataRun, TheVocabularyFollowsTheTokenizerAndSamplesDecodeThroughIt) {
  TempDir dir;
  const std::string model = TrainTokenizer(dir);
  ResolvedTrainConfig resolved;
  resolved.config = TinyDenseConfig(dir / "text.txt");
  resolved.config.tokenizer = model;
  ApplyTokenizerVocabulary(resolved);
  EXPECT_EQ(resolved.config.model.vocab_size, 100);

  TrainConfig c = resolved.config;
  c.sample_tokens = 20;
  Trainer t(c);
  EXPECT_FALSE(t.data().byte_text());
  // Text encoded with the tokenizer: several bytes per token.
  EXPECT_GT(t.data().bytes_per_token(), 1.5);
  const StepMetrics m = t.Step();
  EXPECT_TRUE(std::isfinite(m.ce_loss));
  const std::string sample = t.Sample(20);
  EXPECT_FALSE(sample.empty());
  // Decoded pieces of the training words, not raw ids.
  EXPECT_NE(sample.find_first_of("aeiou"), std::string::npos) << sample;

  // A vocabulary set explicitly (here: by the checkpoint) that differs is refused, naming both.
  resolved.config.model.vocab_size = 256;
  resolved.explicit_keys["vocab_size"] = "checkpoint runs/x/checkpoints/step_00000010";
  try {
    ApplyTokenizerVocabulary(resolved);
    ADD_FAILURE() << "a tokenizer of 100 ids against a checkpoint of 256 was accepted";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(model), std::string::npos) << what;
    EXPECT_NE(what.find("100"), std::string::npos) << what;
    EXPECT_NE(what.find("256"), std::string::npos) << what;
    EXPECT_NE(what.find("checkpoint runs/x"), std::string::npos) << what;
  }
  // The trainer itself refuses a model whose vocabulary is not the tokenizer's.
  c.model.vocab_size = 256;
  EXPECT_THROW(Trainer{c}, InvalidArgument);
}

// `fn` must throw switchyard::Error naming every part.
template <typename Fn>
void ExpectErrorNaming(Fn&& fn, const std::vector<std::string>& parts, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(message.find(p), std::string::npos) << what << ": " << message;
    }
  }
}

TEST(TrainingDataRun, BadInputIsAnErrorNamingTheFileBeforeStepOne) {
  TempDir dir;
  const std::string good = WriteMegatron(dir, "good", 30, 5);
  auto make = [&](const std::string& data) {
    TrainConfig c = TinyDenseConfig(data);
    return [c] { Trainer t(c); };
  };
  auto damaged = [&](const std::string& name, const std::function<void(std::vector<char>&)>& fn,
                     const std::string& ext) {
    const std::string prefix = WriteMegatron(dir, name, 30, 5);
    std::ifstream in(prefix + ext, std::ios::binary);
    std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    in.close();
    fn(bytes);
    std::ofstream out(prefix + ext, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return prefix;
  };
  const std::string truncated = damaged(
      "truncated", [](std::vector<char>& b) { b.resize(b.size() - 10); }, ".bin");
  ExpectErrorNaming(make("0.5 " + good + " 0.5 " + truncated), {"truncated.bin", "runs past"},
                    "truncated .bin");
  const std::string magic = damaged(
      "magic", [](std::vector<char>& b) { b[0] = 'X'; }, ".idx");
  ExpectErrorNaming(make(magic), {"magic.idx", "magic"}, "wrong magic");
  const std::string version = damaged(
      "version", [](std::vector<char>& b) { b[9] = 2; }, ".idx");
  ExpectErrorNaming(make(version), {"version.idx", "version 2; expected 1"}, "wrong version");
  // Pointers past the .bin: the last sequence's pointer moved beyond the data.
  const std::string pointers = damaged(
      "pointers",
      [](std::vector<char>& b) {
        // Header 34 bytes, 30 lengths (int32), then 30 pointers (int64): the last one.
        const size_t at = 34 + 30 * 4 + 29 * 8;
        const int64_t far = int64_t{1} << 20;
        std::memcpy(b.data() + at, &far, sizeof far);
      },
      ".idx");
  ExpectErrorNaming(make(pointers), {"pointers", "runs past the end of"}, "pointers past the .bin");
  const std::string big = WriteMegatron(dir, "big_ids", 30, 5, 1000);
  ExpectErrorNaming(make(big), {"big_ids", "outside the vocabulary", "[0, 256)"},
                    "ids >= the vocabulary");
  {
    dataset::MegatronWriter w(dir / "empty", dataset::MegatronDtype::kUint16);
    w.Finish();
  }
  ExpectErrorNaming(make(dir / "empty"), {"empty.idx", "empty dataset"}, "empty dataset");
  ExpectErrorNaming(make("0 " + good + " 0 " + good), {"'data'", "sum to 0"}, "zero weights");
  ExpectErrorNaming(make("-1 " + good + " 2 " + good), {"'data'", "\"-1\"", ">= 0"},
                    "negative weight");
  ExpectErrorNaming(make("0.5 " + good + " 0.5"), {"'data'", "odd number"}, "odd fields");
  ExpectErrorNaming(make(dir / "missing.bin"), {"missing.bin"}, "missing file");
  {
    TrainConfig c = TinyDenseConfig(good);
    c.tokenizer = dir / "nope.model";
    ExpectErrorNaming([&] { Trainer t(c); }, {"nope.model"}, "missing tokenizer");
  }
  // Held-out part shorter than one window.
  {
    TrainConfig c = TinyDenseConfig(good);
    c.model.seq_len = 64;
    c.val_fraction = 0.04;  // one document of 3..40 tokens
    ExpectErrorNaming([&] { Trainer t(c); }, {"held-out part of", "good"}, "short held-out part");
  }
}

TEST(TrainingDataRun, DataSourcesParse) {
  EXPECT_TRUE(ParseDataSources("", "data").empty());
  const auto one = ParseDataSources("a.txt,b dir/c.txt", "data");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].path, "a.txt,b dir/c.txt");  // a path list, not a blend
  const auto blend = ParseDataSources("0.7 A 0.3 B", "data");
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_EQ(blend[0].weight, 0.7);
  EXPECT_EQ(blend[1].path, "B");
  const auto lines = ParseDataSources("2\nmy data/a\n1e0\nb", "data");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].path, "my data/a");
  EXPECT_EQ(lines[1].weight, 1.0);
  EXPECT_THROW(ParseDataSources("0.5 A nan B", "data"), InvalidArgument);
  EXPECT_THROW(ParseDataSources("0.5 A inf B", "data"), InvalidArgument);
}

}  // namespace
}  // namespace switchyard::train
