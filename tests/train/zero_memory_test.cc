// ZeRO that frees memory and gradient reduction overlapped with the backward (zero.h,
// distributed.h): the pages the optimizer's arrays hold per stage, measured (mincore) and
// compared with what each stage keeps; overlapped reductions give the same results bit for bit
// as reductions after the backward; ZeRO-3 gathers one block at a time.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/page_array.h"
#include "switchyard/train/zero.h"
#include "train/grad_check.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

TEST(PageArrayTest, ReleasedPagesReadZeroAndLeaveMemory) {
  const int64_t pe = PageArray::PageElements();
  const int64_t page = pe * static_cast<int64_t>(sizeof(float));
  PageArray a(10 * pe);
  EXPECT_EQ(a.ResidentBytes(), 0) << "nothing is committed before it is written";
  for (int64_t i = 0; i < a.size(); ++i) a.data()[i] = 1.0f + static_cast<float>(i);
  EXPECT_EQ(a.ResidentBytes(), 10 * page);
  // Pages 2..5 wholly inside; the elements of pages 1 and 6 in the range are zeroed only.
  a.Release(pe + 7, 6 * pe + 3);
  EXPECT_EQ(a.ResidentBytes(), 6 * page);
  a.data()[3 * pe] = 5.0f;  // writing commits the page again
  EXPECT_EQ(a.ResidentBytes(), 7 * page);
  for (int64_t i = 0; i < a.size(); ++i) {
    const bool released = i >= pe + 7 && i < 6 * pe + 3 && i != 3 * pe;
    ASSERT_EQ(a.data()[i], released      ? 0.0f
                           : i == 3 * pe ? 5.0f
                                         : 1.0f + static_cast<float>(i))
        << i;
  }
  // (Reading a released page maps the system's zero page, which counts as resident.)
  a.Release(0, a.size());
  EXPECT_EQ(a.ResidentBytes(), 0);
  EXPECT_EQ(a.data()[3 * pe], 0.0f);
}

// Four buckets of 4 ranks x 2 pages each: three blocks and the parameters outside blocks, so that
// every rank's part of every bucket is exactly 2 pages and the counts are exact.
constexpr int kRanks = 4;

void Build(ParameterSet& params) {
  const int64_t n = kRanks * 2 * PageArray::PageElements();
  uint64_t seed = 1;
  for (const char* name : {"embed.weight", "blocks.0.w", "blocks.1.w", "blocks.2.w"}) {
    params.Add(name, testing::RandomTensor({n}, seed++));
  }
}

void SetGrads(ParameterSet& params, int rank, int step) {
  uint64_t k = 0;
  for (Parameter& p : params.all()) {
    p.grad.CopyFrom(testing::RandomTensor(
        p.value.shape(), 1000 + 100 * static_cast<uint64_t>(step) + 10 * k++ + rank));
  }
}

TEST(ZeroMemoryTest, EachStageKeepsWhatItShards) {
  const int64_t page = PageArray::PageElements() * static_cast<int64_t>(sizeof(float));
  const int64_t full = 4 * kRanks * 2 * page;  // bytes of all values (or all gradients)
  const int64_t own = 4 * 2 * page;            // this rank's 2 pages of each bucket
  std::vector<std::vector<float>> final_values(4);
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    std::mutex mu;
    comm::RunInProcess(kRanks, [&](comm::Communicator& group) {
      ParameterSet params;
      Build(params);
      std::vector<Parameter*> ptrs;
      for (Parameter& p : params.all()) ptrs.push_back(&p);
      MemoryMeter meter;
      ShardedAdamW zero(ptrs, group, stage, {}, {.bucket_per_block = true, .meter = &meter});
      EXPECT_EQ(zero.num_buckets(), 4);
      for (int step = 0; step < 2; ++step) {
        zero.GatherParameters();
        zero.ZeroGradients();
        // Stages 2 and 3 give every gradient page back at the step's start; 0 and 1 hold the
        // whole gradient through the step and zero it in place.
        EXPECT_EQ(zero.MemoryUse().gradients, stage >= 2 ? 0 : full);
        SetGrads(params, group.rank(), step);
        EXPECT_EQ(zero.MemoryUse().gradients, full);
        // As the hooks do: blocks in reverse order after their backward, the rest at the end.
        for (int64_t block = 2; block >= 0; --block) zero.LaunchUnitReduction(block);
        zero.ReduceGradients(1.0f / kRanks);
        const ZeroMemory after_reduce = zero.MemoryUse();
        EXPECT_EQ(after_reduce.gradients, stage >= 2 ? own : full);
        EXPECT_EQ(after_reduce.scratch, 0);
        EXPECT_EQ(after_reduce.state, stage == 0 ? 2 * full : 2 * own);
        zero.Step(0.01f);
        EXPECT_EQ(zero.MemoryUse().values, stage == 3 ? own : full);
      }
      if (stage == 3) {
        zero.GatherUnit(1);  // one block's bucket: its other ranks' 6 pages come back
        EXPECT_EQ(zero.MemoryUse().values, own + 3 * 2 * page);
        zero.ReleaseUnit(1);
        EXPECT_EQ(zero.MemoryUse().values, own);
      }
      // The peak: the training step before the first bucket was given back holds everything
      // (one reduction's receive buffer at stages 2/3, each rank's 2 pages).
      EXPECT_GE(meter.peak().total(), (stage == 0 ? 4 : 2) * full);
      zero.GatherParameters();
      std::vector<float> flat;
      for (const Parameter& p : params.all()) {
        flat.insert(flat.end(), p.value.data<float>(), p.value.data<float>() + p.value.numel());
      }
      if (group.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        final_values[static_cast<size_t>(stage)] = std::move(flat);
      }
    });
  }
  // What was given back read 0 and was never used: every stage computes the same update.
  for (int stage = 1; stage <= 3; ++stage) {
    ASSERT_EQ(final_values[static_cast<size_t>(stage)].size(), final_values[0].size());
    for (size_t i = 0; i < final_values[0].size(); ++i) {
      ASSERT_NEAR(final_values[static_cast<size_t>(stage)][i], final_values[0][i],
                  1e-6f * (1 + std::abs(final_values[0][i])))
          << "stage " << stage << " element " << i;
    }
  }
}

