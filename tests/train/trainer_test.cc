// The training loop: config keys, checkpoints (atomic, verified, pruned), bit-for-bit resume,
// learning below the unigram entropy, data-parallel hooks, and the run directory.
#include "switchyard/train/trainer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/generate.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// A small corpus with structure to learn: fortune-style records.
std::string WriteCorpus(const TempDir& dir) {
  std::string text;
  const char* words[] = {"the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
                         "we like to read books"};
  for (int i = 0; i < 200; ++i) text += std::string(words[i % 4]) + ".\n%\n";
  std::string path = dir / "corpus.txt";
  WriteTextFileAtomic(path, text);
  return path;
}

TrainConfig TinyTrainConfig(const TempDir& dir) {
  TrainConfig c;
  c.model.seq_len = 16;
  c.model.model_dim = 32;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.hidden_dim = 64;
  c.batch_size = 8;
  c.steps = 6;
  c.warmup_steps = 2;
  c.lr = 1e-2;
  c.data = WriteCorpus(dir);
  c.out = dir / "run";
  c.eval_every = 3;
  c.log_every = 1;
  c.checkpoint_every = 3;
  c.keep_checkpoints = 0;
  c.sample_tokens = 20;
  c.threads = 1;
  return c;
}

std::FILE* DevNull() {
  static std::FILE* f = std::fopen("/dev/null", "w");
  return f;
}

