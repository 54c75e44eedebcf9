// Training data: byte-level tokens (vocab 256) from a real text corpus, a held-out split for
// the validation loss, deterministic batch sampling, and the corpus's unigram entropy (the loss
// of the best model that ignores context, which a trained model must get well below).
//
// The default corpus is the `fortunes` files that scripts/setup.sh installs (Debian packages
// fortunes, fortunes-min and fortune-mod, about 2.6 MB): text records separated by lines holding
// a single "%". With only fortunes-min installed (about 100 KB) the default run trains on that and
// says so (DefaultCorpusNote).
//
// TrainingData (the end of this file) is what the trainer reads: the byte-level text above for
// the default run, or tokenized data (train/dataset/) as a weighted blend, through a tokenizer.
//
// Thread-safety: Corpus, BatchSampler and TrainingData are immutable after construction.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/train/config.h"
#include "switchyard/train/dataset/samples.h"
#include "switchyard/train/dataset/tokenizer.h"

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
// The fingerprint a run recognizes a data file by (16 hex digits of FNV-1a): all of its bytes up
// to 64 MiB, else its size and its first and last MiB, so that a 20 GB dataset is not read whole
// (checkpoints' data identity, the agreement of an MPI run's ranks). IoError if unreadable.
std::string DataFileFingerprint(const std::string& path);
// Every file a run reads (training, then held-out), as TrainingData would: text files, a
// Megatron source's .bin and .idx, flat token files.
std::vector<std::string> RunCorpusFiles(const std::string& data, const std::string& val_data,
                                        const std::string& data_format = "auto");

// The identity of a corpus for checkpoints: its files (absolute paths), its bytes (training
// then held-out) and their FNV-1a 64 checksum, as a JSON object.
std::string DataIdentityJson(const Corpus& corpus);

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

// ---- A run's training data (docs/data.md, "Training on it") ----

// One source of a blend.
struct DataSource {
  double weight = 1;
  std::string
      path;  // a text file or directory (or a comma list of them), a Megatron prefix, a .bin
};
// The sources of the key `key` ("data" or "val_data"):
//   ""                       -> none (the caller's default);
//   "W1 S1 W2 S2 ..."        -> a weighted blend (Megatron's --data-path form): an even number of
//                               fields, every other one a number; the fields are the lines of the
//                               value when it has several (the command line's --data 0.7 A 0.3 B
//                               arrives so, paths may hold spaces), else its space-separated words;
//   anything else            -> one source of weight 1 (the whole value).
// InvalidArgument naming the key and the field when a weight is not a finite number >= 0, the
// weights do not sum to a positive number, or a blend has an odd number of fields.
std::vector<DataSource> ParseDataSources(const std::string& value, std::string_view key);

// The model's vocabulary follows a SentencePiece tokenizer (`tokenizer` other than "bytes"):
// vocab_size is set to the tokenizer's when no source set it explicitly; when one did (a flag,
// the --config file, the resumed checkpoint) and it differs, InvalidArgument naming the tokenizer
// file, both sizes and where vocab_size came from. Loads the model (IoError / InvalidArgument
// naming the file).
void ApplyTokenizerVocabulary(ResolvedTrainConfig& resolved);

struct TrainingDataOptions {
  std::string data, val_data;  // the keys
  std::string data_format = "auto";
  std::string tokenizer = "bytes";
  double val_fraction = 0.1;
  int64_t seq_len = 0;
  uint64_t seed = 0;
  int64_t batch_size = 1;     // evaluation batch rows
  int64_t eval_tokens = 0;    // held-out tokens per evaluation (0: all)
  int64_t vocab_size = 256;   // the model's: every token id must lie below it
  int64_t min_eval_rows = 1;  // EvaluationBatches' min_rows (the data-parallel ranks)
};
TrainingDataOptions TrainingDataOptionsOf(const TrainConfig& config, int64_t data_ranks);

// The data of a run:
//   - byte-level text (the tokenizer "bytes", every source text, no weights): Corpus,
//     BatchSampler and EvaluationBatches above, exactly as before tokenized data existed (the
//     default fortunes run's losses do not change);
//   - otherwise a dataset::SampleStream over the sources (text encoded with the tokenizer, one
//     document per record, each followed by its end-of-document id when it has one; token files
//     memory-mapped), held-out documents split off the end of every source
//     (dataset::SplitDocuments, val_fraction) or the sources of val_data, evaluated as their
//     consecutive windows in file order.
// Either way rows [r0, r1) of step s's global batch are a pure function of (sources, weights,
// seq_len, seed, s * global_batch + r): every layout and every resume draws the same batches.
// Every bad input is an error here, before step 1, naming the file and what was expected.
class TrainingData {
 public:
  explicit TrainingData(const TrainingDataOptions& options);
  ~TrainingData();
  TrainingData(const TrainingData&) = delete;
  TrainingData& operator=(const TrainingData&) = delete;

  // Rows [row_begin, row_end) of step `step`'s global batch of `global_batch` rows.
  Batch Sample(int64_t step, int64_t global_batch, int64_t row_begin, int64_t row_end) const;
  // The held-out evaluation batches (EvaluationBatches' shape); empty without a held-out set.
  const std::vector<Batch>& eval_batches() const { return eval_batches_; }
  const dataset::Tokenizer& tokenizer() const { return *tokenizer_; }
  // The byte-level text path (the default run's).
  bool byte_text() const { return sampler_ != nullptr; }
  // Unigram entropy of the training bytes (nats per byte); NaN for tokenized data.
  double unigram_entropy() const { return unigram_entropy_; }
  // UTF-8 bytes per token of the held-out set (of the first training batches without one): the
  // divisor of bits per byte. 1 for byte-level data; NaN when the tokenizer cannot decode the
  // ids (token files of a model vocabulary above the byte tokenizer's).
  double bytes_per_token() const { return bytes_per_token_; }
  int64_t train_tokens() const { return train_tokens_; }
  int64_t val_tokens() const { return val_tokens_; }
  // The checkpoint's record of the data ({"files", "bytes", "fnv1a64"}, DataIdentityJson's form).
  const std::string& identity_json() const { return identity_json_; }
  // "fortunes corpus (N train / M held-out bytes)" and the like, for the run's first lines.
  std::string Description() const;
  // DefaultCorpusNote for the default corpus, else "".
  const std::string& note() const { return note_; }

 private:
  void OpenTokenized(const TrainingDataOptions& o);

  std::unique_ptr<dataset::Tokenizer> tokenizer_;
  // Byte-level text.
  Corpus corpus_;
  std::unique_ptr<BatchSampler> sampler_;
  // Tokenized.
  std::vector<std::shared_ptr<const dataset::TokenSource>> sources_;
  std::unique_ptr<dataset::SampleStream> stream_;
  int64_t seq_len_ = 0;

  std::vector<Batch> eval_batches_;
  double unigram_entropy_ = NAN;
  double bytes_per_token_ = NAN;
  int64_t train_tokens_ = 0, val_tokens_ = 0;
  std::string identity_json_;
  std::string description_;
  std::string note_;
};

}  // namespace switchyard::train
