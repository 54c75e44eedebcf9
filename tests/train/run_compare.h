// A few optimizer steps on one rank or on in-process ranks, recorded the same way, and the
// comparison the layout tests make between them (losses, gradient norms and expert loads per
// step, and the final parameters, up to float summation order).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/trainer.h"
#include "switchyard/train/zero.h"

namespace switchyard::train::testing {

struct RunRecord {
  // Per step; drop_rate and expert_load are the first MoE block's, loads every block's.
  std::vector<double> loss, grad_norm, drop_rate, aux_loss, z_loss;
  std::vector<std::vector<int64_t>> expert_load;
  std::vector<std::vector<std::vector<int64_t>>> loads;
  TensorMap model;  // full values after the last step (layout-independent form)
  // Rank 0's model: its tensor-parallel size and the shape of a weight it holds (a shard with tp).
  int tp_size = 1;
  Shape fc1_shape;
  double tp_bytes = 0;  // bytes the tensor-parallel layers moved over the run (rank mean)
  double cp_bytes = 0;  // bytes the context-parallel attention moved over the run (rank mean)

  void Add(const StepMetrics& m) {
    loss.push_back(m.loss);
    grad_norm.push_back(m.grad_norm);
    drop_rate.push_back(m.drop_rate.empty() ? 0.0 : m.drop_rate[0]);
    aux_loss.push_back(m.aux_loss);
    z_loss.push_back(m.z_loss);
    expert_load.push_back(m.expert_load.empty() ? std::vector<int64_t>{} : m.expert_load[0]);
    loads.push_back(m.expert_load);
    tp_bytes += m.tp_bytes;
    cp_bytes += m.cp_bytes;
  }
};

// `steps` steps of the single-rank trainer.
inline RunRecord SingleRank(const TrainConfig& c, int steps) {
  Trainer t(c);
  RunRecord r;
  for (int s = 0; s < steps; ++s) r.Add(t.Step());
  r.model = t.model().parameters().Values();
  return r;
}

// `steps` steps on c.ranks in-process ranks; rank 0's record. `zero` are ShardedAdamW's checking
// options (poison_non_owned: values and gradients that stop being valid on a rank become NaN, so
// a stale read would show).
inline RunRecord OnRanks(const TrainConfig& c, int steps, const ZeroOptions& zero = {}) {
  RunRecord result;
  std::mutex mu;
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size(), zero);
    RunRecord r;
    for (int s = 0; s < steps; ++s) r.Add(rt.trainer().Step());
    TransformerLm& model = rt.trainer().model();
    r.tp_size = model.tp_size();
    if (const Parameter* fc1 = model.parameters().Find("blocks.0.mlp.fc1.weight")) {
      r.fc1_shape = fc1->value.shape();
    }
    CheckpointData d = rt.trainer().Snapshot();
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result = r;
      result.model = d.model;
    }
  });
  return result;
}

// The same run up to float summation order: losses (2e-5 relative), gradient norms (1e-4), the
// first MoE block's expert loads exactly, and every parameter within 2e-3 (relative, 1e-3 floor).
inline void ExpectSameRun(const RunRecord& want, const RunRecord& got, const std::string& what) {
  ASSERT_EQ(want.loss.size(), got.loss.size()) << what;
  for (size_t s = 0; s < want.loss.size(); ++s) {
    EXPECT_NEAR(got.loss[s], want.loss[s], 2e-5 * std::abs(want.loss[s])) << what << " step " << s;
    EXPECT_NEAR(got.grad_norm[s], want.grad_norm[s], 1e-4 * want.grad_norm[s])
        << what << " step " << s;
    EXPECT_EQ(got.expert_load[s], want.expert_load[s]) << what << " step " << s;
  }
  ASSERT_EQ(want.model.size(), got.model.size()) << what;
  for (const auto& [name, w] : want.model) {
    auto it = got.model.find(name);
    ASSERT_NE(it, got.model.end()) << what << ": " << name;
    ASSERT_EQ(it->second.shape(), w.shape()) << what << ": " << name;
    const float* a = w.data<float>();
    const float* b = it->second.data<float>();
    double worst = 0;
    for (int64_t i = 0; i < w.numel(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])) /
                                  (1e-3 + std::abs(static_cast<double>(a[i]))));
    }
    EXPECT_LT(worst, 2e-3) << what << ": " << name;
  }
}

}  // namespace switchyard::train::testing
