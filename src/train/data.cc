#include "switchyard/train/data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "switchyard/core/file_util.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/rng.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/dataset/megatron.h"
#include "switchyard/train/dataset/metrics.h"
#include "switchyard/train/dataset/preprocess.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

// The regular files of a directory, sorted; symlinks and ".dat" (fortune index) files skipped.
std::vector<std::string> DirectoryFiles(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.is_symlink() || !entry.is_regular_file()) continue;
      if (entry.path().extension() == ".dat") continue;
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

std::vector<std::string> DefaultCorpusFiles(const std::string& dir) {
  std::vector<std::string> files = DirectoryFiles(dir);
  SY_REQUIRE(!files.empty(), IoError,
             "default corpus: no fortune files in '{}' (install the Debian packages fortunes, "
             "fortunes-min and fortune-mod with scripts/setup.sh, or set 'data' to a text file)",
             dir);
  return files;
}

std::string DefaultCorpusNote(const std::vector<std::string>& files) {
  namespace fs = std::filesystem;
  int64_t bytes = 0;
  for (const std::string& f : files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (!ec) bytes += static_cast<int64_t>(size);
  }
  if (bytes >= kFullFortunesBytes) return "";
  return fmt::format(
      "note: the default corpus holds only {} bytes (Debian's fortunes-min); install the package "
      "'fortunes' (scripts/setup.sh) for the full corpus of about 2.6 MB that the documented "
      "figures use",
      bytes);
}

std::vector<std::string> ExpandDataPaths(const std::string& list, std::string_view key) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string entry = list.substr(at, comma - at);
    at = comma + 1;
    SY_REQUIRE(!entry.empty(), InvalidArgument,
               "config: '{}' \"{}\": expected a comma-separated list of files and directories, "
               "found an empty entry",
               key, list);
    std::error_code ec;
    if (fs::is_directory(entry, ec)) {
      std::vector<std::string> in_dir = DirectoryFiles(entry);
      SY_REQUIRE(!in_dir.empty(), IoError, "config: '{}': the directory '{}' holds no text file",
                 key, entry);
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      SY_REQUIRE(fs::exists(entry, ec), IoError,
                 "config: '{}': '{}' does not exist (expected a text file or a directory)", key,
                 entry);
      files.push_back(entry);
    }
  }
  return files;
}

std::vector<std::string_view> SplitRecords(std::string_view text, int64_t chunk_bytes) {
  SY_REQUIRE(chunk_bytes >= 1, InvalidArgument, "SplitRecords: chunk_bytes must be >= 1, got {}",
             chunk_bytes);
  bool fortune = text.starts_with("%\n") || text.find("\n%\n") != std::string_view::npos ||
                 text == "%" || text.ends_with("\n%");
  std::vector<std::string_view> records;
  size_t start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    size_t next = eol == std::string_view::npos ? text.size() : eol + 1;
    std::string_view line = text.substr(pos, next - pos);
    bool cut;
    if (fortune) {
      cut = line == "%\n" || line == "%";
    } else {
      // Cut at the first line end after chunk_bytes, or inside an over-long line.
      cut = static_cast<int64_t>(next - start) >= chunk_bytes;
      if (static_cast<int64_t>(next - start) > 2 * chunk_bytes) {
        next = start + static_cast<size_t>(chunk_bytes);
      }
    }
    pos = next;
    if (cut) {
      records.push_back(text.substr(start, pos - start));
      start = pos;
    }
  }
  if (start < text.size()) records.push_back(text.substr(start));
  return records;
}

Corpus CorpusFromText(std::string_view text, double val_fraction) {
  SY_REQUIRE(val_fraction >= 0 && val_fraction <= 0.5, InvalidArgument,
             "val_fraction: expected a value in [0, 0.5], got {}", val_fraction);
  SY_REQUIRE(!text.empty(), InvalidArgument, "corpus: the text is empty");
  Corpus c;
  std::vector<std::string_view> records = SplitRecords(text);
  // Every k-th record held out; k bounded by the records (a larger k holds none out).
  const int64_t k =
      val_fraction > 0
          ? std::max<int64_t>(2, CheckedToInt64(std::round(1.0 / val_fraction),
                                                "val_fraction: 1 / val_fraction (held-out stride)",
                                                1, int64_t{1} << 53))
          : 0;
  c.records = static_cast<int64_t>(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    bool held_out = k > 0 && static_cast<int64_t>(i) % k == k - 1;
    auto& dst = held_out ? c.val : c.train;
    dst.insert(dst.end(), records[i].begin(), records[i].end());
    c.val_records += held_out ? 1 : 0;
  }
  return c;
}

