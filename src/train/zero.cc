#include "switchyard/train/zero.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/core/hash.h"

namespace switchyard::train {
namespace {

// FNV-1a over what every rank of the group must agree on.
class Fingerprint {
 public:
  void Add(const void* data, size_t n) {
    hash_ = FnvHash(std::span(static_cast<const std::byte*>(data), n), hash_);
  }
  template <typename T>
  void AddValue(T v) {
    Add(&v, sizeof(v));
  }
  int64_t value() const { return static_cast<int64_t>(hash_); }

 private:
  uint64_t hash_ = kFnv1a64Basis;
};

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

}  // namespace

ShardedAdamW::ShardedAdamW(std::vector<Parameter*> params, comm::Communicator& group, int stage,
                           AdamWOptions options, ZeroOptions zero)
    : group_(group), stage_(stage), options_(options), zero_(zero) {
  SY_REQUIRE(stage >= 0 && stage <= 3, InvalidArgument, "ShardedAdamW: stage must be 0..3, got {}",
             stage);
  AdamW validate(options);  // same option checks and messages as AdamW
  Fingerprint fingerprint;
  fingerprint.AddValue(stage);
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.beta1));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.beta2));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.eps));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.weight_decay));
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter* p = params[i];
    SY_REQUIRE(p != nullptr, InvalidArgument, "ShardedAdamW: parameter {} is null", i);
    SY_REQUIRE(p->value.defined() && p->value.dtype() == DType::kFloat32, InvalidArgument,
               "ShardedAdamW: parameter '{}' must have a float32 value, got {}", p->name,
               p->value.defined() ? p->value.ToString() : std::string("undefined"));
    if (!p->options.trainable) continue;
    SY_REQUIRE(p->grad.defined() && p->grad.dtype() == DType::kFloat32 &&
                   p->grad.shape() == p->value.shape(),
               InvalidArgument,
               "ShardedAdamW: parameter '{}' needs a float32 gradient of shape {}, got {}", p->name,
               ShapeToString(p->value.shape()),
               p->grad.defined() ? p->grad.ToString() : std::string("undefined"));
    for (const Parameter* q : params_) {
      SY_REQUIRE(q->name != p->name, InvalidArgument, "ShardedAdamW: parameter '{}' is given twice",
                 p->name);
    }
    params_.push_back(p);
    offsets_.push_back(total_);
    total_ += p->value.numel();
    fingerprint.Add(p->name.data(), p->name.size() + 1);
    fingerprint.AddValue(p->value.dim());
    for (int64_t d : p->value.shape()) fingerprint.AddValue(d);
    fingerprint.AddValue(p->options.weight_decay);
  }

  // Every rank must see the same flat layout: compare fingerprints (one int64 per rank).
  const int g = group_.size();
  std::vector<int64_t> prints(static_cast<size_t>(g));
  const int64_t mine = fingerprint.value();
  group_.AllGather(&mine, prints.data(), 1, DType::kInt64).Wait();
  for (int q = 0; q < g; ++q) {
    SY_REQUIRE(prints[static_cast<size_t>(q)] == prints[0], InvalidArgument,
               "ShardedAdamW over group '{}': rank {} passed different parameters (names, shapes, "
               "weight decay, order), stage or AdamW options than rank 0; every rank must pass "
               "the same",
               group_.name(), q);
  }

  chunk_ = (total_ + g - 1) / g;
  const int r = group_.rank();
  own_begin_ = std::min(total_, static_cast<int64_t>(r) * chunk_);
  own_end_ = std::min(total_, own_begin_ + chunk_);
  exp_avg_.assign(static_cast<size_t>(state_end() - state_begin()), 0.0f);
  exp_avg_sq_.assign(exp_avg_.size(), 0.0f);
  scratch_.assign(static_cast<size_t>(chunk_ * g), 0.0f);
  shard_.assign(static_cast<size_t>(chunk_), 0.0f);
}

std::vector<ShardedAdamW::Segment> ShardedAdamW::Segments(int64_t begin, int64_t end) const {
  std::vector<Segment> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    int64_t lo = offsets_[i], hi = lo + params_[i]->value.numel();
    int64_t a = std::max(lo, begin), b = std::min(hi, end);
    if (a < b) out.push_back({params_[i], a - lo, a, b - a});
  }
  return out;
}

