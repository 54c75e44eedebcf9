// Failures of one rank of a `switchyard` job under mpirun (docs/errors.md, "MPI and multi-rank
// failures"): whatever fails on one rank -- an error of its own, a rank stopped until its peers'
// deadline, a rank killed, settings that differ between ranks, a rank count that differs from
// the processes started -- the whole job ends within seconds, with a nonzero exit code and the
// first error printed once. Each case runs mpirun with np 2 (one with np 4), with per-rank flags
// through a small wrapper script, and bounds the wall time: before this was fixed, these jobs
// ended after a 60 s deadline or never.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "parallel/cli_helpers.h"

namespace switchyard::parallel {
namespace {

using testing::ReadAll;

// Generous for a loaded 2-core CI machine; the old behaviour took 60 s or forever.
constexpr double kJobLimitSeconds = 20;

const char* kLayerConfig = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "top_k": 2,
  "capacity_factor": 1.0})";

struct TimedResult {
  int exit_code = -1;  // -1: killed by a signal or by the limit
  bool over_limit = false;
  double seconds = 0;
  std::string out, err;
};

// Runs `command` through sh in a process group of its own, stdout and stderr in `dir`; after
// `limit` seconds the group is killed and over_limit set.
TimedResult RunTimed(const std::string& command, const std::string& dir, double limit) {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const std::string full = command + " > " + out + " 2> " + err;
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  TimedResult r;
  int status = 0;
  for (;;) {
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r.seconds > limit) {
      r.over_limit = true;
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = !r.over_limit && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadAll(out);
  r.err = ReadAll(err);
  return r;
}

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

class CliMpiFailure : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::TestDir("sy_cli_mpi_failure"); }

  void TearDown() override {
    // A rank left stopped or running by a failed expectation must not outlive the test.
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      if (e.path().extension() != ".pid") continue;
      const int pid = std::atoi(ReadAll(e.path().string()).c_str());
      if (pid > 1) kill(pid, SIGKILL);
    }
  }

  // `switchyard <args>` on np ranks; rank r also gets rank_args[r] (if any), and `rank_prelude[r]`
  // runs in the rank's shell before it becomes switchyard (its pid is $$).
  TimedResult Mpirun(int np, const std::string& args, const std::vector<std::string>& rank_args,
                     const std::vector<std::string>& rank_prelude = {}) {
    const std::string script = dir_ + "/rank.sh";
    std::string text = "#!/bin/sh\nr=$OMPI_COMM_WORLD_RANK\necho $$ > " + dir_ + "/rank$r.pid\n";
    text += "case $r in\n";
    for (size_t r = 0; r < std::max(rank_args.size(), rank_prelude.size()); ++r) {
      text += std::to_string(r) + ") " + (r < rank_prelude.size() ? rank_prelude[r] : "") +
              "\n  exec " + SY_SWITCHYARD_BIN + " \"$@\" " +
              (r < rank_args.size() ? rank_args[r] : "") + " ;;\n";
    }
    text += "*) exec " + std::string(SY_SWITCHYARD_BIN) + " \"$@\" ;;\nesac\n";
    std::ofstream(script) << text;
    return RunTimed(std::string("bash ") + SY_MPIRUN_SCRIPT + " -np " + std::to_string(np) +
                        " sh " + script + " " + args,
                    dir_, 3 * kJobLimitSeconds);
  }

  // A small training run's flags, without --data and --out; --batch_size 8 unless the ranks get
  // their own.
  std::string Train(const std::string& extra, bool batch_size = true) const {
    return "train --plain --seq_len 16 --model_dim 32 --num_layers 2 --num_heads 2 "
           "--hidden_dim 48 --warmup_steps 1 --log_every 1 --eval_every 0 "
           "--sample_tokens 0 --threads 1 " +
           extra + (batch_size ? " --batch_size 8" : "");
  }

  void WriteCorpus(const std::string& name, const std::string& line) const {
    std::string text;
    for (int i = 0; i < 200; ++i) text += line + " " + std::to_string(i) + "\n";
    std::ofstream(dir_ + "/" + name) << text;
  }

  std::string dir_;
};