Corpus LoadCorpus(const std::vector<std::string>& files, double val_fraction) {
  SY_REQUIRE(!files.empty(), InvalidArgument, "corpus: no files given");
  std::string text;
  for (const auto& f : files) {
    std::string t = ReadTextFile(f);
    if (!t.empty() && t.back() != '\n') t.push_back('\n');
    text += t;
  }
  SY_REQUIRE(!text.empty(), InvalidArgument, "corpus: the files {} are empty",
             fmt::join(files, ", "));
  Corpus c = CorpusFromText(text, val_fraction);
  c.files = files;
  return c;
}

Corpus LoadRunCorpus(const std::string& data, const std::string& val_data, double val_fraction,
                     std::string* note) {
  const std::vector<std::string> train =
      data.empty() ? DefaultCorpusFiles() : ExpandDataPaths(data, "data");
  if (note != nullptr) *note = data.empty() ? DefaultCorpusNote(train) : "";
  if (val_data.empty()) return LoadCorpus(train, val_fraction);
  Corpus c = LoadCorpus(train, 0.0);
  const std::vector<std::string> held = ExpandDataPaths(val_data, "val_data");
  Corpus v = LoadCorpus(held, 0.0);
  c.val = std::move(v.train);
  c.val_records = v.records;
  c.files.insert(c.files.end(), held.begin(), held.end());
  return c;
}

std::string DataIdentityJson(const Corpus& corpus) {
  std::vector<std::string> files;
  for (const std::string& f : corpus.files) {
    std::error_code ec;
    const std::filesystem::path p = std::filesystem::absolute(f, ec);
    files.push_back(ec ? f : p.lexically_normal().string());
  }
  // The hash of train then held-out bytes, without copying the corpus.
  const uint64_t hash = Fnv1a64(std::as_bytes(std::span(corpus.val)),
                                Fnv1a64(std::as_bytes(std::span(corpus.train))));
  json names = json::array();
  for (const std::string& f : files) names.push_back(json::parse(StringToJsonValue(f)));
  json j = {{"files", names},
            {"bytes", corpus.train.size() + corpus.val.size()},
            {"fnv1a64", fmt::format("{:016x}", hash)}};
  return j.dump();
}

// RunCorpusFiles is defined with TrainingData below.

double UnigramEntropy(const std::vector<uint8_t>& tokens) {
  if (tokens.empty()) return 0;
  int64_t counts[256] = {};
  for (uint8_t t : tokens) ++counts[t];
  double n = static_cast<double>(tokens.size()), h = 0;
  for (int64_t c : counts) {
    if (c > 0) {
      double p = static_cast<double>(c) / n;
      h -= p * std::log(p);
    }
  }
  return h;
}

BatchSampler::BatchSampler(const std::vector<uint8_t>& tokens, int64_t seq_len, uint64_t seed)
    : tokens_(&tokens), seq_len_(seq_len), seed_(seed) {
  SY_REQUIRE(seq_len >= 1, InvalidArgument, "seq_len must be >= 1, got {}", seq_len);
  SY_REQUIRE(static_cast<int64_t>(tokens.size()) > seq_len, InvalidArgument,
             "training text has {} tokens, fewer than one window of seq_len + 1 = {}",
             tokens.size(), seq_len + 1);
}

int64_t BatchSampler::Offset(int64_t step, int64_t global_batch, int64_t row) const {
  CounterRng rng(seed_, kStreamData);
  auto bits = rng.Bits(static_cast<uint64_t>(step) * static_cast<uint64_t>(global_batch) +
                       static_cast<uint64_t>(row));
  uint64_t r = (static_cast<uint64_t>(bits[1]) << 32) | bits[0];
  uint64_t windows = tokens_->size() - static_cast<uint64_t>(seq_len_);  // offsets 0..size-seq-1
  return static_cast<int64_t>(r % windows);
}

