// Run-directory pieces: SVG writer and figures, progress line, metrics JSON lines, the run
// directory's lock and the check that a run's writes never replace its inputs.
#include "switchyard/train/run_dir.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/metrics.h"
#include "switchyard/train/progress.h"
#include "switchyard/train/svg.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

size_t Count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

// Checks that every element opened is closed: a cheap well-formedness check of our output.
void ExpectBalanced(const std::string& svg) {
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_EQ(Count(svg, "<svg "), 1u);
  EXPECT_EQ(Count(svg, "</svg>"), 1u);
  EXPECT_EQ(Count(svg, "<text"), Count(svg, "</text>"));
  EXPECT_EQ(Count(svg, "<title>"), Count(svg, "</title>"));
}

TEST(SvgTest, EscapesTextAndAttributes) {
  EXPECT_EQ(EscapeXml("a<b & \"c\" 'd'>"), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;");
  SvgWriter svg(100, 50);
  svg.Text(1, 2, "<loss & val>");
  svg.Rect(0, 0, 10, 10, "#fff", "none", "tip <1>");
  svg.Polyline({0, 0}, "red");  // one point: nothing drawn
  std::string s = svg.str();
  ExpectBalanced(s);
  EXPECT_NE(s.find("&lt;loss &amp; val&gt;"), std::string::npos);
  EXPECT_NE(s.find("<title>tip &lt;1&gt;</title>"), std::string::npos);
  EXPECT_EQ(s.find("<polyline"), std::string::npos);
}

TEST(SvgTest, NiceTicks) {
  EXPECT_EQ(NiceTicks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  auto t = NiceTicks(1.3, 3.1, 6);
  ASSERT_FALSE(t.empty());
  EXPECT_GE(t.front(), 1.3);
  EXPECT_LE(t.back(), 3.1);
  EXPECT_EQ(NiceTicks(2, 2), (std::vector<double>{2}));
  EXPECT_EQ(TickLabel(1500), "1500");
  EXPECT_EQ(TickLabel(25000), "25k");
  EXPECT_EQ(TickLabel(0.25), "0.25");
}

TEST(SvgTest, LinePlotHasSeriesLegendAndReferenceLine) {
  PlotSeries a{"train loss", "#1f77b4", {0, 1, 2, 3}, {5, 4, NAN, 2}};
  PlotSeries b{"val loss", "#d62728", {3}, {2.5}};
  LinePlotOptions o;
  o.title = "loss";
  o.reference_lines.push_back({"unigram entropy 3.0", 3.0});
  std::string s = LinePlotSvg({a, b}, o);
  ExpectBalanced(s);
  EXPECT_EQ(Count(s, "<polyline"), 1u);  // the NaN breaks series a: 2 points, then 1 point
  EXPECT_NE(s.find("unigram entropy 3.0"), std::string::npos);
  EXPECT_NE(s.find("val loss"), std::string::npos);
  EXPECT_NE(s.find("stroke-dasharray"), std::string::npos);
  ExpectBalanced(LinePlotSvg({}, o));  // empty: still a valid document
}

TEST(SvgTest, HeatmapHasOneCellPerValue) {
  HeatmapPanel p0{"layer 0", {{1, 2, 3}, {4, 5, 6}}};
  HeatmapPanel p1{"layer 1", {{0, 0, 9}, {1, 1, 1}, {2, 2, 2}}};
  std::string s = HeatmapSvg({p0, p1}, {10, 20, 30}, {});
  ExpectBalanced(s);
  EXPECT_EQ(Count(s, "<title>"), 15u);              // 5 rows x 3 columns, each cell with a tooltip
  EXPECT_NE(s.find("#fde725"), std::string::npos);  // the maximum (9) gets the top color
  ExpectBalanced(HeatmapSvg({}, {}, {}));
}

std::string Capture(const std::function<void(std::FILE*)>& fn) {
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  fn(f);
  std::fclose(f);
  std::string s(buf, len);
  std::free(buf);
  return s;
}

TEST(ProgressTest, FormatsStepLossRateDropAndEta) {
  ProgressInfo info{.step = 120,
                    .total = 800,
                    .ce_loss = 2.13456,
                    .val_loss = NAN,
                    .tokens_per_s = 12345,
                    .drop_rate = 0.015,
                    .eta_s = 83};
  std::string line = ProgressBar::FormatLine(info, 10);
  EXPECT_EQ(line, "[#---------] step 120/800  ce_loss 2.1346  12.3k tok/s  drop 1.5%  ETA 1m23s");
  info.drop_rate = NAN;  // dense: no drop column
  info.val_loss = 2.5;
  EXPECT_EQ(ProgressBar::FormatLine(info, 0),
            "step 120/800  ce_loss 2.1346  val_ce_loss 2.5000  12.3k tok/s  ETA 1m23s");
  EXPECT_EQ(FormatDuration(3725), "1h02m");
  EXPECT_EQ(FormatDuration(NAN), "-");
  EXPECT_EQ(FormatRate(1.2e6), "1.20M");
}

TEST(ProgressTest, RedrawsInPlaceOnATerminalAndPrintsLinesOtherwise) {
  ProgressInfo info{.step = 0, .total = 4, .ce_loss = 1.0};
  std::string tty = Capture([&](std::FILE* f) {
    ProgressBar bar(f, /*interactive=*/true);
    for (int s = 1; s <= 4; ++s) {
      info.step = s;
      bar.Update(info);
    }
    bar.Print("eval: val 1.0");
    bar.Finish();
  });
  EXPECT_EQ(Count(tty, "\r"), 5u);
  EXPECT_EQ(Count(tty, "\n"), 2u);  // the printed line and the final newline
  EXPECT_NE(tty.find("\r\x1b[Keval: val 1.0\n"), std::string::npos);
  std::string plain = Capture([&](std::FILE* f) {
    ProgressBar bar(f, /*interactive=*/false, /*plain_every=*/3);
    for (int s = 1; s <= 4; ++s) {
      info.step = s;
      bar.Update(info);
    }
    bar.Finish();
  });
  EXPECT_EQ(plain.find('\r'), std::string::npos);
  EXPECT_EQ(Count(plain, "\n"), 2u);  // step 3 and the last step
  EXPECT_NE(plain.find("step 3/4"), std::string::npos);
  EXPECT_NE(plain.find("step 4/4"), std::string::npos);
}

TEST(MetricsTest, JsonLinesRoundTripAndResumeTruncates) {
  testing::TempDir dir;
  std::string path = dir / "metrics.jsonl";
  StepMetrics m;
  m.loss = 2.5;
  m.ce_loss = 2.4;
  m.lr = 1e-3;
  m.expert_load = {{3, 5}, {4, 4}};
  m.drop_rate = {0.1, 0.0};
  {
    MetricsWriter w(path);
    for (int s = 1; s <= 5; ++s) {
      m.step = s;
      m.val_loss = s == 5 ? 2.6 : NAN;
      w.Append(m);
    }
  }
  auto all = ReadMetrics(path);
  ASSERT_EQ(all.size(), 5u);
  EXPECT_EQ(all[4].step, 5);
  EXPECT_DOUBLE_EQ(all[4].val_loss, 2.6);
  EXPECT_TRUE(std::isnan(all[0].val_loss));
  EXPECT_EQ(all[2].expert_load, m.expert_load);
  EXPECT_EQ(all[2].drop_rate, m.drop_rate);
  EXPECT_EQ(MetricsToJson(all[3]), ReadTextFile(path).substr(0, 0) + MetricsToJson(all[3]));
  // A resumed run from step 3 drops steps 4 and 5 (and a torn line), then appends.
  {
    std::FILE* f = std::fopen(path.c_str(), "a");
    std::fputs("{\"step\": 6, \"lo", f);
    std::fclose(f);
    MetricsWriter w(path, 3);
    m.step = 4;
    w.Append(m);
  }
  all = ReadMetrics(path);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all.back().step, 4);
  EXPECT_THROW(MetricsFromJson("{\"loss\": 1}", "x"), IoError);
  EXPECT_THROW(MetricsFromJson("not json", "x"), IoError);
}

// A torn last line (no newline) is skipped; a malformed line before it is an error naming the
// file and line, and the writer of a resumed run leaves such a file as it is.
TEST(MetricsTest, OnlyATornLastLineIsSkipped) {
  testing::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  WriteTextFileAtomic(path, "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3, \"lo");
  std::vector<StepMetrics> all = ReadMetrics(path);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.back().step, 2);
  const std::string middle = "{\"step\": 1}\n{\"step\": 2, \"lo\n{\"step\": 3}\n";
  WriteTextFileAtomic(path, middle);
  try {
    ReadMetrics(path);
    ADD_FAILURE() << "a malformed middle line was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MetricsWriter(path, 3), IoError);
  EXPECT_EQ(ReadTextFile(path), middle);
}

// The lock is taken before the marker is written: a directory holding only the lock file (a run
// starting, or one killed before its marker) is a run directory to a second run, which is
// refused naming the owner while the lock is held and admitted once it is not.
TEST(RunDirectoryLockTest, ADirectoryWithOnlyTheLockFile) {
  testing::TempDir dir;
  const std::string run = dir / "run";
  std::filesystem::create_directories(run);
  const std::string lock = run + "/" + kRunLockFile;
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::write(fd, "4242\n", 5), 5);
  try {
    RunDirectoryLock second(run);
    ADD_FAILURE() << "a held lock was taken again";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another switchyard run (pid 4242)"),
              std::string::npos)
        << e.what();
  }
  ::close(fd);  // the owner is gone (killed before its marker): the directory is usable
  RunDirectoryLock again(run);
  EXPECT_TRUE(again.held());
  EXPECT_TRUE(IsRunDirectory(run));
  // Another file next to the lock: not a run's directory.
  testing::TempDir other;
  WriteTextFileAtomic(other / kRunLockFile, "");
  WriteTextFileAtomic(other / "notes.txt", "mine\n");
  EXPECT_THROW(RunDirectoryLock(other.path()), InvalidArgument);
}

