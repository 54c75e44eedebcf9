// Trainer::WriteRunEnd: the end of a run on the writer (sample.txt, summary.json and the final
// lines of the output).
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "switchyard/core/file_util.h"
#include "switchyard/core/limits.h"
#include "switchyard/kernels/cpu_features.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/train/dataset/metrics.h"
#include "switchyard/train/generate.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/progress.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/trainer.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

// `loss` (nats/token) in bits per byte of the summary's data (NaN where unknown).
double BitsPerByteOf(const RunSummary& summary, double loss) {
  const double bpt = summary.bytes_per_token;
  return std::isfinite(loss) && std::isfinite(bpt) ? dataset::BitsPerByte(loss, bpt) : NAN;
}

// summary.json: every figure of the run that is known (a value that is not is left out).
json SummaryJson(const RunSummary& summary) {
  auto finite = [](double v) { return std::isfinite(v) ? json(v) : json(); };
  auto bits_per_byte = [&](double loss) { return BitsPerByteOf(summary, loss); };
  json s = {{"steps", summary.steps},
            {"seconds", summary.seconds},
            {"parameters", summary.parameters},
            {"unigram_entropy", finite(summary.unigram_entropy)},
            {"flops_per_token", summary.flops_per_token},
            {"tokens_per_s_median", finite(summary.tokens_per_s)},
            {"final_train_ce_loss", finite(summary.final_train_ce_loss)},
            {"final_val_ce_loss", finite(summary.final_val_ce_loss)},
            {"final_train_perplexity", finite(std::exp(summary.final_train_ce_loss))},
            {"final_val_perplexity", finite(std::exp(summary.final_val_ce_loss))},
            {"bytes_per_token", finite(summary.bytes_per_token)},
            {"final_train_bits_per_byte", finite(bits_per_byte(summary.final_train_ce_loss))},
            {"final_val_bits_per_byte", finite(bits_per_byte(summary.final_val_ce_loss))},
            {"moe_time_share", finite(summary.moe_time_share)},
            {"moe_comm_share", finite(summary.moe_comm_share)},
            {"tp_bytes_per_step", finite(summary.tp_bytes_per_step)},
            {"tp_comm_share", finite(summary.tp_comm_share)},
            {"cp_bytes_per_step", finite(summary.cp_bytes_per_step)},
            {"cp_comm_share", finite(summary.cp_comm_share)},
            {"memory_estimate_bytes_per_rank", summary.memory_estimate_bytes},
            {"memory_peak_bytes_per_rank_max", finite(summary.memory_peak_bytes)},
            {"memory_peak_bytes_per_rank_min", finite(summary.memory_peak_min_bytes)},
            {"memory_train_peak_bytes_per_rank_max", finite(summary.memory_train_peak_bytes)},
            {"skipped_steps", summary.skipped_steps},
            {"grad_reduce_s", finite(summary.grad_reduce_s)},
            {"grad_reduce_blocked_s", finite(summary.grad_reduce_blocked_s)},
            {"peak_rss_bytes", summary.peak_rss_bytes},
            {"saved_activation_bytes", summary.saved_activation_bytes}};
  if (summary.zero_peak_bytes > 0) {
    s["zero_memory"] = {{"peak_bytes", summary.zero_peak_bytes},
                        {"parameters", summary.zero_peak_values},
                        {"gradients", summary.zero_peak_gradients},
                        {"optimizer_state", summary.zero_peak_state},
                        {"reduction_buffers", summary.zero_peak_scratch},
                        {"formula_bytes", summary.zero_formula_bytes}};
  }
  if (summary.router_worst_step >= 0) {
    const moe::RouterStats& w = summary.router_worst;
    s["router_worst"] = {{"step", summary.router_worst_step},
                         {"moe_layer", summary.router_worst_layer},
                         {"max_over_mean", finite(w.max_over_mean)},
                         {"cv", finite(w.cv)},
                         {"min_load", w.min_load},
                         {"dropped_share", finite(w.dropped_share)},
                         {"entropy", finite(w.entropy)}};
    json& worst = s["router_worst"];
    for (auto it = worst.begin(); it != worst.end();) {
      it = it->is_null() ? worst.erase(it) : std::next(it);
    }
  }
  // Only what is known: a value that is not (no step ran, a dense model) is left out.
  for (auto it = s.begin(); it != s.end();) it = it->is_null() ? s.erase(it) : std::next(it);
  return s;
}

}  // namespace

