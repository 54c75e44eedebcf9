// Training samples from tokenized datasets, Megatron-LM's GPT-dataset way (docs/data.md,
// "Samples"):
//   - a dataset's documents are concatenated, each followed by the end-of-document id when
//     SampleOptions::eod is set (data preprocessed with --append-eod already carries it), in a
//     seeded random order that is drawn anew for every epoch, into one endless token stream;
//   - sample k of a dataset is the window of seq_len + 1 tokens starting at token
//     position(k) * seq_len of that stream (windows share their boundary token; a window crosses
//     document and epoch boundaries freely); position(k) permutes the sample indices within
//     blocks of one epoch's samples by a seeded bijection, so that a batch does not hold
//     neighbouring windows of one document;
//   - a blend of datasets with weights picks, for global sample i, the dataset whose count lags
//     its share the most (Megatron's blending index: the largest weight * (i + 1) - count, ties
//     to the lower dataset); dataset d's n-th pick is its sample n.
//
// The determinism rule: the tokens of global sample i are a pure function of (the datasets, the
// weights in their order, seq_len, seed, eod, i). Nothing depends on which samples were read
// before or in which order, by which rank, with which batch size: rows [r0, r1) of step s with a
// global batch of B rows are global samples s * B + r0 .. s * B + r1 - 1. So every layout and
// every resume reads the same global batches, and a rank fetches its rows directly.
//
// Cost: a dataset keeps, for the epochs in use, its document order and the token offset of each
// document in it (16 bytes per document, built in one pass when an epoch is first touched; the
// last few epochs are cached). The blend keeps each dataset's count every kBlendCheckpoint
// samples (8 bytes per dataset), built lazily up to the largest index asked for: fetching sample
// i first costs O(i * datasets) once (3 s for i = 10^8 over 3 datasets, measured on a busy 2-core
// VM), then O(kBlendCheckpoint * datasets).
//
// Memory: the token files are mapped, not read; what the process itself holds is the epoch tables
// and the blend's checkpoints (2M documents: 32 MB; the mapped pages it touched show as RssFile,
// page cache the kernel reclaims at will).
// Thread-safety: Sample/Batch/Locate may be called concurrently (caches behind a mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "switchyard/train/dataset/token_source.h"

namespace switchyard::train::dataset {

// A seeded bijection of [0, n): a 4-round Feistel network over the smallest even number of bits
// that covers n, walked until it lands in range (at most a few steps on average). O(1) memory.
class Permutation {
 public:
  Permutation(int64_t n, uint64_t key);
  int64_t operator()(int64_t i) const;
  int64_t size() const { return n_; }

 private:
  int64_t n_;
  uint64_t key_;
  int half_bits_ = 1;
};

// Documents [begin, end) of a source.
struct DocumentRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// The training and held-out documents (docs/data.md, "Validation"): the last
// round(num_documents * val_fraction) documents are held out (at least one when val_fraction > 0),
// as Megatron's contiguous train/valid split. InvalidArgument naming `name` when val_fraction is
// outside [0, 0.5] or nothing would be left to train on.
struct DocumentSplit {
  DocumentRange train, val;
};
DocumentSplit SplitDocuments(int64_t num_documents, double val_fraction, const std::string& name);

struct SampleOptions {
  int64_t seq_len = 0;           // a sample holds seq_len + 1 tokens (inputs and targets)
  uint64_t seed = 0;             // document and sample order
  bool shuffle = true;           // false: documents and samples in file order (evaluation)
  std::optional<int32_t> eod{};  // appended after every document when set
};

// One dataset's samples (see the top of this file). `source` must outlive this object.
class DatasetSamples {
 public:
  // `stream_key` separates the orders of datasets in one blend (their position in it).
  // InvalidArgument when seq_len < 1, the range is empty or out of the source, or it holds no
  // token.
  DatasetSamples(const TokenSource& source, DocumentRange documents, SampleOptions options,
                 uint64_t stream_key = 0);

  // Tokens in one pass over the documents (EOD ids included).
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // Whole windows in one pass: max(1, (tokens_per_epoch - 1) / seq_len). With shuffle off,
  // samples 0 .. samples_per_epoch() - 1 are the consecutive windows of the documents in order
  // (the held-out evaluation set).
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  // Tokens of sample k >= 0 into `out` (seq_len + 1 of them).
  void Sample(int64_t k, std::span<int32_t> out) const;

 private:
  struct Epoch {
    int64_t epoch = -1;
    std::vector<int64_t> order;  // document ids in this epoch's order
    std::vector<int64_t> start;  // token offset of order[j] in the epoch; start.back() = total
  };
  std::shared_ptr<const Epoch> EpochTable(int64_t epoch) const;
  void ReadStream(int64_t position, std::span<int32_t> out) const;
  int64_t DocumentTokens(int64_t doc) const;

  const TokenSource* source_;
  DocumentRange documents_;
  SampleOptions options_;
  uint64_t stream_key_;
  int64_t tokens_per_epoch_ = 0;
  int64_t samples_per_epoch_ = 0;
  mutable std::mutex mu_;
  mutable std::vector<std::shared_ptr<const Epoch>> epochs_;  // most recent last
};

// Megatron's blending index over weights (normalized here), with random access.
inline constexpr int64_t kBlendCheckpoint = 1024;

class BlendIndex {
 public:
  // InvalidArgument naming the weight when one is negative or not finite, or when they do not
  // sum to a positive number.
  explicit BlendIndex(std::vector<double> weights);

  struct Location {
    int dataset = 0;    // which dataset global sample i comes from
    int64_t index = 0;  // that dataset's sample number
  };
  Location Locate(int64_t i) const;
  const std::vector<double>& weights() const { return weights_; }

 private:
  int Pick(int64_t i, const std::vector<int64_t>& counts) const;

  std::vector<double> weights_;
  mutable std::mutex mu_;
  // checkpoints_[c * datasets + d] = dataset d's count before sample c * kBlendCheckpoint.
  mutable std::vector<int64_t> checkpoints_;
};

struct BlendedDataset {
  double weight = 1;
  std::shared_ptr<const TokenSource> source;
  DocumentRange documents;  // size() == 0: all of the source's documents
};

// The stream of global samples over a blend of datasets.
class SampleStream {
 public:
  SampleStream(std::vector<BlendedDataset> datasets, SampleOptions options);

  int64_t seq_len() const { return options_.seq_len; }
  int num_datasets() const { return static_cast<int>(datasets_.size()); }
  BlendIndex::Location Locate(int64_t global_index) const { return blend_.Locate(global_index); }
  // Tokens of global sample i (seq_len + 1 of them).
  void Sample(int64_t global_index, std::span<int32_t> out) const;
  // Rows [row_begin, row_end) of step `step`'s global batch of `global_batch` rows: row r is
  // global sample step * global_batch + r. Row-major [row_end - row_begin, seq_len + 1].
  std::vector<int32_t> Batch(int64_t step, int64_t global_batch, int64_t row_begin,
                             int64_t row_end) const;
  const DatasetSamples& dataset(int d) const { return *samples_[static_cast<size_t>(d)]; }

 private:
  std::vector<BlendedDataset> datasets_;
  SampleOptions options_;
  BlendIndex blend_;
  std::vector<std::unique_ptr<DatasetSamples>> samples_;
};

}  // namespace switchyard::train::dataset
