#include "switchyard/train/dataset/samples.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "switchyard/core/error.h"

namespace switchyard::train::dataset {
// GCC's 128-bit integer (the high word of a 64 x 64 product); __extension__ keeps -Wpedantic
// quiet about it.
__extension__ using Uint128 = unsigned __int128;

namespace {

// SplitMix64's finalizer: a well-mixed 64-bit hash (the round function and the shuffle's draws).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Key(uint64_t a, uint64_t b, uint64_t c) { return Mix(Mix(Mix(a) ^ b) ^ c); }

// Keys of the two random orders of a dataset (separate uses of the seed).
constexpr uint64_t kDocumentOrder = 0x646f63;  // "doc"
constexpr uint64_t kSampleOrder = 0x736d70;    // "smp"
constexpr size_t kCachedEpochs = 3;

}  // namespace

Permutation::Permutation(int64_t n, uint64_t key) : n_(n), key_(key) {
  SY_CHECK(n >= 1 && n <= (int64_t{1} << 62), "permutation of {} elements", n);
  while ((int64_t{1} << (2 * half_bits_)) < n) ++half_bits_;
}

int64_t Permutation::operator()(int64_t i) const {
  SY_CHECK(i >= 0 && i < n_, "index {} of a permutation of {}", i, n_);
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  auto x = static_cast<uint64_t>(i);
  // Cycle walking: the Feistel network is a bijection of [0, 4^half_bits); applying it until the
  // value lands in [0, n) restricts it to a bijection of [0, n).
  do {
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = Key(key_, round, right) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

DocumentSplit SplitDocuments(int64_t num_documents, double val_fraction, const std::string& name) {
  SY_REQUIRE(std::isfinite(val_fraction) && val_fraction >= 0 && val_fraction <= 0.5,
             InvalidArgument, "val_fraction {}: expected a number in [0, 0.5]", val_fraction);
  int64_t val = std::llround(static_cast<double>(num_documents) * val_fraction);
  if (val_fraction > 0) val = std::max<int64_t>(val, 1);
  SY_REQUIRE(num_documents - val >= 1, InvalidArgument,
             "{}: {} documents cannot be split with val_fraction {}: nothing would be left to "
             "train on; expected at least 2 documents",
             name, num_documents, val_fraction);
  return {{0, num_documents - val}, {num_documents - val, num_documents}};
}

DatasetSamples::DatasetSamples(const TokenSource& source, DocumentRange documents,
                               SampleOptions options, uint64_t stream_key)
    : source_(&source), documents_(documents), options_(options), stream_key_(stream_key) {
  SY_REQUIRE(options_.seq_len >= 1, InvalidArgument, "seq_len {}: expected >= 1", options_.seq_len);
  SY_REQUIRE(documents_.begin >= 0 && documents_.begin < documents_.end &&
                 documents_.end <= source.num_documents(),
             InvalidArgument, "{}: documents [{}, {}) are not a non-empty range of its {}",
             source.name(), documents_.begin, documents_.end, source.num_documents());
  if (options_.eod && source.vocab_size() > 0) {
    SY_REQUIRE(*options_.eod >= 0 && *options_.eod < source.vocab_size(), InvalidArgument,
               "{}: end-of-document id {} is outside the vocabulary [0, {})", source.name(),
               *options_.eod, source.vocab_size());
  }
  for (int64_t d = documents_.begin; d < documents_.end; ++d) {
    tokens_per_epoch_ += DocumentTokens(d);
  }
  SY_REQUIRE(tokens_per_epoch_ > 0, InvalidArgument,
             "{}: documents [{}, {}) hold no tokens; expected a non-empty dataset", source.name(),
             documents_.begin, documents_.end);
  samples_per_epoch_ = std::max<int64_t>(1, (tokens_per_epoch_ - 1) / options_.seq_len);
}

int64_t DatasetSamples::DocumentTokens(int64_t doc) const {
  return source_->document_length(doc) + (options_.eod ? 1 : 0);
}

std::shared_ptr<const DatasetSamples::Epoch> DatasetSamples::EpochTable(int64_t epoch) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : epochs_) {
      if (e->epoch == epoch) return e;
    }
  }
  // Built outside the lock (two threads may build the same epoch; both get equal tables).
  auto table = std::make_shared<Epoch>();
  table->epoch = epoch;
  const int64_t n = documents_.size();
  table->order.resize(static_cast<size_t>(n));
  std::iota(table->order.begin(), table->order.end(), documents_.begin);
  if (options_.shuffle) {
    // Fisher-Yates with counter-based draws: the order depends only on (seed, key, epoch).
    const uint64_t key =
        Key(options_.seed, Key(kDocumentOrder, stream_key_, 0), static_cast<uint64_t>(epoch));
    for (int64_t i = n - 1; i > 0; --i) {
      const auto bound = static_cast<Uint128>(i + 1);
      const auto j = static_cast<int64_t>((Mix(key ^ Mix(static_cast<uint64_t>(i))) * bound) >> 64);
      std::swap(table->order[static_cast<size_t>(i)], table->order[static_cast<size_t>(j)]);
    }
  }
  table->start.resize(static_cast<size_t>(n) + 1);
  table->start[0] = 0;
  for (int64_t j = 0; j < n; ++j) {
    table->start[static_cast<size_t>(j + 1)] =
        table->start[static_cast<size_t>(j)] + DocumentTokens(table->order[static_cast<size_t>(j)]);
  }
  std::lock_guard<std::mutex> lock(mu_);
  epochs_.push_back(table);
  if (epochs_.size() > kCachedEpochs) epochs_.erase(epochs_.begin());
  return table;
}

