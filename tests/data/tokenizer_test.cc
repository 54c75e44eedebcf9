// Tokenizers (bytes, SentencePiece), preprocessing into a Megatron dataset read back document by
// document, and the bits-per-byte helpers.
#include "switchyard/train/dataset/tokenizer.h"

#include "core/temp_dir.h"
#include "data/dataset_io.h"
#include "switchyard/train/dataset/megatron.h"
#include "switchyard/train/dataset/metrics.h"
#include "switchyard/train/dataset/preprocess.h"
#include "switchyard/train/dataset/token_source.h"

namespace switchyard::train::dataset {
namespace {

using switchyard::testing::TempDir;
using testing::ExpectError;
using testing::ReadBytes;

// A few hundred lines of text with a repetitive vocabulary, enough to train a small model.
std::string SomeText(int lines) {
  const char* words[] = {"the",   "expert", "router", "sends",   "tokens", "to",    "each",
                         "layer", "of",     "a",      "mixture", "model",  "while", "ranks",
                         "wait",  "for",    "their",  "peers",   "naïve",  "café"};
  std::string text;
  uint32_t x = 1;
  for (int l = 0; l < lines; ++l) {
    for (int w = 0; w < 12; ++w) {
      x = x * 1103515245 + 12345;
      text += words[(x >> 16) % 20];
      text += w == 11 ? "\n" : " ";
    }
  }
  return text;
}

struct Trained {
  TempDir dir;
  std::string text_path = dir.File("corpus.txt");
  std::string model_path;
  Trained() {
    WriteTextFileAtomic(text_path, SomeText(400));
    model_path = TrainSentencePiece({.inputs = {text_path}, .vocab_size = 100}, dir.File("sp"));
  }
};

TEST(ByteTokenizer, RoundTripsBytes) {
  const ByteTokenizer t;
  const std::string text("h\xc3\xa9\x00llo", 7);
  const auto ids = t.Encode(std::string_view(text.data(), 7));
  EXPECT_EQ(ids, (std::vector<int32_t>{'h', 0xc3, 0xa9, 0, 'l', 'l', 'o'}));
  EXPECT_EQ(t.Decode(ids), std::string(text.data(), 7));
  EXPECT_EQ(t.vocab_size(), 256);
  EXPECT_FALSE(t.eod_id().has_value());
  ExpectError(
      [&] {
        t.Decode(std::vector<int32_t>{1, 256});
      },
      {"id 256", "position 1", "[0, 256)"});
}

TEST(SentencePiece, TrainsEncodesAndDecodes) {
  Trained t;
  EXPECT_EQ(t.model_path, t.dir.File("sp.model"));
  const SentencePieceTokenizer sp(t.model_path);
  EXPECT_EQ(sp.vocab_size(), 100);
  EXPECT_EQ(sp.eod_id(), std::optional<int32_t>(2));
  const std::string line = "the router sends tokens to each expert";
  const auto ids = sp.Encode(line);
  EXPECT_LT(ids.size(), line.size() / 2);  // pieces longer than bytes
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 100);
  }
  EXPECT_EQ(sp.Decode(ids), line);
  ExpectError([&] { sp.Decode(std::vector<int32_t>{5, 100}); }, {"sp.model", "id 100", "[0, 100)"});
  // No temporary file left next to the model.
  EXPECT_EQ(t.dir.List(), (std::vector<std::string>{"corpus.txt", "sp.model"}));
}

TEST(SentencePiece, BadModelsAndTrainingInputsAreRefused) {
  TempDir dir;
  WriteTextFileAtomic(dir.File("junk.model"), "not a model");
  ExpectError([&] { SentencePieceTokenizer s(dir.File("junk.model")); },
              {"junk.model", "not a SentencePiece model"});
  ExpectError([&] { SentencePieceTokenizer s(dir.File("none.model")); },
              {"none.model", "does not exist"});
  ExpectError([&] { SentencePieceTokenizer s(dir.path()); }, {"not a regular file"});
  ExpectError([&] { TrainSentencePiece({.inputs = {dir.File("none.txt")}}, dir.File("x")); },
              {"--input", "none.txt", "does not exist"});
  WriteTextFileAtomic(dir.File("tiny.txt"), "ab ab\n");
  ExpectError(
      [&] {
        TrainSentencePiece({.inputs = {dir.File("tiny.txt")}, .vocab_size = 5000}, dir.File("x"));
      },
      {"could not train", "5000", "tiny.txt"});
  EXPECT_FALSE(std::filesystem::exists(dir.File("x.model")));
}

