#include "switchyard/train/data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "switchyard/core/file_util.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/rng.h"

namespace switchyard::train {

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

std::vector<std::string> RunCorpusFiles(const std::string& data, const std::string& val_data) {
  std::vector<std::string> files =
      data.empty() ? DefaultCorpusFiles() : ExpandDataPaths(data, "data");
  if (!val_data.empty()) {
    for (std::string& f : ExpandDataPaths(val_data, "val_data")) files.push_back(std::move(f));
  }
  return files;
}

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

std::vector<Batch> EvaluationBatches(const std::vector<uint8_t>& tokens, int64_t seq_len,
                                     int64_t batch_size, int64_t max_tokens, int64_t min_rows) {
  SY_REQUIRE(seq_len >= 1 && batch_size >= 1 && min_rows >= 1 && min_rows <= batch_size,
             InvalidArgument,
             "EvaluationBatches: seq_len {} and batch_size {} must be >= 1, min_rows {} in [1, "
             "batch_size]",
             seq_len, batch_size, min_rows);
  int64_t n = static_cast<int64_t>(tokens.size());
  int64_t windows = n > seq_len ? (n - 1) / seq_len : 0;
  if (max_tokens > 0) windows = std::min(windows, max_tokens / seq_len);
  // Batch boundaries: batch_size rows each; a last batch shorter than min_rows joins the one
  // before it, or, when it is the only one, is padded with ignored rows.
  std::vector<int64_t> starts;
  for (int64_t w0 = 0; w0 < windows; w0 += batch_size) starts.push_back(w0);
  if (starts.size() >= 2 && windows - starts.back() < min_rows) starts.pop_back();
  std::vector<Batch> out;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t w0 = starts[i];
    const int64_t real = (i + 1 < starts.size() ? starts[i + 1] : windows) - w0;
    const int64_t rows = std::max(real, min_rows);
    Batch b{Tensor::Empty({rows, seq_len}, DType::kInt32),
            Tensor::Empty({rows, seq_len}, DType::kInt32)};
    int32_t* tok = b.tokens.data<int32_t>();
    int32_t* tgt = b.targets.data<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* src = tokens.data() + (w0 + std::min(r, real - 1)) * seq_len;
      for (int64_t t = 0; t < seq_len; ++t) {
        tok[r * seq_len + t] = src[t];
        tgt[r * seq_len + t] = r < real ? src[t + 1] : -1;  // padding: not counted
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace switchyard::train
