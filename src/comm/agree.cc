// AgreeOnConfig (see switchyard/comm/agree.h).
#include "switchyard/comm/agree.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"
#include "switchyard/core/hash.h"

namespace switchyard::comm {
namespace {

constexpr size_t kMaxShownValue = 96;

// key \0 value \0 ..., padded with zeros to whole int64 words.
std::vector<int64_t> Pack(const ConfigEntries& entries) {
  std::string bytes;
  for (const auto& [key, value] : entries) {
    bytes += key;
    bytes += '\0';
    bytes += value;
    bytes += '\0';
  }
  std::vector<int64_t> words((bytes.size() + 7) / 8, 0);
  if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  return words;
}

std::map<std::string, std::string> Unpack(const int64_t* words, size_t count) {
  const char* p = reinterpret_cast<const char*>(words);
  const char* end = p + count * 8;
  std::map<std::string, std::string> out;
  while (p < end && *p != '\0') {
    std::string key(p, strnlen(p, static_cast<size_t>(end - p)));
    p += key.size() + 1;
    SY_CHECK(p < end, "config agreement: truncated entry '{}'", key);
    std::string value(p, strnlen(p, static_cast<size_t>(end - p)));
    p += value.size() + 1;
    out.emplace(std::move(key), std::move(value));
  }
  return out;
}

std::string Shown(const std::string& value) {
  if (value.size() <= kMaxShownValue) return value;
  return value.substr(0, kMaxShownValue) + "...";
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

}  // namespace

std::string ContentDigest(const void* data, size_t bytes) {
  const uint64_t h = FnvHash(std::span(static_cast<const std::byte*>(data), bytes));
  return fmt::format("fnv1a64:{:016x}/{}", h, bytes);
}

void AgreeOnConfig(Communicator& comm, std::string_view what, const ConfigEntries& entries) {
  {
    std::map<std::string, int> seen;
    for (const auto& [key, value] : entries) {
      SY_CHECK(key.find('\0') == std::string::npos && value.find('\0') == std::string::npos &&
                   !key.empty() && ++seen[key] == 1,
               "config agreement: bad or repeated key '{}'", key);
    }
  }
  const int n = comm.size();
  if (n == 1) return;
  std::vector<int64_t> mine = Pack(entries);
  int64_t my_words = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  comm.AllGather(&my_words, sizes.data(), 1, DType::kInt64).Wait();
  const int64_t most = *std::max_element(sizes.begin(), sizes.end());
  if (most == 0) return;  // no rank has settings to compare
  mine.resize(static_cast<size_t>(most), 0);
  std::vector<int64_t> all(static_cast<size_t>(most) * static_cast<size_t>(n));
  comm.AllGather(mine.data(), all.data(), static_cast<size_t>(most), DType::kInt64).Wait();

  std::vector<std::map<std::string, std::string>> by_rank;
  std::map<std::string, int> keys;  // every key of any rank
  for (int r = 0; r < n; ++r) {
    by_rank.push_back(Unpack(all.data() + static_cast<size_t>(r) * static_cast<size_t>(most),
                             static_cast<size_t>(sizes[static_cast<size_t>(r)])));
    for (const auto& kv : by_rank.back()) keys[kv.first] = 0;
  }
  std::string differences;
  int differing = 0;
  for (const auto& [key, unused] : keys) {
    // value -> ranks, in order of first appearance
    std::vector<std::pair<std::string, std::vector<int>>> values;
    for (int r = 0; r < n; ++r) {
      auto it = by_rank[static_cast<size_t>(r)].find(key);
      std::string v = it == by_rank[static_cast<size_t>(r)].end() ? "(not set)" : it->second;
      auto slot = std::find_if(values.begin(), values.end(),
                               [&](const auto& entry) { return entry.first == v; });
      if (slot == values.end()) {
        values.emplace_back(v, std::vector<int>{r});
      } else {
        slot->second.push_back(r);
      }
    }
    if (values.size() == 1) continue;
    ++differing;
    differences += fmt::format("{}'{}': ", differences.empty() ? "" : "; ", key);
    for (size_t i = 0; i < values.size(); ++i) {
      differences += fmt::format("{}{} on {}", i ? ", " : "", Shown(values[i].first),
                                 RankList(values[i].second));
    }
  }
  if (differing == 0) return;
  // Every rank found the same differences; rank 0 reports them.
  if (comm.rank() != 0) NoteFailureReportedByPeer();
  throw InvalidArgument(fmt::format(
      "{}: the ranks of group '{}' were started with different settings (every rank must get the "
      "same flags, config file and input files); {}: {}",
      what, comm.name(),
      differing == 1 ? "1 key differs" : fmt::format("{} keys differ", differing), differences));
}

}  // namespace switchyard::comm
