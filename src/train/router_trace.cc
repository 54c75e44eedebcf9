#include "switchyard/train/router_trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <limits>
#include <numeric>

#include "switchyard/core/error.h"
#include "switchyard/core/safetensors.h"

namespace switchyard::train {

namespace {

constexpr const char* kFormat = "switchyard-router-trace";

std::string Joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

Tensor TraceExpertIdsAsInt32(const Tensor& experts) {
  if (!experts.defined() || experts.dim() != 2) return {};
  if (experts.dtype() == DType::kInt32) return experts;
  if (experts.dtype() == DType::kInt16) return experts.To(DType::kInt32);
  return {};
}

std::vector<int64_t> RowTokens(int64_t rows, int64_t global_token_offset,
                               const std::vector<int64_t>* token_index) {
  if (token_index != nullptr && !token_index->empty()) return *token_index;
  std::vector<int64_t> t(static_cast<size_t>(rows));
  std::iota(t.begin(), t.end(), global_token_offset);
  return t;
}

TracedForward::TracedForward(RouterTrace* t, std::string p, uint64_t s, bool training, int64_t rows,
                             int64_t global_token_offset, const std::vector<int64_t>* token_index,
                             int64_t top_k)
    : trace(training ? t : nullptr), prefix(std::move(p)), step(static_cast<int64_t>(s) + 1) {
  if (trace == nullptr || (!trace->replaying() && !trace->Records(step))) {
    trace = nullptr;
    return;
  }
  tokens = RowTokens(rows, global_token_offset, token_index);
  if (trace->replaying()) forced = trace->Forced(prefix, step, tokens, top_k);
}

void TracedForward::Record(const moe::LayerOutput& out, bool save_for_backward) {
  if (trace == nullptr || !save_for_backward) return;
  trace->Record(prefix, step, tokens, out.topk_idx, out.combine_weights);
}

RouterTraceOptions RouterTraceOptionsFromConfig(const std::string& trace, const std::string& steps,
                                                const std::string& replay) {
  RouterTraceOptions o;
  o.record_dir = trace;
  o.replay_dir = replay;
  SY_REQUIRE(steps.empty() || !trace.empty(), InvalidArgument,
             "config: 'router_trace_steps' \"{}\" chooses steps to record, but 'router_trace' "
             "(the directory) is not set",
             steps);
  SY_REQUIRE(trace.empty() || trace != replay, InvalidArgument,
             "config: 'router_trace' and 'router_replay' are the same directory {}: recording "
             "would overwrite the trace being replayed",
             trace);
  // What fails only once a step runs is refused here, before anything is written.
  std::error_code fs_error;
  SY_REQUIRE(trace.empty() || !std::filesystem::exists(trace, fs_error) ||
                 std::filesystem::is_directory(trace, fs_error),
             InvalidArgument,
             "config: 'router_trace' {} exists and is not a directory: expected a directory to "
             "record the routes into (it is created when missing)",
             trace);
  SY_REQUIRE(replay.empty() || std::filesystem::is_directory(replay, fs_error), InvalidArgument,
             "config: 'router_replay' {}: expected the directory of a router trace "
             "('router_trace' of an earlier run), and there is no such directory",
             replay);
  auto number = [&](const std::string& text) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    SY_REQUIRE(ec == std::errc() && end == text.data() + text.size() && v >= 1, InvalidArgument,
               "config: 'router_trace_steps' \"{}\": expected steps >= 1 as \"1,100,1000\" or "
               "\"every:N\", and \"{}\" is not one",
               steps, text);
    return v;
  };
  if (steps.starts_with("every:")) {
    o.every = number(steps.substr(6));
  } else if (!steps.empty()) {
    size_t at = 0;
    while (at <= steps.size()) {
      const size_t comma = std::min(steps.find(',', at), steps.size());
      o.record_steps.push_back(number(steps.substr(at, comma - at)));
      at = comma + 1;
    }
  }
  return o;
}

RouterTrace::RouterTrace(RouterTraceOptions options, int rank)
    : options_(std::move(options)), rank_(rank) {}

std::string RouterTrace::StepDirectory(const std::string& dir, int64_t step) {
  return (std::filesystem::path(dir) / fmt::format("step_{:06d}", step)).string();
}

bool RouterTrace::Records(int64_t step) const {
  if (!recording()) return false;
  if (!options_.record_steps.empty()) {
    return std::find(options_.record_steps.begin(), options_.record_steps.end(), step) !=
           options_.record_steps.end();
  }
  return options_.every <= 0 || step % options_.every == 0;
}

void RouterTrace::Record(const std::string& prefix, int64_t step, std::span<const int64_t> tokens,
                         const Tensor& experts, const Tensor& weights) {
  if (!Records(step)) return;
  const auto n = static_cast<int64_t>(tokens.size());
  ExpectShape("experts", experts, {n, kAnySize});
  const int64_t k = experts.size(1);
  ExpectShape("weights", weights, {n, k});
  Recorded& r = recorded_[prefix];
  SY_CHECK(r.top_k == 0 || r.top_k == k);
  r.top_k = k;
  r.tokens.insert(r.tokens.end(), tokens.begin(), tokens.end());
  r.experts.insert(r.experts.end(), experts.data<int32_t>(), experts.data<int32_t>() + n * k);
  r.weights.insert(r.weights.end(), weights.data<float>(), weights.data<float>() + n * k);
}

void RouterTrace::EndStep(int64_t step) {
  if (recorded_.empty()) return;
  TensorMap tensors;
  for (const auto& [prefix, r] : recorded_) {
    const auto n = static_cast<int64_t>(r.tokens.size());
    tensors[prefix + "tokens"] = Tensor::FromVector(r.tokens, {n});
    // int16 ids (half the bytes) whenever every id fits, as for any layer of <= 32768 experts.
    const bool fits16 = std::all_of(r.experts.begin(), r.experts.end(), [](int32_t e) {
      return e >= std::numeric_limits<int16_t>::min() && e <= std::numeric_limits<int16_t>::max();
    });
    Tensor ids = Tensor::FromVector(r.experts, {n, r.top_k});
    tensors[prefix + "experts"] = fits16 ? ids.To(DType::kInt16) : ids;
    tensors[prefix + "weights"] = Tensor::FromVector(r.weights, {n, r.top_k}).To(DType::kBFloat16);
  }
  recorded_.clear();
  const std::string dir = StepDirectory(options_.record_dir, step);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  SY_REQUIRE(!ec, IoError, "router trace: cannot create directory {}: {}", dir, ec.message());
  WriteSafetensors(
      (std::filesystem::path(dir) / fmt::format("rank_{:05d}.safetensors", rank_)).string(),
      tensors, {{"format", kFormat}, {"step", std::to_string(step)}});
}

void RouterTrace::LoadReplayStep(int64_t step) {
  if (loaded_step_ == step) return;
  replayed_.clear();
  const std::string dir = StepDirectory(options_.replay_dir, step);
  std::error_code ec;
  SY_REQUIRE(std::filesystem::is_directory(dir, ec), InvalidArgument,
             "router replay: {} holds no routes of step {} (no directory {}); replay a trace "
             "recorded for every step of this run",
             options_.replay_dir, step, dir);
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  SY_REQUIRE(!files.empty(), InvalidArgument, "router replay: {} holds no .safetensors file", dir);
  for (const std::string& file : files) {
    const auto meta = ReadSafetensorsMetadata(file);
    auto format = meta.find("format");
    SY_REQUIRE(format != meta.end() && format->second == kFormat, InvalidArgument,
               "router replay: {} is not a router trace (metadata \"format\" is not \"{}\")", file,
               kFormat);
    const TensorMap t = ReadSafetensors(file);
    for (const auto& [name, stored] : t) {
      if (!name.ends_with("experts")) continue;
      const Tensor tensor = TraceExpertIdsAsInt32(stored);
      const std::string prefix = name.substr(0, name.size() - 7);
      auto tok = t.find(prefix + "tokens");
      SY_REQUIRE(tok != t.end(), InvalidArgument, "router replay: {} has {} but no {}tokens", file,
                 name, prefix);
      SY_REQUIRE(tensor.defined() && tok->second.dtype() == DType::kInt64 &&
                     tok->second.shape() == Shape{tensor.size(0)},
                 InvalidArgument,
                 "router replay: {}: expected {} int16 or int32 [N, k] and {}tokens int64 [N]",
                 file, name, prefix);
      Replayed& r = replayed_[prefix];
      const int64_t k = tensor.size(1), n = tensor.size(0);
      SY_REQUIRE(r.top_k == 0 || r.top_k == k, InvalidArgument,
                 "router replay: {} records top-{} routes of {}, another file of the step top-{}",
                 file, k, prefix, r.top_k);
      r.top_k = k;
      const int32_t* e = tensor.data<int32_t>();
      const int64_t* g = tok->second.data<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        auto [it, fresh] = r.row.emplace(g[i], r.experts.size() / static_cast<size_t>(k));
        if (fresh) {
          r.experts.insert(r.experts.end(), e + i * k, e + (i + 1) * k);
        } else {
          SY_REQUIRE(std::equal(e + i * k, e + (i + 1) * k,
                                r.experts.begin() + static_cast<std::ptrdiff_t>(it->second) * k),
                     InvalidArgument,
                     "router replay: {} records other routes for token {} of {} than another "
                     "file of step {}",
                     file, g[i], prefix, step);
        }
      }
    }
  }
  loaded_step_ = step;
}

