#include "switchyard/train/metrics.h"

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/dataset/metrics.h"
#include "switchyard/train/svg.h"

namespace switchyard::train {

using nlohmann::json;

void SetPerByteFigures(StepMetrics& m, double bytes_per_token) {
  const bool per_byte = std::isfinite(bytes_per_token) && bytes_per_token > 0;
  auto set = [&](double loss, double& ppl, double& bpb) {
    ppl = std::isfinite(loss) ? dataset::Perplexity(loss) : NAN;
    bpb = std::isfinite(loss) && per_byte ? dataset::BitsPerByte(loss, bytes_per_token) : NAN;
  };
  set(m.ce_loss, m.perplexity, m.bits_per_byte);
  set(m.val_loss, m.val_perplexity, m.val_bits_per_byte);
}

namespace {

// The floating-point fields of a "router" entry by their key (non-finite written as null).
std::array<std::pair<const char*, double*>, 8> RouterStatFields(moe::RouterStats& r) {
  return {{{"max_over_mean", &r.max_over_mean},
           {"cv", &r.cv},
           {"dropped_share", &r.dropped_share},
           {"entropy", &r.entropy},
           {"l_aux", &r.l_aux},
           {"z_loss", &r.z_loss},
           {"bias_min", &r.bias_min},
           {"bias_max", &r.bias_max}}};
}

}  // namespace

std::string MetricsToJson(const StepMetrics& m) {
  json j;
  j["step"] = m.step;
  auto put = [&](const char* key, double v) {
    if (std::isfinite(v)) j[key] = v;
  };
  put("loss", m.loss);
  put("ce_loss", m.ce_loss);
  put("aux_loss", m.aux_loss);
  put("z_loss", m.z_loss);
  put("lr", m.lr);
  put("grad_norm", m.grad_norm);
  put("tokens_per_s", m.tokens_per_s);
  put("step_time_s", m.step_time_s);
  put("moe_time_s", m.moe_time_s);
  put("moe_comm_s", m.moe_comm_s);
  put("val_ce_loss", m.val_loss);
  put("perplexity", m.perplexity);
  put("bits_per_byte", m.bits_per_byte);
  put("val_perplexity", m.val_perplexity);
  put("val_bits_per_byte", m.val_bits_per_byte);
  if (m.skipped_steps > 0) j["skipped_steps"] = m.skipped_steps;
  if (!m.expert_load.empty()) j["expert_load"] = m.expert_load;
  if (!m.drop_rate.empty()) j["drop_rate"] = m.drop_rate;
  if (!m.router.empty()) {
    json layers = json::array();
    for (moe::RouterStats r : m.router) {
      json o = {{"num_tokens", r.num_tokens},
                {"routed", r.routed},
                {"min_load", r.min_load},
                {"max_load", r.max_load}};
      for (const auto& [key, v] : RouterStatFields(r))
        o[key] = std::isfinite(*v) ? json(*v) : json();
      layers.push_back(std::move(o));
    }
    j["router"] = std::move(layers);
  }
  return j.dump();
}

StepMetrics MetricsFromJson(const std::string& line, const std::string& what) {
  StepMetrics m;
  try {
    json j = json::parse(line);
    SY_REQUIRE(j.is_object() && j.contains("step"), IoError, "{}: expected an object with 'step'",
               what);
    m.step = j.at("step").get<int64_t>();
    auto get = [&](const char* key, double& dst) {
      if (j.contains(key)) dst = j.at(key).get<double>();
    };
    get("loss", m.loss);
    get("ce_loss", m.ce_loss);
    get("aux_loss", m.aux_loss);
    get("z_loss", m.z_loss);
    get("lr", m.lr);
    get("grad_norm", m.grad_norm);
    get("tokens_per_s", m.tokens_per_s);
    get("step_time_s", m.step_time_s);
    get("moe_time_s", m.moe_time_s);
    get("moe_comm_s", m.moe_comm_s);
    get("val_loss", m.val_loss);  // written before the rename to val_ce_loss
    get("val_ce_loss", m.val_loss);
    get("perplexity", m.perplexity);
    get("bits_per_byte", m.bits_per_byte);
    get("val_perplexity", m.val_perplexity);
    get("val_bits_per_byte", m.val_bits_per_byte);
    if (j.contains("skipped_steps")) m.skipped_steps = j.at("skipped_steps").get<int64_t>();
    if (j.contains("expert_load")) {
      m.expert_load = j.at("expert_load").get<std::vector<std::vector<int64_t>>>();
    }
    if (j.contains("drop_rate")) m.drop_rate = j.at("drop_rate").get<std::vector<double>>();
    if (j.contains("router")) {
      for (const json& r : j.at("router")) {
        moe::RouterStats& st = m.router.emplace_back();
        st.num_tokens = r.at("num_tokens").get<int64_t>();
        st.routed = r.at("routed").get<int64_t>();
        st.min_load = r.at("min_load").get<int64_t>();
        st.max_load = r.at("max_load").get<int64_t>();
        for (const auto& [key, v] : RouterStatFields(st)) {
          *v = r.at(key).is_null() ? NAN : r.at(key).get<double>();
        }
      }
    }
  } catch (const json::exception& e) {
    throw IoError(fmt::format("{}: malformed metrics line: {}", what, e.what()));
  }
  return m;
}

namespace {

struct MetricsLine {
  std::string text;
  StepMetrics metrics;
};

// The lines of metrics.jsonl text with their metrics, a torn last line (no newline, does not
// parse) left out.
std::vector<MetricsLine> ParseMetricsLines(const std::string& text, const std::string& path) {
  std::vector<MetricsLine> out;
  size_t at = 0;
  int64_t n = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    const bool terminated = end != std::string::npos;
    std::string line = text.substr(at, terminated ? end - at : std::string::npos);
    at = terminated ? end + 1 : text.size();
    ++n;
    if (line.empty()) continue;
    try {
      StepMetrics m = MetricsFromJson(line, fmt::format("{}:{}", path, n));
      out.push_back({std::move(line), std::move(m)});
    } catch (const IoError&) {
      if (terminated) throw;  // only the last line can be torn
    }
  }
  return out;
}

}  // namespace