void DatasetSamples::ReadStream(int64_t position, std::span<int32_t> out) const {
  size_t done = 0;
  while (done < out.size()) {
    const int64_t epoch = position / tokens_per_epoch_;
    const int64_t q = position % tokens_per_epoch_;
    const auto table = EpochTable(epoch);
    const auto it = std::upper_bound(table->start.begin(), table->start.end(), q);
    const auto j = static_cast<size_t>(it - table->start.begin() - 1);
    const int64_t doc = table->order[j];
    const int64_t offset = q - table->start[j];
    const int64_t length = source_->document_length(doc);
    const int64_t avail = table->start[j + 1] - q;  // to the end of this document (and its EOD)
    const auto take =
        static_cast<size_t>(std::min<int64_t>(avail, static_cast<int64_t>(out.size() - done)));
    const auto real =
        static_cast<size_t>(std::clamp<int64_t>(length - offset, 0, static_cast<int64_t>(take)));
    if (real > 0) source_->Read(doc, offset, out.subspan(done, real));
    if (take > real) out[done + real] = *options_.eod;  // only the EOD follows the tokens
    done += take;
    position += static_cast<int64_t>(take);
  }
}

void DatasetSamples::Sample(int64_t k, std::span<int32_t> out) const {
  SY_CHECK(k >= 0, "sample {}", k);
  SY_CHECK(static_cast<int64_t>(out.size()) == options_.seq_len + 1, "sample buffer of {}",
           out.size());
  int64_t position = k;
  if (options_.shuffle) {
    const int64_t block = k / samples_per_epoch_;
    const Permutation within(
        samples_per_epoch_,
        Key(options_.seed, Key(kSampleOrder, stream_key_, 0), static_cast<uint64_t>(block)));
    position = block * samples_per_epoch_ + within(k % samples_per_epoch_);
  }
  ReadStream(position * options_.seq_len, out);
}

BlendIndex::BlendIndex(std::vector<double> weights) : weights_(std::move(weights)) {
  SY_REQUIRE(!weights_.empty(), InvalidArgument, "data blend: expected at least one dataset");
  double sum = 0;
  for (size_t d = 0; d < weights_.size(); ++d) {
    SY_REQUIRE(std::isfinite(weights_[d]) && weights_[d] >= 0, InvalidArgument,
               "data blend: weight {} of dataset {}: expected a finite number >= 0", weights_[d],
               d + 1);
    sum += weights_[d];
  }
  SY_REQUIRE(sum > 0 && std::isfinite(sum), InvalidArgument,
             "data blend: the weights sum to {}; expected a positive sum", sum);
  for (double& w : weights_) w /= sum;
  checkpoints_.assign(weights_.size(), 0);
}