std::vector<int32_t> RouterTrace::Forced(const std::string& prefix, int64_t step,
                                         std::span<const int64_t> tokens, int64_t top_k) {
  LoadReplayStep(step);
  auto it = replayed_.find(prefix);
  if (it == replayed_.end()) {
    std::vector<std::string> layers;
    for (const auto& [p, r] : replayed_) layers.push_back(p);
    throw InvalidArgument(
        fmt::format("router replay: step {} of {} has no routes of the MoE layer {} (it has: {})",
                    step, options_.replay_dir, prefix, Joined(layers)));
  }
  const Replayed& r = it->second;
  SY_REQUIRE(r.top_k == top_k, InvalidArgument,
             "router replay: {} records top-{} routes for {} in step {}, but the layer routes "
             "top-{}",
             options_.replay_dir, r.top_k, prefix, step, top_k);
  std::vector<int32_t> out;
  out.reserve(tokens.size() * static_cast<size_t>(top_k));
  for (int64_t g : tokens) {
    auto row = r.row.find(g);
    SY_REQUIRE(row != r.row.end(), InvalidArgument,
               "router replay: step {} of {} has no route of token {} in {} (the trace holds {} "
               "tokens: another batch size, sequence length or data?)",
               step, options_.replay_dir, g, prefix, r.row.size());
    const auto at = static_cast<std::ptrdiff_t>(row->second) * top_k;
    out.insert(out.end(), r.experts.begin() + at, r.experts.begin() + at + top_k);
  }
  return out;
}

}  // namespace switchyard::train