// Inputs that a run's writes would replace or prune are refused; others are not.
TEST(RunDirectoryLockTest, InputsOutsideTheRunDirectory) {
  testing::TempDir dir;
  const std::string run = dir / "run";
  std::filesystem::create_directories(run + "/checkpoints/step_00000001");
  for (const char* f : {"metrics.jsonl", "sample.txt", "checkpoints/step_00000001/state.json"}) {
    WriteTextFileAtomic(run + "/" + f, "x\n");
  }
  WriteTextFileAtomic(dir / "corpus.txt", "x\n");
  std::filesystem::create_symlink(run + "/sample.txt", dir / "link.txt");
  auto refused = [&](const std::string& path, const std::string& resume = "") {
    try {
      RequireInputsOutsideRunDirectory(run, {{"data", path}}, resume);
      return false;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("data '" + path + "'"), std::string::npos) << e.what();
      return true;
    }
  };
  EXPECT_TRUE(refused(run + "/metrics.jsonl"));
  EXPECT_TRUE(refused(dir / "link.txt"));  // a link to a file the run writes
  EXPECT_TRUE(refused(run + "/../run/sample.txt"));
  EXPECT_TRUE(refused(run));  // the run directory as a data directory
  EXPECT_TRUE(refused(run + "/checkpoints/step_00000001/state.json"));
  EXPECT_FALSE(refused(run + "/checkpoints/step_00000001/state.json",
                       run + "/checkpoints/step_00000001"));  // the resumed checkpoint
  EXPECT_FALSE(refused(dir / "corpus.txt"));
  EXPECT_FALSE(refused(run + "/summary.json"));  // does not exist: cannot be read either
  EXPECT_NO_THROW(RequireInputsOutsideRunDirectory(dir / "new", {{"data", run + "/sample.txt"}}));
}

TEST(MetricsTest, FiguresAreWritten) {
  testing::TempDir dir;
  std::vector<StepMetrics> h(3);
  for (int i = 0; i < 3; ++i) {
    h[i].step = i + 1;
    h[i].ce_loss = 3.0 - i;
    h[i].expert_load = {{i, 2 * i, 3}};
  }
  h[2].val_loss = 1.5;
  WriteLossSvg(dir / "loss.svg", h, 3.1, "run");
  WriteExpertLoadSvg(dir / "expert_load.svg", h, "run");
  std::string loss = ReadTextFile(dir / "loss.svg");
  std::string load = ReadTextFile(dir / "expert_load.svg");
  ExpectBalanced(loss);
  ExpectBalanced(load);
  EXPECT_NE(loss.find("unigram entropy 3.100"), std::string::npos);
  EXPECT_EQ(Count(load, "<title>"), 9u);  // 3 experts x 3 steps
}

}  // namespace
}  // namespace switchyard::train