Batch BatchSampler::Sample(int64_t step, int64_t global_batch, int64_t row_begin,
                           int64_t row_end) const {
  SY_REQUIRE(step >= 0 && global_batch >= 1 && 0 <= row_begin && row_begin <= row_end &&
                 row_end <= global_batch,
             InvalidArgument,
             "BatchSampler: rows [{}, {}) of a global batch of {} at step {} are out of range",
             row_begin, row_end, global_batch, step);
  int64_t rows = row_end - row_begin;
  Batch b{Tensor::Empty({rows, seq_len_}, DType::kInt32),
          Tensor::Empty({rows, seq_len_}, DType::kInt32)};
  int32_t* tok = b.tokens.data<int32_t>();
  int32_t* tgt = b.targets.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = tokens_->data() + Offset(step, global_batch, row_begin + r);
    for (int64_t t = 0; t < seq_len_; ++t) {
      tok[r * seq_len_ + t] = src[t];
      tgt[r * seq_len_ + t] = src[t + 1];
    }
  }
  return b;
}

namespace {

// Tokens of held-out window w (seq_len + 1 of them) into `out`.
using WindowFunction = std::function<void(int64_t w, std::span<int32_t> out)>;

// EvaluationBatches over `windows` windows that `fetch` reads.
std::vector<Batch> BatchWindows(int64_t windows, int64_t seq_len, int64_t batch_size,
                                int64_t min_rows, const WindowFunction& fetch) {
  // Batch boundaries: batch_size rows each; a last batch shorter than min_rows joins the one
  // before it, or, when it is the only one, is padded with ignored rows.
  std::vector<int64_t> starts;
  for (int64_t w0 = 0; w0 < windows; w0 += batch_size) starts.push_back(w0);
  if (starts.size() >= 2 && windows - starts.back() < min_rows) starts.pop_back();
  std::vector<Batch> out;
  std::vector<int32_t> window(static_cast<size_t>(seq_len + 1));
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t w0 = starts[i];
    const int64_t real = (i + 1 < starts.size() ? starts[i + 1] : windows) - w0;
    const int64_t rows = std::max(real, min_rows);
    Batch b{Tensor::Empty({rows, seq_len}, DType::kInt32),
            Tensor::Empty({rows, seq_len}, DType::kInt32)};
    int32_t* tok = b.tokens.data<int32_t>();
    int32_t* tgt = b.targets.data<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      fetch(w0 + std::min(r, real - 1), window);
      for (int64_t t = 0; t < seq_len; ++t) {
        tok[r * seq_len + t] = window[static_cast<size_t>(t)];
        tgt[r * seq_len + t] = r < real ? window[static_cast<size_t>(t + 1)] : -1;  // padding
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

void RequireEvaluationShape(int64_t seq_len, int64_t batch_size, int64_t min_rows) {
  SY_REQUIRE(seq_len >= 1 && batch_size >= 1 && min_rows >= 1 && min_rows <= batch_size,
             InvalidArgument,
             "EvaluationBatches: seq_len {} and batch_size {} must be >= 1, min_rows {} in [1, "
             "batch_size]",
             seq_len, batch_size, min_rows);
}

}  // namespace

std::vector<Batch> EvaluationBatches(const std::vector<uint8_t>& tokens, int64_t seq_len,
                                     int64_t batch_size, int64_t max_tokens, int64_t min_rows) {
  RequireEvaluationShape(seq_len, batch_size, min_rows);
  int64_t n = static_cast<int64_t>(tokens.size());
  int64_t windows = n > seq_len ? (n - 1) / seq_len : 0;
  if (max_tokens > 0) windows = std::min(windows, max_tokens / seq_len);
  return BatchWindows(windows, seq_len, batch_size, min_rows,
                      [&](int64_t w, std::span<int32_t> out) {
                        const uint8_t* src = tokens.data() + w * seq_len;
                        std::copy(src, src + seq_len + 1, out.begin());
                      });
}

// ---- TrainingData ----

namespace {

using dataset::Format;

// The most held-out tokens an evaluation set of tokenized data holds without 'eval_tokens'
// (their batches take 8 bytes a token: 512 MiB).
constexpr int64_t kMaxEvalTokens = int64_t{1} << 26;

// Fields of a data key: its lines when it has several, else its space-separated words.
std::vector<std::string> DataFields(const std::string& value) {
  std::vector<std::string> fields;
  const char sep = value.find('\n') != std::string::npos ? '\n' : ' ';
  size_t at = 0;
  while (at <= value.size()) {
    const size_t end = std::min(value.find(sep, at), value.size());
    if (end > at) fields.push_back(value.substr(at, end - at));
    at = end + 1;
  }
  return fields;
}

// The number `text` whole, or nullopt.
std::optional<double> ParseWeight(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno != 0) return std::nullopt;
  return v;
}

// The sources of the default corpus ("" data): the fortunes directory.
std::vector<DataSource> SourcesOrDefault(const std::string& data) {
  std::vector<DataSource> sources = ParseDataSources(data, "data");
  if (sources.empty()) sources.push_back({1.0, ""});
  return sources;
}

// The files of one source.
std::vector<std::string> SourceFiles(const DataSource& s, Format requested, std::string_view key) {
  if (s.path.empty()) return DefaultCorpusFiles();
  const Format format = dataset::DetectFormat(s.path, requested);
  if (format == Format::kText) return ExpandDataPaths(s.path, key);
  if (format == Format::kMegatron) {
    const std::string prefix = dataset::MegatronPrefix(s.path);
    return {prefix + ".bin", prefix + ".idx"};
  }
  return {s.path};
}

// FNV-1a of a file: all of it up to 64 MiB, else its size and its first and last MiB (a 20 GB
// dataset is not read whole to be recognized on resume).
uint64_t FileDigest(const std::string& path, uint64_t state) {
  constexpr uint64_t kWhole = uint64_t{64} << 20, kEnds = uint64_t{1} << 20;
  std::ifstream in(path, std::ios::binary);
  SY_REQUIRE(in.good(), IoError, "cannot read '{}'", path);
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  auto hash_range = [&](uint64_t offset, uint64_t bytes) {
    std::vector<char> buf(bytes);
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(buf.data(), static_cast<std::streamsize>(bytes));
    SY_REQUIRE(in.good(), IoError, "cannot read {} bytes at {} of '{}'", bytes, offset, path);
    state = Fnv1a64(std::as_bytes(std::span(buf)), state);
  };
  if (size <= kWhole) {
    if (size > 0) hash_range(0, size);
  } else {
    const std::string size_text = std::to_string(size);
    state = Fnv1a64(std::as_bytes(std::span(size_text)), state);
    hash_range(0, kEnds);
    hash_range(size - kEnds, kEnds);
  }
  return state;
}

std::string AbsolutePath(const std::string& f) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(f, ec);
  return ec ? f : p.lexically_normal().string();
}

}  // namespace

