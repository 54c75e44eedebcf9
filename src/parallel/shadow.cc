#include "parallel/shadow.h"

#include <fmt/format.h>

#include <cstring>

#include "parallel/collectives.h"
#include "parallel/trace_context.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel::internal {
namespace {

// The present tensors of an expert-weights struct, in packing order.
std::vector<const Tensor*> Parts(const moe::ExpertWeights& w) {
  std::vector<const Tensor*> out;
  for (const Tensor* t : {&w.fc1_weight, &w.fc1_bias, &w.fc2_weight, &w.fc2_bias, &w.fc3_weight}) {
    if (t->defined()) out.push_back(t);
  }
  return out;
}

// Elements of one expert's slice of t [G, ...].
int64_t PerExpert(const Tensor& t) { return t.size(0) == 0 ? 0 : t.numel() / t.size(0); }

// Copies expert `index` of every part of w into `packed` (to = true) or back (to = false).
void PackExpert(const moe::ExpertWeights& w, int64_t index, float* packed, bool to) {
  int64_t at = 0;
  for (const Tensor* t : Parts(w)) {
    const int64_t n = PerExpert(*t);
    float* slice = t->data<float>() + index * n;
    if (to) {
      std::memcpy(packed + at, slice, static_cast<size_t>(n) * sizeof(float));
    } else {
      std::memcpy(slice, packed + at, static_cast<size_t>(n) * sizeof(float));
    }
    at += n;
  }
}

void AddExpert(const moe::ExpertWeights& w, int64_t index, const float* packed) {
  int64_t at = 0;
  for (const Tensor* t : Parts(w)) {
    const int64_t n = PerExpert(*t);
    float* slice = t->data<float>() + index * n;
    for (int64_t i = 0; i < n; ++i) slice[i] += packed[at + i];
    at += n;
  }
}

Tensor LikeFor(const Tensor& t, int64_t experts) {
  if (!t.defined()) return Tensor();
  Shape s = t.shape();
  s[0] = experts;
  return Tensor::Empty(s);
}

}  // namespace

ShadowExperts::ShadowExperts(comm::Communicator& group, std::vector<int64_t> experts,
                             int64_t local_experts, const moe::ExpertWeights& local)
    : group_(group), experts_(std::move(experts)), local_experts_(local_experts), local_(local) {
  SY_CHECK(local.fc1_weight.size(0) == local_experts);
  for (const Tensor* t : Parts(local)) packed_ += PerExpert(*t);
  const auto s = static_cast<int64_t>(experts_.size());
  weights_.fc1_weight = LikeFor(local.fc1_weight, s);
  weights_.fc1_bias = LikeFor(local.fc1_bias, s);
  weights_.fc2_weight = LikeFor(local.fc2_weight, s);
  weights_.fc2_bias = LikeFor(local.fc2_bias, s);
  weights_.fc3_weight = LikeFor(local.fc3_weight, s);
}

ShadowExperts::~ShadowExperts() {
  for (Pending& p : pending_) {
    try {
      p.work.Wait();
    } catch (...) {  // an error is already being reported elsewhere
    }
  }
}

std::vector<char> ShadowExperts::Mask(int64_t num_experts) const {
  std::vector<char> mask(static_cast<size_t>(num_experts), 0);
  for (int64_t e : experts_) mask[static_cast<size_t>(e)] = 1;
  return mask;
}

void ShadowExperts::StartBroadcast() {
  packed_params_.clear();
  pending_.clear();
  for (int64_t e : experts_) {
    const int owner = static_cast<int>(e / local_experts_);
    Tensor buf = Tensor::Empty({packed_});
    if (owner == group_.rank()) PackExpert(local_, e % local_experts_, buf.data<float>(), true);
    comm::BroadcastOptions o;
    o.root = owner;
    pending_.push_back({group_.Broadcast(buf, o), NowSeconds()});
    packed_params_.push_back(buf);
  }
}

void ShadowExperts::FinishBroadcast(CommStats* stats) {
  for (size_t j = 0; j < pending_.size(); ++j) {
    const double t0 = NowSeconds();
    pending_[j].work.Wait();
    AccountWork(Tracing() ? fmt::format("broadcast e{}", experts_[j]) : std::string(),
                pending_[j].work, stats, Traffic::kWeights,
                static_cast<double>(packed_params_[j].nbytes()), pending_[j].issued, t0,
                NowSeconds());
    PackExpert(weights_, static_cast<int64_t>(j), packed_params_[j].data<float>(), false);
  }
  pending_.clear();
  packed_params_.clear();
}

moe::ExpertGroups ShadowExperts::Groups(const moe::DispatchPlan& plan) const {
  moe::ExpertGroups g;
  for (int64_t e : experts_) {
    g.begin.push_back(plan.offsets[static_cast<size_t>(e)]);
    g.rows.push_back(plan.counts[static_cast<size_t>(e)]);
  }
  return g;
}

void ShadowExperts::StartReduce(const moe::ExpertWeights& grads) {
  packed_grads_.clear();
  reduced_.clear();
  pending_.clear();
  for (size_t j = 0; j < experts_.size(); ++j) {
    const int owner = static_cast<int>(experts_[j] / local_experts_);
    Tensor buf = Tensor::Empty({packed_});
    PackExpert(grads, static_cast<int64_t>(j), buf.data<float>(), true);
    Tensor out = owner == group_.rank() ? Tensor::Empty({packed_}) : Tensor();
    comm::ReduceOptions o;
    o.root = owner;
    pending_.push_back(
        {group_.Reduce(buf.data<float>(), out.defined() ? out.data<float>() : nullptr,
                       static_cast<size_t>(packed_), DType::kFloat32, o),
         NowSeconds()});
    packed_grads_.push_back(buf);
    reduced_.push_back(out);
  }
}

void ShadowExperts::FinishReduce(moe::ExpertWeights* local_grads, CommStats* stats) {
  for (size_t j = 0; j < pending_.size(); ++j) {
    const double t0 = NowSeconds();
    pending_[j].work.Wait();
    AccountWork(Tracing() ? fmt::format("reduce e{}", experts_[j]) : std::string(),
                pending_[j].work, stats, Traffic::kWeights,
                static_cast<double>(packed_grads_[j].nbytes()), pending_[j].issued, t0,
                NowSeconds());
    if (reduced_[j].defined()) {
      AddExpert(*local_grads, experts_[j] % local_experts_, reduced_[j].data<float>());
    }
  }
  pending_.clear();
  packed_grads_.clear();
  reduced_.clear();
}

}  // namespace switchyard::parallel::internal
