// `switchyard train` from the command line: the run directory of a small distributed run, a
// resume under another layout, clear errors for bad flags, and (with MPI) the same losses as
// processes under mpirun as with ranks as threads.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/cli_helpers.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train {
namespace {

namespace fs = std::filesystem;
using parallel::testing::CommandResult;
using parallel::testing::ReadAll;
using parallel::testing::RunCommand;

class TrainCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/train_cli_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string text;
    const char* lines[] = {"the cat sat on the mat", "a dog ran in the park",
                           "the sun is warm today", "we like to read books"};
    for (int i = 0; i < 300; ++i) text += std::string(lines[i % 4]) + ".\n%\n";
    WriteTextFileAtomic(dir_ + "/corpus.txt", text);
  }

  // A small model, no --out; `extra` adds flags.
  std::string CommandWithoutOut(const std::string& extra) const {
    return std::string(SY_SWITCHYARD_BIN) + " train --plain --data " + dir_ +
           "/corpus.txt --seq_len 16 --model_dim 32 --num_layers 2 --num_heads 2 --hidden_dim 48 "
           "--batch_size 8 --warmup_steps 1 --lr 0.01 --adam_eps 1e-5 --log_every 1 "
           "--eval_every 0 --sample_tokens 16 --threads 1 " +
           extra;
  }
  // The same into dir_/out.
  std::string Command(const std::string& out, const std::string& extra) const {
    return CommandWithoutOut("--out " + dir_ + "/" + out + " " + extra);
  }

  // The steps of metrics.jsonl's lines.
  std::vector<int64_t> Steps(const std::string& out) const {
    std::vector<int64_t> steps;
    std::ifstream in(dir_ + "/" + out + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) steps.push_back(nlohmann::json::parse(line).at("step"));
    return steps;
  }

  // Every file under dir_/out by relative path, with a hash of its content.
  std::map<std::string, size_t> Files(const std::string& out) const {
    std::map<std::string, size_t> files;
    for (const auto& e : fs::recursive_directory_iterator(dir_ + "/" + out)) {
      if (e.is_regular_file()) {
        files[fs::relative(e.path(), dir_ + "/" + out).string()] =
            std::hash<std::string>()(ReadAll(e.path().string()));
      }
    }
    return files;
  }

  // The per-step training losses of metrics.jsonl.
  std::vector<double> Losses(const std::string& out) const {
    std::vector<double> losses;
    std::ifstream in(dir_ + "/" + out + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      losses.push_back(j.at("loss").get<double>());
    }
    return losses;
  }

  std::string dir_;
};

