// Input files end to end (docs/errors.md, "Inputs that are not regular files"): a FIFO given as
// any input blocked the command for ever, a device never ended; now every input that is not a
// regular file is refused before it is read, naming the path and what it is. Also trace-svg's
// trace: strict JSON (a repeated key is an error) and fields of the wrong type named, and the
// emulated-link errors of `train` naming the flag that was typed.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::CliResult;
using testing::RunSwitchyard;
using testing::RunSwitchyardAfter;

// A hang fails as exit code 124 instead of blocking the test.
const char* const kWithin = "timeout -k 5 60";

void ExpectOneLineError(const CliResult& r, int code, const std::vector<std::string>& says) {
  EXPECT_EQ(r.exit_code, code) << "stdout:\n" << r.out << "stderr:\n" << r.err;
  EXPECT_EQ(r.err.rfind("switchyard: error: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line:\n" << r.err;
  for (const std::string& s : says)
    EXPECT_NE(r.err.find(s), std::string::npos) << s << "\n" << r.err;
}

class CliInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/sy_cli_inputs_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    fifo_ = Path("pipe");
    ASSERT_EQ(::mkfifo(fifo_.c_str(), 0600), 0);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Write(const std::string& name, const std::string& text) const {
    std::ofstream(Path(name)) << text;
    return Path(name);
  }

  std::string dir_, fifo_;
};

TEST_F(CliInputs, FifosDevicesAndDirectoriesAreRefusedNotWaitedOn) {
  const std::string text = Write("text.txt", "one line of text\nanother line of text\n");
  const std::string layer_json = Write("layer.json", R"({"model_dim": 4, "hidden_dim": 4,
                                                        "num_experts": 2})");
  const std::string train = "train --ranks 1 --steps 1 --out " + Path("run");
  const std::string layer_out = " --out " + Path("out.safetensors");
  const std::vector<std::string> with_fifo = {
      train + " --data " + fifo_,
      train + " --data " + text + " --val-data " + fifo_,
      train + " --config " + fifo_,
      train + " --data " + text + " --moe-layer-config " + fifo_,
      "train-dense --steps 1 --out " + Path("dense") + " --data " + fifo_,
      "layer --config " + fifo_ + " --tensors " + text + layer_out,
      "layer --config " + layer_json + " --tensors " + fifo_ + layer_out,
      "trace-svg --trace " + fifo_ + " --out " + Path("t.svg"),
  };
  for (const std::string& args : with_fifo) {
    SCOPED_TRACE(args);
    ExpectOneLineError(
        RunSwitchyardAfter(kWithin, args), 1,
        {"cannot read '" + fifo_ + "': it is a FIFO (named pipe), not a regular file"});
  }
  ExpectOneLineError(RunSwitchyardAfter(kWithin, train + " --data /dev/zero"), 1,
                     {"cannot read '/dev/zero': it is a character device, not a regular file"});
  ExpectOneLineError(
      RunSwitchyardAfter(kWithin, "layer --config " + dir_ + " --tensors " + text + layer_out), 1,
      {"cannot read '" + dir_ + "': it is a directory, not a regular file"});
  struct stat st {};
  ASSERT_EQ(::stat(fifo_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));  // untouched
  EXPECT_FALSE(std::filesystem::exists(Path("run")));
}

// A directory given as --data lists its regular files: a FIFO inside it is skipped (never
// opened), the text beside it is trained on.
TEST_F(CliInputs, AFifoInsideADataDirectoryIsSkipped) {
  std::filesystem::create_directories(Path("corpus"));
  {
    std::ofstream text(Path("corpus/a.txt"));
    for (int i = 0; i < 200; ++i) text << "line " << i << " of the corpus, with words to learn\n";
  }
  ASSERT_EQ(::mkfifo(Path("corpus/b.fifo").c_str(), 0600), 0);
  const CliResult r = RunSwitchyardAfter(kWithin,
                                         "train --ranks 1 --steps 1 --plain --model-dim 16 "
                                         "--num-layers 1 --seq-len 16 --val-fraction 0 "
                                         "--batch-size 2 --data " +
                                             Path("corpus") + " --out " + Path("run"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST_F(CliInputs, TraceFieldsOfTheWrongTypeAreNamed) {
  const std::string out = " --out " + Path("t.svg");
  auto trace = [&](const std::string& events) {
    return Write("t.json", R"({"traceEvents": [)" + events + "]}");
  };
  // A string timestamp printed nlohmann's "type_error.302".
  ExpectOneLineError(
      RunSwitchyard("trace-svg --trace " +
                    trace(R"({"ph": "X", "tid": 1, "ts": "abc", "dur": 5, "name": "a"})") + out),
      2, {"t.json: traceEvents[0]: \"ts\" is \"abc\"; expected a number of microseconds"});
  // A key given twice was silently the last one (docs/errors.md: an error).
  ExpectOneLineError(
      RunSwitchyard("trace-svg --trace " +
                    trace(R"({"ph": "X", "tid": 1, "ts": 0, "ts": 3, "dur": 5, "name": "a"})") +
                    out),
      2, {"t.json: key 'traceEvents.ts' appears twice"});
  // A span of 1e300 us made the time axis infinite and its tick loop endless.
  ExpectOneLineError(
      RunSwitchyardAfter(kWithin, "trace-svg --trace " +
                                      trace(R"({"ph": "X", "tid": 1, "ts": 1e300, "dur": 1e300,
                                                "name": "a"})") +
                                      out),
      2, {"traceEvents[0]: \"ts\" is 1e+300"});
  ExpectOneLineError(
      RunSwitchyard("trace-svg --trace " +
                    trace(R"({"ph": "X", "tid": 1.5, "ts": 0, "dur": 5, "name": "a"})") + out),
      2, {"traceEvents[0]: \"tid\" is 1.5; expected an integer"});
  ExpectOneLineError(RunSwitchyard("trace-svg --trace " +
                                   trace(R"({"ph": "X", "tid": 1, "ts": 0, "dur": 5, "name": "a"},
                             {"ph": "M", "tid": 1, "name": "thread_name", "args": {"name": 3}})") +
                                   out),
                     2, {"traceEvents[1]: \"args.name\" is 3; expected a string"});
  EXPECT_FALSE(std::filesystem::exists(Path("t.svg")));
  // A well-formed trace is still drawn.
  const CliResult r = RunSwitchyard("trace-svg --trace " +
                                    trace(R"({"ph": "X", "tid": 1, "ts": 0, "dur": 5, "name": "a"},
               {"ph": "M", "tid": 1, "name": "thread_name", "args": {"name": "rank 0"}})") +
                                    out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(Path("t.svg")));
}

// `train --link-latency-us 1e8` said "--intra-latency-us", a flag train does not have.
TEST_F(CliInputs, TrainLinkErrorsNameTheFlagTyped) {
  const std::string train = "train --ranks 2 --steps 1 --out " + Path("run");
  CliResult r = RunSwitchyard(train + " --link-latency-us 1e8");
  ExpectOneLineError(r, 2, {"--link-latency-us: 1e+08 us is not below the collective deadline"});
  EXPECT_EQ(r.err.find("--intra"), std::string::npos) << r.err;
  r = RunSwitchyard(train + " --link-gbps 1e-9");
  ExpectOneLineError(r, 2, {"--link-gbps: 1e-09 is not 0 (unlimited) or a bandwidth"});
  EXPECT_EQ(r.err.find("--intra"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(Path("run")));
}

}  // namespace
}  // namespace switchyard
