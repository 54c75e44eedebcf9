// `switchyard train` on tokenized data (runs the binary): a blend of a preprocessed Megatron
// dataset and a nanoGPT file with a SentencePiece tokenizer, the vocabulary taken from the
// tokenizer, bits per byte and perplexity in metrics.jsonl and summary.json, and bad inputs
// refused with exit 2 naming the file before step 1 (docs/data.md, "Training on it").
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/run_switchyard.h"
#include "core/temp_dir.h"
#include "data/dataset_io.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train::dataset {
namespace {

using nlohmann::json;
using switchyard::testing::RunSwitchyard;
using switchyard::testing::TempDir;
using testing::Put;
using testing::WriteBytes;

std::string Text(int lines) {
  std::string text;
  const char* words[] = {"experts", "route",  "tokens", "across",  "ranks", "while", "the",
                         "router",  "learns", "a",      "balance", "of",    "load",  "and"};
  uint32_t x = 3;
  for (int l = 0; l < lines; ++l) {
    for (int w = 0; w < 10; ++w) {
      x = x * 1103515245u + 12345u;
      text += words[(x >> 16) % 14];
      text += w == 9 ? "\n" : " ";
    }
  }
  return text;
}

// Small model keys for a quick run.
const char* kSmall =
    "--seq-len 16 --model-dim 16 --num-layers 2 --num-heads 2 --hidden-dim 32 --moe-every 0 "
    "--ranks 1 --threads 1 --batch-size 4 --steps 3 --log-every 1 --eval-every 3 "
    "--checkpoint-every 0 --plain";

TEST(CliTrainData, BlendWithATokenizerReportsBitsPerByte) {
  TempDir dir;
  WriteTextFileAtomic(dir.File("c.txt"), Text(600));
  auto r =
      RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 64 --model-type bpe "
                                "--out {}",
                                dir.File("c.txt"), dir.File("tok")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunSwitchyard(
      fmt::format("preprocess --input {} --tokenizer {} --out {} --append-eod --quiet",
                  dir.File("c.txt"), dir.File("tok.model"), dir.File("mega")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // A nanoGPT file: ids 5..60, uint16.
  std::vector<char> flat;
  for (int i = 0; i < 6000; ++i) Put<uint16_t>(flat, static_cast<uint16_t>(5 + i * 7 % 56));
  WriteBytes(dir.File("flat.bin"), flat);
  const std::string out = dir.File("run");
  // The flat file is one document (65,536 tokens each): held-out text comes from --val-data.
  WriteTextFileAtomic(dir.File("val.txt"), Text(40));
  r = RunSwitchyard(fmt::format(
      "train {} --data 0.75 {} 0.25 {} --tokenizer {} --sample-tokens 8 --val-data {} --out {}",
      kSmall, dir.File("mega"), dir.File("flat.bin"), dir.File("tok.model"), dir.File("val.txt"),
      out));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("tokenizer sentencepiece:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bits/byte"), std::string::npos) << r.out;
  const json config = json::parse(ReadTextFile(out + "/config.json"));
  EXPECT_EQ(config.at("vocab_size"), 64);  // from the tokenizer
  const json summary = json::parse(ReadTextFile(out + "/summary.json"));
  ASSERT_TRUE(summary.contains("final_val_bits_per_byte")) << summary.dump();
  const double bpt = summary.at("bytes_per_token").get<double>();
  EXPECT_GT(bpt, 1.0);
  const double val = summary.at("final_val_ce_loss").get<double>();
  EXPECT_NEAR(summary.at("final_val_bits_per_byte").get<double>(), val / (std::log(2.0) * bpt),
              1e-9);
  EXPECT_NEAR(summary.at("final_val_perplexity").get<double>(), std::exp(val),
              1e-9 * std::exp(val));
  // The last metrics line carries the same figures.
  const std::string metrics = ReadTextFile(out + "/metrics.jsonl");
  const std::string last = metrics.substr(metrics.rfind('\n', metrics.size() - 2) + 1);
  const json line = json::parse(last);
  EXPECT_TRUE(line.contains("val_bits_per_byte")) << last;
  EXPECT_TRUE(line.contains("bits_per_byte")) << last;
  EXPECT_TRUE(line.contains("perplexity")) << last;
  EXPECT_TRUE(std::filesystem::exists(out + "/sample.txt"));

  // A different tokenizer against the checkpoint's vocabulary: exit 2 naming both.
  WriteTextFileAtomic(dir.File("c2.txt"), Text(600));
  r =
      RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 48 --model-type bpe "
                                "--out {}",
                                dir.File("c2.txt"), dir.File("tok48")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunSwitchyard(fmt::format("train --resume {} --tokenizer {} --steps 4 --plain", out,
                                dir.File("tok48.model")));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("tok48.model"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("48"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("checkpoint"), std::string::npos) << r.err;
}

TEST(CliTrainData, BadDataIsRefusedBeforeStepOne) {
  TempDir dir;
  std::vector<char> odd(19, 0);
  WriteBytes(dir.File("odd.bin"), odd);
  struct Case {
    std::string flags, needle;
  };
  const std::vector<Case> cases = {
      {"--data " + dir.File("odd.bin"), "odd.bin"},
      {"--data 0.5 " + dir.File("odd.bin") + " -0.5 " + dir.File("odd.bin"), "'data'"},
      {"--data 0 " + dir.File("odd.bin") + " 0 " + dir.File("odd.bin"), "sum to 0"},
      {"--data " + dir.File("odd.bin") + " --data-format llmc", "odd.bin"},
      {"--data " + dir.File("odd.bin") + " --data-format bpe", "'data_format'"},
      {"--tokenizer " + dir.File("none.model"), "none.model"},
  };
  for (const Case& c : cases) {
    const std::string out = dir.File("run_bad");
    auto r = RunSwitchyard(fmt::format("train {} {} --out {}", kSmall, c.flags, out));
    EXPECT_EQ(r.exit_code, c.needle == "none.model" ? 1 : 2) << c.flags << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.flags << "\n" << r.err;
    EXPECT_FALSE(std::filesystem::exists(out + "/metrics.jsonl")) << c.flags;
  }
}

}  // namespace
}  // namespace switchyard::train::dataset
