// The small corpus and MoE model the training tests share: runs of a few steps on in-process
// ranks compared with one rank.
#pragma once

#include <string>

#include "switchyard/core/file_util.h"
#include "switchyard/train/config.h"
#include "train/temp_dir.h"

namespace switchyard::train::testing {

// Four sentences as fortune records, 200 times, in <dir>/corpus.txt; returns the path.
inline std::string WriteTinyCorpus(const TempDir& dir) {
  std::string text;
  const char* words[] = {"the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
                         "we like to read books"};
  for (int i = 0; i < 200; ++i) text += std::string(words[i % 4]) + ".\n%\n";
  std::string path = dir / "corpus.txt";
  WriteTextFileAtomic(path, text);
  return path;
}

// Two blocks, the second an MoE block with 4 experts and drops (capacity factor 1.0), gate noise
// off (the default) and the aux and z losses on, so that routing, drops and both loss terms take
// part in the comparison; one rank, one compute thread.
inline TrainConfig TinyMoeConfig(const TempDir& dir) {
  TrainConfig c;
  c.model.seq_len = 16;
  c.model.model_dim = 32;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.hidden_dim = 48;
  c.model.moe_every = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.capacity_factor = 1.0;
  c.aux_loss_coef = 0.05;
  c.z_loss_coef = 0.01;
  c.batch_size = 8;
  c.steps = 10;
  c.warmup_steps = 1;
  c.lr = 1e-2;
  c.grad_clip = 0.5;  // clipping active: the global norm must count each gradient once
  // The attention key bias has an exactly zero gradient (softmax ignores a per-query constant),
  // so what it gets is rounding noise (~1e-9) that depends on summation order, and Adam's
  // m / sqrt(v) would turn that noise into full-size steps. An epsilon well above the noise keeps
  // the comparison about the computation, not about amplified rounding.
  c.adam_eps = 1e-5;
  c.data = WriteTinyCorpus(dir);
  c.out = dir / "run";
  c.threads = 1;
  c.ranks = 1;
  return c;
}

}  // namespace switchyard::train::testing
