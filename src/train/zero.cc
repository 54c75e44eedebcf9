#include "switchyard/train/zero.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <limits>
#include <string_view>
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

// The block index of "blocks.<i>.<...>", -1 for other names.
int64_t UnitOf(const std::string& name) {
  constexpr std::string_view kPrefix = "blocks.";
  if (!name.starts_with(kPrefix)) return -1;
  int64_t v = 0;
  size_t i = kPrefix.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) v = v * 10 + (name[i] - '0');
  return i < name.size() && name[i] == '.' ? v : -1;
}

using comm::Clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double NowSeconds() { return Seconds(Clock::now().time_since_epoch()); }

// A tensor of `shape` viewing array[offset...]; the handle keeps the array alive.
Tensor View(const std::shared_ptr<PageArray>& array, int64_t offset, const Shape& shape) {
  float* p = array->data() == nullptr ? nullptr : array->data() + offset;
  if (NumElements(shape) == 0) return Tensor::Zeros(shape);
  return Tensor::FromBlob(p, shape, DType::kFloat32, [keep = array](void*) {});
}

}  // namespace

MemoryMeter::~MemoryMeter() {
  if (account_) account_->Release(charged_);
}

void MemoryMeter::Register(const ShardedAdamW* opt) {
  opts_.push_back(opt);
  if (!account_) account_ = CurrentMemoryAccount();
  ChargeAccount(Current().total());
}

void MemoryMeter::ChargeAccount(int64_t total) {
  if (!account_) return;
  if (total > charged_) account_->Charge(total - charged_);
  if (total < charged_) account_->Release(charged_ - total);
  charged_ = total;
}

void MemoryMeter::Sample() {
  ZeroMemory now = Current();
  if (now.total() > peak_.total()) peak_ = now;
  ChargeAccount(now.total());
}

ZeroMemory MemoryMeter::Current() const {
  ZeroMemory sum;
  for (const ShardedAdamW* o : opts_) {
    ZeroMemory m = o->MemoryUse();
    sum.values += m.values;
    sum.gradients += m.gradients;
    sum.state += m.state;
    sum.scratch += m.scratch;
  }
  return sum;
}

ShardedAdamW::ShardedAdamW(std::vector<Parameter*> params, comm::Communicator& group, int stage,
                           AdamWOptions options, ZeroOptions zero)
    : group_(group), stage_(stage), options_(options), zero_(zero) {
  SY_REQUIRE(stage >= 0 && stage <= 3, InvalidArgument, "ShardedAdamW: stage must be 0..3, got {}",
             stage);
  SY_REQUIRE(zero.bucket_elements >= 0, InvalidArgument,
             "ShardedAdamW: bucket_elements must be >= 0, got {}", zero.bucket_elements);
  AdamW validate(options);  // same option checks and messages as AdamW
  Fingerprint fingerprint;
  fingerprint.AddValue(stage);
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.beta1));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.beta2));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.eps));
  fingerprint.AddValue(std::bit_cast<uint32_t>(options.weight_decay));
  fingerprint.AddValue(zero.bucket_elements);
  fingerprint.AddValue(zero.bucket_per_block);
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
    total_ += p->value.numel();
    fingerprint.Add(p->name.data(), p->name.size() + 1);
    fingerprint.AddValue(p->value.dim());
    for (int64_t d : p->value.shape()) fingerprint.AddValue(d);
    fingerprint.AddValue(p->options.weight_decay);
  }

  // Every rank must see the same layout: compare fingerprints (one int64 per rank).
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

  // Buckets, in parameter order.
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t unit = zero_.bucket_per_block ? UnitOf(params_[i]->name) : -1;
    const bool fresh =
        buckets_.empty() || buckets_.back().unit != unit ||
        (zero_.bucket_elements > 0 && buckets_.back().numel >= zero_.bucket_elements);
    if (fresh) {
      Bucket b;
      b.unit = unit;
      b.first = i;
      buckets_.push_back(std::move(b));
    }
    buckets_.back().last = i + 1;
    buckets_.back().numel += params_[i]->value.numel();
  }
  const int r = group_.rank();
  int64_t base = 0, state = 0;
  for (Bucket& b : buckets_) {
    b.base = base;
    b.chunk = (b.numel + g - 1) / g;
    b.own_begin = base + std::min(b.numel, static_cast<int64_t>(r) * b.chunk);
    b.own_end = base + std::min(b.numel, static_cast<int64_t>(r + 1) * b.chunk);
    int64_t at = base;
    for (size_t i = b.first; i < b.last; ++i) {
      offsets_.push_back(at);
      at += params_[i]->value.numel();
    }
    b.state_offset = state;
    state += StateEnd(b) - StateBegin(b);
    base += b.chunk * g;
  }

  // Move values and gradients into the arrays.
  values_ = std::make_shared<PageArray>(base);
  grads_ = std::make_shared<PageArray>(base);
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    Tensor v = View(values_, offsets_[i], p.value.shape());
    Tensor gr = View(grads_, offsets_[i], p.value.shape());
    if (p.value.numel() > 0) {
      v.CopyFrom(p.value);
      gr.CopyFrom(p.grad);
    }
    p.value = std::move(v);
    p.grad = std::move(gr);
  }
  exp_avg_.assign(static_cast<size_t>(state), 0.0f);
  exp_avg_sq_.assign(exp_avg_.size(), 0.0f);
  if (zero_.meter != nullptr) zero_.meter->Register(this);
}