std::vector<StepMetrics> ReadMetrics(const std::string& path) {
  std::vector<StepMetrics> out;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return out;
  for (MetricsLine& line : ParseMetricsLines(ReadTextFile(path), path)) {
    out.push_back(std::move(line.metrics));
  }
  return out;
}

MetricsWriter::MetricsWriter(std::string path, int64_t keep_through_step) : path_(std::move(path)) {
  if (keep_through_step >= 0) {
    std::error_code ec;
    if (std::filesystem::exists(path_, ec)) {
      // Keep the lines up to the resumed step, dropping a torn last line if the run was killed
      // while writing it.
      std::string kept;
      for (const MetricsLine& line : ParseMetricsLines(ReadTextFile(path_), path_)) {
        if (line.metrics.step <= keep_through_step) kept += line.text + "\n";
      }
      WriteTextFileAtomic(path_, kept);
    }
  }
  file_ = std::fopen(path_.c_str(), keep_through_step >= 0 ? "a" : "w");
  SY_REQUIRE(file_ != nullptr, IoError, "{}: cannot open for writing: {}", path_,
             std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::Append(const StepMetrics& m) {
  std::string line = MetricsToJson(m) + "\n";
  SY_REQUIRE(
      std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
      IoError, "{}: write failed: {}", path_, std::strerror(errno));
}

void WriteLossSvg(const std::string& path, const std::vector<StepMetrics>& history,
                  double unigram_entropy, const std::string& title) {
  PlotSeries train{"train loss", "#1f77b4", {}, {}};
  PlotSeries val{"val loss", "#d62728", {}, {}};
  for (const auto& m : history) {
    if (std::isfinite(m.ce_loss)) {
      train.x.push_back(static_cast<double>(m.step));
      train.y.push_back(m.ce_loss);
    }
    if (std::isfinite(m.val_loss)) {
      val.x.push_back(static_cast<double>(m.step));
      val.y.push_back(m.val_loss);
    }
  }
  LinePlotOptions o;
  o.title = title;
  o.y_label = "cross-entropy (nats/token)";
  if (std::isfinite(unigram_entropy)) {
    o.reference_lines.push_back(
        {fmt::format("unigram entropy {:.3f}", unigram_entropy), unigram_entropy, "#555"});
  }
  WriteTextFileAtomic(path, LinePlotSvg({train, val}, o));
}

void WriteExpertLoadSvg(const std::string& path, const std::vector<StepMetrics>& history,
                        const std::string& title) {
  std::vector<double> columns;
  std::vector<HeatmapPanel> panels;
  for (const auto& m : history) {
    if (m.expert_load.empty()) continue;
    if (panels.empty()) {
      for (size_t l = 0; l < m.expert_load.size(); ++l) {
        HeatmapPanel p;
        p.title = fmt::format("MoE layer {}", l);
        p.values.resize(m.expert_load[l].size());
        panels.push_back(std::move(p));
      }
    }
    if (m.expert_load.size() != panels.size()) continue;  // layout changed: skip the line
    columns.push_back(static_cast<double>(m.step));
    for (size_t l = 0; l < panels.size(); ++l) {
      auto& rows = panels[l].values;
      for (size_t e = 0; e < rows.size(); ++e) {
        rows[e].push_back(e < m.expert_load[l].size() ? static_cast<double>(m.expert_load[l][e])
                                                      : std::nan(""));
      }
    }
  }
  HeatmapOptions o;
  o.title = title;
  WriteTextFileAtomic(path, HeatmapSvg(panels, columns, o));
}

}  // namespace switchyard::train
