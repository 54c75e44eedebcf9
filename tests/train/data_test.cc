#include "switchyard/train/data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>
#include <string>

namespace switchyard::train {
namespace {

std::string Join(const std::vector<std::string_view>& parts) {
  std::string s;
  for (auto p : parts) s += p;
  return s;
}

TEST(SplitRecordsTest, FortuneRecordsEndAfterPercentLines) {
  std::string text = "one\nline\n%\ntwo\n%\nthree\n";
  auto r = SplitRecords(text);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], "one\nline\n%\n");
  EXPECT_EQ(r[1], "two\n%\n");
  EXPECT_EQ(r[2], "three\n");
  EXPECT_EQ(Join(r), text);
}

TEST(SplitRecordsTest, PlainTextIsCutAtLineEndsAfterChunkBytes) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "line number " + std::to_string(i) + "\n";
  text += std::string(100, 'x');  // an over-long last line without newline
  auto r = SplitRecords(text, 40);
  EXPECT_EQ(Join(r), text);
  for (size_t i = 0; i + 1 < r.size(); ++i) {
    EXPECT_GE(r[i].size(), 40u);
    EXPECT_LE(r[i].size(), 80u);
  }
  EXPECT_GT(r.size(), 10u);
}

TEST(CorpusTest, EveryKthRecordIsHeldOut) {
  std::string text;
  for (int i = 0; i < 20; ++i) text += "record " + std::to_string(i) + "\n%\n";
  Corpus c = CorpusFromText(text, 0.25);
  EXPECT_EQ(c.records, 20);
  EXPECT_EQ(c.val_records, 5);
  std::string val(c.val.begin(), c.val.end()), train(c.train.begin(), c.train.end());
  EXPECT_EQ(val, "record 3\n%\nrecord 7\n%\nrecord 11\n%\nrecord 15\n%\nrecord 19\n%\n");
  EXPECT_EQ(train.size() + val.size(), text.size());
  EXPECT_EQ(train.find("record 3\n"), std::string::npos);
  Corpus none = CorpusFromText(text, 0.0);
  EXPECT_TRUE(none.val.empty());
  EXPECT_THROW(CorpusFromText(text, 0.9), InvalidArgument);
  EXPECT_THROW(CorpusFromText("", 0.1), InvalidArgument);
}

TEST(CorpusTest, DefaultFortunesCorpusIsInstalledAndLoads) {
  // scripts/setup.sh installs fortunes-min and fortune-mod; the default run needs them.
  std::vector<std::string> files = DefaultCorpusFiles();
  ASSERT_FALSE(files.empty());
  for (const auto& f : files) {
    EXPECT_EQ(f.find(".dat"), std::string::npos) << f;
    EXPECT_EQ(f.find(".u8"), std::string::npos) << f;
  }
  Corpus c = LoadCorpus(files, 0.1);
  EXPECT_GT(c.train.size(), 50000u);
  EXPECT_GT(c.val.size(), 5000u);
  EXPECT_GT(c.records, 100);
  double h = UnigramEntropy(c.train);
  EXPECT_GT(h, 2.5);  // English text: about 4.4 bits = 3.0 nats per byte
  EXPECT_LT(h, 3.5);
  EXPECT_THROW(DefaultCorpusFiles("/nonexistent/dir"), IoError);
  EXPECT_THROW(LoadCorpus({"/nonexistent/file"}, 0.1), IoError);
}

TEST(UnigramEntropyTest, KnownDistributions) {
  EXPECT_DOUBLE_EQ(UnigramEntropy({7, 7, 7}), 0.0);
  EXPECT_NEAR(UnigramEntropy({1, 2, 1, 2}), std::log(2.0), 1e-12);
  std::vector<uint8_t> all(256);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_NEAR(UnigramEntropy(all), std::log(256.0), 1e-12);
}

TEST(BatchSamplerTest, WindowsAreShiftedAndInRange) {
  std::vector<uint8_t> tokens(300);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint8_t>(i % 251);
  BatchSampler s(tokens, 16, 42);
  Batch b = s.Sample(3, 8, 0, 8);
  ASSERT_EQ(b.tokens.shape(), (Shape{8, 16}));
  std::set<int64_t> offsets;
  for (int64_t r = 0; r < 8; ++r) {
    int64_t off = s.Offset(3, 8, r);
    offsets.insert(off);
    ASSERT_GE(off, 0);
    ASSERT_LE(off + 16, 299);
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(b.tokens.data<int32_t>()[r * 16 + t], tokens[off + t]);
      EXPECT_EQ(b.targets.data<int32_t>()[r * 16 + t], tokens[off + t + 1]);
    }
  }
  EXPECT_GT(offsets.size(), 4u);
  EXPECT_THROW(BatchSampler(tokens, 300, 1), InvalidArgument);
  EXPECT_THROW(s.Sample(0, 8, 4, 9), InvalidArgument);
}

TEST(BatchSamplerTest, DeterministicAndIndependentOfHowRowsAreSplit) {
  std::vector<uint8_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint8_t>((i * 7) % 256);
  BatchSampler s(tokens, 8, 5);
  Batch whole = s.Sample(11, 6, 0, 6);
  Batch again = BatchSampler(tokens, 8, 5).Sample(11, 6, 0, 6);
  // Ranks 0..2 of 3, each taking 2 rows.
  for (int rank = 0; rank < 3; ++rank) {
    Batch part = s.Sample(11, 6, 2 * rank, 2 * rank + 2);
    for (int64_t i = 0; i < 16; ++i) {
      EXPECT_EQ(part.tokens.data<int32_t>()[i], whole.tokens.data<int32_t>()[rank * 16 + i]);
    }
  }
  for (int64_t i = 0; i < 48; ++i) {
    EXPECT_EQ(whole.tokens.data<int32_t>()[i], again.tokens.data<int32_t>()[i]);
  }
  // Another step or seed gives other windows.
  EXPECT_NE(s.Offset(11, 6, 0), s.Offset(12, 6, 0));
  EXPECT_NE(s.Offset(11, 6, 0), BatchSampler(tokens, 8, 6).Offset(11, 6, 0));
}

TEST(EvaluationBatchesTest, ConsecutiveWindows) {
  std::vector<uint8_t> tokens(35);
  std::iota(tokens.begin(), tokens.end(), 0);
  auto batches = EvaluationBatches(tokens, 4, 3, 0);  // (35 - 1) / 4 = 8 windows: 3 + 3 + 2
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2].tokens.size(0), 2);
  EXPECT_EQ(batches[1].tokens.data<int32_t>()[0], 12);  // window 3 starts at 3 * 4
  EXPECT_EQ(batches[1].targets.data<int32_t>()[3], 16);
  EXPECT_EQ(EvaluationBatches(tokens, 4, 3, 8).size(), 1u);  // max 8 tokens: 2 windows
  EXPECT_TRUE(EvaluationBatches(std::vector<uint8_t>(4), 4, 3, 0).empty());
}

}  // namespace
}  // namespace switchyard::train