ShardedAdamW::~ShardedAdamW() = default;

int64_t ShardedAdamW::owned_elements() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.own_end - b.own_begin;
  return n;
}

int64_t ShardedAdamW::own_begin() const {
  SY_CHECK(buckets_.size() <= 1, "own_begin: more than one bucket");
  return buckets_.empty() ? 0 : buckets_[0].own_begin;
}

int64_t ShardedAdamW::own_end() const {
  SY_CHECK(buckets_.size() <= 1, "own_end: more than one bucket");
  return buckets_.empty() ? 0 : buckets_[0].own_end;
}

std::vector<ShardedAdamW::Segment> ShardedAdamW::Segments(int64_t begin, int64_t end) const {
  std::vector<Segment> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    int64_t lo = offsets_[i], hi = lo + params_[i]->value.numel();
    int64_t a = std::max(lo, begin), b = std::min(hi, end);
    if (a < b) out.push_back({params_[i], i, a - lo, a, b - a});
  }
  return out;
}

ZeroMemory ShardedAdamW::MemoryUse() const {
  ZeroMemory m;
  const int64_t pe = PageArray::PageElements();
  const int64_t page_bytes = pe * static_cast<int64_t>(sizeof(float));
  auto count = [&](const PageArray& array, bool values) {
    std::vector<bool> pages = array.ResidentPages();
    for (const Bucket& b : buckets_) {
      // A collective in flight writes (or reads) the whole bucket: count it whole.
      if (!(values ? b.gathering : b.reducing)) continue;
      const int64_t end = b.base + b.chunk * group_.size();
      for (int64_t q = b.base / pe; q < (end + pe - 1) / pe; ++q) {
        pages[static_cast<size_t>(q)] = true;
      }
    }
    int64_t n = 0;
    for (bool in : pages) n += in ? 1 : 0;
    return n * page_bytes;
  };
  m.values = count(*values_, true);
  m.gradients = count(*grads_, false);
  m.state = static_cast<int64_t>((exp_avg_.capacity() + exp_avg_sq_.capacity()) * sizeof(float));
  for (const Bucket& b : buckets_) {
    m.scratch +=
        static_cast<int64_t>((b.received.capacity() + b.staged.capacity()) * sizeof(float));
  }
  return m;
}

void ShardedAdamW::Sample() const {
  if (zero_.meter != nullptr) zero_.meter->Sample();
}

ReductionTimes ShardedAdamW::TakeReductionTimes() {
  return std::exchange(times_, ReductionTimes{});
}