int BlendIndex::Pick(int64_t i, const std::vector<int64_t>& counts) const {
  int best = 0;
  double best_error = -INFINITY;
  for (size_t d = 0; d < weights_.size(); ++d) {
    const double error = weights_[d] * static_cast<double>(i + 1) - static_cast<double>(counts[d]);
    if (error > best_error) {
      best_error = error;
      best = static_cast<int>(d);
    }
  }
  return best;
}

BlendIndex::Location BlendIndex::Locate(int64_t i) const {
  SY_CHECK(i >= 0, "global sample {}", i);
  const size_t k = weights_.size();
  const auto c = static_cast<size_t>(i / kBlendCheckpoint);
  std::vector<int64_t> counts(k);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t have = checkpoints_.size() / k; have <= c; ++have) {
      counts.assign(checkpoints_.end() - static_cast<std::ptrdiff_t>(k), checkpoints_.end());
      const int64_t first = static_cast<int64_t>(have - 1) * kBlendCheckpoint;
      for (int64_t s = first; s < first + kBlendCheckpoint; ++s) {
        ++counts[static_cast<size_t>(Pick(s, counts))];
      }
      checkpoints_.insert(checkpoints_.end(), counts.begin(), counts.end());
    }
    std::copy_n(checkpoints_.begin() + static_cast<std::ptrdiff_t>(c * k), k, counts.begin());
  }
  for (int64_t s = static_cast<int64_t>(c) * kBlendCheckpoint; s < i; ++s) {
    ++counts[static_cast<size_t>(Pick(s, counts))];
  }
  const int d = Pick(i, counts);
  return {d, counts[static_cast<size_t>(d)]};
}

namespace {
std::vector<double> WeightsOf(const std::vector<BlendedDataset>& datasets) {
  std::vector<double> w;
  for (const auto& d : datasets) w.push_back(d.weight);
  return w;
}
}  // namespace

SampleStream::SampleStream(std::vector<BlendedDataset> datasets, SampleOptions options)
    : datasets_(std::move(datasets)), options_(options), blend_(WeightsOf(datasets_)) {
  for (size_t d = 0; d < datasets_.size(); ++d) {
    auto& entry = datasets_[d];
    SY_REQUIRE(entry.source != nullptr, InvalidArgument, "data blend: dataset {} is missing",
               d + 1);
    if (entry.documents.size() == 0) entry.documents = {0, entry.source->num_documents()};
    samples_.push_back(
        std::make_unique<DatasetSamples>(*entry.source, entry.documents, options_, d));
  }
}

void SampleStream::Sample(int64_t global_index, std::span<int32_t> out) const {
  const auto where = blend_.Locate(global_index);
  samples_[static_cast<size_t>(where.dataset)]->Sample(where.index, out);
}

std::vector<int32_t> SampleStream::Batch(int64_t step, int64_t global_batch, int64_t row_begin,
                                         int64_t row_end) const {
  SY_CHECK(step >= 0 && global_batch >= 1 && 0 <= row_begin && row_begin <= row_end &&
               row_end <= global_batch,
           "rows [{}, {}) of a global batch of {} at step {}", row_begin, row_end, global_batch,
           step);
  const auto width = static_cast<size_t>(options_.seq_len + 1);
  std::vector<int32_t> tokens(static_cast<size_t>(row_end - row_begin) * width);
  for (int64_t r = row_begin; r < row_end; ++r) {
    Sample(step * global_batch + r,
           std::span<int32_t>(tokens).subspan(static_cast<size_t>(r - row_begin) * width, width));
  }
  return tokens;
}

}  // namespace switchyard::train::dataset