// The job ended in time with a nonzero exit code and exactly one error line naming every part;
// unless a timeout is the cause, no rank's deadline played a part.
void ExpectOneErrorNaming(const TimedResult& r, const std::vector<std::string>& parts,
                          bool timeout_is_the_cause = false) {
  EXPECT_FALSE(r.over_limit) << "the job did not end: " << r.err;
  EXPECT_LT(r.seconds, kJobLimitSeconds) << r.err;
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_EQ(Count(r.err, "switchyard: error:"), 1) << r.err;
  if (!timeout_is_the_cause) {
    EXPECT_EQ(Count(r.err, "timed out"), 0) << r.err;
    EXPECT_EQ(Count(r.err, "peer never matched"), 0) << r.err;
  }
  for (const std::string& part : parts) {
    EXPECT_NE(r.err.find(part), std::string::npos) << "no '" << part << "' in: " << r.err;
  }
}

// ---- A rank stopped (kill -STOP) until its peers' deadline, or killed ----

TEST_F(CliMpiFailure, RankStoppedPastTheDeadlineEndsTheJob) {
  // Rank 1 stops itself 4 s in, during the benchmark; its peers time out after 3 s. The rank
  // that printed the timeout used to hang in MPI's shutdown (and crash when rank 1 resumed).
  for (int np : {2, 4}) {
    TimedResult r = Mpirun(np,
                           "bench comm --transport mpi --op allreduce --sizes 1M --iters 100000 "
                           "--warmup 0 --timeout-ms 3000",
                           {"", ""}, {"", "(sleep 4; kill -STOP $$) </dev/null >/dev/null 2>&1 &"});
    ExpectOneErrorNaming(r, {"timed out", "rank 1 (world rank 1)"}, /*timeout_is_the_cause=*/true);
    EXPECT_EQ(r.exit_code, 1) << np << " ranks: " << r.err;
  }
}

TEST_F(CliMpiFailure, RankKilledEndsTheJob) {
  TimedResult r = Mpirun(2,
                         "bench comm --transport mpi --op allreduce --sizes 1M --iters 100000 "
                         "--warmup 0",
                         {"", ""}, {"", "(sleep 3; kill -KILL $$) </dev/null >/dev/null 2>&1 &"});
  EXPECT_FALSE(r.over_limit) << r.err;
  EXPECT_LT(r.seconds, kJobLimitSeconds) << r.err;
  EXPECT_NE(r.exit_code, 0) << r.err;
}

// ---- An error on one rank only ----

TEST_F(CliMpiFailure, MissingDataOnOneRankEndsTheJobWithThatError) {
  WriteCorpus("corpus.txt", "the quick brown fox jumps over the lazy dog");
  TimedResult r = Mpirun(2, Train("--steps 3 --out " + dir_ + "/run"),
                         {"--data " + dir_ + "/corpus.txt", "--data " + dir_ + "/missing.txt"});
  ExpectOneErrorNaming(r, {"MPI rank 1 of 2", "missing.txt"});
}

TEST_F(CliMpiFailure, UnwritableOutOnRankZeroEndsTheJobWithThatError) {
  WriteCorpus("corpus.txt", "the quick brown fox jumps over the lazy dog");
  TimedResult r = Mpirun(2, Train("--steps 3 --data " + dir_ + "/corpus.txt"),
                         {"--out /proc/version/run", "--out " + dir_ + "/run"});
  ExpectOneErrorNaming(r, {"MPI rank 0 of 2", "/proc/version/run"});
}

TEST_F(CliMpiFailure, MissingTensorsOnOneRankEndsTheJobWithThatError) {
  testing::WriteLayerInputs(dir_, kLayerConfig, 12);
  TimedResult r = Mpirun(
      2, "layer --quiet --config " + dir_ + "/layer.json --out " + dir_ + "/o",
      {"--tensors " + dir_ + "/in.safetensors", "--tensors " + dir_ + "/missing.safetensors"});
  ExpectOneErrorNaming(r, {"missing.safetensors"});
}

// ---- Ranks started with different settings ----

