// The fixture of the `switchyard train` CLI tests that run the binary on a small model and a
// small corpus (train_cli_safety_test.cc, train_cli_robust_test.cc).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/cli_helpers.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train {

namespace fs = std::filesystem;
using nlohmann::json;
using parallel::testing::CommandResult;
using parallel::testing::ReadAll;
using parallel::testing::RunCommand;

inline bool Contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

class TrainCliSafetyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/train_cli_safety_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    WriteCorpus("corpus.txt", 300, "");
  }

  void WriteCorpus(const std::string& name, int records, const std::string& suffix) const {
    std::string text;
    const char* lines[] = {"the cat sat on the mat", "a dog ran in the park",
                           "the sun is warm today", "we like to read books"};
    for (int i = 0; i < records; ++i) text += std::string(lines[i % 4]) + suffix + ".\n%\n";
    WriteTextFileAtomic(dir_ + "/" + name, text);
  }

  CommandResult Run(const std::string& command) const { return RunCommand(command, dir_); }

  // `defaults` ("--key value" pairs) without the keys that `extra` sets, then `extra`.
  static std::string Merge(const std::string& defaults, const std::string& extra) {
    std::istringstream in(defaults);
    std::string key, value, merged;
    while (in >> key >> value) {
      if (!Contains(" " + extra + " ", " " + key + " ")) merged += key + " " + value + " ";
    }
    return merged + extra;
  }
  // The binary with the run flags but no model flags.
  std::string Bare(const std::string& extra) const {
    return std::string(SY_SWITCHYARD_BIN) + " train --plain " +
           Merge("--data " + dir_ +
                     "/corpus.txt --warmup_steps 1 --lr 0.01 --adam_eps 1e-5 --log_every 1 "
                     "--eval_every 0 --sample_tokens 16 --threads 1",
                 extra);
  }
  // A small model into dir_/out.
  std::string Command(const std::string& out, const std::string& extra) const {
    return Bare(
        Merge("--seq_len 16 --model_dim 32 --num_layers 2 --num_heads 2 --hidden_dim 48 "
              "--batch_size 8 --out " +
                  dir_ + "/" + out,
              extra));
  }

  std::vector<json> Metrics(const std::string& out) const {
    std::vector<json> lines;
    std::ifstream in(dir_ + "/" + out + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) lines.push_back(json::parse(line));
    return lines;
  }

  std::string Latest(const std::string& out) const {
    return ReadAll(dir_ + "/" + out + "/checkpoints/latest");
  }

  // Files under dir_/out whose names mark an unfinished write.
  std::vector<std::string> Leftovers(const std::string& out) const {
    std::vector<std::string> found;
    for (const auto& e : fs::recursive_directory_iterator(dir_ + "/" + out)) {
      const std::string name = e.path().filename().string();
      if (Contains(name, ".tmp") || Contains(name, ".partial-") || Contains(name, ".trash-") ||
          Contains(name, ".prev-")) {
        found.push_back(e.path().string());
      }
    }
    return found;
  }

  std::string dir_;
};

}  // namespace switchyard::train