TEST_F(TrainCliTest, RunDirectoryAndResumeUnderAnotherLayout) {
  CommandResult a = RunCommand(Command("a", "--ranks 4 --steps 4 --checkpoint_every 2"), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  for (const char* f : {"config.json", "metrics.jsonl", "loss.svg", "expert_load.svg",
                        "summary.json", "sample.txt", "checkpoints/latest"}) {
    EXPECT_TRUE(fs::exists(dir_ + "/a/" + f)) << f;
  }
  EXPECT_NE(a.out.find("done: 4 steps"), std::string::npos) << a.out;
  auto config = nlohmann::json::parse(ReadAll(dir_ + "/a/config.json"));
  EXPECT_EQ(config.at("ranks"), 4);
  EXPECT_EQ(config.at("arch"), "mixtral");  // the embedded default: MoE in every block
  EXPECT_EQ(config.at("moe_every"), 1);
  const std::vector<double> full = Losses("a");
  ASSERT_EQ(full.size(), 4u);

  // The checkpoint of step 2 continued on 2 ranks with ZeRO-2 repeats steps 3 and 4.
  fs::create_directories(dir_ + "/b/checkpoints");
  fs::copy(dir_ + "/a/checkpoints", dir_ + "/b/checkpoints", fs::copy_options::recursive);
  std::string step2 = dir_ + "/b/checkpoints/step_00000002";
  ASSERT_TRUE(fs::exists(step2));
  CommandResult b =
      RunCommand(Command("c", "--ranks 2 --ep 2 --zero_stage 2 --steps 4 --resume " + step2), dir_);
  ASSERT_EQ(b.exit_code, 0) << b.out << b.err;
  const std::vector<double> resumed = Losses("c");
  ASSERT_EQ(resumed.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(resumed[i], full[2 + i], 2e-5 * full[2 + i]) << "step " << 3 + i;
  }
}

// No layout flags: the embedded default layout, 4 ranks as threads with EP 4, and the default
// model, the `mixtral` preset (MoE in every block, 4 experts, top-2, dropless, SwiGLU, RoPE,
// RMSNorm, a quarter of the heads as kv heads, Hugging Face's balancing loss). `--arch gpt` is
// the GPT-2-style model that was the default before (MoE in every other block, capacity 1.25).
TEST_F(TrainCliTest, NoLayoutFlagsRunTheEmbeddedDefault) {
  CommandResult r = RunCommand(Command("default", "--steps 1"), dir_);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto config = nlohmann::json::parse(ReadAll(dir_ + "/default/config.json"));
  EXPECT_EQ(config.at("ranks"), 4);
  EXPECT_EQ(config.at("ep"), 4);
  EXPECT_EQ(config.at("zero_stage"), 0);
  EXPECT_EQ(config.at("arch"), "mixtral");
  EXPECT_EQ(config.at("moe_every"), 1);
  EXPECT_EQ(config.at("num_experts"), 4);
  EXPECT_EQ(config.at("top_k"), 2);
  EXPECT_EQ(config.at("capacity_factor"), 0.0);
  EXPECT_EQ(config.at("aux_loss"), "hf_concat");
  EXPECT_EQ(config.at("mlp"), "swiglu");
  EXPECT_EQ(config.at("norm"), "rmsnorm");
  EXPECT_EQ(config.at("position_embedding"), "rope");
  EXPECT_EQ(config.at("num_kv_heads"), 1);  // max(1, 2 heads / 4)
  EXPECT_EQ(config.at("tied_head"), false);
  EXPECT_EQ(Steps("default"), std::vector<int64_t>({1}));

  CommandResult g = RunCommand(Command("gpt", "--steps 1 --arch gpt"), dir_);
  ASSERT_EQ(g.exit_code, 0) << g.out << g.err;
  auto gpt = nlohmann::json::parse(ReadAll(dir_ + "/gpt/config.json"));
  EXPECT_EQ(gpt.at("arch"), "gpt");
  EXPECT_EQ(gpt.at("moe_every"), 2);
  EXPECT_EQ(gpt.at("capacity_factor"), 1.25);
  EXPECT_EQ(gpt.at("aux_loss"), "gshard");
  EXPECT_EQ(gpt.at("mlp"), "gelu");
  EXPECT_EQ(gpt.at("norm"), "layernorm");
  EXPECT_EQ(gpt.at("position_embedding"), "learned");
  EXPECT_EQ(gpt.at("num_kv_heads"), 0);
  EXPECT_EQ(gpt.at("tied_head"), true);
}

// A checkpoint of a gpt run (`--arch gpt`, or a default run from before the default became the
// `mixtral` preset, whose checkpoint has no 'arch' key) resumes without flags as that gpt model:
// the resumed steps repeat the uninterrupted run's losses.
TEST_F(TrainCliTest, AGptCheckpointResumesAsGptWithoutFlags) {
  CommandResult full =
      RunCommand(Command("full", "--arch gpt --ranks 2 --steps 3 --checkpoint_every 0"), dir_);
  ASSERT_EQ(full.exit_code, 0) << full.out << full.err;
  CommandResult a =
      RunCommand(Command("a", "--arch gpt --ranks 2 --steps 2 --checkpoint_every 2"), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  const std::vector<double> want = Losses("full");
  ASSERT_EQ(want.size(), 3u);
  // The same checkpoint with its config as a checkpoint from before the 'arch' key: without
  // the model-architecture keys, which took their (GPT-2) defaults then.
  fs::copy(dir_ + "/a/checkpoints/step_00000002", dir_ + "/old", fs::copy_options::recursive);
  const std::string state = dir_ + "/old/state.json";
  auto j = nlohmann::json::parse(ReadAll(state));
  for (const char* key :
       {"arch", "norm", "mlp", "position_embedding", "num_kv_heads", "rope_theta", "attention_bias",
        "mlp_bias", "hf_router", "norm_topk_prob", "aux_loss"}) {
    ASSERT_EQ(j.at("config").erase(key), 1u) << key;
  }
  WriteTextFileAtomic(state, j.dump());
  for (const std::string& from : {dir_ + "/a/checkpoints/step_00000002", dir_ + "/old"}) {
    fs::remove_all(dir_ + "/b");
    CommandResult b = RunCommand(Command("b", "--ranks 2 --steps 3 --resume " + from), dir_);
    ASSERT_EQ(b.exit_code, 0) << from << "\n" << b.out << b.err;
    auto config = nlohmann::json::parse(ReadAll(dir_ + "/b/config.json"));
    EXPECT_EQ(config.at("arch"), "gpt") << from;
    EXPECT_EQ(config.at("moe_every"), 2) << from;
    EXPECT_EQ(config.at("norm"), "layernorm") << from;
    const std::vector<double> resumed = Losses("b");
    ASSERT_EQ(resumed.size(), 1u) << from;
    EXPECT_EQ(resumed[0], want[2]) << from;
  }
}

// --resume without --out continues the resumed run in its own directory, for each form of the
// path (run, checkpoints or checkpoint directory), and leaves the default run directory, which
// holds another run, untouched.
TEST_F(TrainCliTest, ResumeWithoutOutContinuesTheResumedRunInItsDirectory) {
  const std::string cd = "cd " + dir_ + " && ";
  CommandResult other =
      RunCommand(Command("runs/train", "--ranks 2 --steps 2 --checkpoint_every 1"), dir_);
  ASSERT_EQ(other.exit_code, 0) << other.out << other.err;
  CommandResult mine =
      RunCommand(Command("mine", "--ranks 2 --steps 2 --checkpoint_every 1"), dir_);
  ASSERT_EQ(mine.exit_code, 0) << mine.out << mine.err;
  const std::map<std::string, size_t> other_files = Files("runs/train");
  ASSERT_TRUE(other_files.count("checkpoints/latest"));

  const std::string resumes[] = {"mine", "mine/checkpoints",
                                 dir_ + "/mine/checkpoints/step_00000004/"};
  for (int i = 0; i < 3; ++i) {
    const int64_t steps = 3 + i;
    CommandResult r = RunCommand(
        cd + CommandWithoutOut(fmt::format("--ranks 2 --steps {} --checkpoint_every 1 --resume {}",
                                           steps, resumes[i])),
        dir_);
    ASSERT_EQ(r.exit_code, 0) << resumes[i] << "\n" << r.out << r.err;
    EXPECT_EQ(Files("runs/train"), other_files) << "--resume " << resumes[i];
    EXPECT_FALSE(fs::exists(dir_ + "/runs/train-2")) << "--resume " << resumes[i];
    std::vector<int64_t> want;
    for (int64_t s = 1; s <= steps; ++s) want.push_back(s);
    EXPECT_EQ(Steps("mine"), want) << "--resume " << resumes[i];
    EXPECT_EQ(ReadAll(dir_ + "/mine/checkpoints/latest"), fmt::format("step_{:08}\n", steps));
  }
  // A checkpoint outside a run's checkpoints directory: which run it continues is unknown.
  fs::copy(dir_ + "/mine/checkpoints/step_00000005", dir_ + "/loose");
  CommandResult r = RunCommand(cd + CommandWithoutOut("--ranks 2 --steps 6 --resume loose"), dir_);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("set 'out'"), std::string::npos) << r.err;
  EXPECT_EQ(Files("runs/train"), other_files);
}

// A dense run of the default model (moe_every 0: the preset's router keys recorded but acting
// nowhere) starts a new run with --init-from: the source's recorded keys are not refused as
// settings that cannot act.
TEST_F(TrainCliTest, ADenseDefaultModelRunInitsANewRun) {
  CommandResult a = RunCommand(Command("dense", "--moe_every 0 --ranks 1 --steps 1"), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  CommandResult b =
      RunCommand(Command("next", "--ranks 1 --steps 1 --init-from " + dir_ + "/dense"), dir_);
  ASSERT_EQ(b.exit_code, 0) << b.out << b.err;
  auto config = nlohmann::json::parse(ReadAll(dir_ + "/next/config.json"));
  EXPECT_EQ(config.at("arch"), "mixtral");
  EXPECT_EQ(config.at("moe_every"), 0);
  EXPECT_EQ(config.at("aux_loss"), "hf_concat");
}

// `--tp N [--sequence-parallel] [--tp-comm-overlap]` on ranks as threads: the one-rank losses,
// the layout in the header, and a run saved at tp 2 resumes at tp 1. The gpt model: the
// comm-GEMM overlap does not support the default model's grouped-query attention.
TEST_F(TrainCliTest, TensorParallelFlags) {
  CommandResult one = RunCommand(Command("one", "--arch gpt --ranks 1 --steps 3"), dir_);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  CommandResult tp = RunCommand(
      Command("tp", "--arch gpt --ranks 4 --tp 2 --sequence-parallel --tp-comm-overlap --steps 2"),
      dir_);
  ASSERT_EQ(tp.exit_code, 0) << tp.out << tp.err;
  EXPECT_NE(tp.out.find("layout: 4 ranks = tp 2 (sequence parallel, comm-GEMM overlap) x dp 2"),
            std::string::npos)
      << tp.out;
  CommandResult resumed =
      RunCommand(Command("tp", "--ranks 1 --steps 3 --resume " + dir_ + "/tp"), dir_);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  const std::vector<double> want = Losses("one"), got = Losses("tp");
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-5 * want[i]) << "step " << i + 1;
  }
  CommandResult bad = RunCommand(Command("bad", "--tp 3 --steps 1"), dir_);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("'tp' 3 must divide 'ranks' 4"), std::string::npos) << bad.err;
}

