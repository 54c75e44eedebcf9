#include "switchyard/parallel/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <set>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::parallel {

std::string_view TraceStreamName(TraceStream stream) {
  return stream == TraceStream::kCompute ? "compute" : "comm";
}

void Tracer::Add(TraceEvent event) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> Tracer::Events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

size_t Tracer::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

namespace {

// JSON string contents (names are ASCII identifiers in practice; escape what JSON requires).
std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
  return out;
}

int Tid(const TraceEvent& e) { return 2 * e.rank + static_cast<int>(e.stream); }

}  // namespace

std::string Tracer::ToJson() const {
  std::vector<TraceEvent> events = Events();
  std::sort(events.begin(), events.end(),
            [](const TraceEvent& a, const TraceEvent& b) { return a.begin_s < b.begin_s; });
  double t0 = events.empty() ? 0 : events.front().begin_s;
  std::set<std::pair<int, int>> tracks;  // (rank, stream)
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  for (const TraceEvent& e : events) tracks.insert({e.rank, static_cast<int>(e.stream)});
  sep();
  out +=
      R"({"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "switchyard"}})";
  for (auto [rank, stream] : tracks) {
    const int tid = 2 * rank + stream;
    sep();
    out += fmt::format(
        R"({{"name": "thread_name", "ph": "M", "pid": 0, "tid": {}, "args": {{"name": "rank {} {}"}}}})",
        tid, rank, TraceStreamName(static_cast<TraceStream>(stream)));
    sep();
    out += fmt::format(
        R"({{"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": {}, "args": {{"sort_index": {}}}}})",
        tid, tid);
  }
  for (const TraceEvent& e : events) {
    sep();
    std::string args =
        fmt::format(R"("rank": {}, "stream": "{}")", e.rank, TraceStreamName(e.stream));
    for (const auto& [k, v] : e.args) args += fmt::format(R"(, "{}": {})", JsonEscape(k), v);
    out += fmt::format(
        R"({{"name": "{}", "cat": "{}", "ph": "X", "pid": 0, "tid": {}, "ts": {:.3f}, "dur": {:.3f}, "args": {{{}}}}})",
        JsonEscape(e.name), JsonEscape(e.category), Tid(e), (e.begin_s - t0) * 1e6,
        std::max(0.0, e.end_s - e.begin_s) * 1e6, args);
  }
  out += "\n]}\n";
  return out;
}

void Tracer::WriteJson(const std::string& path) const { WriteTextFileAtomic(path, ToJson()); }

// One event per line: name \t category \t rank \t stream \t begin \t end {\t key \t value}.
std::string Tracer::Serialize() const {
  std::string out;
  for (const TraceEvent& e : Events()) {
    out += fmt::format("{}\t{}\t{}\t{}\t{:.9f}\t{:.9f}", e.name, e.category, e.rank,
                       static_cast<int>(e.stream), e.begin_s, e.end_s);
    for (const auto& [k, v] : e.args) out += fmt::format("\t{}\t{}", k, v);
    out += '\n';
  }
  return out;
}

namespace {

template <typename T>
T ParseNumber(std::string_view field) {
  T v{};
  auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
  SY_REQUIRE(ec == std::errc() && ptr == field.data() + field.size(), InvalidArgument,
             "trace events: malformed number '{}'", field);
  return v;
}

}  // namespace

void Tracer::Merge(std::string_view serialized) {
  std::vector<TraceEvent> parsed;
  while (!serialized.empty()) {
    size_t eol = serialized.find('\n');
    std::string_view line = serialized.substr(0, eol);
    serialized.remove_prefix(eol == std::string_view::npos ? serialized.size() : eol + 1);
    if (line.empty()) continue;
    std::vector<std::string_view> f;
    for (size_t at = 0;;) {
      size_t tab = line.find('\t', at);
      f.push_back(line.substr(at, tab == std::string_view::npos ? line.npos : tab - at));
      if (tab == std::string_view::npos) break;
      at = tab + 1;
    }
    SY_REQUIRE(f.size() >= 6 && f.size() % 2 == 0, InvalidArgument,
               "trace events: malformed line '{}'", line);
    TraceEvent e;
    e.name = f[0];
    e.category = f[1];
    e.rank = ParseNumber<int>(f[2]);
    e.stream = ParseNumber<int>(f[3]) == 0 ? TraceStream::kCompute : TraceStream::kComm;
    e.begin_s = ParseNumber<double>(f[4]);
    e.end_s = ParseNumber<double>(f[5]);
    for (size_t i = 6; i < f.size(); i += 2) {
      e.args.emplace_back(std::string(f[i]), ParseNumber<double>(f[i + 1]));
    }
    parsed.push_back(std::move(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (TraceEvent& e : parsed) events_.push_back(std::move(e));
}

}  // namespace switchyard::parallel