TEST(TrainConfigTest, JsonRoundTripAndErrors) {
  TrainConfig c;
  c.model.model_dim = 96;
  c.model.norm = NormKind::kRmsNorm;
  c.data = "x.txt";
  c.seed = 7;
  TrainConfig back = TrainConfigFromJson(TrainConfigToJson(c));
  EXPECT_EQ(TrainConfigToJson(back), TrainConfigToJson(c));
  EXPECT_EQ(back.model.model_dim, 96);
  EXPECT_EQ(back.model.norm, NormKind::kRmsNorm);
  auto message = [](const std::string& json) {
    try {
      TrainConfigFromJson(json);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(R"({"stepz": 3})"), "config: unknown key 'stepz'");
  EXPECT_EQ(message(R"({"steps": 2.5})"), "config: key 'steps': expected an integer, got 2.5");
  EXPECT_EQ(message(R"({"tied_head": 1})"),
            "config: key 'tied_head': expected true or false, got 1");
  EXPECT_NE(message(R"({"norm": "batchnorm"})").find("layernorm"), std::string::npos);
  EXPECT_NE(message("[1]").find("expected a JSON object"), std::string::npos);
  TrainConfig s;
  SetTrainConfigValue(s, "steps", "12");
  SetTrainConfigValue(s, "data", "/some/file.txt");  // bare string
  SetTrainConfigValue(s, "lr", "1e-3");
  SetTrainConfigValue(s, "norm", "rmsnorm");
  EXPECT_EQ(s.steps, 12);
  EXPECT_EQ(s.data, "/some/file.txt");
  EXPECT_DOUBLE_EQ(s.lr, 1e-3);
  EXPECT_THROW(SetTrainConfigValue(s, "steps", "many"), InvalidArgument);
  // ... experts_per_block, tp, sequence_parallel, tp_comm_overlap, arrangement, etp, cp, cp_algo,
  // microbatches, pp, pipeline_schedule, virtual_stages, pipeline_split, overlap_grad_reduce,
  // bucket_mb, check_finite, routing_scope, val_data, trace_step, adaptive_r, a2a_algo,
  // a2a_ranks_per_node, smart_schedule, shadow_experts; the model's recompute and precision;
  // attention_core, memory_budget_mib; topk_scaling_factor (the MoE router's routed scaling);
  // data_format, tokenizer; the router keys num_groups, group_topk, aux_loss,
  // expert_bias_update_rate, router_group_by, router_trace, router_trace_steps, router_replay; the
  // model architecture block: arch, position_embedding, rope_theta, num_kv_heads, norm_eps,
  // attention_bias, qk_norm, mlp, mlp_bias, pad_token_id, hf_router, norm_topk_prob,
  // gated_shared_expert_hidden, mlp_only_layers.
  EXPECT_EQ(TrainConfigKeys().size(), 99u);
  s.batch_size = 0;
  EXPECT_THROW(ValidateTrainConfig(s), InvalidArgument);
}

TEST(TrainConfigTest, ExpertsPerBlockIsAListOfCounts) {
  TrainConfig c = TrainConfigFromJson(R"({"experts_per_block": [4, 8]})");
  EXPECT_EQ(c.experts_per_block, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(TrainConfigFromJson(TrainConfigToJson(c)).experts_per_block, c.experts_per_block);
  SetTrainConfigValue(c, "experts_per_block", "2,16,4");  // the command line's spelling
  EXPECT_EQ(c.experts_per_block, (std::vector<int64_t>{2, 16, 4}));
  SetTrainConfigValue(c, "experts_per_block", "[8]");
  EXPECT_EQ(c.experts_per_block, (std::vector<int64_t>{8}));
  for (const char* bad : {"4,,8", "4,x", "0,4", "-2", "4.5"}) {
    try {
      SetTrainConfigValue(c, "experts_per_block", bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'experts_per_block': expected a list of integers"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(TrainerTest, LearnsBelowTheUnigramEntropy) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  c.steps = 80;
  c.warmup_steps = 5;
  Trainer t(c);
  double first = t.Step().ce_loss;
  StepMetrics m;
  while (t.step() < c.steps) m = t.Step();
  double val = t.Evaluate();
  EXPECT_GT(first, t.unigram_entropy());
  EXPECT_LT(m.ce_loss, 0.6 * t.unigram_entropy()) << "first " << first;
  EXPECT_LT(val, 0.6 * t.unigram_entropy());
  EXPECT_GT(m.tokens_per_s, 0);
  EXPECT_TRUE(m.expert_load.empty());
}

TEST(TrainerTest, SameSeedSameLosses) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  Trainer a(c), b(c);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(a.Step().loss, b.Step().loss);
  c.seed = 2;
  Trainer other(c);
  Trainer again(TinyTrainConfig(dir));
  EXPECT_NE(other.Step().loss, again.Step().loss);
}

TEST(TrainerTest, ResumeIsBitForBit) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  std::vector<double> straight;
  {
    Trainer t(c);
    for (int i = 0; i < 6; ++i) straight.push_back(t.Step().loss);
  }
  std::string ckpt;
  std::vector<double> resumed;
  {
    Trainer t(c);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.Step().loss);
    ckpt = SaveCheckpoint(dir / "ckpts", t.Snapshot());
    t.Step();  // the interrupted run went on; must not matter
  }
  {
    Trainer t(c);
    t.Restore(LoadCheckpoint(dir / "ckpts"));
    EXPECT_EQ(t.step(), 3);
    EXPECT_EQ(t.optimizer_step(), 3);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.Step().loss);
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i;
}

// A trainer alone is the objects of every run over a one-rank world: its context, pipeline group
// and process groups have one rank, and its optimizer state lives in the buffer's sharded
// optimizers (two floats per trainable element).
TEST(TrainerTest, AloneRunsTheSameObjectsOverOneRankGroups) {
  TempDir dir;
  Trainer t(TinyTrainConfig(dir));
  EXPECT_EQ(t.groups().world().size(), 1);
  EXPECT_EQ(t.context().world_size, 1);
  ASSERT_NE(t.context().pipeline, nullptr);
  EXPECT_EQ(t.context().pipeline->size(), 1);
  t.Step();
  EXPECT_EQ(t.optimizer_step(), 1);
  EXPECT_EQ(t.buffer().optimizer_state_elements(),
            2 * t.model().parameters().NumTrainableElements());
}

TEST(TrainerTest, RestoreRejectsAnotherModel) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  Trainer t(c);
  t.Step();
  CheckpointData snap = t.Snapshot();
  c.model.model_dim = 64;
  Trainer other(c);
  try {
    other.Restore(snap);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'model_dim': the checkpoint has 32, this run 64"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointTest, SaveLoadLatestAndPrune) {
  TempDir dir;
  CheckpointData d;
  d.seed = 3;
  d.global_batch = 4;
  d.config_json = R"({"steps": 9})";
  d.model = {{"w", Tensor::Full({2, 2}, 1.5)}};
  d.optimizer = {{"w.exp_avg", Tensor::Zeros({2, 2})}, {"w.exp_avg_sq", Tensor::Zeros({2, 2})}};
  for (int64_t s : {10, 20, 30}) {
    d.step = s;
    d.optimizer_step = s;
    d.model["w"].Fill(static_cast<double>(s));
    SaveCheckpoint(dir / "ck", d, /*keep=*/2);
  }
  auto list = ListCheckpoints(dir / "ck");
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(fs::path(list[0]).filename(), "step_00000020");
  CheckpointData back = LoadCheckpoint(dir / "ck");
  EXPECT_EQ(back.step, 30);
  EXPECT_EQ(back.optimizer_step, 30);
  EXPECT_EQ(back.seed, 3u);
  EXPECT_EQ(back.global_batch, 4);
  EXPECT_EQ(back.model.at("w").At(3), 30.0);
  EXPECT_EQ(back.optimizer.size(), 2u);
  EXPECT_EQ(ResolveCheckpoint(list[0]), list[0]);
  EXPECT_EQ(LoadCheckpoint(list[0]).step, 20);
  // model.safetensors is an ordinary safetensors file with the parameter names.
  EXPECT_EQ(ReadSafetensors(list[1] + "/model.safetensors").count("w"), 1u);
  EXPECT_THROW(LoadCheckpoint(dir / "nothing"), IoError);
}

void FlipByte(const std::string& path, size_t offset) {
  std::vector<std::byte> bytes = ReadFileBytes(path);
  bytes.at(offset) ^= std::byte{0x40};
  WriteFileAtomic(path, bytes);
}

TEST(CheckpointTest, CorruptedOrTruncatedGivesAClearErrorAndThePreviousStillLoads) {
  TempDir dir;
  CheckpointData d;
  d.model = {{"w", Tensor::Full({64}, 2.0)}};
  d.step = 1;
  SaveCheckpoint(dir / "ck", d);
  d.step = 2;
  std::string second = SaveCheckpoint(dir / "ck", d);
  auto message = [&] {
    try {
      LoadCheckpoint(dir / "ck");
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string model = second + "/model.safetensors";
  std::vector<std::byte> good = ReadFileBytes(model);
  FlipByte(model, good.size() - 3);  // a bit flip in the data
  std::string m = message();
  EXPECT_NE(m.find("model.safetensors is corrupted"), std::string::npos) << m;
  EXPECT_NE(m.find("step_00000001"), std::string::npos) << m;  // names the usable previous one
  WriteFileAtomic(model, std::span(good).first(good.size() / 2));
  m = message();
  EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  WriteTextFileAtomic(second + "/state.json", "{\"format_version\": 1, \"step\": ");
  m = message();
  EXPECT_NE(m.find("state.json is malformed"), std::string::npos) << m;
  EXPECT_EQ(LoadCheckpoint(dir / "ck/step_00000001").step, 1);
}

// What a killed save leaves is cleaned by the next one (real kills: checkpoint_kill_test.cc).
TEST(CheckpointTest, TheNextSaveRemovesAKilledSavesLeftovers) {
  TempDir dir;
  CheckpointData d;
  d.model = {{"w", Tensor::Full({4}, 1.0)}};
  d.step = 5;
  SaveCheckpoint(dir / "ck", d);
  // What a run killed in the middle of saving step 10 leaves: a partial directory with a torn
  // file, and `latest` still naming step 5.
  fs::create_directories(dir / "ck/step_00000010.partial-12345");
  WriteTextFileAtomic(dir / "ck/step_00000010.partial-12345/model.safetensors", "torn");
  EXPECT_EQ(LoadCheckpoint(dir / "ck").step, 5);
  EXPECT_EQ(ListCheckpoints(dir / "ck").size(), 1u);
  d.step = 10;
  SaveCheckpoint(dir / "ck", d);  // the next save cleans the leftovers
  EXPECT_FALSE(fs::exists(dir / "ck/step_00000010.partial-12345"));
  EXPECT_EQ(LoadCheckpoint(dir / "ck").step, 10);
}

TEST(RunTest, WritesTheRunDirectoryAndResumesBitForBit) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  RunSummary s;
  {
    Trainer t(c);
    RunOptions o;
    o.out = DevNull();
    s = t.Run(o);
  }
  for (const char* f : {"config.json", "metrics.jsonl", "loss.svg", "sample.txt", "summary.json",
                        "checkpoints/latest", "checkpoints/step_00000003/model.safetensors",
                        "checkpoints/step_00000006/optimizer.safetensors"}) {
    EXPECT_TRUE(fs::exists(c.out + "/" + f)) << f;
  }
  EXPECT_FALSE(fs::exists(c.out + "/expert_load.svg"));  // dense model
  EXPECT_EQ(s.steps, 6);
  EXPECT_EQ(s.sample.size(), 20u);
  EXPECT_TRUE(std::isfinite(s.final_val_ce_loss));
  EXPECT_EQ(TrainConfigFromJson(ReadTextFile(c.out + "/config.json")).steps, 6);
  std::vector<StepMetrics> straight = ReadMetrics(c.out + "/metrics.jsonl");
  ASSERT_EQ(straight.size(), 6u);
  EXPECT_TRUE(std::isfinite(straight[2].val_loss));
  // A fresh run does not overwrite a run that has checkpoints.
  {
    Trainer t(c);
    RunOptions o;
    o.out = DevNull();
    EXPECT_THROW(t.Run(o), InvalidArgument);
  }
  // Resume from the step-3 checkpoint of the same run directory: steps 4..6 repeat exactly.
  {
    Trainer t(c);
    RunOptions o;
    o.out = DevNull();
    o.resume = c.out + "/checkpoints/step_00000003";
    t.Run(o);
  }
  std::vector<StepMetrics> again = ReadMetrics(c.out + "/metrics.jsonl");
  ASSERT_EQ(again.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(again[i].step, straight[i].step);
    EXPECT_EQ(again[i].loss, straight[i].loss) << "step " << again[i].step;
    EXPECT_EQ(again[i].grad_norm, straight[i].grad_norm);
  }
  EXPECT_EQ(again[5].val_loss, straight[5].val_loss);
}

// Every file under `dir` by relative path, with the checksum of its content.
std::map<std::string, uint64_t> FilesUnder(const std::string& dir) {
  std::map<std::string, uint64_t> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) {
      files[fs::relative(e.path(), dir).string()] = Fnv1a64(ReadFileBytes(e.path().string()));
    }
  }
  return files;
}

// Resuming run a into the directory of another run b (which has checkpoints) would truncate b's
// metrics and replace its checkpoints: refused, b untouched. Into a's own or a new directory it
// continues.
TEST(RunTest, ResumeNeverWritesIntoAnotherRunsDirectory) {
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  c.steps = 2;
  c.checkpoint_every = 1;
  c.eval_every = 0;
  c.sample_tokens = 0;
  RunOptions o;
  o.out = DevNull();
  for (const char* run : {"a", "b"}) {
    c.out = dir / run;
    Trainer(c).Run(o);
  }
  const std::map<std::string, uint64_t> b_files = FilesUnder(dir / "b");
  ASSERT_EQ(b_files.count("checkpoints/latest"), 1u);
  c.steps = 3;
  for (const std::string& resume : {dir / "a", dir / "a/checkpoints/step_00000001"}) {
    c.out = dir / "b";
    o.resume = resume;
    EXPECT_THROW(Trainer(c).Run(o), InvalidArgument) << resume;
    EXPECT_EQ(FilesUnder(dir / "b"), b_files) << resume;
  }
  // Into its own directory (spelled differently) and into a new one.
  for (const char* out : {"c", "a/"}) {
    c.out = dir / out;
    o.resume = dir / "a/checkpoints";
    EXPECT_EQ(Trainer(c).Run(o).steps, 3) << out;
  }
  EXPECT_EQ(ReadMetrics(dir / "a/metrics.jsonl").size(), 3u);
  EXPECT_EQ(ReadMetrics(dir / "c/metrics.jsonl").size(), 1u);  // steps 3 only: a new directory
  EXPECT_EQ(FilesUnder(dir / "b"), b_files);
}

// The run directory a --resume path belongs to (where a resume without --out continues).
TEST(CheckpointTest, RunDirectoryOfCheckpoint) {
  TempDir dir;
  CheckpointData d;
  d.model = {{"w", Tensor::Full({4}, 1.0)}};
  d.step = 3;
  SaveCheckpoint(dir / "run/checkpoints", d);
  const std::string run = dir / "run";
  for (const std::string& path :
       {run, run + "/", run + "/checkpoints", run + "/checkpoints/",
        run + "/checkpoints/step_00000003", run + "/checkpoints/step_00000003/"}) {
    EXPECT_EQ(fs::path(RunDirectoryOfCheckpoint(path)), fs::path(run)) << path;
  }
  // A checkpoint copied out of its run: no run directory to continue in.
  fs::copy(run + "/checkpoints/step_00000003", dir / "loose");
  EXPECT_THROW(RunDirectoryOfCheckpoint(dir / "loose"), InvalidArgument);
  EXPECT_THROW(RunDirectoryOfCheckpoint(dir / "nothing"), IoError);
}

TEST(GenerateTest, DeterministicForASeed) {
  TempDir dir;
  Trainer t(TinyTrainConfig(dir));
  SampleOptions o;
  o.max_tokens = 30;
  o.seed = 4;
  o.prompt = "the ";
  std::string a = GenerateText(t.model(), o), b = GenerateText(t.model(), o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 30u);
  o.seed = 5;
  EXPECT_NE(GenerateText(t.model(), o), a);
  o.top_k = 1;  // greedy: independent of the seed
  std::string g1 = GenerateText(t.model(), o);
  o.seed = 6;
  EXPECT_EQ(GenerateText(t.model(), o), g1);
  o.temperature = 0;
  EXPECT_THROW(GenerateText(t.model(), o), InvalidArgument);
}

// Data parallelism through the trainer's own objects: two ranks as threads of one in-process
// world average their gradients in the trainer's buffer (the same code a trainer alone runs over
// its one-rank world). The losses equal the single-rank run's up to float summation order.
TEST(TrainerTest, DataParallelRanksMatchOneRank) {
  kernels::SetBlasThreads(1);
  TempDir dir;
  TrainConfig c = TinyTrainConfig(dir);
  std::vector<double> single;
  {
    Trainer t(c);
    for (int i = 0; i < 4; ++i) single.push_back(t.Step().ce_loss);
    single.push_back(t.Evaluate());
  }
  std::vector<double> dp[2];
  TrainConfig two = c;
  two.ranks = 2;
  comm::RunInProcess(2, [&](comm::Communicator& world) {
    Trainer t(two, world, world.size());
    const int r = world.rank();
    for (int i = 0; i < 4; ++i) dp[r].push_back(t.Step().ce_loss);
    dp[r].push_back(t.Evaluate());
  });
  for (size_t i = 0; i < single.size(); ++i) {
    EXPECT_EQ(dp[0][i], dp[1][i]);  // every rank reports the global value
    EXPECT_NEAR(dp[0][i], single[i], 1e-4 * single[i]) << "step " << i;
  }
}

}  // namespace
}  // namespace switchyard::train

