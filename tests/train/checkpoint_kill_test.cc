// Checkpoint saves killed for real: a child process saves (including re-saving the step `latest`
// names) and dies at every point of the save sequence, or at random moments by SIGKILL; after
// each death the checkpoint `latest` names must load and be one of the saved states, and the
// next save must not delete it.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "switchyard/core/error.h"
#include "switchyard/train/checkpoint.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr int kStoppedExit = 42;  // the child stopped at its probe point
constexpr int kFailedExit = 43;   // the child's save threw

// Step `step` of a run whose every value is `value`.
CheckpointData State(int64_t step, float value) {
  CheckpointData d;
  d.step = step;
  d.optimizer_step = step;
  d.seed = 7;
  d.global_batch = 4;
  d.config_json = R"({"steps": 10})";
  d.model = {{"w", Tensor::Full({1024}, value)}, {"b", Tensor::Full({16}, value)}};
  d.optimizer = {{"w.exp_avg", Tensor::Full({1024}, value)},
                 {"w.exp_avg_sq", Tensor::Full({1024}, value)}};
  return d;
}

// The value of a loaded state, checking that every tensor holds it (no mix of two saves).
float ValueOf(const CheckpointData& d) {
  const float v = d.model.at("w").data<float>()[0];
  for (const TensorMap* map : {&d.model, &d.optimizer}) {
    for (const auto& [name, t] : *map) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (t.data<float>()[i] != v) {
          ADD_FAILURE() << name << "[" << i << "] = " << t.data<float>()[i] << ", w[0] = " << v;
          return NAN;
        }
      }
    }
  }
  return v;
}

// Loads what `latest` names and expects step `step` with one of `values`.
void ExpectLatestLoads(const std::string& dir, int64_t step, const std::set<float>& values,
                       const std::string& what) {
  CheckpointData d;
  try {
    d = LoadCheckpoint(dir);
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": latest does not load: " << e.what();
    return;
  }
  EXPECT_EQ(d.step, step) << what;
  EXPECT_EQ(d.optimizer_step, step) << what;
  EXPECT_TRUE(values.count(ValueOf(d)) != 0) << what << ": value " << ValueOf(d);
}

int g_stop_at = -1;

// Runs `save` in a child process that _exits at probe point `stop_at` of its first save, as a
// kill there would leave things. Returns true when the child stopped there, false when the save
// had fewer points and completed.
bool SaveInChildStoppedAt(int stop_at, const std::function<void()>& save) {
  pid_t pid = ::fork();
  if (pid == 0) {
    g_stop_at = stop_at;
    SetCheckpointSaveProbeForTesting([](int point) {
      if (point == g_stop_at) ::_exit(kStoppedExit);
    });
    try {
      save();
    } catch (...) {
      ::_exit(kFailedExit);
    }
    ::_exit(0);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_NE(WEXITSTATUS(status), kFailedExit) << "the save threw at point " << stop_at;
  return WIFEXITED(status) && WEXITSTATUS(status) == kStoppedExit;
}

// Every entry of a checkpoints directory after a completed save: `latest` and step directories.
void ExpectNoLeftovers(const std::string& dir, const std::string& what) {
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "latest" || (name.size() == 13 && name.starts_with("step_")))
        << what << ": leftover " << name;
  }
}