void ShardedAdamW::ZeroGradients() {
  for (const Bucket& b : buckets_) {
    SY_CHECK(!b.reducing, "ZeroGradients while a reduction is in flight");
  }
  Sample();
  if (stage_ >= 2) {
    // Only the shards stay after the reductions: every page goes back and the backward takes
    // the ones it writes.
    grads_->Release(0, grads_->size());
  } else {
    // The whole gradient is held through the step anyway: zero it in place. Giving the pages
    // back would make the backward fault every one in again (a copy-on-write fault and a TLB
    // flush per page, about 15 % of the default run's step).
    std::fill_n(grads_->data(), grads_->size(), 0.0f);
  }
  for (Bucket& b : buckets_) b.reduced = false;
}

void ShardedAdamW::LaunchReduction(Bucket& b) {
  b.reducing = true;
  if (group_.size() == 1 || b.numel == 0) {
    b.reduction = comm::Work();
    return;
  }
  float* flat = grads_->data() + b.base;
  if (stage_ <= 1) {
    b.reduction = group_.AllReduce(flat, flat, static_cast<size_t>(b.numel), DType::kFloat32);
  } else {
    // The padding [numel, g c) is never written: it reads 0.
    b.received.assign(static_cast<size_t>(b.chunk), 0.0f);
    b.reduction = group_.ReduceScatter(flat, b.received.data(), static_cast<size_t>(b.chunk),
                                       DType::kFloat32);
  }
}

void ShardedAdamW::LaunchUnitReduction(int64_t unit) {
  for (Bucket& b : buckets_) {
    if (b.unit != unit || b.reducing || b.reduced) continue;
    LaunchReduction(b);
    ++times_.overlapped;
  }
}

void ShardedAdamW::FinishReduction(Bucket& b, float scale) {
  const double t0 = NowSeconds();
  b.reduction.Wait();
  times_.blocked_seconds += NowSeconds() - t0;
  Clock::time_point started, finished;
  if (b.reduction.Times(&started, &finished)) times_.reduce_seconds += Seconds(finished - started);
  ++times_.buckets;
  b.reduction = comm::Work();
  if (stage_ <= 1 || group_.size() == 1) {
    float* g = grads_->data() + b.base;
    for (int64_t j = 0; j < b.numel; ++j) g[j] = g[j] * scale;
  } else {
    const int64_t r0 = b.base + static_cast<int64_t>(group_.rank()) * b.chunk;
    float* g = grads_->data();
    for (int64_t j = b.own_begin; j < b.own_end; ++j) {
      g[j] = b.received[static_cast<size_t>(j - r0)] * scale;
    }
    Sample();
    std::vector<float>().swap(b.received);
    Release(b, /*values=*/false);
  }
  b.reducing = false;
  b.reduced = true;
}

void ShardedAdamW::FinishUnitReduction(int64_t unit, float scale) {
  for (Bucket& b : buckets_) {
    if (b.unit == unit && b.reducing) FinishReduction(b, scale);
  }
}

void ShardedAdamW::ReduceGradients(float scale) {
  for (Bucket& b : buckets_) {
    if (!b.reducing && !b.reduced) LaunchReduction(b);
  }
  for (Bucket& b : buckets_) {
    if (b.reducing) FinishReduction(b, scale);
    b.reduced = false;  // the round is complete
  }
  Sample();
}

void ShardedAdamW::Release(Bucket& b, bool values) {
  if (group_.size() == 1 && values) return;  // owns everything
  if (stage_ <= 1 && !values) return;
  PageArray& array = values ? *values_ : *grads_;
  if (zero_.poison_non_owned) {
    for (auto [begin, end] :
         {std::pair{b.base, b.own_begin}, std::pair{b.own_end, b.base + b.numel}}) {
      if (begin < end) std::fill(array.data() + begin, array.data() + end, kPoison);
    }
    return;
  }
  array.Release(b.base, b.own_begin);
  array.Release(b.own_end, b.base + b.chunk * group_.size());
}