namespace switchyard::train {
namespace {

TEST(EscapeForTerminal, KeepsTextAndUtf8EscapesEverythingElse) {
  EXPECT_EQ(EscapeForTerminal("plain text\n\tok"), "plain text\n\tok");
  EXPECT_EQ(EscapeForTerminal("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(EscapeForTerminal(std::string("a\x1b[2Jb\x7f", 7)), "a\\x1b[2Jb\\x7f");
  // Stray continuation bytes, truncated sequences, overlong forms, surrogates and C1 controls.
  EXPECT_EQ(EscapeForTerminal("\x80x"), "\\x80x");
  EXPECT_EQ(EscapeForTerminal("\xe2\x82"), "\\xe2\\x82");
  EXPECT_EQ(EscapeForTerminal("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(EscapeForTerminal("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(EscapeForTerminal("\xc2\x9b"), "\\xc2\\x9b");
  EXPECT_EQ(EscapeForTerminal("\xff\xfe"), "\\xff\\xfe");
}

}  // namespace
}  // namespace switchyard::train

namespace switchyard::train {
namespace {

// Fnv1a64 continued from a state hashes the concatenation (the run's data identity hashes the
// training and held-out bytes without joining them).
TEST(Fnv1a64, ContinuingEqualsHashingTheConcatenation) {
  const std::string a = "the cat sat", b = " on the mat";
  const std::string ab = a + b;
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  EXPECT_EQ(Fnv1a64(bytes(b), Fnv1a64(bytes(a))), Fnv1a64(bytes(ab)));
  EXPECT_NE(Fnv1a64(bytes(a), Fnv1a64(bytes(b))), Fnv1a64(bytes(ab)));
  EXPECT_EQ(Fnv1a64({}), kFnv1a64Start);
}

}  // namespace
}  // namespace switchyard::train