// preprocess -> read back gives the tokenizer's ids, document by document, for any number of
// workers (the files are byte-identical), with and without the EOD id.
TEST(Preprocess, ReadBackGivesTheTokenizersIdsPerDocument) {
  Trained t;
  const SentencePieceTokenizer sp(t.model_path);
  // A .jsonl input too, with an empty document that is skipped.
  std::string jsonl =
      "{\"text\": \"the expert waits\", \"id\": 1}\n{\"text\": \"\"}\n"
      "{\"text\": \"café naïve \\\"quoted\\\"\"}\n";
  WriteTextFileAtomic(t.dir.File("more.jsonl"), jsonl);
  std::vector<std::string> expected_docs;
  {
    std::istringstream in(SomeText(400));
    std::string line;
    while (std::getline(in, line)) expected_docs.push_back(line);
  }
  expected_docs.push_back("the expert waits");
  expected_docs.push_back("café naïve \"quoted\"");
  std::vector<char> first_bin, first_idx;
  for (int workers : {1, 3}) {
    for (bool eod : {false, true}) {
      const std::string prefix = t.dir.File(fmt::format("out{}{}", workers, eod));
      int calls = 0;
      const auto r = Preprocess(sp,
                                {.inputs = {t.text_path, t.dir.File("more.jsonl")},
                                 .append_eod = eod,
                                 .workers = workers,
                                 .chunk_documents = 64,
                                 .progress = [&](const PreprocessProgress&) { ++calls; }},
                                prefix);
      EXPECT_EQ(r.documents, static_cast<int64_t>(expected_docs.size()));
      EXPECT_EQ(r.empty_skipped, 1);
      EXPECT_GT(calls, 5);
      const auto source = OpenTokenSource(prefix, {.vocab_size = sp.vocab_size()});
      ASSERT_EQ(source->num_documents(), r.documents);
      for (size_t d = 0; d < expected_docs.size(); ++d) {
        auto ids = sp.Encode(expected_docs[d]);
        if (eod) ids.push_back(2);
        ASSERT_EQ(source->Document(static_cast<int64_t>(d)), ids) << d;
      }
      if (!eod) {
        if (workers == 1) {
          first_bin = ReadBytes(prefix + ".bin");
          first_idx = ReadBytes(prefix + ".idx");
        } else {
          EXPECT_EQ(ReadBytes(prefix + ".bin"), first_bin);
          EXPECT_EQ(ReadBytes(prefix + ".idx"), first_idx);
        }
      }
    }
  }
}

TEST(EncodeDocuments, InOrderForAnyWorkersAndAsATokenSource) {
  Trained t;
  const SentencePieceTokenizer sp(t.model_path);
  const std::vector<std::string_view> docs{"the expert", "", "ranks wait for their peers",
                                           "a mixture model", "café"};
  const auto one = EncodeDocuments(sp, docs, true, 1);
  EXPECT_EQ(EncodeDocuments(sp, docs, true, 3), one);
  ASSERT_EQ(one.size(), docs.size());
  for (size_t d = 0; d < docs.size(); ++d) {
    auto ids = sp.Encode(docs[d]);
    ids.push_back(2);
    EXPECT_EQ(one[d], ids) << d;
  }
  const InMemoryTokenSource source("memory", one, sp.vocab_size());
  EXPECT_EQ(source.Document(2), one[2]);
  EXPECT_TRUE(EncodeDocuments(sp, {}, false, 2).empty());
  ExpectError([] { EncodeDocuments(ByteTokenizer(), {}, true); },
              {"--append-eod", "no end-of-document id"});
  ExpectError(
      [] {
        InMemoryTokenSource("m", {{1, 300}}, 256).Document(0);
      },
      {"m: token id 300", "document 0, position 1"});
}

TEST(Preprocess, BadInputsAreRefusedAndWriteNothing) {
  TempDir dir;
  const ByteTokenizer bytes;
  WriteTextFileAtomic(dir.File("a.txt"), "hello\n");
  ExpectError(
      [&] {
        Preprocess(bytes, {.inputs = {dir.File("a.txt")}, .append_eod = true}, dir.File("o"));
      },
      {"--append-eod", "bytes", "no end-of-document id"});
  ExpectError([&] { Preprocess(bytes, {.inputs = {dir.File("b.txt")}}, dir.File("o")); },
              {"--input", "b.txt", "does not exist"});
  WriteTextFileAtomic(dir.File("bad.jsonl"), "{\"text\": \"ok\"}\n{\"txt\": \"x\"}\n");
  ExpectError([&] { Preprocess(bytes, {.inputs = {dir.File("bad.jsonl")}}, dir.File("o")); },
              {"bad.jsonl:2", "string \"text\"", "--json-key"});
  WriteTextFileAtomic(dir.File("bad2.jsonl"), "{\"text\": \"ok\"\n");
  ExpectError([&] { Preprocess(bytes, {.inputs = {dir.File("bad2.jsonl")}}, dir.File("o")); },
              {"bad2.jsonl:1", "not a JSON object"});
  WriteTextFileAtomic(dir.File("empty.txt"), "\n\r\n\n");
  ExpectError([&] { Preprocess(bytes, {.inputs = {dir.File("empty.txt")}}, dir.File("o")); },
              {"no document", "3 empty lines"});
  WriteTextFileAtomic(dir.File("same.bin"), "text\n");
  ExpectError([&] { Preprocess(bytes, {.inputs = {dir.File("same.bin")}}, dir.File("same")); },
              {"--out", "--input", "same.bin"});
  EXPECT_EQ(ReadBytes(dir.File("same.bin")), (std::vector<char>{'t', 'e', 'x', 't', '\n'}));
  EXPECT_FALSE(std::filesystem::exists(dir.File("o.bin")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("o.idx")));
}

TEST(Metrics, BitsPerByteAndPerplexity) {
  EXPECT_DOUBLE_EQ(BitsPerByte(std::log(2.0), 1.0), 1.0);
  EXPECT_DOUBLE_EQ(BitsPerByte(4 * std::log(2.0), 4.0), 1.0);
  EXPECT_NEAR(Perplexity(std::log(50.0)), 50.0, 1e-9);
  ExpectError([] { BitsPerByte(1, 0); }, {"bytes per token 0", "positive"});
  const ByteTokenizer bytes;
  EXPECT_DOUBLE_EQ(BytesPerToken(bytes, std::vector<int32_t>{1, 2, 3}), 1.0);
  Trained t;
  const SentencePieceTokenizer sp(t.model_path);
  const std::string line = "the mixture model sends tokens";
  EXPECT_DOUBLE_EQ(BytesPerToken(sp, sp.Encode(line)),
                   static_cast<double>(line.size()) / static_cast<double>(sp.Encode(line).size()));
}

}  // namespace
}  // namespace switchyard::train::dataset