double ShardedAdamW::OwnGradSquaredNorm() const {
  double total = 0;
  for (const Bucket& b : buckets_) {
    for (const Segment& s : Segments(b.own_begin, b.own_end)) {
      const float* g = s.param->grad.data<float>() + s.param_offset;
      double sum = 0;
      for (int64_t j = 0; j < s.length; ++j) sum += static_cast<double>(g[j]) * g[j];
      total += sum;
    }
  }
  return total;
}

void ShardedAdamW::ScaleGradients(float factor) {
  if (factor == 1.0f) return;
  for (const Bucket& b : buckets_) {
    const int64_t begin = stage_ <= 1 ? b.base : b.own_begin;
    const int64_t end = stage_ <= 1 ? b.base + b.numel : b.own_end;
    float* g = grads_->data();
    for (int64_t j = begin; j < end; ++j) g[j] *= factor;
  }
}

void ShardedAdamW::Step(float lr) {
  ++step_;
  has_state_ = true;
  for (const Bucket& b : buckets_) {
    const int64_t base = StateBegin(b);
    for (const Segment& s : Segments(base, StateEnd(b))) {
      const float wd = s.param->options.weight_decay ? options_.weight_decay : 0.0f;
      const int64_t k = b.state_offset + (s.flat_offset - base);
      AdamWUpdate(s.param->value.data<float>() + s.param_offset,
                  s.param->grad.data<float>() + s.param_offset, exp_avg_.data() + k,
                  exp_avg_sq_.data() + k, s.length, options_, lr, wd, step_);
    }
  }
  if (stage_ == 1 || stage_ == 2) {
    for (Bucket& b : buckets_) LaunchGather(b);
    for (Bucket& b : buckets_) FinishGather(b);
  } else if (stage_ == 3) {
    // Stale: their owners stepped them.
    for (Bucket& b : buckets_) {
      SY_CHECK(!b.gathering, "Step while a gather is in flight");
      Sample();
      Release(b, /*values=*/true);
      b.gathered = group_.size() == 1;
    }
  }
}

void ShardedAdamW::LaunchGather(Bucket& b) {
  if (b.gathering) return;
  b.gathering = true;
  if (group_.size() == 1 || b.numel == 0) {
    b.gather = comm::Work();
    return;
  }
  const int64_t r0 = b.base + static_cast<int64_t>(group_.rank()) * b.chunk;
  b.staged.assign(static_cast<size_t>(b.chunk), 0.0f);
  std::copy(values_->data() + b.own_begin, values_->data() + b.own_end,
            b.staged.begin() + (b.own_begin - r0));
  b.gather = group_.AllGather(b.staged.data(), values_->data() + b.base,
                              static_cast<size_t>(b.chunk), DType::kFloat32);
}

void ShardedAdamW::FinishGather(Bucket& b) {
  if (!b.gathering) return;
  b.gather.Wait();
  b.gather = comm::Work();
  std::vector<float>().swap(b.staged);
  b.gathering = false;
  b.gathered = true;
}

void ShardedAdamW::GatherParameters() {
  if (stage_ != 3) return;
  for (Bucket& b : buckets_) {
    if (!b.gathered) LaunchGather(b);
  }
  for (Bucket& b : buckets_) FinishGather(b);
}

void ShardedAdamW::ReleaseParameters() {
  if (stage_ != 3) return;
  for (Bucket& b : buckets_) {
    FinishGather(b);
    if (!b.gathered) continue;
    Sample();
    Release(b, /*values=*/true);
    b.gathered = group_.size() == 1;
  }
}

bool ShardedAdamW::HasUnit(int64_t unit) const {
  for (const Bucket& b : buckets_) {
    if (b.unit == unit) return true;
  }
  return false;
}

void ShardedAdamW::PrefetchUnit(int64_t unit) {
  if (stage_ != 3) return;
  for (Bucket& b : buckets_) {
    if (b.unit == unit && !b.gathered) LaunchGather(b);
  }
}

