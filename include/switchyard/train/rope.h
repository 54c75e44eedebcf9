// Rotary position embeddings (RoPE, Su et al. 2021) in the non-interleaved "rotate half" form of
// Hugging Face's Llama/Mixtral/Qwen2/OLMoE code, over the full head dimension:
//   inv_freq[i] = 1 / theta^(2i / head_dim),  angle = position * inv_freq[i],  i < head_dim / 2
//   y[i]              = x[i] cos(angle) - x[i + head_dim/2] sin(angle)
//   y[i + head_dim/2] = x[i + head_dim/2] cos(angle) + x[i] sin(angle)
// for every head of every token. Positions are given per token, so a context-parallel rank passes
// the global positions of the tokens it holds (SequenceSplit::Positions) and rotates exactly as
// the single rank does. The angles are computed in float32 as Hugging Face computes them
// (inv_freq in float32, position * inv_freq in float32, cos/sin of that).
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard::train {

// x [num_tokens, num_heads * head_dim] float32, positions [num_tokens] (>= 0), head_dim even and
// dividing x's columns -> y of x's shape. InvalidArgument naming the argument otherwise.
Tensor RopeForward(const Tensor& x, std::span<const int64_t> positions, int64_t head_dim,
                   double theta, int threads = 1);

// The adjoint (the rotation by -angle): dx from dy [num_tokens, num_heads * head_dim].
Tensor RopeBackward(const Tensor& dy, std::span<const int64_t> positions, int64_t head_dim,
                    double theta, int threads = 1);

// Positions 0 .. seq_len - 1 repeated for each of batch_size sequences ([batch_size * seq_len]).
std::vector<int64_t> SequencePositions(int64_t batch_size, int64_t seq_len);

}  // namespace switchyard::train