std::string DataFileFingerprint(const std::string& path) {
  return fmt::format("{:016x}", FileDigest(path, kFnv1a64Start));
}

std::vector<DataSource> ParseDataSources(const std::string& value, std::string_view key) {
  const std::vector<std::string> fields = DataFields(value);
  if (fields.empty()) return {};
  const bool blend = fields.size() >= 2 && ParseWeight(fields[0]).has_value();
  if (!blend) return {{1.0, value.find('\n') != std::string::npos ? fields[0] : value}};
  SY_REQUIRE(fields.size() % 2 == 0, InvalidArgument,
             "config: '{}': a blend is pairs of a weight and a source (\"0.7 PREFIX_A 0.3 "
             "PREFIX_B\"); {} fields is an odd number",
             key, fields.size());
  std::vector<DataSource> sources;
  double sum = 0;
  for (size_t i = 0; i < fields.size(); i += 2) {
    const std::optional<double> w = ParseWeight(fields[i]);
    SY_REQUIRE(w.has_value() && std::isfinite(*w) && *w >= 0, InvalidArgument,
               "config: '{}': weight {} \"{}\" (before source \"{}\"): expected a finite number "
               ">= 0",
               key, i / 2 + 1, fields[i], fields[i + 1]);
    sum += *w;
    sources.push_back({*w, fields[i + 1]});
  }
  SY_REQUIRE(sum > 0 && std::isfinite(sum), InvalidArgument,
             "config: '{}': the weights of the blend sum to {}; expected a positive sum", key, sum);
  return sources;
}