std::string WriteCorpus(const testing::TempDir& dir) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "the cat sat on the mat; a dog ran in the park.\n%\n";
  std::string path = dir / "corpus.txt";
  WriteTextFileAtomic(path, text);
  return path;
}

// Four blocks (two MoE), large enough that one block's pages are a fraction of the model's.
TrainConfig Config(const testing::TempDir& dir) {
  TrainConfig c;
  c.model.seq_len = 16;
  c.model.model_dim = 64;
  c.model.num_layers = 4;
  c.model.num_heads = 2;
  c.model.hidden_dim = 256;
  c.model.moe_every = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.batch_size = 8;
  c.steps = 3;
  c.warmup_steps = 1;
  c.lr = 1e-2;
  c.data = WriteCorpus(dir);
  c.out = dir / "run";
  c.threads = 1;
  c.ranks = 2;
  return c;
}

struct Outcome {
  std::vector<double> loss, grad_norm;
  TensorMap model;
  ZeroMemory peak;  // rank 0's
  ReductionTimes times;
};

Outcome RunLayout(const TrainConfig& c, int steps) {
  Outcome out;
  std::mutex mu;
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size());
    Outcome o;
    for (int s = 0; s < steps; ++s) {
      StepMetrics m = rt.trainer().Step();
      o.loss.push_back(m.loss);
      o.grad_norm.push_back(m.grad_norm);
    }
    o.peak = rt.buffer().peak_memory();
    o.times = rt.buffer().run_reduction_times();
    CheckpointData d = rt.trainer().Snapshot();
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = o;
      out.model = d.model;
    }
  });
  return out;
}

TEST(ZeroMemoryTest, BucketSizeIsCheckedAndTheOverlapIsAKey) {
  TrainConfig c;
  c.bucket_mb = -1;
  try {
    ValidateTrainConfig(c);
    ADD_FAILURE() << "a negative bucket_mb was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bucket_mb"), std::string::npos) << e.what();
  }
  TrainConfig d;
  SetTrainConfigValue(d, "overlap_grad_reduce", "false");
  SetTrainConfigValue(d, "bucket_mb", "0.5");
  EXPECT_FALSE(d.overlap_grad_reduce);
  EXPECT_EQ(d.bucket_mb, 0.5);
  EXPECT_TRUE(IsLayoutKey("overlap_grad_reduce"));
  EXPECT_TRUE(IsLayoutKey("bucket_mb"));
}

TEST(ZeroMemoryTest, OverlappedReductionGivesTheSameRunBitForBit) {
  testing::TempDir dir;
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TrainConfig c = Config(dir);
    c.zero_stage = stage;
    c.bucket_mb = 0.05;  // several buckets per block
    c.overlap_grad_reduce = false;
    const Outcome off = RunLayout(c, 3);
    c.overlap_grad_reduce = true;
    const Outcome on = RunLayout(c, 3);
    EXPECT_EQ(on.loss, off.loss);
    EXPECT_EQ(on.grad_norm, off.grad_norm);
    ASSERT_EQ(on.model.size(), off.model.size());
    for (const auto& [name, t] : off.model) {
      const Tensor& u = on.model.at(name);
      ASSERT_EQ(u.shape(), t.shape()) << name;
      EXPECT_EQ(std::memcmp(u.raw(), t.raw(), t.nbytes()), 0) << name;
    }
    // Off: every bucket after the backward; on: the blocks' buckets during it (only the
    // parameters outside blocks wait for the end).
    EXPECT_EQ(off.times.overlapped, 0);
    EXPECT_GT(on.times.overlapped, 0);
    EXPECT_LT(on.times.overlapped, on.times.buckets);
    EXPECT_EQ(on.times.buckets, off.times.buckets);
    EXPECT_GT(on.times.buckets, 3 * (c.model.num_layers + 1)) << "several buckets per block";
  }
}

