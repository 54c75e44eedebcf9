// `switchyard train` as a user meets its failures: what a failure after training steps keeps,
// what is checked before the first step, non-finite losses, the precedence of config sources,
// resume, run-directory ownership (marker and lock), a file-size limit and the output's figures.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "switchyard/core/file_util.h"
#include "train/train_cli_fixture.h"

namespace switchyard::train {
namespace {

// Case 1: the last held-out batch has fewer rows than ranks (4 ranks, batch 4; seq_len 32 with
// batch 8). Evaluation works, and the run ends with its checkpoint.
TEST_F(TrainCliSafetyTest, EvaluationWithFewerHeldOutRowsThanRanks) {
  CommandResult r = Run(Command("a", "--ranks 4 --batch_size 4 --steps 3 --eval_every 2"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Latest("a"), "step_00000003\n");
  r = Run(Command("b", "--ranks 4 --seq_len 32 --batch_size 8 --steps 2 --eval_every 1"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Latest("b"), "step_00000002\n");
}

// Case 1, the class: any failure after step >= 1 keeps the steps: the last completed step is
// saved and the error says where. Here the figure loss.svg cannot be written (a directory holds
// its name), which first fails at the evaluation of step 2, with no periodic checkpoint.
TEST_F(TrainCliSafetyTest, AFailureAfterTrainingStepsSavesTheLastCompletedStep) {
  fs::create_directories(dir_ + "/a/loss.svg");
  WriteTextFileAtomic(dir_ + "/a/.switchyard-run", "{}\n");  // a run directory (marker)
  CommandResult r = Run(Command("a", "--ranks 2 --steps 5 --eval_every 2 --checkpoint_every 0"));
  ASSERT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "loss.svg")) << r.err;
  EXPECT_TRUE(Contains(r.err, "step_00000002")) << r.err;
  EXPECT_EQ(Latest("a"), "step_00000002\n");
  EXPECT_TRUE(Leftovers("a").empty());
}

// Case 2: what the run needs is checked before its first step: generation (sample_tokens with
// a vocabulary that is not bytes) and memory.
TEST_F(TrainCliSafetyTest, LateFailuresAreFoundBeforeTheFirstStep) {
  CommandResult r = Run(Command("a", "--ranks 2 --steps 2 --vocab_size 100000"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "sample_tokens")) << r.err;
  EXPECT_FALSE(fs::exists(dir_ + "/a/metrics.jsonl"));
  r = Run(Command("b", "--ranks 2 --steps 2 --vocab_size 100000 --sample_tokens 0"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  r = Run(Command("c",
                  "--ranks 2 --steps 2 --vocab_size 1000000000 --model_dim 1024 "
                  "--num_heads 8 --sample_tokens 0"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "needs")) << r.err;
  EXPECT_FALSE(fs::exists(dir_ + "/c/metrics.jsonl"));
  // A held-out text shorter than one window, an eval_tokens below one window.
  r = Run(Command("d", "--ranks 2 --steps 2 --seq_len 2000"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "held-out")) << r.err;
  r = Run(Command("e", "--ranks 2 --steps 2 --eval_tokens 5"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "eval_tokens")) << r.err;
}

// Case 3: a non-finite loss stops the run with an error naming the step and keeps the last good
// checkpoint; --nonfinite skip skips such steps and counts them.
TEST_F(TrainCliSafetyTest, NonFiniteLossStopsOrIsSkipped) {
  CommandResult r = Run(Command("a", "--ranks 2 --steps 6 --lr 1e30 --checkpoint_every 1"));
  ASSERT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "non-finite")) << r.err;
  EXPECT_FALSE(Contains(r.out, "loss -")) << r.out;
  const std::vector<json> lines = Metrics("a");
  ASSERT_FALSE(lines.empty());
  for (const json& j : lines) EXPECT_TRUE(j.contains("loss") && j.contains("grad_norm")) << j;
  const int64_t bad_step = lines.back().at("step").get<int64_t>() + 1;
  EXPECT_TRUE(Contains(r.err, fmt::format("step {}", bad_step))) << r.err;
  EXPECT_EQ(Latest("a"), fmt::format("step_{:08}\n", bad_step - 1));

  r = Run(Command("b", "--ranks 2 --steps 4 --lr 1e30 --nonfinite skip"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  json summary = json::parse(ReadAll(dir_ + "/b/summary.json"));
  EXPECT_GT(summary.at("skipped_steps").get<int64_t>(), 0) << summary;
  for (const auto& [key, value] : summary.items()) EXPECT_FALSE(value.is_null()) << key;
  int64_t skipped = 0;
  for (const json& j : Metrics("b")) skipped += j.value("skipped_steps", int64_t{0});
  EXPECT_EQ(skipped, summary.at("skipped_steps").get<int64_t>());
  EXPECT_FALSE(Contains(r.out, "nan")) << r.out;
}

// Case 4: values of --moe_layer_config win over train's defaults; two explicit values that
// disagree are an error naming both sources; check_finite works.
TEST_F(TrainCliSafetyTest, MoeLayerConfigValuesAreNotOverwrittenByDefaults) {
  WriteTextFileAtomic(dir_ + "/layer.json",
                      R"({"top_k": 1, "capacity_factor": 2.0, "aux_loss_coef": 0.05})");
  CommandResult r =
      Run(Command("a", "--ranks 2 --steps 1 --moe_layer_config " + dir_ + "/layer.json"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  json config = json::parse(ReadAll(dir_ + "/a/config.json"));
  EXPECT_EQ(config.at("top_k"), 1);
  EXPECT_EQ(config.at("capacity_factor"), 2.0);
  EXPECT_EQ(config.at("aux_loss_coef"), 0.05);

  r = Run(Command("b", "--ranks 2 --steps 1 --top_k 2 --moe_layer_config " + dir_ + "/layer.json"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "top_k")) << r.err;
  EXPECT_TRUE(Contains(r.err, "--top_k")) << r.err;
  EXPECT_TRUE(Contains(r.err, "layer.json")) << r.err;
  // The same value twice is no conflict.
  r = Run(Command("c", "--ranks 2 --steps 1 --top_k 1 --moe_layer_config " + dir_ + "/layer.json"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;

  // check_finite: the MoE blocks' inputs become non-finite (lr 1e30; non-finite steps skipped,
  // so only check_finite can stop the run).
  WriteTextFileAtomic(dir_ + "/finite.json", R"({"check_finite": true})");
  r = Run(Command("d", "--ranks 2 --steps 6 --lr 1e30 --nonfinite skip --moe_layer_config " + dir_ +
                           "/finite.json"));
  // Non-finite values under check_finite are bad input (InvalidArgument): exit 2.
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "check_finite")) << r.err;
}

// Case 5: resume takes the model from the checkpoint, reports every conflicting flag at once,
// refuses other data, and retention keeps the resumed step and moves the abandoned timeline's
// checkpoints aside.
TEST_F(TrainCliSafetyTest, ResumeTakesTheModelFromTheCheckpoint) {
  CommandResult r = Run(Command("a",
                                "--ranks 2 --steps 6 --checkpoint_every 2 "
                                "--keep_checkpoints 0"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string step2 = dir_ + "/a/checkpoints/step_00000002";
  // No model flags at all: the checkpoint's model.
  r = Run(Bare("--ranks 2 --steps 3 --keep_checkpoints 1 --resume " + step2));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Latest("a"), "step_00000003\n");
  EXPECT_TRUE(fs::exists(step2)) << "the resumed step was pruned";
  EXPECT_FALSE(fs::exists(dir_ + "/a/checkpoints/step_00000006"))
      << "a checkpoint of the abandoned timeline is still a checkpoint of the run";
  bool kept_aside = false;
  for (const auto& e : fs::recursive_directory_iterator(dir_ + "/a/checkpoints")) {
    kept_aside = kept_aside || e.path().filename() == "step_00000006";
  }
  EXPECT_TRUE(kept_aside) << "the abandoned timeline's step 6 was deleted";

  // Conflicting model flags: all of them in one error.
  r = Run(Bare("--ranks 2 --steps 4 --model_dim 64 --num_layers 3 --resume " + dir_ + "/a"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "model_dim")) << r.err;
  EXPECT_TRUE(Contains(r.err, "num_layers")) << r.err;

  // Other data.
  WriteCorpus("other.txt", 300, " again");
  r = Run(Bare("--ranks 2 --steps 4 --data " + dir_ + "/other.txt --resume " + dir_ + "/a"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "other.txt")) << r.err;
  EXPECT_TRUE(Contains(r.err, "corpus.txt")) << r.err;
}

// Case 6: a non-empty directory that is not a run directory is refused, untouched.
TEST_F(TrainCliSafetyTest, ANonEmptyDirectoryThatIsNotARunIsRefused) {
  fs::create_directories(dir_ + "/mine");
  for (const char* f : {"config.json", "metrics.jsonl", "summary.json"}) {
    WriteTextFileAtomic(dir_ + "/mine/" + f, "my own file\n");
  }
  CommandResult r = Run(Command("mine", "--ranks 2 --steps 1"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "not a switchyard run directory")) << r.err;
  for (const char* f : {"config.json", "metrics.jsonl", "summary.json"}) {
    EXPECT_EQ(ReadAll(dir_ + "/mine/" + f), "my own file\n") << f;
  }
  // An empty directory is fine, and so is continuing a run directory.
  fs::create_directories(dir_ + "/empty");
  r = Run(Command("empty", "--ranks 2 --steps 1"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  r = Run(Command("empty", "--ranks 2 --steps 2 --resume " + dir_ + "/empty"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Case 6: one live run per run directory; the second is refused at start naming the owner's
// pid; the lock goes with the process.
TEST_F(TrainCliSafetyTest, ARunDirectoryHasOneLiveOwner) {
  const std::string pid_file = dir_ + "/pid";
  ASSERT_EQ(std::system((Command("a", "--ranks 2 --steps 100000 --checkpoint_every 1") +
                         " > /dev/null 2>&1 & echo $! > " + pid_file)
                            .c_str()),
            0);
  const pid_t first = std::stoi(ReadAll(pid_file));
  // Wait until the first run has started training.
  for (int i = 0; i < 600 && !fs::exists(dir_ + "/a/checkpoints/latest"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(dir_ + "/a/checkpoints/latest"));
  CommandResult r = Run(Command("a", "--ranks 2 --steps 3 --resume " + dir_ + "/a"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, std::to_string(first))) << r.err;
  ::kill(first, SIGKILL);
  for (int i = 0; i < 200 && ::kill(first, 0) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The owner is gone: its lock with it. Stop with a finished run at some step.
  r = Run(Command("a", "--ranks 2 --steps 1 --resume " + dir_ + "/a"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Case 7: a file-size limit: a clear error, the run's files and nothing half-written.
TEST_F(TrainCliSafetyTest, AFileSizeLimitIsAClearErrorWithNothingLeftOver) {
  // SIGXFSZ ignored (inherited across exec), 64 KiB per file: the metrics fit, a checkpoint
  // does not.
  CommandResult r = Run("bash -c \"trap '' XFSZ; ulimit -f 128; exec " +
                        Command("a", "--ranks 2 --steps 3 --checkpoint_every 1") + "\"");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  // The error names the checkpoint that could not be saved and why, not only a temporary file
  // that no longer exists.
  EXPECT_TRUE(Contains(r.err, "checkpoints/step_00000001: cannot write checkpoint")) << r.err;
  EXPECT_TRUE(Contains(r.err, "file size limit reached")) << r.err;
  EXPECT_TRUE(Leftovers("a").empty()) << ::testing::PrintToString(Leftovers("a"));
}

// Case 8: the output shows only meaningful figures: a resumed run with nothing left to do, a
// tiny run, MoE shares that add up.
TEST_F(TrainCliSafetyTest, OutputShowsOnlyMeaningfulFigures) {
  CommandResult r = Run(Command("a", "--ranks 2 --steps 2"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::string all = r.out;
  r = Run(Command("a", "--ranks 2 --steps 2 --resume " + dir_ + "/a"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  all += r.out;
  for (const char* bad : {"nan", "inf", " - ", "-nan", "loss -"}) {
    EXPECT_FALSE(Contains(all, bad)) << bad << " in\n" << all;
  }
  // The progress line's figure is the cross-entropy, named as in metrics.jsonl.
  EXPECT_TRUE(Contains(all, "ce_loss ")) << all;
  json summary = json::parse(ReadAll(dir_ + "/a/summary.json"));
  EXPECT_TRUE(summary.contains("final_train_ce_loss")) << summary;
  EXPECT_TRUE(summary.contains("final_val_ce_loss")) << summary;
  for (const auto& [key, value] : summary.items()) EXPECT_FALSE(value.is_null()) << key;
  // The MoE share of step time is a share.
  std::string::size_type p = all.find("MoE layers: ");
  ASSERT_NE(p, std::string::npos) << all;
  EXPECT_LE(std::stod(all.substr(p + 12)), 100.0) << all.substr(p, 80);
}

// Case 9: floats that become integers are range-checked.
TEST_F(TrainCliSafetyTest, FloatToIntegerConversionsAreChecked) {
  CommandResult r = Run(Command("a", "--ranks 2 --steps 1 --val_fraction 1e-300"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "val_fraction")) << r.err;
  r = Run(Command("b", "--ranks 2 --steps 1 --threads 4294967297"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "threads")) << r.err;
}

// Case 10: context parallelism as a new user meets it: every bad layout is exit code 2 with a
// message naming the keys; tp 2 x cp 2 trains and reports its context-parallel bytes and the
// memory per rank; a memory budget refuses the layout whose per-rank estimate exceeds it (cp 1)
// and admits the one with cp (cp 2), naming the estimate and the budget.
TEST_F(TrainCliSafetyTest, ContextParallelLayoutsAndMemoryBudget) {
  struct Bad {
    const char* flags;
    std::vector<std::string> needles;
  };
  const Bad bad[] = {
      {"--ranks 3 --cp 2", {"'cp' 2", "'ranks' 3"}},
      {"--ranks 2 --cp -1", {"'cp'"}},
      {"--ranks 4 --cp 4 --seq_len 12", {"'seq_len' 12", "'cp' 4", "8"}},
      {"--ranks 4 --cp 4 --cp_algo ulysses --num_heads 2 --model_dim 32",
       {"'num_heads' 2", "'cp' 4"}},
      {"--ranks 4 --tp 2 --cp 2 --cp_algo ulysses --num_heads 2",
       {"'num_heads' 2", "'tp' 2", "'cp' 2"}},
      {"--ranks 2 --cp 2 --cp_algo flash", {"'cp_algo'", "flash"}},
      {"--ranks 2 --cp 2 --attention_core softmax", {"'attention_core'", "'cp' 2"}},
      {"--ranks 2 --memory_budget_mib -1", {"'memory_budget_mib'"}},
  };
  for (const Bad& b : bad) {
    CommandResult r = Run(Command("bad", std::string(b.flags) + " --steps 1"));
    EXPECT_EQ(r.exit_code, 2) << b.flags << "\n" << r.out << r.err;
    for (const std::string& n : b.needles) EXPECT_TRUE(Contains(r.err, n)) << n << "\n" << r.err;
  }
  const std::string model = "--seq_len 64 --num_heads 4 --batch_size 2 --steps 2 ";
  CommandResult r =
      Run(Command("tpcp", model + "--ranks 4 --tp 2 --cp 2 --sequence_parallel true"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(Contains(r.out, "tp 2 (sequence parallel) x dp 1 x cp 2 (ring)")) << r.out;
  EXPECT_TRUE(Contains(r.out, "context parallel (cp 2, ring): ")) << r.out;
  EXPECT_TRUE(Contains(r.out, "memory per rank: estimate ")) << r.out;
  EXPECT_TRUE(Contains(r.out, "measured peak of the tensors held ")) << r.out;
  json summary = json::parse(ReadAll(dir_ + "/tpcp/summary.json"));
  EXPECT_GT(summary.at("cp_bytes_per_step").get<double>(), 0) << summary;
  EXPECT_GT(summary.at("memory_peak_bytes_per_rank_max").get<double>(), 0) << summary;
  // The budget: between the estimates of cp 1 (17 MiB) and cp 2 (3 MiB) for this model at
  // seq_len 512.
  const std::string longer =
      "--seq_len 512 --num_heads 4 --batch_size 1 --steps 1 --sample_tokens 0 --eval_tokens "
      "512 --memory_budget_mib 10 ";
  r = Run(Command("cp1", longer + "--ranks 1"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "per-rank memory estimate")) << r.err;
  EXPECT_TRUE(Contains(r.err, "'memory_budget_mib' 10")) << r.err;
  r = Run(Command("cp2", longer + "--ranks 2 --cp 2"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

}  // namespace
}  // namespace switchyard::train