std::vector<std::string> RunCorpusFiles(const std::string& data, const std::string& val_data,
                                        const std::string& data_format) {
  const Format requested = dataset::ParseFormat(data_format, "data_format");
  std::vector<std::string> files;
  for (const DataSource& s : SourcesOrDefault(data)) {
    for (std::string& f : SourceFiles(s, requested, "data")) files.push_back(std::move(f));
  }
  for (const DataSource& s : ParseDataSources(val_data, "val_data")) {
    for (std::string& f : SourceFiles(s, requested, "val_data")) files.push_back(std::move(f));
  }
  return files;
}

void ApplyTokenizerVocabulary(ResolvedTrainConfig& resolved) {
  TrainConfig& c = resolved.config;
  if (c.tokenizer == "bytes") return;
  const int64_t v = dataset::LoadTokenizer(c.tokenizer)->vocab_size();
  const auto source = resolved.explicit_keys.find("vocab_size");
  if (source == resolved.explicit_keys.end()) {
    c.model.vocab_size = v;
    return;
  }
  SY_REQUIRE(c.model.vocab_size == v, InvalidArgument,
             "tokenizer '{}' has a vocabulary of {} ids, but vocab_size is {} ({}): the model's "
             "vocabulary must be the tokenizer's (leave vocab_size out to take it, or use the "
             "tokenizer the checkpoint was trained with)",
             c.tokenizer, v, c.model.vocab_size, source->second);
}

TrainingDataOptions TrainingDataOptionsOf(const TrainConfig& c, int64_t data_ranks) {
  return {.data = c.data,
          .val_data = c.val_data,
          .data_format = c.data_format,
          .tokenizer = c.tokenizer,
          .val_fraction = c.val_fraction,
          .seq_len = c.model.seq_len,
          .seed = c.seed,
          .batch_size = c.batch_size,
          .eval_tokens = c.eval_tokens,
          .vocab_size = c.model.vocab_size,
          .min_eval_rows = data_ranks};
}

TrainingData::~TrainingData() = default;

TrainingData::TrainingData(const TrainingDataOptions& o) : seq_len_(o.seq_len) {
  const Format requested = dataset::ParseFormat(o.data_format, "data_format");
  tokenizer_ = dataset::LoadTokenizer(o.tokenizer);
  const bool bytes = o.tokenizer == "bytes";
  SY_REQUIRE(bytes || o.vocab_size == tokenizer_->vocab_size(), InvalidArgument,
             "tokenizer '{}' has a vocabulary of {} ids, but the model's vocab_size is {}: they "
             "must be equal",
             o.tokenizer, tokenizer_->vocab_size(), o.vocab_size);
  const std::vector<DataSource> train = ParseDataSources(o.data, "data");
  const bool one_text =
      train.size() <= 1 && (train.empty() || train[0].weight == 1) &&
      (train.empty() || dataset::DetectFormat(train[0].path, requested) == Format::kText);
  const std::vector<DataSource> val = ParseDataSources(o.val_data, "val_data");
  bool val_text = val.size() <= 1;
  for (const DataSource& s : val) {
    val_text = val_text && dataset::DetectFormat(s.path, requested) == Format::kText;
  }
  if (!(bytes && one_text && val_text)) {
    OpenTokenized(o);
    return;
  }
  // Byte-level text: the default run's path, unchanged.
  SY_REQUIRE(o.vocab_size >= 256, InvalidArgument,
             "config: byte-level data needs vocab_size >= 256, got {}", o.vocab_size);
  corpus_ = LoadRunCorpus(o.data, o.val_data, o.val_fraction, &note_);
  identity_json_ = DataIdentityJson(corpus_);
  unigram_entropy_ = UnigramEntropy(corpus_.train);
  sampler_ = std::make_unique<BatchSampler>(corpus_.train, o.seq_len, o.seed);
  eval_batches_ =
      EvaluationBatches(corpus_.val, o.seq_len, o.batch_size, o.eval_tokens, o.min_eval_rows);
  SY_REQUIRE((o.val_data.empty() && o.val_fraction == 0) || !eval_batches_.empty(), InvalidArgument,
             "data: the held-out text ({} bytes, {}) is shorter than one evaluation window of "
             "seq_len + 1 = {} tokens: use a longer text, a larger val_fraction or a smaller "
             "seq_len, or val_fraction 0 to train without a validation loss",
             corpus_.val.size(),
             o.val_data.empty() ? fmt::format("val_fraction {}", o.val_fraction)
                                : fmt::format("val_data {}", o.val_data),
             o.seq_len + 1);
  bytes_per_token_ = 1;
  train_tokens_ = static_cast<int64_t>(corpus_.train.size());
  val_tokens_ = static_cast<int64_t>(corpus_.val.size());
  description_ = fmt::format("{} ({} train / {} held-out bytes)",
                             o.data.empty() ? std::string("fortunes corpus") : o.data,
                             corpus_.train.size(), corpus_.val.size());
}