// `--pp N --microbatches M --pipeline-schedule KIND` on ranks as threads: the one-rank losses of
// the same micro-batches, and a pipelined run's checkpoint resumes on one rank.
TEST_F(TrainCliTest, PipelineFlags) {
  CommandResult one = RunCommand(Command("one", "--ranks 1 --microbatches 4 --steps 3"), dir_);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  CommandResult pp = RunCommand(
      Command("pp", "--ranks 2 --pp 2 --microbatches 4 --pipeline-schedule 1f1b --steps 2"), dir_);
  ASSERT_EQ(pp.exit_code, 0) << pp.out << pp.err;
  EXPECT_NE(pp.out.find("x pp 2"), std::string::npos) << pp.out;
  CommandResult resumed = RunCommand(
      Command("pp", "--ranks 1 --microbatches 4 --steps 3 --resume " + dir_ + "/pp"), dir_);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  const std::vector<double> want = Losses("one"), got = Losses("pp");
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-5 * want[i]) << "step " << i + 1;
  }
  CommandResult bad = RunCommand(Command("bad", "--pp 3 --steps 1"), dir_);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("'pp' 3 must divide 'ranks' 4"), std::string::npos) << bad.err;
  bad = RunCommand(Command("bad", "--pp 2 --pipeline-schedule gpipe --steps 1"), dir_);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("gpipe"), std::string::npos) << bad.err;
}

