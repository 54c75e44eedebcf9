// Whole runs on in-process ranks over a grid of (ranks, batch_size, seq_len, corpus size,
// eval_tokens): every combination that starts must finish (evaluation included, whatever the
// held-out text leaves for the last batch) with its final checkpoint, and one that cannot run
// must be refused before its first step.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/distributed.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::FILE* DevNull() {
  static std::FILE* f = std::fopen("/dev/null", "w");
  return f;
}

std::string WriteCorpus(const TempDir& dir, int records) {
  std::string text;
  const char* lines[] = {"the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
                         "we like to read books"};
  for (int i = 0; i < records; ++i) text += std::string(lines[i % 4]) + ".\n%\n";
  std::string path = dir / ("corpus_" + std::to_string(records) + ".txt");
  WriteTextFileAtomic(path, text);
  return path;
}

TrainConfig TinyConfig(const TempDir& dir) {
  TrainConfig c;
  c.model.seq_len = 8;
  c.model.model_dim = 16;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.hidden_dim = 16;
  c.model.moe_every = 2;
  c.num_experts = 2;
  c.top_k = 1;
  c.steps = 2;
  c.warmup_steps = 1;
  c.eval_every = 1;
  c.log_every = 1;
  c.checkpoint_every = 0;
  c.sample_tokens = 4;
  c.threads = 1;
  return c;
}

TEST(RunGridTest, EveryStartedRunFinishesWithItsCheckpoint) {
  TempDir dir;
  // 40 records: 4 held out (~100 bytes); 400 records: ~1000 held-out bytes.
  const std::string small = WriteCorpus(dir, 40), large = WriteCorpus(dir, 400);
  int runs = 0, refused = 0;
  for (int64_t ranks : {1, 3, 4}) {
    for (int64_t batch : {ranks, int64_t{8}}) {
      if (batch < ranks) continue;
      for (int64_t seq_len : {8, 32}) {
        for (const std::string& data : {small, large}) {
          for (int64_t eval_tokens : {0, 40}) {
            TrainConfig c = TinyConfig(dir);
            c.ranks = ranks;
            c.ep = ranks == 4 ? 2 : 1;
            c.batch_size = batch;
            c.model.seq_len = seq_len;
            c.data = data;
            c.eval_tokens = eval_tokens;
            c.out = dir / fmt::format("run_{}_{}_{}_{}_{}", ranks, batch, seq_len,
                                      data == small ? "s" : "l", eval_tokens);
            const std::string what = c.out;
            DistributedRunOptions o;
            o.run.out = DevNull();
            RunSummary s;
            try {
              s = RunDistributedTraining(*comm::CreateInProcessLauncher(static_cast<int>(ranks)), c,
                                         o);
            } catch (const InvalidArgument& e) {
              // Refused: only before the first step, with nothing trained.
              ++refused;
              EXPECT_FALSE(fs::exists(c.out + "/metrics.jsonl")) << what << ": " << e.what();
              continue;
            } catch (const std::exception& e) {
              ADD_FAILURE() << what << ": " << e.what();
              continue;
            }
            ++runs;
            EXPECT_EQ(s.steps, 2) << what;
            EXPECT_EQ(ReadTextFile(c.out + "/checkpoints/latest"), "step_00000002\n") << what;
          }
        }
      }
    }
  }
  // Most of the grid runs; the refusals are the held-out texts shorter than one window.
  EXPECT_GT(runs, 3 * refused) << runs << " runs, " << refused << " refused";
}

}  // namespace
}  // namespace switchyard::train