void TrainingData::OpenTokenized(const TrainingDataOptions& o) {
  const Format requested = dataset::ParseFormat(o.data_format, "data_format");
  std::vector<std::string> files;
  std::string summary;  // the hashed description of the sources
  // Opens a source: text encoded with the tokenizer (one document per record, each followed by
  // the end-of-document id when the tokenizer has one), token files mapped.
  auto open = [&](const DataSource& s, std::string_view key) {
    const Format format = s.path.empty() ? Format::kText : dataset::DetectFormat(s.path, requested);
    const std::vector<std::string> source_files = SourceFiles(s, requested, key);
    files.insert(files.end(), source_files.begin(), source_files.end());
    summary += fmt::format("{} {} {};", s.weight, dataset::FormatName(format), s.path);
    if (s.path.empty()) note_ = DefaultCorpusNote(source_files);
    std::shared_ptr<const dataset::TokenSource> source;
    if (format == Format::kText) {
      const Corpus text = LoadCorpus(source_files, 0.0);
      const std::string_view all(reinterpret_cast<const char*>(text.train.data()),
                                 text.train.size());
      const std::vector<std::string_view> records = SplitRecords(all);
      source = std::make_shared<dataset::InMemoryTokenSource>(
          s.path.empty() ? std::string("fortunes corpus") : s.path,
          dataset::EncodeDocuments(*tokenizer_, records, tokenizer_->eod_id().has_value()),
          o.vocab_size);
    } else {
      source = dataset::OpenTokenSource(s.path, {.format = format, .vocab_size = o.vocab_size});
    }
    sources_.push_back(source);
    return source;
  };
  const dataset::SampleOptions sample{.seq_len = o.seq_len, .seed = o.seed};
  dataset::SampleOptions in_order = sample;
  in_order.shuffle = false;
  std::vector<dataset::BlendedDataset> blend;
  std::vector<std::unique_ptr<dataset::DatasetSamples>> held_out;
  std::vector<std::string> held_names;
  const std::vector<DataSource> val = ParseDataSources(o.val_data, "val_data");
  for (const DataSource& s : SourcesOrDefault(o.data)) {
    auto source = open(s, "data");
    dataset::DocumentSplit split{{0, source->num_documents()}, {}};
    if (val.empty()) {
      split = dataset::SplitDocuments(source->num_documents(), o.val_fraction, source->name());
    }
    blend.push_back({s.weight, source, split.train});
    if (split.val.size() > 0) {
      held_out.push_back(std::make_unique<dataset::DatasetSamples>(*source, split.val, in_order));
      held_names.push_back(source->name());
    }
  }
  for (const DataSource& s : val) {
    auto source = open(s, "val_data");
    held_out.push_back(std::make_unique<dataset::DatasetSamples>(
        *source, dataset::DocumentRange{0, source->num_documents()}, in_order));
    held_names.push_back(source->name());
  }
  stream_ = std::make_unique<dataset::SampleStream>(blend, sample);
  for (int d = 0; d < stream_->num_datasets(); ++d) {
    train_tokens_ += stream_->dataset(d).tokens_per_epoch();
  }
  // The held-out windows: each held-out set's consecutive windows, set after set.
  std::vector<std::pair<const dataset::DatasetSamples*, int64_t>> windows;  // (set, sample)
  int64_t total_windows = 0;
  for (size_t i = 0; i < held_out.size(); ++i) {
    const auto& h = held_out[i];
    val_tokens_ += h->tokens_per_epoch();
    SY_REQUIRE(h->tokens_per_epoch() > o.seq_len, InvalidArgument,
               "data: the held-out part of '{}' has {} tokens, fewer than one evaluation window "
               "of seq_len + 1 = {}: use more data, a larger val_fraction or a smaller seq_len, "
               "or val_fraction 0 to train without a validation loss",
               held_names[i], h->tokens_per_epoch(), o.seq_len + 1);
    total_windows += h->samples_per_epoch();
  }
  // The evaluation batches are held in memory: all of a large held-out set is refused.
  SY_REQUIRE(o.eval_tokens > 0 || total_windows <= kMaxEvalTokens / o.seq_len, InvalidArgument,
             "data: the held-out set holds {} windows of {} tokens, more than the {} tokens an "
             "evaluation may hold in memory: set 'eval_tokens' to evaluate a part of it",
             total_windows, o.seq_len, kMaxEvalTokens);
  const int64_t limit = o.eval_tokens > 0 ? o.eval_tokens / o.seq_len : total_windows;
  for (const auto& h : held_out) {
    for (int64_t k = 0; k < h->samples_per_epoch(); ++k) {
      if (static_cast<int64_t>(windows.size()) >= limit) break;
      windows.emplace_back(h.get(), k);
    }
  }
  RequireEvaluationShape(o.seq_len, o.batch_size, o.min_eval_rows);
  eval_batches_ = BatchWindows(static_cast<int64_t>(windows.size()), o.seq_len, o.batch_size,
                               o.min_eval_rows, [&](int64_t w, std::span<int32_t> out) {
                                 const auto& [set, k] = windows[static_cast<size_t>(w)];
                                 set->Sample(k, out);
                               });
  // Bytes per token: of the held-out targets, else of the first 64 training samples.
  std::vector<int32_t> ids, window(static_cast<size_t>(o.seq_len + 1));
  for (size_t w = 0; w < std::max<size_t>(windows.size(), 64); ++w) {
    if (w < windows.size()) {
      windows[w].first->Sample(windows[w].second, window);
    } else if (windows.empty()) {
      stream_->Sample(static_cast<int64_t>(w), window);
    } else {
      break;
    }
    ids.insert(ids.end(), window.begin() + 1, window.end());
  }
  const bool decodable = o.tokenizer != "bytes" || o.vocab_size <= 256;
  if (decodable) bytes_per_token_ = dataset::BytesPerToken(*tokenizer_, ids);
  // The identity: files, their bytes, a digest of the files, the blend and the tokenizer.
  if (o.tokenizer != "bytes") files.push_back(o.tokenizer);
  uint64_t hash = Fnv1a64(std::as_bytes(std::span(summary)));
  uint64_t total = 0;
  json names = json::array();
  for (const std::string& f : files) {
    hash = FileDigest(f, hash);
    std::error_code ec;
    total += std::filesystem::file_size(f, ec);
    names.push_back(json::parse(StringToJsonValue(AbsolutePath(f))));
  }
  identity_json_ =
      json{{"files", names}, {"bytes", total}, {"fnv1a64", fmt::format("{:016x}", hash)}}.dump();
  std::string list;
  for (int d = 0; d < stream_->num_datasets(); ++d) {
    const auto& src = *sources_[static_cast<size_t>(d)];
    list += fmt::format(
        "{}{}{} ({} documents, {} tokens)", d > 0 ? ", " : "",
        blend.size() > 1 ? fmt::format("{:.3g} ", blend[static_cast<size_t>(d)].weight) : "",
        src.name(), src.num_documents(), src.num_tokens());
  }
  description_ =
      fmt::format("{}; tokenizer {} (vocabulary {}); {} train / {} held-out tokens", list,
                  tokenizer_->name(), tokenizer_->vocab_size(), train_tokens_, val_tokens_);
}

Batch TrainingData::Sample(int64_t step, int64_t global_batch, int64_t row_begin,
                           int64_t row_end) const {
  if (sampler_ != nullptr) return sampler_->Sample(step, global_batch, row_begin, row_end);
  const std::vector<int32_t> rows = stream_->Batch(step, global_batch, row_begin, row_end);
  const int64_t n = row_end - row_begin, w = seq_len_ + 1;
  Batch b{Tensor::Empty({n, seq_len_}, DType::kInt32), Tensor::Empty({n, seq_len_}, DType::kInt32)};
  int32_t* tok = b.tokens.data<int32_t>();
  int32_t* tgt = b.targets.data<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* src = rows.data() + r * w;
    std::copy(src, src + seq_len_, tok + r * seq_len_);
    std::copy(src + 1, src + w, tgt + r * seq_len_);
  }
  return b;
}

std::string TrainingData::Description() const { return description_; }

}  // namespace switchyard::train
