// `switchyard train` against bad values and unkind events (issue: second adversarial round):
// 64-bit integer keys and float keys range-checked before anything narrows or allocates, keys
// that cannot act in the chosen layout, inputs that the run's writes would replace, a torn last
// metrics line, SIGINT/SIGTERM during a run, a changed MoE layer file on resume and paths that
// are not UTF-8. Every refusal is exit code 2 before anything is written.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "train/train_cli_fixture.h"

namespace switchyard::train {
namespace {

struct Bad {
  std::string flags;
  std::vector<std::string> needles;  // each must be in the error
};

class TrainCliRobustTest : public TrainCliSafetyTest {
 protected:
  // Each case exits with 2, names its needles and writes nothing (no run directory).
  void ExpectRefused(const std::vector<Bad>& cases, const std::string& command = "train") {
    for (const Bad& b : cases) {
      std::string cmd = Command("bad", b.flags);
      if (command != "train") cmd.replace(cmd.find(" train "), 7, " " + command + " ");
      CommandResult r = Run(cmd);
      EXPECT_EQ(r.exit_code, 2) << b.flags << "\n" << r.out << r.err;
      for (const std::string& n : b.needles) {
        EXPECT_TRUE(Contains(r.err, n)) << b.flags << ": no '" << n << "' in\n" << r.err;
      }
      EXPECT_FALSE(fs::exists(dir_ + "/bad")) << b.flags << ": wrote its run directory";
    }
  }