TEST_F(CliMpiFailure, TrainRanksWithDifferentSettingsAreNamed) {
  WriteCorpus("corpus.txt", "the quick brown fox jumps over the lazy dog");
  TimedResult r = Mpirun(2, Train("--data " + dir_ + "/corpus.txt --out " + dir_ + "/run", false),
                         {"--steps 3 --lr 0.01 --seed 1 --batch_size 8",
                          "--steps 4 --lr 0.02 --seed 1 --batch_size 4"});
  ExpectOneErrorNaming(r, {"different settings", "'steps': 3 on rank 0, 4 on rank 1",
                           "'lr': 0.01 on rank 0, 0.02 on rank 1", "'batch_size'"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.find("'seed'"), std::string::npos) << "seed is the same: " << r.err;
}

TEST_F(CliMpiFailure, TrainRanksWithDifferentDataAreNamed) {
  WriteCorpus("a.txt", "the quick brown fox jumps over the lazy dog");
  WriteCorpus("b.txt", "pack my box with five dozen liquor jugs");
  TimedResult r = Mpirun(2, Train("--steps 3 --out " + dir_ + "/run"),
                         {"--data " + dir_ + "/a.txt", "--data " + dir_ + "/b.txt"});
  ExpectOneErrorNaming(r, {"'data (content)': fnv1a64:", "on rank 0", "on rank 1"});
}

TEST_F(CliMpiFailure, LayerRanksWithDifferentTensorsAreNamed) {
  testing::WriteLayerInputs(dir_, kLayerConfig, 12);
  std::filesystem::rename(dir_ + "/in.safetensors", dir_ + "/a.safetensors");
  testing::WriteLayerInputs(dir_, kLayerConfig, 13);
  TimedResult r = Mpirun(2, "layer --quiet --config " + dir_ + "/layer.json --out " + dir_ + "/o",
                         {"--tensors " + dir_ + "/a.safetensors",
                          "--tensors " + dir_ + "/in.safetensors --scope per_rank"});
  ExpectOneErrorNaming(r, {"layer: the ranks", "'tensor 'x'': float32[12, 8]", "float32[13, 8]",
                           "'scope': global on rank 0, per_rank on rank 1"});
}

TEST_F(CliMpiFailure, BenchCommRanksWithDifferentSettingsAreNamed) {
  TimedResult r =
      Mpirun(2, "bench comm --transport mpi --op allreduce --sizes 4K", {"", "--iters 5"});
  ExpectOneErrorNaming(r, {"bench comm: the ranks", "'iters': 20 on rank 0, 5 on rank 1"});
}

// ---- The number of ranks ----

TEST_F(CliMpiFailure, TrainRanksDifferentFromTheProcessesStartedIsRefused) {
  WriteCorpus("corpus.txt", "the quick brown fox jumps over the lazy dog");
  TimedResult r = Mpirun(2, Train("--ranks 4 --steps 3 --data " + dir_ + "/corpus.txt"), {});
  ExpectOneErrorNaming(r, {"ranks: 4 requested but mpirun started 2 processes"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

TEST_F(CliMpiFailure, TrainTransportMpiOutsideALauncherIsRefused) {
  WriteCorpus("corpus.txt", "the quick brown fox jumps over the lazy dog");
  TimedResult r = RunTimed(std::string(SY_SWITCHYARD_BIN) + " " +
                               Train("--ranks 2 --transport mpi --steps 3 --data " + dir_ +
                                     "/corpus.txt --out " + dir_ + "/run"),
                           dir_, 3 * kJobLimitSeconds);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("not started by an MPI launcher"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("2 ranks"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/run"));
}

TEST_F(CliMpiFailure, LayerRanksDifferentFromTheProcessesStartedIsRefused) {
  testing::WriteLayerInputs(dir_, kLayerConfig, 12);
  TimedResult r = Mpirun(2,
                         "layer --quiet --ranks 4 --config " + dir_ + "/layer.json --tensors " +
                             dir_ + "/in.safetensors --out " + dir_ + "/o",
                         {});
  ExpectOneErrorNaming(r, {"--ranks 4 but mpirun started 2 processes"});
}

TEST_F(CliMpiFailure, LayerUnderMpirunTakesTheWorldSize) {
  testing::WriteLayerInputs(dir_, kLayerConfig, 12);
  const std::string layer = std::string(SY_SWITCHYARD_BIN) + " layer --config " + dir_ +
                            "/layer.json --tensors " + dir_ + "/in.safetensors --out " + dir_;
  ASSERT_EQ(testing::RunCommand(layer + "/single.safetensors --quiet", dir_).exit_code, 0);
  TimedResult r = Mpirun(2,
                         "layer --threads 1 --config " + dir_ + "/layer.json --tensors " + dir_ +
                             "/in.safetensors --out " + dir_ + "/mpi.safetensors",
                         {});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("layer: 2 ranks (mpi)"), std::string::npos) << r.out;
  EXPECT_TRUE(testing::SameOutputs(dir_ + "/mpi.safetensors", dir_ + "/single.safetensors"));
}

}  // namespace
}  // namespace switchyard::parallel