void ShardedAdamW::ReduceGradients(float scale) {
  if (total_ == 0) return;
  float* flat = scratch_.data();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i]->grad.numel() == 0) continue;  // no storage to copy from
    std::memcpy(flat + offsets_[i], params_[i]->grad.data<float>(), params_[i]->grad.nbytes());
  }
  if (stage_ <= 1) {
    group_.AllReduce(flat, flat, static_cast<size_t>(total_), DType::kFloat32).Wait();
    for (size_t i = 0; i < params_.size(); ++i) {
      float* g = params_[i]->grad.data<float>();
      const float* s = flat + offsets_[i];
      for (int64_t j = 0; j < params_[i]->grad.numel(); ++j) g[j] = s[j] * scale;
    }
    return;
  }
  std::fill(scratch_.begin() + total_, scratch_.end(), 0.0f);  // padding
  group_.ReduceScatter(flat, shard_.data(), static_cast<size_t>(chunk_), DType::kFloat32).Wait();
  for (const Segment& s : Segments(own_begin_, own_end_)) {
    float* g = s.param->grad.data<float>() + s.param_offset;
    const float* src = shard_.data() + (s.flat_offset - own_begin_);
    for (int64_t j = 0; j < s.length; ++j) g[j] = src[j] * scale;
  }
  if (zero_.poison_non_owned) PoisonNonOwned(/*values=*/false);
}

double ShardedAdamW::OwnGradSquaredNorm() const {
  double total = 0;
  for (const Segment& s : Segments(own_begin_, own_end_)) {
    const float* g = s.param->grad.data<float>() + s.param_offset;
    double sum = 0;
    for (int64_t j = 0; j < s.length; ++j) sum += static_cast<double>(g[j]) * g[j];
    total += sum;
  }
  return total;
}

void ShardedAdamW::ScaleGradients(float factor) {
  if (factor == 1.0f) return;
  const int64_t begin = stage_ <= 1 ? 0 : own_begin_;
  const int64_t end = stage_ <= 1 ? total_ : own_end_;
  for (const Segment& s : Segments(begin, end)) {
    float* g = s.param->grad.data<float>() + s.param_offset;
    for (int64_t j = 0; j < s.length; ++j) g[j] *= factor;
  }
}

void ShardedAdamW::Step(float lr) {
  ++step_;
  has_state_ = true;
  const int64_t base = state_begin();
  for (const Segment& s : Segments(base, state_end())) {
    const float wd = s.param->options.weight_decay ? options_.weight_decay : 0.0f;
    const int64_t k = s.flat_offset - base;
    AdamWUpdate(s.param->value.data<float>() + s.param_offset,
                s.param->grad.data<float>() + s.param_offset, exp_avg_.data() + k,
                exp_avg_sq_.data() + k, s.length, options_, lr, wd, step_);
  }
  if (stage_ == 1 || stage_ == 2) {
    AllGatherValues();
  } else if (stage_ == 3 && zero_.poison_non_owned) {
    PoisonNonOwned(/*values=*/true);  // stale: their owners stepped them
  }
}

void ShardedAdamW::GatherParameters() {
  if (stage_ == 3) AllGatherValues();
}

void ShardedAdamW::ReleaseParameters() {
  if (stage_ == 3 && zero_.poison_non_owned) PoisonNonOwned(/*values=*/true);
}

void ShardedAdamW::AllGatherValues() {
  if (total_ == 0 || group_.size() == 1) return;  // one rank owns everything
  std::fill(shard_.begin(), shard_.end(), 0.0f);
  for (const Segment& s : Segments(own_begin_, own_end_)) {
    std::memcpy(shard_.data() + (s.flat_offset - own_begin_),
                s.param->value.data<float>() + s.param_offset, sizeof(float) * s.length);
  }
  group_.AllGather(shard_.data(), scratch_.data(), static_cast<size_t>(chunk_), DType::kFloat32)
      .Wait();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i]->value.numel() == 0) continue;
    std::memcpy(params_[i]->value.data<float>(), scratch_.data() + offsets_[i],
                params_[i]->value.nbytes());
  }
}