  // Starts `command` in the background; returns its pid.
  static pid_t Start(const std::string& command, const std::string& log) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", ("exec " + command + " > " + log + " 2>&1").c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid;
  }
  // Waits until dir_/out/metrics.jsonl has `lines` lines (at most 60 s).
  void WaitForMetricsLines(const std::string& out, size_t lines) const {
    for (int i = 0; i < 1200; ++i) {
      if (fs::exists(dir_ + "/" + out + "/metrics.jsonl") && Metrics(out).size() >= lines) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "no " << lines << " metrics lines in " << out;
  }
  static int WaitExit(pid_t pid) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
  }
};

// 64-bit integer keys: the full value is range-checked before any narrowing (2^32 + 1 used to
// wrap to 1, 2^32 to 0: a division by zero), by flag and by --config file, and the message shows
// the value given.
TEST_F(TrainCliRobustTest, IntegerKeysAreCheckedAsTheFullValue) {
  std::vector<Bad> cases = {
      {"--ranks 2 --ep 4294967296", {"'ep'", "4294967296"}},
      {"--ranks 2 --ep 4294967297", {"'ep'", "4294967297"}},
      {"--ranks 2 --overlap_degree 4294967298", {"'overlap_degree'", "4294967298"}},
      {"--ranks 2 --etp 4294967298", {"'etp'", "4294967298"}},
      {"--ranks 4294967297", {"'ranks'", "4294967297"}},
      {"--ranks 2 --tp 4294967298", {"'tp'", "4294967298"}},
      {"--ranks 2 --pp 4294967298", {"'pp'", "4294967298"}},
      {"--ranks 2 --cp 4294967298", {"'cp'", "4294967298"}},
      {"--ranks 2 --virtual_stages 4294967297", {"'virtual_stages'", "4294967297"}},
      {"--ranks 2 --a2a_ranks_per_node 4294967298", {"'a2a_ranks_per_node'", "4294967298"}},
      {"--ranks 2 --microbatches 4294967297", {"'microbatches'", "4294967297"}},
      {"--ranks 2 --zero_stage 4294967296", {"'zero_stage'", "4294967296"}},
      {"--ranks 2 --num_experts 4294967297", {"'num_experts'", "4294967297"}},
      {"--ranks 2 --ep -1", {"'ep'", "-1"}},
      {"--ranks 2 --log_every 9223372036854775808", {"'log_every'", "9223372036854775808"}},
  };
  WriteTextFileAtomic(dir_ + "/big.json", "{\"ep\": 4294967297, \"ranks\": 2}");
  cases.push_back({"--config " + dir_ + "/big.json", {"'ep'", "4294967297"}});
  ExpectRefused(cases);
}

// --threads is capped like `switchyard layer`'s, refused before any thread starts (100000
// threads used to abort the process; 10000 took 40 s and 700 MB).
TEST_F(TrainCliRobustTest, ThreadsAreCappedBeforeAnyThreadStarts) {
  const auto start = std::chrono::steady_clock::now();
  ExpectRefused({{"--ranks 1 --threads 100000", {"'threads'", "100000", "256"}},
                 {"--ranks 1 --threads 10000", {"'threads'", "10000"}},
                 {"--ranks 64 --threads 128", {"'threads' 128 x 'ranks' 64"}}});
  ExpectRefused({{"--threads 100000", {"'threads'", "100000"}}}, "train-dense");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// Float keys: finite and in range, before any size is derived from them.
TEST_F(TrainCliRobustTest, FloatKeysAreRangeChecked) {
  ExpectRefused({
      {"--ranks 2 --capacity_factor 1e18", {"'capacity_factor'", "1e+18"}},
      {"--ranks 2 --capacity_factor -1e30", {"'capacity_factor'", "-1e+30"}},
      {"--ranks 2 --bucket_mb 1e20", {"'bucket_mb'", "1e+20"}},
      {"--ranks 2 --bucket_mb -1e30", {"'bucket_mb'"}},
      {"--ranks 2 --memory_budget_mib 1e300", {"'memory_budget_mib'"}},
      {"--ranks 2 --beta1 1", {"'beta1'"}},
      {"--ranks 2 --beta2 -0.5", {"'beta2'"}},
      {"--ranks 2 --adam_eps -1", {"'adam_eps'"}},
      {"--ranks 2 --lr 1e309", {"'lr'"}},
      {"--ranks 2 --aux_loss_coef -1", {"'aux_loss_coef'"}},
      // The emulated links of train are named by train's flags.
      {"--ranks 2 --link-latency-us 1e8", {"--link-latency-us", "1e+08"}},
      {"--ranks 2 --link-gbps 1e-9", {"--link-gbps", "1e-09"}},
  });
}

// A key set explicitly to a value that cannot act in the chosen layout is an error naming it
// (checked before anything is written); its default value is only a notice.
TEST_F(TrainCliRobustTest, KeysThatCannotActAreRefused) {
  WriteTextFileAtomic(dir_ + "/random.json", "{\"drop_policy\": \"random\"}");
  WriteTextFileAtomic(dir_ + "/seq.json", "{\"aux_loss\": \"sequence\", \"sequence_length\": 16}");
  ExpectRefused({
      {"--ranks 2 --moe_layer_config " + dir_ + "/seq.json", {"seq.json", "aux_loss", "sequence"}},
      {"--ranks 2 --steps 1 --resume ''", {"--resume", "empty"}},
      {"--ranks 2 --steps 1 --data ''", {"--data", "empty"}},
      {"--ranks 1 --pipeline_schedule fthenb", {"'pipeline_schedule'", "'pp' is 1"}},
      {"--ranks 1 --pipeline_schedule 1f1x", {"'pipeline_schedule'", "1f1x"}},
      {"--ranks 1 --pipeline_schedule interleaved --virtual_stages 2", {"'pp' is 1"}},
      {"--ranks 2 --cp_algo ulysses", {"'cp_algo'", "'cp' is 1"}},
      {"--ranks 2 --a2a_ranks_per_node 2", {"'a2a_ranks_per_node'", "'a2a_algo'"}},
      {"--ranks 2 --a2a_algo 2dh", {"'a2a_algo'", "a2a_ranks_per_node"}},
      {"--ranks 1 --overlap_degree 2", {"'overlap_degree'"}},
      {"--ranks 1 --shadow_experts auto", {"'shadow_experts'"}},
      {"--ranks 2 --moe_every 0 --overlap_degree 2", {"'overlap_degree'", "no MoE blocks"}},
      {"--ranks 2 --moe_every 0 --aux_loss hf_concat", {"'aux_loss'", "no MoE blocks"}},
      {"--ranks 2 --pp 2", {"'pp'", "'microbatches'"}},
      {"--ranks 2 --steps 3 --trace_step 10", {"'trace_step'", "10", "step 3"}},
      {"--ranks 2 --moe_every 5", {"'moe_every'", "dense"}},
  });
  ExpectRefused({{"--tp 2", {"'tp'", "train-dense"}},
                 {"--pp 2", {"'pp'", "train-dense"}},
                 {"--cp 2", {"'cp'", "train-dense"}},
                 {"--zero_stage 1", {"'zero_stage'", "train-dense"}},
                 {"--aux_loss global", {"'aux_loss'", "no MoE blocks"}},
                 {"--trace_step 1", {"'trace_step'"}},
                 {"--resume ''", {"--resume"}}},
                "train-dense");
  // The MoE blocks route in the global token order, so random drops act under cp too: the run
  // goes through its steps (its equality with one rank: tests/train/context_parallel_test.cc).
  CommandResult r = Run(Command("cp_random",
                                "--ranks 2 --cp 2 --seq_len 16 --steps 2 "
                                "--moe_layer_config " +
                                    dir_ + "/random.json"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The default value: a notice, and the run goes on.
  r = Run(Command("ok", "--ranks 1 --steps 1 --cp_algo ring"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "note: 'cp_algo' \"ring\"")) << r.err;
}

// The run's writes never replace or delete its inputs: data, held-out data, the --config file,
// a data directory that is the run directory, an input among the checkpoints it prunes.
TEST_F(TrainCliRobustTest, TrainNeverOverwritesItsInputs) {
  CommandResult r = Run(Command(
      "g", "--ranks 2 --steps 2 --checkpoint_every 1 --keep_checkpoints 1 --sample_tokens 400"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string g = dir_ + "/g";
  const std::string sample = ReadAll(g + "/sample.txt"), metrics = ReadAll(g + "/metrics.jsonl"),
                    config = ReadAll(g + "/config.json");
  ASSERT_FALSE(sample.empty());
  json k = json::parse(config);
  const std::string resume = " --resume " + g + " --steps 3 --out " + g;
  // keep_checkpoints 1 prunes step 1 at the next save.
  fs::copy(g + "/checkpoints/step_00000002", g + "/checkpoints/step_00000001");
  for (const Bad& b : std::vector<Bad>{
           {"--val_data " + g + "/sample.txt" + resume, {"sample.txt", "val_data", "same file"}},
           {"--data " + g + "/metrics.jsonl" + resume, {"metrics.jsonl", "data", "same file"}},
           {"--data " + g + resume, {"data '", "is the run directory"}},
           {"--data " + g + "/checkpoints/step_00000001/state.json" + resume,
            {"state.json", "checkpoints"}},
           {"--config " + g + "/config.json" + resume, {"config.json", "--config", "same file"}},
       }) {
    r = Run(Bare(b.flags));
    EXPECT_EQ(r.exit_code, 2) << b.flags << "\n" << r.out << r.err;
    for (const std::string& n : b.needles) EXPECT_TRUE(Contains(r.err, n)) << n << "\n" << r.err;
  }
  EXPECT_TRUE(fs::exists(g + "/checkpoints/step_00000001/state.json"));
  // Another run's checkpoint as data is only read.
  r = Run(Bare("--data " + g + "/checkpoints/step_00000001/state.json --steps 1 --out " + dir_ +
               "/g2 --seq_len 16 --model_dim 32 --num_layers 2 --num_heads 2 --hidden_dim 48 "
               "--batch_size 8 --val_fraction 0.3"));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadAll(g + "/sample.txt"), sample);
  EXPECT_EQ(ReadAll(g + "/metrics.jsonl"), metrics);
  EXPECT_EQ(ReadAll(g + "/config.json"), config);
  // The --config file whose "out" is its own directory.
  json own = json::parse(config);
  own["out"] = dir_ + "/k";
  fs::create_directories(dir_ + "/k");
  WriteTextFileAtomic(dir_ + "/k/config.json", own.dump());
  WriteTextFileAtomic(dir_ + "/k/.switchyard-run", "{}\n");
  r = Run(std::string(SY_SWITCHYARD_BIN) + " train --plain --config " + dir_ + "/k/config.json");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "config.json")) << r.err;
  EXPECT_EQ(ReadAll(dir_ + "/k/config.json"), own.dump());
}

// A torn last metrics line (a kill or a file-size limit while writing it) does not block resume;
// a malformed line before the last one is an error naming the file and line.
TEST_F(TrainCliRobustTest, ResumeToleratesATornLastMetricsLine) {
  CommandResult r = Run(Command("a", "--ranks 2 --steps 3 --checkpoint_every 1"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string path = dir_ + "/a/metrics.jsonl";
  const std::string good = ReadAll(path);
  WriteTextFileAtomic(path, good + "{\"step\": 4, \"loss\": 1.2");
  r = Run(Command("a", "--ranks 2 --steps 5 --resume " + dir_ + "/a"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::vector<int64_t> steps;
  for (const json& m : Metrics("a")) steps.push_back(m.at("step").get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  // A torn line in the middle is not a kill's trace: refused, the file kept.
  const std::string five = ReadAll(path);
  WriteTextFileAtomic(path, "{\"step\": 1, \"lo\n" + five);
  r = Run(Command("a", "--ranks 2 --steps 6 --resume " + dir_ + "/a"));
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "metrics.jsonl:1")) << r.err;
  EXPECT_EQ(ReadAll(path), "{\"step\": 1, \"lo\n" + five);
}

// SIGINT / SIGTERM: the step under way completes, the last completed step is saved, the exit
// code is 128 + the signal; the run resumes from there. Two ranks as threads, and one.
TEST_F(TrainCliRobustTest, ASignalSavesTheLastCompletedStep) {
  struct Case {
    const char* out;
    int signal;
    std::string command;
  };
  const Case cases[] = {
      {"int", SIGINT, Command("int", "--ranks 2 --steps 100000 --checkpoint_every 1000")},
      {"term", SIGTERM, Command("term", "--ranks 1 --steps 100000 --checkpoint_every 1000")},
  };
  for (const Case& c : cases) {
    const pid_t pid = Start(c.command, dir_ + "/" + c.out + ".log");
    WaitForMetricsLines(c.out, 2);
    ::kill(pid, c.signal);
    EXPECT_EQ(WaitExit(pid), 128 + c.signal) << ReadAll(dir_ + "/" + c.out + ".log");
    const std::vector<json> lines = Metrics(c.out);
    ASSERT_FALSE(lines.empty());
    const int64_t last = lines.back().at("step").get<int64_t>();
    EXPECT_EQ(Latest(c.out), fmt::format("step_{:08}\n", last));
    EXPECT_TRUE(Contains(ReadAll(dir_ + "/" + c.out + ".log"), "stopped by signal"));
    CommandResult r = Run(
        Command(c.out, fmt::format("--ranks 2 --steps {} --resume {}/{}", last + 1, dir_, c.out)));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(Metrics(c.out).back().at("step").get<int64_t>(), last + 1);
  }
}

// Resuming with a changed MoE layer file names the option that changed and the checkpoint (it
// used to be "internal check 'false' failed" or "parameter ... is missing"). The gpt model, whose
// experts have biases (the default model's SwiGLU experts have none, so fc_bias false is theirs).
TEST_F(TrainCliRobustTest, ResumeNamesAChangedMoeLayerOption) {
  const std::string layer = dir_ + "/layer.json";
  WriteTextFileAtomic(layer, "{}");
  CommandResult r = Run(Command("a", "--arch gpt --ranks 2 --steps 1 --moe_layer_config " + layer));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* changed :
       {"{\"fc_bias\": false}", "{\"residual_moe\": true}", "{\"shared_expert_hidden\": 16}",
        "{\"gated\": true}", "{\"expert_bias\": true}"}) {
    WriteTextFileAtomic(layer, changed);
    r = Run(Command("a", "--ranks 2 --steps 2 --resume " + dir_ + "/a"));
    EXPECT_EQ(r.exit_code, 2) << changed << "\n" << r.out << r.err;
    const std::string key = json::parse(changed).begin().key();
    EXPECT_TRUE(Contains(r.err, "'" + key + "'")) << changed << "\n" << r.err;
    EXPECT_TRUE(Contains(r.err, "step_00000001")) << r.err;
  }
  // A checkpoint from before the options were recorded: the message says what to check.
  const std::string state = dir_ + "/a/checkpoints/step_00000001/state.json";
  json j = json::parse(ReadAll(state));
  ASSERT_TRUE(j.contains("moe_layer"));
  j.erase("moe_layer");
  WriteTextFileAtomic(state, j.dump(2));
  WriteTextFileAtomic(layer, "{\"fc_bias\": false}");
  r = Run(Command("a", "--ranks 2 --steps 2 --resume " + dir_ + "/a"));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_TRUE(Contains(r.err, "does not record its MoE layer options")) << r.err;
  EXPECT_TRUE(Contains(r.err, "layer.json")) << r.err;
}

// A path that is not UTF-8 is legal: the run writes config.json (the path as {"hex": ...}),
// its checkpoint, and resumes finding the same file.
TEST_F(TrainCliRobustTest, PathsThatAreNotUtf8RoundTrip) {
  const std::string name = "corpus\xff\xfe.txt";
  fs::copy_file(dir_ + "/corpus.txt", dir_ + "/" + name);
  CommandResult r = Run(Command("a", "--ranks 2 --steps 1 --data '" + dir_ + "/" + name + "'"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json config = json::parse(ReadAll(dir_ + "/a/config.json"));
  EXPECT_TRUE(Contains(r.out, "corpus\\xff\\xfe.txt")) << r.out;  // escaped on the terminal
  ASSERT_TRUE(config.at("data").is_object()) << config.at("data");
  EXPECT_TRUE(config.at("data").contains("hex"));
  // The data path comes from the checkpoint's config.
  r = Run(fmt::format("{} train --plain --ranks 2 --steps 2 --threads 1 --resume {}/a",
                      SY_SWITCHYARD_BIN, dir_));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Metrics("a").back().at("step").get<int64_t>(), 2);
}

}  // namespace
}  // namespace switchyard::train