// Re-saving the step `latest` names (a resumed run saving its resume step again), stopped dead
// at every point of the sequence, and the next save (another step) stopped right after its
// cleanup of leftovers: `latest` always loads the old or the new state.
TEST(CheckpointKillTest, ReSaveStoppedAtEveryPointKeepsLatestLoadable) {
  int points = 0;
  for (int stop_at = 0;; ++stop_at) {
    TempDir tmp;
    const std::string dir = tmp / "checkpoints";
    SaveCheckpoint(dir, State(1, 1.0f));
    SaveCheckpoint(dir, State(2, 2.0f));
    const std::string what = fmt::format("re-save stopped at point {}", stop_at);
    bool stopped =
        SaveInChildStoppedAt(stop_at, [&] { SaveCheckpoint(dir, State(2, 3.0f), /*keep=*/1); });
    ExpectLatestLoads(dir, 2, {2.0f, 3.0f}, what);
    // The next save cleans up what the dead one left; stopped right after that (point 0).
    EXPECT_TRUE(SaveInChildStoppedAt(0, [&] { SaveCheckpoint(dir, State(3, 4.0f)); })) << what;
    ExpectLatestLoads(dir, 2, {2.0f, 3.0f}, what + ", then the next save's cleanup");
    SaveCheckpoint(dir, State(3, 4.0f));
    ExpectLatestLoads(dir, 3, {4.0f}, what + ", then a completed save");
    ExpectNoLeftovers(dir, what);
    if (!stopped) {
      ExpectLatestLoads(dir + "/step_00000002", 2, {3.0f}, "the completed re-save");
      points = stop_at;
      break;
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GE(points, 6);  // the sequence was walked through, not skipped
}

// A fresh step (no re-save) stopped at every point: `latest` names the previous or the new one.
TEST(CheckpointKillTest, NewStepStoppedAtEveryPointKeepsLatestLoadable) {
  for (int stop_at = 0;; ++stop_at) {
    TempDir tmp;
    const std::string dir = tmp / "checkpoints";
    SaveCheckpoint(dir, State(1, 1.0f));
    SaveCheckpoint(dir, State(2, 2.0f));
    const std::string what = fmt::format("save stopped at point {}", stop_at);
    bool stopped =
        SaveInChildStoppedAt(stop_at, [&] { SaveCheckpoint(dir, State(3, 3.0f), /*keep=*/1); });
    CheckpointData d = LoadCheckpoint(dir);
    EXPECT_TRUE(d.step == 2 || d.step == 3) << what << ": step " << d.step;
    EXPECT_EQ(ValueOf(d), static_cast<float>(d.step)) << what;
    SaveCheckpoint(dir, State(4, 4.0f));
    ExpectLatestLoads(dir, 4, {4.0f}, what + ", then a completed save");
    ExpectNoLeftovers(dir, what);
    if (!stopped || ::testing::Test::HasFailure()) break;
  }
}

// SIGKILL at random moments of a process that keeps saving steps 2 and 3 (value 100 * step + k)
// with keep = 2, so that it re-saves the step `latest` names, replaces other steps and prunes.
TEST(CheckpointKillTest, SigkillAtRandomMomentsKeepsLatestLoadable) {
  TempDir tmp;
  const std::string dir = tmp / "checkpoints";
  SaveCheckpoint(dir, State(1, 100.0f));
  SaveCheckpoint(dir, State(2, 200.0f));
  // Kill moments spread over about six saves (fsync makes a save's duration the disk's).
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) SaveCheckpoint(tmp / "timing", State(2, 200.0f));
  const int64_t save_us = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count() /
                          3;
  std::mt19937 rng(1);
  std::set<float> seen;  // the states `latest` named after the kills
  // At least 40 kills, and on until they have landed in 5 different states: a slow fork or a
  // loaded machine (sanitizer builds, parallel tests) can make the first ones land early, so the
  // window widens with every kill (up to 200).
  for (int kill = 0; kill < 200 && (kill < 40 || seen.size() < 5); ++kill) {
    pid_t pid = ::fork();
    if (pid == 0) {
      try {
        for (int k = 0;; ++k) {
          int64_t step = k % 3 == 2 ? 3 : 2;
          SaveCheckpoint(dir, State(step, static_cast<float>(100 * step + k % 12)), /*keep=*/2);
        }
      } catch (...) {
        ::_exit(kFailedExit);
      }
    }
    const int64_t window_us = (6 + kill / 10) * save_us + 100;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % window_us));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saving child ended by itself: status " << status;
    const std::string what = fmt::format("kill {}", kill);
    try {
      CheckpointData d = LoadCheckpoint(dir);
      float v = ValueOf(d);
      seen.insert(v);
      EXPECT_TRUE(d.step >= 1 && d.step <= 3) << what << ": step " << d.step;
      EXPECT_TRUE(v >= 100.0f * d.step && v < 100.0f * d.step + 12) << what << ": value " << v;
    } catch (const Error& e) {
      ADD_FAILURE() << what << ": latest does not load: " << e.what();
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GE(seen.size(), 5u) << "the kills did not land while the child was saving";
  SaveCheckpoint(dir, State(4, 400.0f));
  ExpectLatestLoads(dir, 4, {400.0f}, "after the kills");
  ExpectNoLeftovers(dir, "after the kills");
}

}  // namespace
}  // namespace switchyard::train