void ShardedAdamW::PoisonNonOwned(bool values) {
  for (auto [begin, end] : {std::pair{int64_t{0}, own_begin_}, std::pair{own_end_, total_}}) {
    for (const Segment& s : Segments(begin, end)) {
      Tensor& t = values ? s.param->value : s.param->grad;
      std::fill_n(t.data<float>() + s.param_offset, s.length, kPoison);
    }
  }
}

TensorMap ShardedAdamW::FullState() {
  TensorMap out;
  if (!has_state_) return out;
  // Full flat exp_avg / exp_avg_sq: local at stage 0, else all-gathered as per-rank blocks
  // [own exp_avg, padded to c | own exp_avg_sq, padded to c].
  const float* m = exp_avg_.data();
  const float* v = exp_avg_sq_.data();
  std::vector<float> full_m, full_v;
  if (stage_ >= 1 && group_.size() > 1 && total_ > 0) {
    const int g = group_.size();
    const size_t c = static_cast<size_t>(chunk_);
    std::vector<float> send(2 * c, 0.0f), recv(2 * c * static_cast<size_t>(g));
    std::copy(exp_avg_.begin(), exp_avg_.end(), send.begin());
    std::copy(exp_avg_sq_.begin(), exp_avg_sq_.end(), send.begin() + static_cast<ptrdiff_t>(c));
    group_.AllGather(send.data(), recv.data(), 2 * c, DType::kFloat32).Wait();
    full_m.resize(static_cast<size_t>(total_));
    full_v.resize(static_cast<size_t>(total_));
    for (int q = 0; q < g; ++q) {
      const size_t begin = std::min(static_cast<size_t>(q) * c, static_cast<size_t>(total_));
      const size_t n = std::min(c, static_cast<size_t>(total_) - begin);
      const float* block = recv.data() + 2 * c * static_cast<size_t>(q);
      std::copy_n(block, n, full_m.begin() + static_cast<ptrdiff_t>(begin));
      std::copy_n(block + c, n, full_v.begin() + static_cast<ptrdiff_t>(begin));
    }
    m = full_m.data();
    v = full_v.data();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = *params_[i];
    Tensor tm = Tensor::Empty(p.value.shape());
    Tensor tv = Tensor::Empty(p.value.shape());
    std::copy_n(m + offsets_[i], p.value.numel(), tm.data<float>());
    std::copy_n(v + offsets_[i], p.value.numel(), tv.data<float>());
    out.emplace(p.name + ".exp_avg", std::move(tm));
    out.emplace(p.name + ".exp_avg_sq", std::move(tv));
  }
  return out;
}

void ShardedAdamW::LoadFullState(const TensorMap& tensors, int64_t step) {
  SY_REQUIRE(step >= 0, InvalidArgument, "ShardedAdamW state: step must be >= 0, got {}", step);
  // Check everything before changing anything.
  std::vector<std::pair<Tensor, Tensor>> loaded;  // float32 exp_avg, exp_avg_sq per params_[i]
  for (const Parameter* p : params_) {
    Tensor found[2];
    int k = 0;
    for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
      std::string key = p->name + suffix;
      auto it = tensors.find(key);
      SY_REQUIRE(it != tensors.end(), InvalidArgument, "ShardedAdamW state: '{}' is missing", key);
      SY_REQUIRE(it->second.shape() == p->value.shape(), InvalidArgument,
                 "ShardedAdamW state '{}': expected shape {}, got {}", key,
                 ShapeToString(p->value.shape()), ShapeToString(it->second.shape()));
      ExpectFloating(key, it->second);
      found[k++] = it->second.To(DType::kFloat32);
    }
    loaded.emplace_back(std::move(found[0]), std::move(found[1]));
  }
  const int64_t base = state_begin();
  std::vector<float> m(static_cast<size_t>(state_end() - base));
  std::vector<float> v(m.size());
  size_t i = 0;
  for (const Segment& s : Segments(base, state_end())) {
    while (params_[i] != s.param) ++i;
    std::copy_n(loaded[i].first.data<float>() + s.param_offset, s.length,
                m.begin() + (s.flat_offset - base));
    std::copy_n(loaded[i].second.data<float>() + s.param_offset, s.length,
                v.begin() + (s.flat_offset - base));
  }
  exp_avg_ = std::move(m);
  exp_avg_sq_ = std::move(v);
  step_ = step;
  has_state_ = true;
}

}  // namespace switchyard::train