TEST(ZeroMemoryTest, PeakPerRankFallsWithTheStage) {
  testing::TempDir dir;
  std::vector<ZeroMemory> peak(4);
  for (int stage = 0; stage <= 3; ++stage) {
    TrainConfig c = Config(dir);
    c.ranks = 4;
    c.ep = 4;
    c.zero_stage = stage;
    peak[static_cast<size_t>(stage)] = RunLayout(c, 2).peak;
  }
  for (int stage = 0; stage <= 3; ++stage) {
    const ZeroMemory& p = peak[static_cast<size_t>(stage)];
    RecordProperty("stage" + std::to_string(stage) + "_peak_bytes", std::to_string(p.total()));
  }
  // Stage 1 shards the state; stage 2 also gives back the gradients of each reduced block
  // during the backward; stage 3 also the values of every block not running.
  EXPECT_LT(static_cast<double>(peak[1].state), 0.6 * static_cast<double>(peak[0].state));
  EXPECT_EQ(peak[1].values, peak[0].values);
  EXPECT_LT(peak[2].gradients, peak[1].gradients);
  EXPECT_EQ(peak[2].values, peak[1].values);
  EXPECT_LT(peak[3].values, peak[2].values);
  EXPECT_LT(peak[3].total(), peak[2].total());
  EXPECT_LT(peak[2].total(), peak[1].total());
  EXPECT_LT(peak[1].total(), peak[0].total());
}

// Forwards to the hooks and, right after they prepared block `i`, checks which blocks' values are
// there: with poison_non_owned, what a rank gave back is NaN.
class CheckingObserver : public BlockObserver {
 public:
  CheckingObserver(BlockObserver* hooks, ParameterSet* params, int64_t blocks)
      : hooks_(hooks), params_(params), blocks_(blocks) {}

  void BeforeBlock(int64_t block, bool backward) override {
    hooks_->BeforeBlock(block, backward);
    ++calls;
    for (int64_t j = 0; j < blocks_; ++j) {
      if (j == block - 1 || j == block + 1) continue;  // a prefetch may be writing them
      const int64_t nan = NaNs(j);
      if (j == block) {
        EXPECT_EQ(nan, 0) << "block " << block << (backward ? " backward" : " forward")
                          << ": its values must be gathered";
      } else {
        EXPECT_GT(nan, 0) << "block " << j << " during block " << block
                          << (backward ? " backward" : " forward") << ": must be given back";
      }
    }
  }
  void AfterBlock(int64_t block, bool backward) override { hooks_->AfterBlock(block, backward); }

  int64_t calls = 0;

 private:
  int64_t NaNs(int64_t block) const {
    const std::string prefix = "blocks." + std::to_string(block) + ".";
    int64_t n = 0;
    for (const Parameter& p : params_->all()) {
      if (!p.options.trainable || p.options.group != ParamGroup::kDense ||
          !p.name.starts_with(prefix)) {
        continue;
      }
      const float* v = p.value.data<float>();
      for (int64_t k = 0; k < p.value.numel(); ++k) n += std::isnan(v[k]) ? 1 : 0;
    }
    return n;
  }

  BlockObserver* hooks_;
  ParameterSet* params_;
  int64_t blocks_;
};

TEST(ZeroMemoryTest, Stage3GathersEachBlockJustBeforeItRuns) {
  testing::TempDir dir;
  TrainConfig c = Config(dir);
  c.zero_stage = 3;
  std::vector<double> losses[2];
  for (int ranks : {1, 2}) {
    c.ranks = ranks;
    std::mutex mu;
    comm::RunInProcess(ranks, [&](comm::Communicator& world) {
      RankTrainer rt(c, world, world.size(), ZeroOptions{.poison_non_owned = true});
      TransformerLm& model = rt.trainer().model();
      CheckingObserver check(&rt.buffer(), &model.parameters(), c.model.num_layers);
      if (ranks > 1) model.SetBlockObserver(&check);
      std::vector<double> mine;
      for (int s = 0; s < 2; ++s) mine.push_back(rt.trainer().Step().loss);
      if (ranks > 1) {
        EXPECT_EQ(check.calls, 2 * 2 * c.model.num_layers);  // forward + backward
      }
      std::lock_guard<std::mutex> lock(mu);
      if (world.rank() == 0) losses[ranks - 1] = mine;
    });
  }
  // The checks did not change the run: it still equals one rank.
  ASSERT_EQ(losses[1].size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_NEAR(losses[1][s], losses[0][s], 2e-5 * losses[0][s]);
}

}  // namespace
}  // namespace switchyard::train
