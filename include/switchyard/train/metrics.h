// The run directory's records: one JSON object per line in metrics.jsonl per logged step, and
// the two figures drawn from them (loss.svg, expert_load.svg).
//
// A metrics line: {"step": 100, "loss": 2.1, "ce_loss": 2.09, "aux_loss": 1.01, "z_loss": 0,
// "lr": 0.003, "grad_norm": 0.8, "tokens_per_s": 21000, "step_time_s": 0.1, "val_ce_loss": 2.2,
// "expert_load": [[tokens per expert] per MoE layer], "drop_rate": [per MoE layer]}.
// `loss` is the training objective (cross-entropy plus the MoE loss terms), `ce_loss` and
// `val_ce_loss` are cross-entropies (train, held-out) in nats per token; "perplexity",
// "bits_per_byte", "val_perplexity" and "val_bits_per_byte" restate them (bits per byte: per
// UTF-8 byte of the text, so that runs with different tokenizers compare). "val_ce_loss" appears on
// evaluation steps only ("val_loss" in files written before the rename is read as it);
// "expert_load", "drop_rate" and "router" (per MoE layer an object of moe::RouterStats's fields:
// "num_tokens", "routed", "max_over_mean", "cv", "min_load", "max_load", "dropped_share",
// "entropy", "l_aux", "z_loss", "bias_min", "bias_max"; docs/observability.md) for MoE models;
// "skipped_steps" when steps of the interval were skipped as non-finite (their values are not in
// the means; every value of an interval of skipped steps only is absent).
//
// Thread-safety: a MetricsWriter belongs to one thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "switchyard/moe/router_stats.h"

namespace switchyard::train {

struct StepMetrics {
  int64_t step = 0;  // steps completed (1 after the first step)
  double loss = NAN;
  double ce_loss = NAN;
  double aux_loss = 0;
  double z_loss = 0;
  double lr = NAN;
  double grad_norm = NAN;  // before clipping
  double tokens_per_s = NAN;
  double step_time_s = NAN;
  double moe_time_s = NAN;  // of step_time_s: in the MoE layers (forward + backward), rank mean
  double moe_comm_s = NAN;  // of moe_time_s: blocked in their collectives (dispatch, combine, ...)
  // Rank mean of each rank's own step time up to the metrics reduction (the denominator of the
  // MoE time share; not written to metrics.jsonl).
  double rank_time_s = NAN;
  // Rank means of the tensor-parallel layers' bytes on the wire and time blocked in their
  // collectives this step (0 without tensor parallelism; not written to metrics.jsonl).
  double tp_bytes = 0;
  double tp_comm_s = 0;
  // The same for the context-parallel attention (Traffic::kContext).
  double cp_bytes = 0;
  double cp_comm_s = 0;
  double val_loss = NAN;  // held-out cross-entropy ("val_ce_loss"); NaN: not evaluated here
  // exp(ce_loss), ce_loss in bits per byte of text (docs/data.md, "Metrics"), and the same of
  // val_loss ("perplexity", "bits_per_byte", "val_perplexity", "val_bits_per_byte"; NaN: unknown).
  double perplexity = NAN;
  double bits_per_byte = NAN;
  double val_perplexity = NAN;
  double val_bits_per_byte = NAN;
  int64_t skipped_steps = 0;  // steps of the interval skipped as non-finite (nonfinite = skip)
  std::vector<std::vector<int64_t>> expert_load;  // [moe layer][expert] routed pairs
  std::vector<double> drop_rate;                  // [moe layer] dropped / routed
  // [moe layer] the routing statistics of the step (of a line: of its interval's steps summed,
  // the expert bias of its last step), global over the ranks and micro-batches ("router").
  std::vector<moe::RouterStats> router;
  // [moe layer] what `router` is computed from (not written to metrics.jsonl).
  std::vector<moe::RouterSums> router_sums;
};

// Sets the perplexities and bits per byte of `m` from its losses and the text's UTF-8 bytes per
// token (NaN: bits per byte unknown).
void SetPerByteFigures(StepMetrics& m, double bytes_per_token);

// One line of JSON (no newline). NaN fields are omitted.
std::string MetricsToJson(const StepMetrics& m);
// Parses a line written by MetricsToJson; throws IoError naming `what` on malformed input.
StepMetrics MetricsFromJson(const std::string& line, const std::string& what);
// Every line of a metrics.jsonl file (missing file: empty). A torn last line -- one without its
// newline that does not parse, what a run killed or stopped by a file-size limit while writing
// it leaves -- is skipped; a malformed line anywhere else is an IoError naming the file and line.
std::vector<StepMetrics> ReadMetrics(const std::string& path);

// Appends lines to metrics.jsonl, flushing each one.
class MetricsWriter {
 public:
  // Opens `path` for appending. With keep_through_step >= 0 (a resumed run), lines of later
  // steps (written after the checkpoint by the interrupted run) and a torn last line are removed
  // first, so the file holds each step once (ReadMetrics: a malformed line before the last one
  // is an IoError). Throws IoError.
  explicit MetricsWriter(std::string path, int64_t keep_through_step = -1);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void Append(const StepMetrics& m);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// loss.svg: train loss and val loss over steps, with the unigram entropy as a reference line
// (NaN: none). Written atomically.
void WriteLossSvg(const std::string& path, const std::vector<StepMetrics>& history,
                  double unigram_entropy, const std::string& title);
// expert_load.svg: per MoE layer, tokens per expert over the logged steps. Written atomically.
void WriteExpertLoadSvg(const std::string& path, const std::vector<StepMetrics>& history,
                        const std::string& title);

}  // namespace switchyard::train