// The MoE layer's options as flags (adaptive r switched every step, 2DH, a separate held-out
// file) give the one-rank losses; --trace_step writes the step's timeline of every rank, which
// `switchyard trace-svg` draws.
TEST_F(TrainCliTest, LayerOptionFlagsAndTheStepTrace) {
  std::string held;
  for (int i = 0; i < 40; ++i) held += "a held-out line " + std::to_string(i) + ".\n%\n";
  WriteTextFileAtomic(dir_ + "/held.txt", held);
  const std::string common =
      "--num_experts 2 --top_k 1 --steps 3 --val_data " + dir_ + "/held.txt ";
  CommandResult one = RunCommand(Command("one", common + "--ranks 1"), dir_);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  CommandResult four = RunCommand(
      Command("four", common + "--ranks 4 --adaptive_r 1,0 --a2a_algo 2dh --a2a_ranks_per_node 2 "
                               "--trace_step 2"),
      dir_);
  ASSERT_EQ(four.exit_code, 0) << four.out << four.err;
  const std::vector<double> want = Losses("one"), got = Losses("four");
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-5 * want[i]) << "step " << i + 1;
  }
  const std::string trace = dir_ + "/four/trace.json";
  ASSERT_TRUE(fs::exists(trace));
  const nlohmann::json j = nlohmann::json::parse(ReadAll(trace));
  std::set<int> tids;
  for (const nlohmann::json& e : j.at("traceEvents")) {
    if (e.at("ph") == "X") tids.insert(e.at("tid").get<int>());
  }
  EXPECT_EQ(tids, (std::set<int>{0, 1, 2, 3, 4, 5, 6, 7}));  // 4 ranks x compute, comm
  CommandResult svg = RunCommand(
      std::string(SY_SWITCHYARD_BIN) + " trace-svg " + trace + " " + dir_ + "/four/trace.svg",
      dir_);
  ASSERT_EQ(svg.exit_code, 0) << svg.out << svg.err;
  const std::string picture = ReadAll(dir_ + "/four/trace.svg");
  EXPECT_NE(picture.find("rank 3"), std::string::npos);
  EXPECT_NE(picture.find("gradient reduce"), std::string::npos);
  // A bad value names the key.
  CommandResult bad = RunCommand(Command("bad", "--routing_scope local --steps 1"), dir_);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("'routing_scope'"), std::string::npos) << bad.err;
}

