// Dataset formats: the Megatron writer and reader, nanoGPT and llm.c readers, format detection,
// and every malformed input refused with an error naming the file and what was expected.
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "core/temp_dir.h"
#include "data/dataset_io.h"
#include "switchyard/train/dataset/flat_tokens.h"
#include "switchyard/train/dataset/megatron.h"
#include "switchyard/train/dataset/token_source.h"

namespace switchyard::train::dataset {
namespace {

using switchyard::testing::TempDir;
using testing::ExpectError;
using testing::Put;
using testing::PutAt;
using testing::ReadBytes;
using testing::WriteBytes;

std::vector<std::vector<int32_t>> SomeDocuments(int n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> docs(static_cast<size_t>(n));
  for (auto& d : docs) {
    d.resize(rng() % 50 + 1);
    for (auto& t : d) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  }
  return docs;
}

void WriteDataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& docs,
                  MegatronDtype dtype) {
  MegatronWriter w(prefix, dtype);
  for (const auto& d : docs) w.AddDocument(d);
  w.Finish();
}

TEST(Megatron, WriterThenReaderGivesTheDocuments) {
  TempDir dir;
  for (MegatronDtype dtype : {MegatronDtype::kUint16, MegatronDtype::kInt32, MegatronDtype::kUint8,
                              MegatronDtype::kInt64}) {
    const auto docs = SomeDocuments(37, dtype == MegatronDtype::kUint8 ? 256 : 60000, 7);
    const std::string prefix = dir.File(fmt::format("ds{}", static_cast<int>(dtype)));
    WriteDataset(prefix, docs, dtype);
    for (const std::string& path : {prefix, prefix + ".bin", prefix + ".idx"}) {
      EXPECT_EQ(DetectFormat(path), Format::kMegatron) << path;
      const auto source = OpenTokenSource(path);
      ASSERT_EQ(source->num_documents(), 37);
      int64_t total = 0;
      for (int d = 0; d < 37; ++d) {
        EXPECT_EQ(source->Document(d), docs[static_cast<size_t>(d)]) << d;
        total += static_cast<int64_t>(docs[static_cast<size_t>(d)].size());
      }
      EXPECT_EQ(source->num_tokens(), total);
    }
  }
}

TEST(Megatron, IndexLayoutFollowsTheSpec) {
  TempDir dir;
  WriteDataset(dir.File("x"), {{1, 2, 3}, {4}}, MegatronDtype::kUint16);
  const auto idx = ReadBytes(dir.File("x.idx"));
  std::vector<char> expected(kMegatronIndexMagic, kMegatronIndexMagic + 9);
  Put<uint64_t>(expected, 1);
  Put<uint8_t>(expected, 8);  // uint16
  Put<uint64_t>(expected, 2);
  Put<uint64_t>(expected, 3);  // document index entries: documents + 1
  Put<int32_t>(expected, 3);
  Put<int32_t>(expected, 1);
  Put<int64_t>(expected, 0);
  Put<int64_t>(expected, 6);
  for (int64_t d : {0, 1, 2}) Put<int64_t>(expected, d);
  EXPECT_EQ(idx, expected);
  EXPECT_EQ(ReadBytes(dir.File("x.bin")), (std::vector<char>{1, 0, 2, 0, 3, 0, 4, 0}));
}

TEST(Megatron, DocumentsOfSeveralSequencesReadAsOne) {
  TempDir dir;
  MegatronWriter w(dir.File("m"), MegatronDtype::kInt32);
  w.AddSequence(std::vector<int32_t>{1, 2});
  w.AddSequence(std::vector<int32_t>{3});
  w.EndDocument();
  w.EndDocument();  // a document without sequences
  w.AddSequence(std::vector<int32_t>{4, 5, 6});
  w.EndDocument();
  w.Finish();
  const auto s = OpenMegatronDataset(dir.File("m"));
  ASSERT_EQ(s->num_documents(), 3);
  EXPECT_EQ(s->Document(0), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(s->Document(1), std::vector<int32_t>{});
  EXPECT_EQ(s->Document(2), (std::vector<int32_t>{4, 5, 6}));
  std::vector<int32_t> part(2);
  s->Read(0, 1, part);
  EXPECT_EQ(part, (std::vector<int32_t>{2, 3}));
}

TEST(Megatron, WriterWithoutFinishLeavesNothingAndKeepsOldFiles) {
  TempDir dir;
  WriteDataset(dir.File("a"), {{9, 9}}, MegatronDtype::kUint16);
  const auto before = ReadBytes(dir.File("a.bin"));
  {
    MegatronWriter w(dir.File("a"), MegatronDtype::kUint16);
    w.AddDocument(std::vector<int32_t>{1, 2, 3});
  }
  EXPECT_EQ(ReadBytes(dir.File("a.bin")), before);
  EXPECT_EQ(dir.List(), (std::vector<std::string>{"a.bin", "a.idx"}));
  MegatronWriter w(dir.File("b"), MegatronDtype::kUint16);
  ExpectError([&] { w.AddDocument(std::vector<int32_t>{70000}); },
              {"b.bin", "token id 70000", "uint16", "0..65535"});
}

// A small valid dataset whose files the bad-input tests then damage.
struct Damaged {
  TempDir dir;
  std::string prefix = dir.File("d");
  std::vector<char> idx, bin, good_idx, good_bin;
  Damaged() {
    WriteDataset(prefix, {{1, 2, 3}, {4, 5}, {6}}, MegatronDtype::kUint16);
    good_idx = idx = ReadBytes(prefix + ".idx");
    good_bin = bin = ReadBytes(prefix + ".bin");
  }
  void Reset() {
    idx = good_idx;
    bin = good_bin;
  }
  void Save() {
    WriteBytes(prefix + ".idx", idx);
    WriteBytes(prefix + ".bin", bin);
  }
  void ExpectRefused(const std::vector<std::string>& parts) {
    Save();
    ExpectError([&] { OpenMegatronDataset(prefix); }, parts);
  }
};

TEST(MegatronBadInput, TruncatedBin) {
  Damaged d;
  d.bin.resize(d.bin.size() - 2);
  d.ExpectRefused(
      {"d.idx", "sequence 2", "runs past the end of", "d.bin", "10 bytes", "truncated"});
}

TEST(MegatronBadInput, PointerPastTheBin) {
  Damaged d;
  PutAt<int64_t>(d.idx, kMegatronIndexHeaderBytes + 3 * 4 + 8, 4000);  // sequence 1's pointer
  d.ExpectRefused({"d.idx", "sequence 1", "at byte 4000", "runs past the end of", "d.bin"});
  PutAt<int64_t>(d.idx, kMegatronIndexHeaderBytes + 3 * 4 + 8, -2);
  d.ExpectRefused({"sequence 1", "at byte -2"});
}

TEST(MegatronBadInput, WrongMagicVersionDtype) {
  Damaged d;
  d.idx[0] = 'X';
  d.ExpectRefused({"d.idx", "not a valid Megatron index", "wrong magic", "MMIDIDX"});
  EXPECT_EQ(DetectFormat(d.prefix + ".bin"), Format::kMegatron);  // reported, not read as nanoGPT
  ExpectError([&] { OpenTokenSource(d.prefix + ".bin"); }, {"d.idx", "wrong magic"});
  d.idx[0] = 'M';
  PutAt<uint64_t>(d.idx, 9, 2);
  d.ExpectRefused({"d.idx", "version 2; expected 1"});
  PutAt<uint64_t>(d.idx, 9, 1);
  PutAt<uint8_t>(d.idx, 17, 9);
  d.ExpectRefused({"d.idx", "dtype code 9", "expected one of 1..8"});
  PutAt<uint8_t>(d.idx, 17, 7);
  d.ExpectRefused({"d.idx", "float32", "expected an integer type"});
}

TEST(MegatronBadInput, IndexShorterOrLongerThanItsCounts) {
  Damaged d;
  d.idx.resize(20);
  d.ExpectRefused({"d.idx", "20 bytes", "34-byte header", "truncated"});
  d.Reset();
  d.idx.pop_back();
  d.ExpectRefused({"d.idx", "cannot hold the index its header announces", "truncated"});
  d.Reset();
  PutAt<uint64_t>(d.idx, 18, uint64_t{1} << 62);  // an absurd sequence count must not overflow
  d.ExpectRefused({"d.idx", "cannot hold the index"});
  d.Reset();
  d.idx.push_back(0);
  d.idx.push_back(0);
  d.ExpectRefused({"d.idx", "its header announces"});
}

TEST(MegatronBadInput, DocumentIndex) {
  Damaged d;
  const size_t docs_at = kMegatronIndexHeaderBytes + 3 * 12;
  PutAt<int64_t>(d.idx, docs_at + 8, 3);
  PutAt<int64_t>(d.idx, docs_at + 16, 2);
  d.ExpectRefused({"d.idx", "document index entry 2 is 2 after 3", "non-decreasing"});
  d.Reset();
  PutAt<int64_t>(d.idx, docs_at, 1);
  d.ExpectRefused({"d.idx", "starts at 1; expected 0"});
  d.Reset();
  PutAt<int64_t>(d.idx, docs_at + 24, 2);
  d.ExpectRefused({"d.idx", "ends at 2; expected the sequence count 3"});
}

TEST(MegatronBadInput, EmptyDatasetMissingAndNonRegularFiles) {
  TempDir dir;
  MegatronWriter w(dir.File("e"), MegatronDtype::kUint16);
  w.Finish();
  ExpectError([&] { OpenMegatronDataset(dir.File("e")); }, {"e.idx", "empty dataset"});
  ExpectError([&] { OpenMegatronDataset(dir.File("missing")); }, {"missing.idx", "No such file"});
  ASSERT_EQ(::mkfifo(dir.File("f.idx").c_str(), 0600), 0);
  WriteBytes(dir.File("f.bin"), {});
  ExpectError([&] { OpenMegatronDataset(dir.File("f")); }, {"f.idx", "FIFO", "not a regular file"});
  std::filesystem::create_directory(dir.File("g.idx"));
  ExpectError([&] { OpenMegatronDataset(dir.File("g")); }, {"g.idx", "a directory"});
}

TEST(Vocabulary, IdsAtOrAboveTheVocabularyAreRefusedAtOpenAndOnRead) {
  TempDir dir;
  std::vector<std::vector<int32_t>> docs(200, std::vector<int32_t>{1, 2, 3});
  docs[0][1] = 500;  // the first document is always checked at open
  WriteDataset(dir.File("v"), docs, MegatronDtype::kUint16);
  ExpectError([&] { OpenTokenSource(dir.File("v"), {.vocab_size = 256}); },
              {"v.bin", "token id 500", "document 0, position 1", "[0, 256)"});
  EXPECT_NO_THROW(OpenTokenSource(dir.File("v"), {.vocab_size = 501}));
  // A bad id in a document the open-time sample skips is caught by the read that returns it.
  docs[0][1] = 1;
  docs[101][2] = 300;
  WriteDataset(dir.File("w"), docs, MegatronDtype::kUint16);
  const auto s = OpenTokenSource(dir.File("w"), {.vocab_size = 256});
  EXPECT_NO_THROW(s->Document(100));
  ExpectError([&] { s->Document(101); }, {"w.bin", "token id 300", "document 101, position 2"});
  ExpectError([&] { s->CheckAllTokens(); }, {"token id 300"});
  // uint16 data cannot exceed a vocabulary of 65536 or more: no check needed or made.
  EXPECT_NO_THROW(OpenTokenSource(dir.File("w"), {.vocab_size = 65536})->CheckAllTokens());
}

TEST(Flat, NanoGptReadsUint16InDocumentsOfFixedSize) {
  TempDir dir;
  std::vector<char> bytes;
  for (uint16_t t = 0; t < 10; ++t) Put<uint16_t>(bytes, static_cast<uint16_t>(t * 7000));
  WriteBytes(dir.File("train.bin"), bytes);
  EXPECT_EQ(DetectFormat(dir.File("train.bin")), Format::kNanoGpt);
  const auto s = OpenTokenSource(dir.File("train.bin"), {.flat_document_tokens = 4});
  ASSERT_EQ(s->num_documents(), 3);
  EXPECT_EQ(s->num_tokens(), 10);
  EXPECT_EQ(s->Document(0), (std::vector<int32_t>{0, 7000, 14000, 21000}));
  EXPECT_EQ(s->Document(2), (std::vector<int32_t>{56000, 63000}));
  bytes.pop_back();
  WriteBytes(dir.File("odd.bin"), bytes);
  ExpectError([&] { OpenTokenSource(dir.File("odd.bin")); }, {"odd.bin", "19 bytes", "odd"});
  WriteBytes(dir.File("empty.bin"), {});
  ExpectError([&] { OpenTokenSource(dir.File("empty.bin")); }, {"empty.bin", "empty dataset"});
  ExpectError([&] { OpenTokenSource(dir.File("train.bin"), {.vocab_size = 50257}); },
              {"train.bin", "token id 56000", "[0, 50257)"});
}

std::vector<char> LlmcFile(int32_t magic, int32_t version, int32_t count,
                           const std::vector<uint16_t>& tokens) {
  std::vector<char> bytes;
  Put(bytes, magic);
  Put(bytes, version);
  Put(bytes, count);
  bytes.resize(1024, 0);
  for (uint16_t t : tokens) Put(bytes, t);
  return bytes;
}

TEST(Flat, LlmcReadsItsHeaderAndRefusesBadOnes) {
  TempDir dir;
  WriteBytes(dir.File("a.bin"), LlmcFile(20240520, 1, 3, {50256, 7, 8}));
  EXPECT_EQ(DetectFormat(dir.File("a.bin")), Format::kLlmc);
  const auto s = OpenTokenSource(dir.File("a.bin"), {.vocab_size = 50257});
  EXPECT_EQ(s->Document(0), (std::vector<int32_t>{50256, 7, 8}));
  WriteBytes(dir.File("v.bin"), LlmcFile(20240520, 2, 3, {1, 2, 3}));
  ExpectError([&] { OpenTokenSource(dir.File("v.bin")); }, {"v.bin", "version 2", "expected 1"});
  WriteBytes(dir.File("m.bin"), LlmcFile(20240326, 1, 3, {1, 2, 3}));
  ExpectError([&] { OpenTokenSource(dir.File("m.bin"), {.format = Format::kLlmc}); },
              {"m.bin", "magic 20240326", "20240520"});
  WriteBytes(dir.File("t.bin"), LlmcFile(20240520, 1, 4, {1, 2, 3}));
  ExpectError([&] { OpenTokenSource(dir.File("t.bin")); },
              {"t.bin", "1030 bytes", "4 tokens need 1032", "truncated"});
  WriteBytes(dir.File("x.bin"), LlmcFile(20240520, 1, 2, {1, 2, 3}));
  ExpectError([&] { OpenTokenSource(dir.File("x.bin")); }, {"x.bin", "trailing bytes"});
  WriteBytes(dir.File("z.bin"), LlmcFile(20240520, 1, 0, {}));
  ExpectError([&] { OpenTokenSource(dir.File("z.bin")); }, {"z.bin", "empty dataset"});
  std::vector<char> short_header(100, 0);
  WriteBytes(dir.File("s.bin"), short_header);
  ExpectError([&] { OpenTokenSource(dir.File("s.bin"), {.format = Format::kLlmc}); },
              {"s.bin", "100 bytes", "1024-byte header"});
  ASSERT_EQ(::mkfifo(dir.File("p.bin").c_str(), 0600), 0);
  ExpectError([&] { OpenTokenSource(dir.File("p.bin")); }, {"p.bin", "FIFO", "regular file"});
}

TEST(Detect, FormatsBySuffixAndHeader) {
  TempDir dir;
  WriteBytes(dir.File("notes.txt"), {'h', 'i'});
  EXPECT_EQ(DetectFormat(dir.File("notes.txt")), Format::kText);
  EXPECT_EQ(DetectFormat(dir.path()), Format::kText);
  EXPECT_EQ(DetectFormat(dir.File("notes.txt"), Format::kMegatron), Format::kMegatron);
  ExpectError([&] { OpenTokenSource(dir.File("notes.txt")); },
              {"notes.txt", "is text", "expected a Megatron prefix"});
  EXPECT_EQ(ParseFormat("llmc"), Format::kLlmc);
  ExpectError([] { ParseFormat("arrow"); },
              {"--data-format 'arrow'", "auto, text, megatron, nanogpt, llmc"});
}

// Random damage to a valid index: every outcome is either a dataset whose reads stay inside the
// files (checked by reading every token) or a switchyard::Error; never a crash or a hang.
TEST(MegatronFuzz, RandomlyCorruptedIndexIsRefusedOrReadSafely) {
  TempDir dir;
  const std::string prefix = dir.File("z");
  WriteDataset(prefix, SomeDocuments(12, 1000, 3), MegatronDtype::kUint16);
  const auto idx = ReadBytes(prefix + ".idx");
  std::mt19937 rng(12345);
  int refused = 0, opened = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<char> bad = idx;
    switch (trial % 3) {
      case 0:  // flip a few bytes anywhere
        for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) {
          bad[rng() % bad.size()] = static_cast<char>(rng());
        }
        break;
      case 1:  // truncate
        bad.resize(rng() % bad.size());
        break;
      default:  // overwrite one 8-byte field of the header or tables with a random value
        if (bad.size() >= 8)
          PutAt<uint64_t>(bad, rng() % (bad.size() - 7), (uint64_t{rng()} << 32) | rng());
    }
    WriteBytes(prefix + ".idx", bad);
    try {
      const auto s = OpenTokenSource(prefix, {.vocab_size = 1000});
      s->CheckAllTokens();
      ++opened;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_EQ(refused + opened, 2000);
}

}  // namespace
}  // namespace switchyard::train::dataset
