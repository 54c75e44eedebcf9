#include "switchyard/train/param_grad_buffer.h"

#include <cmath>
#include <utility>

#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/train/tensor_parallel.h"
#include "switchyard/train/trainer.h"
#include "train/step_trace.h"

namespace switchyard::train {

ParamGradBuffer::ParamGradBuffer(std::shared_ptr<parallel::ProcessGroups> groups, int zero_stage,
                                 const ZeroOptions& zero, parallel::GroupKind expert_sync)
    : groups_(std::move(groups)),
      world_(groups_->world()),
      mesh_(groups_->mesh()),
      zero_stage_(zero_stage),
      zero_options_(zero),
      // The replicas of a tensor-parallel shard: the same tp rank over dp and cp (each cp rank
      // holds other tokens; with cp 1 the data-parallel group).
      data_(groups_->Get(parallel::GroupKind::kDataContext)),
      tokens_(groups_->Get(parallel::GroupKind::kTokens)),
      expert_data_(groups_->Get(expert_sync)) {
  SY_REQUIRE(zero_stage >= 0 && zero_stage <= 3, InvalidArgument,
             "config: 'zero_stage' must be 0, 1, 2 or 3, got {}", zero_stage);
  SY_REQUIRE(expert_sync == parallel::GroupKind::kExpertData ||
                 expert_sync == parallel::GroupKind::kExpertHolders,
             InvalidArgument, "ParamGradBuffer: experts synchronize over ep_dp or expert_holders");
}

ParamGradBuffer::~ParamGradBuffer() = default;

void ParamGradBuffer::SetTiedEmbedding(bool tied_embedding) {
  tied_embedding_ = tied_embedding && mesh_.pp() > 1;
}

TensorMap ParamGradBuffer::FullState() {
  if (!dense_opt_ || dense_opt_->step() == 0) return {};
  TensorMap state = dense_opt_->FullState();
  for (auto& [name, t] : split_opt_->FullState()) state[name] = t;
  for (auto& [name, t] : expert_opt_->FullState()) state[name] = t;
  return state;
}

void ParamGradBuffer::LoadFullState(const TensorMap& state, int64_t step) {
  copy_opt_->LoadFullState(state, step);
  split_opt_->LoadFullState(state, step);
  dense_opt_->LoadFullState(state, step);
  expert_opt_->LoadFullState(state, step);
}

int64_t ParamGradBuffer::optimizer_state_elements() const {
  int64_t n = 0;
  for (const auto* o : {split_opt_.get(), dense_opt_.get(), expert_opt_.get()}) {
    n += o != nullptr ? o->state_elements() : 0;
  }
  return n;
}

void ParamGradBuffer::Prepare(ParameterSet& params, const AdamW& optimizer) {
  if (dense_opt_) return;
  std::vector<Parameter*> split, dense, experts, copies;
  for (Parameter& p : params.all()) {
    if (!p.options.trainable) continue;
    if (p.tied_copy) {
      copies.push_back(&p);
    } else if (p.options.group == ParamGroup::kExpert) {
      experts.push_back(&p);
    } else {
      (p.tp_shard.split() ? split : dense).push_back(&p);
    }
  }
  auto count = [](const std::vector<Parameter*>& ps) {
    int64_t n = 0;
    for (const Parameter* p : ps) n += p->value.numel();
    return n;
  };
  for (const auto* list : {&split, &dense, &experts, &copies}) {
    for (Parameter* p : *list) owned_by_optimizer_.insert(p);
  }
  split_elements_ = count(split);
  dense_elements_ = count(dense);
  expert_elements_ = count(experts);
  ZeroOptions zero = zero_options_;
  zero.bucket_per_block = true;
  zero.meter = &meter_;
  // A tied copy is reduced like the parameter it copies (a tensor-parallel shard or not).
  SY_CHECK(copies.size() <= 1, "more than one tied copy");
  copy_opt_ = std::make_unique<ShardedAdamW>(
      copies, !copies.empty() && copies[0]->tp_shard.split() ? data_ : tokens_, zero_stage_,
      optimizer.options(), zero);
  split_opt_ = std::make_unique<ShardedAdamW>(split, data_, zero_stage_, optimizer.options(), zero);
  dense_opt_ =
      std::make_unique<ShardedAdamW>(dense, tokens_, zero_stage_, optimizer.options(), zero);
  expert_opt_ =
      std::make_unique<ShardedAdamW>(experts, expert_data_, zero_stage_, optimizer.options(), zero);
}

std::vector<ShardedAdamW*> ParamGradBuffer::Optimizers() const {
  if (!dense_opt_) return {};
  return {copy_opt_.get(), split_opt_.get(), dense_opt_.get(), expert_opt_.get()};
}

void ParamGradBuffer::BeginStep(ParameterSet& params) {
  SY_CHECK(dense_opt_ != nullptr, "ParamGradBuffer: Prepare() was not called");
  in_step_ = true;
  last_microbatch_ = true;
  ++steps_;
  if (zero_stage_ == 3) {
    // The blocks are gathered one at a time by BeforeBlock; the rest for the whole step.
    for (ShardedAdamW* o : Optimizers()) o->ReleaseParameters();
    const internal::StepTrace::Span span(trace_, "parameter all-gather", "sync",
                                         parallel::TraceStream::kComm);
    for (ShardedAdamW* o : Optimizers()) o->PrefetchUnit(-1);
    for (ShardedAdamW* o : Optimizers()) o->GatherUnit(-1);
    gathered_ = false;
  }
  for (ShardedAdamW* o : Optimizers()) o->ZeroGradients();
  if (steps_ == 1) {
    // The peak is that of the training steps: the model was built with every value on every
    // rank and the gradients committed; from here on each stage holds what it keeps.
    meter_.Reset();
    meter_.Sample();
  }
  // Trainable parameters outside the optimizers (none today) still start from zero.
  for (Parameter& p : params.all()) {
    if (p.options.trainable && p.grad.defined() && p.grad.numel() > 0 &&
        !owned_by_optimizer_.contains(&p)) {
      p.grad.SetZero();
    }
  }
}

void ParamGradBuffer::BeforeBlock(int64_t block, bool backward) {
  if (!in_step_ || zero_stage_ != 3) return;
  {
    const internal::StepTrace::Span span(trace_, "block parameter all-gather", "sync",
                                         parallel::TraceStream::kComm);
    for (ShardedAdamW* o : Optimizers()) o->PrefetchUnit(block);
    for (ShardedAdamW* o : Optimizers()) o->GatherUnit(block);
  }
  // The block that runs next on this rank (one pipeline stage: every block is this rank's).
  const int64_t next = backward ? block - 1 : block + 1;
  if (mesh_.pp() == 1) {
    for (ShardedAdamW* o : Optimizers()) {
      if (o->HasUnit(next)) o->PrefetchUnit(next);
    }
  }
}

void ParamGradBuffer::AfterBlock(int64_t block, bool backward) {
  if (!in_step_) return;
  if (zero_stage_ == 3) {
    for (ShardedAdamW* o : Optimizers()) o->ReleaseUnit(block);
  }
  if (backward && overlap_ && last_microbatch_ && mesh_.pp() == 1) {
    for (ShardedAdamW* o : Optimizers()) o->LaunchUnitReduction(block);
    const float inv = 1.0f / static_cast<float>(mesh_.dp() * mesh_.cp());
    for (ShardedAdamW* o : Optimizers()) o->FinishUnitReduction(block + 1, inv);
  }
}

ReductionTimes ParamGradBuffer::TakeReductionTimes() {
  ReductionTimes sum;
  for (ShardedAdamW* o : Optimizers()) {
    ReductionTimes t = o->TakeReductionTimes();
    sum.reduce_seconds += t.reduce_seconds;
    sum.blocked_seconds += t.blocked_seconds;
    sum.buckets += t.buckets;
    sum.overlapped += t.overlapped;
  }
  return sum;
}

int64_t ParamGradBuffer::FormulaBytes() const {
  int64_t bytes = 0;
  for (ShardedAdamW* o : Optimizers()) {
    const int64_t n = o->num_elements(), own = o->owned_elements();
    bytes += 4 * (zero_stage_ >= 3 ? own : n);  // parameters
    bytes += 4 * (zero_stage_ >= 2 ? own : n);  // gradients
    bytes += 8 * (zero_stage_ >= 1 ? own : n);  // exp_avg, exp_avg_sq
  }
  return bytes;
}

void ParamGradBuffer::FillSummary(RunSummary* summary) {
  const ReductionTimes t = TakeReductionTimes();
  run_times_.reduce_seconds += t.reduce_seconds;
  run_times_.blocked_seconds += t.blocked_seconds;
  run_times_.buckets += t.buckets;
  run_times_.overlapped += t.overlapped;
  // Per rank: the peak and its parts, the formula, the reduction times (one-hot rows, summed).
  const ZeroMemory& peak = meter_.peak();
  constexpr size_t kRow = 8;
  const size_t w = static_cast<size_t>(world_.size());
  std::vector<double> rows(kRow * w, 0.0);
  double* mine = rows.data() + kRow * static_cast<size_t>(world_.rank());
  mine[0] = static_cast<double>(peak.total());
  mine[1] = static_cast<double>(peak.values);
  mine[2] = static_cast<double>(peak.gradients);
  mine[3] = static_cast<double>(peak.state);
  mine[4] = static_cast<double>(peak.scratch);
  mine[5] = static_cast<double>(FormulaBytes());
  mine[6] = run_times_.reduce_seconds;
  mine[7] = run_times_.blocked_seconds;
  AllReduceSum(rows);
  size_t top = 0;
  double reduce = 0, blocked = 0;
  for (size_t q = 0; q < w; ++q) {
    if (rows[kRow * q] > rows[kRow * top]) top = q;
    reduce += rows[kRow * q + 6];
    blocked += rows[kRow * q + 7];
  }
  const double* r = rows.data() + kRow * top;
  summary->zero_peak_bytes = static_cast<int64_t>(r[0]);
  summary->zero_peak_values = static_cast<int64_t>(r[1]);
  summary->zero_peak_gradients = static_cast<int64_t>(r[2]);
  summary->zero_peak_state = static_cast<int64_t>(r[3]);
  summary->zero_peak_scratch = static_cast<int64_t>(r[4]);
  summary->zero_formula_bytes = static_cast<int64_t>(r[5]);
  if (steps_ > 0) {
    const double per = static_cast<double>(w) * static_cast<double>(steps_);
    summary->grad_reduce_s = reduce / per;
    summary->grad_reduce_blocked_s = blocked / per;
  }
}

void ParamGradBuffer::ReduceGradients(ParameterSet& params) {
  SY_CHECK(dense_opt_ != nullptr, "ParamGradBuffer: Prepare() was not called");
  if (trace_) {
    trace_->Add("forward + backward", "step", parallel::TraceStream::kCompute,
                trace_->step_begin_s(), NowSeconds());
  }
  const internal::StepTrace::Span span(trace_, "gradient reduce", "sync",
                                       parallel::TraceStream::kComm);
  // Every rank's gradients are those of its data shard's mean loss (the MoE blocks scale theirs
  // alike): summed over the holders of the same values, divided by the number of data shards.
  const float inv = 1.0f / static_cast<float>(mesh_.dp() * mesh_.cp());
  if (tied_embedding_ && groups_->Has(parallel::GroupKind::kEmbedding)) {
    // The first stage's embedding and the last stage's copy: each gets the sum of both.
    Parameter* tied = nullptr;
    for (Parameter& p : params.all()) tied = p.name == "embed.weight" ? &p : tied;
    SY_CHECK(tied != nullptr, "a stage of the embedding group holds no embed.weight");
    AllReduceTensor(groups_->Get(parallel::GroupKind::kEmbedding), tied->grad);
  }
  copy_opt_->ReduceGradients(inv);
  split_opt_->ReduceGradients(inv);
  dense_opt_->ReduceGradients(inv);
  expert_opt_->ReduceGradients(inv);
}

// A group kind with G groups whose members share out D distinct sets of values holds G / D copies
// of each element (within a group, each rank owns its range of the set).
// Pipeline stages hold distinct values (the tied copy is left out of counts and norms).
double ParamGradBuffer::CopiesSplit() const {
  return static_cast<double>(world_.size()) / data_.size() / mesh_.tp() / mesh_.pp();
}
double ParamGradBuffer::CopiesDense() const {
  return static_cast<double>(world_.size()) / tokens_.size() / mesh_.pp();
}
double ParamGradBuffer::CopiesExperts() const {
  return static_cast<double>(world_.size()) / expert_data_.size() / mesh_.expert_group_size() /
         mesh_.pp();
}

double ParamGradBuffer::GradSquaredNorm() {
  const internal::StepTrace::Span span(trace_, "gradient norm", "sync",
                                       parallel::TraceStream::kComm);
  // Each rank's own ranges, weighted so that every distinct element counts once over the world.
  double own[1] = {split_opt_->OwnGradSquaredNorm() / CopiesSplit() +
                   dense_opt_->OwnGradSquaredNorm() / CopiesDense() +
                   expert_opt_->OwnGradSquaredNorm() / CopiesExperts()};
  AllReduceSum(own);
  return own[0];
}

int64_t ParamGradBuffer::ModelParameterCount() {
  // Every rank holds each of its sets whole: a set is held by (group size x copies) ranks.
  double share[1] = {static_cast<double>(split_elements_) / (CopiesSplit() * data_.size()) +
                     static_cast<double>(dense_elements_) / (CopiesDense() * tokens_.size()) +
                     static_cast<double>(expert_elements_) /
                         (CopiesExperts() * expert_data_.size())};
  AllReduceSum(share);
  return static_cast<int64_t>(std::llround(share[0]));
}

void ParamGradBuffer::ScaleGradients(float factor) {
  if (factor == 1.0f) return;
  copy_opt_->ScaleGradients(factor);
  split_opt_->ScaleGradients(factor);
  dense_opt_->ScaleGradients(factor);
  expert_opt_->ScaleGradients(factor);
}

void ParamGradBuffer::Step(float lr) {
  const internal::StepTrace::Span span(trace_, "optimizer step", "optimizer",
                                       parallel::TraceStream::kCompute);
  copy_opt_->Step(lr);
  split_opt_->Step(lr);
  dense_opt_->Step(lr);
  expert_opt_->Step(lr);
  gathered_ = zero_stage_ < 3;
}

int64_t ParamGradBuffer::StepCount(const AdamW& optimizer) const {
  return dense_opt_ ? dense_opt_->step() : optimizer.step();
}

void ParamGradBuffer::GatherParameters() {
  if (gathered_) return;
  const internal::StepTrace::Span span(trace_, "parameter all-gather", "sync",
                                       parallel::TraceStream::kComm);
  copy_opt_->GatherParameters();
  split_opt_->GatherParameters();
  dense_opt_->GatherParameters();
  expert_opt_->GatherParameters();
  gathered_ = true;
}

void ParamGradBuffer::ReleaseParameters() {
  in_step_ = false;
  const ReductionTimes t = TakeReductionTimes();
  run_times_.reduce_seconds += t.reduce_seconds;
  run_times_.blocked_seconds += t.blocked_seconds;
  run_times_.buckets += t.buckets;
  run_times_.overlapped += t.overlapped;
  if (zero_stage_ < 3) return;
  copy_opt_->ReleaseParameters();
  split_opt_->ReleaseParameters();
  dense_opt_->ReleaseParameters();
  expert_opt_->ReleaseParameters();
  gathered_ = false;
}

void ParamGradBuffer::AllReduceSum(std::span<double> values) {
  // The transports reduce float32/bfloat16/int32/int64, not float64: all-gather the doubles'
  // bits and add them up in rank order, which also gives every rank the same bits.
  const size_t n = values.size();
  if (n == 0) return;
  std::vector<double> all(n * static_cast<size_t>(world_.size()));
  world_.AllGather(values.data(), all.data(), n, DType::kInt64).Wait();
  for (size_t i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < world_.size(); ++r) s += all[static_cast<size_t>(r) * n + i];
    values[i] = s;
  }
}

}  // namespace switchyard::train