TEST_F(TrainCliTest, BadFlagsAreOneLineErrors) {
  CommandResult r = RunCommand(Command("x", "--ranks 4 --ep 3"), dir_);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("'ep' 3 must divide the number of ranks 4"), std::string::npos) << r.err;
  r = RunCommand(Command("y", "--zero_stage 5"), dir_);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("zero_stage"), std::string::npos) << r.err;
  r = RunCommand(Command("z", "--steps ten"), dir_);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("'steps'"), std::string::npos) << r.err;
  // The comm-GEMM overlap with the default model's attention: refused before anything runs
  // (the planner's candidates go through the same check).
  r = RunCommand(Command("w", "--ranks 2 --tp 2 --sequence-parallel --tp-comm-overlap"), dir_);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("'tp_comm_overlap' is not supported with grouped-query attention"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir_ + "/w"));
  EXPECT_FALSE(fs::exists(dir_ + "/x/checkpoints"));
}

#ifdef SY_MPIRUN_SCRIPT
// Tensor parallelism from the command line in MPI processes: tp 2 with sequence parallelism and
// comm-GEMM overlap (Megatron arrangement for the MoE block), and tp 2 without (DeepSpeed's),
// give the one-rank run's losses. The gpt model: the overlap does not support the default
// model's grouped-query attention.
TEST_F(TrainCliTest, MpiTensorParallelGivesTheOneRankLosses) {
  CommandResult one = RunCommand(Command("one", "--arch gpt --ranks 1 --steps 3"), dir_);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const std::vector<double> want = Losses("one");
  ASSERT_EQ(want.size(), 3u);
  for (const std::string layout :
       {"--tp 2 --sequence-parallel --tp-comm-overlap", "--tp 2 --arrangement deepspeed"}) {
    const std::string out = layout.find("sequence") != std::string::npos ? "sp" : "ds";
    CommandResult m = RunCommand(std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 2 " +
                                     Command(out, "--arch gpt --steps 3 " + layout),
                                 dir_);
    ASSERT_EQ(m.exit_code, 0) << layout << "\n" << m.out << m.err;
    EXPECT_NE(m.out.find("tp 2"), std::string::npos) << m.out;
    const std::vector<double> got = Losses(out);
    ASSERT_EQ(got.size(), 3u) << layout;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 2e-5 * want[i]) << layout << " step " << i + 1;
    }
  }
}

// Pipeline stages as MPI processes: 2 stages x 1F1B equal one rank with the same micro-batches.
TEST_F(TrainCliTest, MpiPipelineGivesTheOneRankLosses) {
  CommandResult one = RunCommand(Command("one", "--ranks 1 --microbatches 4 --steps 3"), dir_);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  CommandResult m = RunCommand(std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 2 " +
                                   Command("pp", "--steps 3 --pp 2 --microbatches 4"),
                               dir_);
  ASSERT_EQ(m.exit_code, 0) << m.out << m.err;
  const std::vector<double> want = Losses("one"), got = Losses("pp");
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-5 * want[i]) << "step " << i + 1;
  }
}

TEST_F(TrainCliTest, MpiProcessesGiveTheThreadRanksLosses) {
  CommandResult t = RunCommand(Command("threads", "--ranks 2 --steps 3"), dir_);
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  CommandResult m = RunCommand(
      std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 2 " + Command("mpi", "--steps 3"), dir_);
  ASSERT_EQ(m.exit_code, 0) << m.out << m.err;
  auto config = nlohmann::json::parse(ReadAll(dir_ + "/mpi/config.json"));
  EXPECT_EQ(config.at("ranks"), 2);  // the MPI world decides
  const std::vector<double> a = Losses("threads"), b = Losses("mpi");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 2e-5 * a[i]) << "step " << i + 1;
}
#endif

}  // namespace
}  // namespace switchyard::train