void Trainer::WriteRunEnd(const RunSummary& summary, bool moe) const {
  const TrainConfig& c = config_;
  const std::string& run_dir = summary.run_dir;
  std::FILE* out = run_out_;
  auto bits_per_byte = [&](double loss) { return BitsPerByteOf(summary, loss); };
  const json s = SummaryJson(summary);
  if (c.sample_tokens > 0) WriteTextFileAtomic(run_dir + "/sample.txt", summary.sample);
  WriteTextFileAtomic(run_dir + "/summary.json", s.dump(2) + "\n");
  std::string done =
      fmt::format("done: {} steps in {}", summary.steps, FormatDuration(summary.seconds));
  if (std::isfinite(summary.tokens_per_s) && summary.tokens_per_s > 0) {
    done += fmt::format(", {} tok/s (median), {:.1f} GFLOP/s of model FLOPs",
                        FormatRate(summary.tokens_per_s),
                        summary.tokens_per_s * summary.flops_per_token / 1e9);
  }
  if (summary.skipped_steps > 0) {
    done += fmt::format(", {} non-finite step(s) skipped", summary.skipped_steps);
  }
  fmt::print(out, "{}\n", done);
  fmt::print(out, "  GEMM backend: {}\n", kernels::GemmBackendName());
  if (std::string warning = kernels::GemmBackendWarning(); !warning.empty()) {
    fmt::print(out, "  {}\n", warning);
  }
  std::string losses;
  if (std::isfinite(summary.final_train_ce_loss)) {
    losses += fmt::format("train ce_loss {:.4f}", summary.final_train_ce_loss);
  }
  if (std::isfinite(summary.final_val_ce_loss)) {
    losses +=
        fmt::format("{}val_ce_loss {:.4f}", losses.empty() ? "" : ", ", summary.final_val_ce_loss);
  }
  if (!losses.empty()) {
    if (std::isfinite(summary.unigram_entropy)) {  // byte-level text
      fmt::print(out, "  {} nats/byte; unigram entropy {:.3f}", losses, summary.unigram_entropy);
      if (std::isfinite(summary.final_val_ce_loss) && summary.unigram_entropy > 0) {
        fmt::print(out, " (val at {:.0f}% of it)",
                   100 * summary.final_val_ce_loss / summary.unigram_entropy);
      }
    } else {
      const double bpb =
          bits_per_byte(std::isfinite(summary.final_val_ce_loss) ? summary.final_val_ce_loss
                                                                 : summary.final_train_ce_loss);
      fmt::print(out, "  {} nats/token{}", losses,
                 std::isfinite(bpb)
                     ? fmt::format("; {} {:.4f} bits/byte",
                                   std::isfinite(summary.final_val_ce_loss) ? "val" : "train", bpb)
                     : "");
    }
    fmt::print(out, "\n");
  }
  if (std::isfinite(summary.moe_time_share)) {
    fmt::print(out,
               "  MoE layers: {:.0f}% of step time (blocked in their collectives {:.0f}%, "
               "gate + dispatch + experts + combine {:.0f}%)\n",
               100 * summary.moe_time_share, 100 * summary.moe_comm_share,
               100 * (summary.moe_time_share - summary.moe_comm_share));
  }
  if (summary.router_worst_step >= 0) {
    const moe::RouterStats& w = summary.router_worst;
    fmt::print(out,
               "  routing: worst imbalance MoE layer {} at step {}: max/mean {:.3f}, cv {:.3f}, "
               "least-loaded expert {} pairs, dropped {:.1f}%, router entropy {:.3f} nats\n",
               summary.router_worst_layer, summary.router_worst_step, w.max_over_mean, w.cv,
               w.min_load, 100 * w.dropped_share, w.entropy);
  }
  if (std::isfinite(summary.tp_bytes_per_step)) {
    fmt::print(out,
               "  tensor parallel: {:.2f} MB per step and rank on the wire, blocked in those "
               "collectives {:.0f}% of step time\n",
               summary.tp_bytes_per_step / 1e6, 100 * summary.tp_comm_share);
  }
  if (summary.zero_peak_bytes > 0) {
    const double mib = 1024.0 * 1024.0;
    fmt::print(out,
               "  ZeRO-{} memory per rank (peak of the largest rank, measured): {:.2f} MiB = "
               "parameters {:.2f} + gradients {:.2f} + optimizer state {:.2f} + reduction buffers "
               "{:.2f}; formula {:.2f} MiB; process peak RSS {:.1f} MiB\n",
               c.zero_stage, summary.zero_peak_bytes / mib, summary.zero_peak_values / mib,
               summary.zero_peak_gradients / mib, summary.zero_peak_state / mib,
               summary.zero_peak_scratch / mib, summary.zero_formula_bytes / mib,
               summary.peak_rss_bytes / mib);
  }
  if (std::isfinite(summary.grad_reduce_s) && summary.grad_reduce_s > 0) {
    // The collectives' run time counts from this rank's launch, waiting for later peers
    // included; the blocked time is what the step paid.
    fmt::print(out,
               "  gradient reduction: blocked {:.2f} ms per step and rank waiting for it "
               "(its collectives ran {:.2f} ms from launch to finish; overlap_grad_reduce {})\n",
               1e3 * summary.grad_reduce_blocked_s, 1e3 * summary.grad_reduce_s,
               !c.overlap_grad_reduce ? "off"
               : c.pp > 1             ? "on, but after the backward with pipeline stages"
                                      : "on");
  }
  if (summary.saved_activation_bytes > 0) {
    fmt::print(out,
               "  activations kept for backward: {:.2f} MiB per micro-batch (recompute {}, "
               "precision {}{})\n",
               static_cast<double>(summary.saved_activation_bytes) / (1 << 20),
               RecomputeName(c.model.recompute), PrecisionName(c.model.precision),
               moe ? "; MoE FFN state not counted" : "");
  }
  if (c.model.precision == Precision::kBFloat16) {
    fmt::print(out, "  precision bf16 GEMMs: {}\n", kernels::ActiveBf16Gemm().reason);
  }
  if (std::isfinite(summary.cp_bytes_per_step)) {
    fmt::print(out,
               "  context parallel (cp {}, {}): {:.2f} MB per step and rank on the wire, blocked "
               "in those collectives {:.0f}% of step time\n",
               c.cp, c.cp_algo, summary.cp_bytes_per_step / 1e6, 100 * summary.cp_comm_share);
  }
  std::string memory =
      fmt::format("  memory per rank: estimate {} (attention_core {})",
                  FormatBytes(static_cast<uint64_t>(summary.memory_estimate_bytes)),
                  ChoiceTraits<AttentionCore>::Name(ResolvedAttentionCore(c)));
  if (c.memory_budget_mib > 0) memory += fmt::format(", budget {} MiB", c.memory_budget_mib);
  if (std::isfinite(summary.memory_peak_bytes)) {
    memory += fmt::format("; measured peak of the tensors held {} (max over ranks; min {})",
                          FormatBytes(static_cast<uint64_t>(summary.memory_peak_bytes)),
                          FormatBytes(static_cast<uint64_t>(summary.memory_peak_min_bytes)));
  }
  fmt::print(out, "{}\n", memory);
  fmt::print(out, "  run directory: {} (metrics.jsonl, loss.svg{}, checkpoints/{}{})\n",
             EscapeForTerminal(run_dir), moe ? ", expert_load.svg" : "",
             c.sample_tokens > 0 ? ", sample.txt" : "",
             std::filesystem::exists(run_dir + "/trace.json") ? ", trace.json" : "");
  if (c.sample_tokens > 0) {
    fmt::print(out, "sample (temperature {}):\n{}\n", c.temperature,
               EscapeForTerminal(summary.sample));
  }
}

}  // namespace switchyard::train