void ShardedAdamW::GatherUnit(int64_t unit) {
  if (stage_ != 3) return;
  PrefetchUnit(unit);
  for (Bucket& b : buckets_) {
    if (b.unit == unit) FinishGather(b);
  }
}

void ShardedAdamW::ReleaseUnit(int64_t unit) {
  if (stage_ != 3) return;
  for (Bucket& b : buckets_) {
    if (b.unit != unit) continue;
    FinishGather(b);
    if (!b.gathered) continue;
    Sample();
    Release(b, /*values=*/true);
    b.gathered = group_.size() == 1;
  }
}

TensorMap ShardedAdamW::FullState() {
  TensorMap out;
  if (!has_state_) return out;
  // Full exp_avg / exp_avg_sq over the arrays' offsets: local at stage 0 (or one rank), else
  // all-gathered per bucket as per-rank blocks [own exp_avg, padded to c | own exp_avg_sq, too].
  const int g = group_.size();
  std::vector<float> full_m(static_cast<size_t>(values_->size())), full_v(full_m.size());
  for (const Bucket& b : buckets_) {
    const size_t k = static_cast<size_t>(b.state_offset);
    if (stage_ == 0 || g == 1) {
      const size_t n = static_cast<size_t>(StateEnd(b) - StateBegin(b));
      std::copy_n(exp_avg_.begin() + static_cast<ptrdiff_t>(k), n, full_m.begin() + StateBegin(b));
      std::copy_n(exp_avg_sq_.begin() + static_cast<ptrdiff_t>(k), n,
                  full_v.begin() + StateBegin(b));
      continue;
    }
    if (b.numel == 0) continue;
    const size_t c = static_cast<size_t>(b.chunk);
    const size_t own = static_cast<size_t>(b.own_end - b.own_begin);
    std::vector<float> send(2 * c, 0.0f), recv(2 * c * static_cast<size_t>(g));
    std::copy_n(exp_avg_.begin() + static_cast<ptrdiff_t>(k), own, send.begin());
    std::copy_n(exp_avg_sq_.begin() + static_cast<ptrdiff_t>(k), own,
                send.begin() + static_cast<ptrdiff_t>(c));
    group_.AllGather(send.data(), recv.data(), 2 * c, DType::kFloat32).Wait();
    for (int q = 0; q < g; ++q) {
      const size_t begin = std::min(static_cast<size_t>(q) * c, static_cast<size_t>(b.numel));
      const size_t n = std::min(c, static_cast<size_t>(b.numel) - begin);
      const float* block = recv.data() + 2 * c * static_cast<size_t>(q);
      std::copy_n(block, n, full_m.begin() + b.base + static_cast<ptrdiff_t>(begin));
      std::copy_n(block + c, n, full_v.begin() + b.base + static_cast<ptrdiff_t>(begin));
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = *params_[i];
    Tensor tm = Tensor::Empty(p.value.shape());
    Tensor tv = Tensor::Empty(p.value.shape());
    std::copy_n(full_m.data() + offsets_[i], p.value.numel(), tm.data<float>());
    std::copy_n(full_v.data() + offsets_[i], p.value.numel(), tv.data<float>());
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
  std::vector<float> m(exp_avg_.size()), v(exp_avg_.size());
  for (const Bucket& b : buckets_) {
    const int64_t base = StateBegin(b);
    for (const Segment& s : Segments(base, StateEnd(b))) {
      const auto at = static_cast<ptrdiff_t>(b.state_offset + (s.flat_offset - base));
      std::copy_n(loaded[s.index].first.data<float>() + s.param_offset, s.length, m.begin() + at);
      std::copy_n(loaded[s.index].second.data<float>() + s.param_offset, s.length, v.begin() + at);
    }
  }
  exp_avg_ = std::move(m);
  exp_avg_sq_ = std::move(v);
  step_ = step;
  has_state_ = true;
}

}  // namespace switchyard::train
