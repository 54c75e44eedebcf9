// Training data: byte-level tokens (vocab 256) from a real text corpus, a held-out split for
// the validation loss, deterministic batch sampling, and the corpus's unigram entropy (the loss
// of the best model that ignores context, which a trained model must get well below).
//
// The default corpus is the `fortunes` files that scripts/setup.sh installs (Debian packages
// fortunes, fortunes-min and fortune-mod, about 2.6 MB): text records separated by lines holding
// a single "%". With only fortunes-min installed (about 100 KB) the default run trains on that and
// says so (DefaultCorpusNote).
//
// Thread-safety: Corpus and BatchSampler are immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard::train {

inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

// The fortune files of `dir`, sorted: regular files (symlinks such as "fortunes.u8" and the
// ".dat" index files are skipped). Throws IoError naming the directory and the packages to
// install when there are none.
std::vector<std::string> DefaultCorpusFiles(const std::string& dir = kFortunesDir);
// Bytes of the full `fortunes` package's text; a default corpus below kFullFortunesBytes is
// fortunes-min alone.
inline constexpr int64_t kFullFortunesBytes = 1000000;
// "" when `files` (DefaultCorpusFiles) hold the full package, else a one-line note naming the
// bytes found and the package to install.
std::string DefaultCorpusNote(const std::vector<std::string>& files);

// The files of a comma-separated list of files and directories (the keys data and val_data): a
// directory gives its regular files as DefaultCorpusFiles does. IoError naming `key` and the
// entry when one does not exist or a directory holds no file; InvalidArgument for an empty entry.
std::vector<std::string> ExpandDataPaths(const std::string& list, std::string_view key);

// Cuts text into records whose concatenation is the text: a record ends after a line that is
// exactly "%" (fortune files); text without such lines is cut at the first line end after
// every `chunk_bytes` bytes (or at chunk_bytes when a line is longer).
std::vector<std::string_view> SplitRecords(std::string_view text, int64_t chunk_bytes = 1024);

struct Corpus {
  std::vector<std::string> files;
  std::vector<uint8_t> train;  // byte tokens
  std::vector<uint8_t> val;    // held-out byte tokens
  int64_t records = 0;
  int64_t val_records = 0;
};

// Reads the files (each ends with a newline, added if missing), splits them into records and
// puts every k-th record (k = round(1 / val_fraction), record index % k == k - 1) into the
// held-out set; val_fraction 0 holds nothing out. Throws IoError for unreadable files and
// InvalidArgument for val_fraction outside [0, 0.5] or an empty corpus.
Corpus LoadCorpus(const std::vector<std::string>& files, double val_fraction);
// The same from text in memory (`files` stays empty).
Corpus CorpusFromText(std::string_view text, double val_fraction);

// A run's corpus from its keys: `data` (ExpandDataPaths; "" = DefaultCorpusFiles()) and either
// `val_data` (held out whole; all of `data` trains) or every k-th record of `data`
// (val_fraction). `files` lists the training files, then the held-out ones. `note` (may be null)
// receives DefaultCorpusNote for the default corpus, else "".
Corpus LoadRunCorpus(const std::string& data, const std::string& val_data, double val_fraction,
                     std::string* note = nullptr);
// Every file a run reads (training, then held-out), as LoadRunCorpus would.
std::vector<std::string> RunCorpusFiles(const std::string& data, const std::string& val_data);

// Unigram (byte frequency) entropy of the tokens, in nats: -sum_b p_b ln p_b.
double UnigramEntropy(const std::vector<uint8_t>& tokens);

// A batch: targets are the tokens shifted by one position.
struct Batch {
  Tensor tokens;   // int32 [rows, seq_len]
  Tensor targets;  // int32 [rows, seq_len]
};

// Random training windows. Row r of the global batch of step s is the window of seq_len + 1
// tokens starting at a uniform offset drawn from CounterRng(seed, kStreamData) at index
// s * global_batch + r. A rank takes rows [begin, end) of the global batch, so every layout
// (1 rank or W ranks splitting the rows) sees the same sequences.
class BatchSampler {
 public:
  // `tokens` must outlive the sampler and hold more than seq_len tokens (InvalidArgument).
  BatchSampler(const std::vector<uint8_t>& tokens, int64_t seq_len, uint64_t seed);

  // Rows [row_begin, row_end) of step `step`'s global batch of `global_batch` rows.
  Batch Sample(int64_t step, int64_t global_batch, int64_t row_begin, int64_t row_end) const;
  // Start offset of a row (for tests).
  int64_t Offset(int64_t step, int64_t global_batch, int64_t row) const;

 private:
  const std::vector<uint8_t>* tokens_;
  int64_t seq_len_;
  uint64_t seed_;
};

// The held-out evaluation set: consecutive non-overlapping windows of seq_len + 1 tokens
// (stride seq_len) from the start of `tokens`, at most max_tokens / seq_len of them (all when
// max_tokens <= 0), in batches of batch_size rows. Every batch has at least `min_rows` rows
// (1 <= min_rows <= batch_size; the trainer passes its number of ranks, so that every rank has
// rows of every batch): a shorter last batch joins the one before it (which then has up to
// batch_size + min_rows - 1 rows) and, when it is the only batch, is padded to min_rows with
// rows whose targets are -1 (ignored by the loss). Empty when the text is shorter than one window.
std::vector<Batch> EvaluationBatches(const std::vector<uint8_t>& tokens, int64_t seq_len,
                                     int64_t batch_size, int64_t max_tokens, int64_t min_rows = 1);

}  // namespace switchyard::train
