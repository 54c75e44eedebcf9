#include "switchyard/plan/cluster.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::plan {

using nlohmann::json;

namespace {

const std::set<std::string> kCollectives = {"allreduce", "allgather", "reduce_scatter", "alltoall",
                                            "sendrecv"};

// Reads cluster files: every key checked by name, with the file and the key in every message.
class Reader {
 public:
  explicit Reader(std::string_view where) : where_(where) {}

  const json& Object(const json& parent, const std::string& key, const std::string& path) const {
    SY_REQUIRE(parent.contains(key), InvalidArgument, "{}: missing key '{}{}' (an object)", where_,
               path, key);
    const json& v = parent.at(key);
    SY_REQUIRE(v.is_object(), InvalidArgument, "{}: '{}{}' must be an object, got {}", where_, path,
               key, v.dump());
    return v;
  }
  // A number in [lo, hi] (lo excluded when `open_lo`).
  double Number(const json& parent, const std::string& key, const std::string& path, double lo,
                bool open_lo, double hi = 1e30) const {
    SY_REQUIRE(parent.contains(key), InvalidArgument, "{}: missing key '{}{}' (a number)", where_,
               path, key);
    const json& v = parent.at(key);
    SY_REQUIRE(v.is_number(), InvalidArgument, "{}: '{}{}' must be a number, got {}", where_, path,
               key, v.dump());
    const double x = v.get<double>();
    const bool ok = std::isfinite(x) && (open_lo ? x > lo : x >= lo) && x <= hi;
    SY_REQUIRE(ok, InvalidArgument, "{}: '{}{}' must be a finite number {} {:g}{}, got {}", where_,
               path, key, open_lo ? ">" : ">=", lo,
               hi < 1e30 ? fmt::format(" and <= {:g}", hi) : std::string(), v.dump());
    return x;
  }
  int Count(const json& parent, const std::string& key) const {
    const double x = Number(parent, key, "", 1, false, 1 << 20);
    SY_REQUIRE(x == std::floor(x), InvalidArgument, "{}: '{}' must be a whole number, got {}",
               where_, key, x);
    return static_cast<int>(x);
  }
  void OnlyKeys(const json& object, const std::set<std::string>& keys,
                const std::string& path) const {
    for (const auto& [key, value] : object.items()) {
      std::string known;
      for (const std::string& k : keys) known += (known.empty() ? "" : ", ") + k;
      SY_REQUIRE(keys.count(key) > 0, InvalidArgument, "{}: unknown key '{}{}' (expected: {})",
                 where_, path, key, known);
    }
  }
  LinkSpec Link(const json& parent, const std::string& key) const {
    const json& o = Object(parent, key, "");
    OnlyKeys(o, {"bandwidth_gbps", "latency_us"}, key + ".");
    return LinkSpec{.bandwidth_gbps = Number(o, "bandwidth_gbps", key + ".", 0, true),
                    .latency_us = Number(o, "latency_us", key + ".", 0, false)};
  }

 private:
  std::string where_;
};

}  // namespace

double Cluster::efficiency(std::string_view collective) const {
  auto it = collective_efficiency.find(std::string(collective));
  return it == collective_efficiency.end() ? 1.0 : it->second;
}

Cluster ParseCluster(std::string_view json_text, std::string_view where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("{}: not valid JSON: {}", where, e.what()));
  }
  SY_REQUIRE(j.is_object(), InvalidArgument, "{}: expected a JSON object, got {}", where,
             j.type_name());
  const Reader r(where);
  r.OnlyKeys(j,
             {"name", "source", "nodes", "devices_per_node", "device", "intra_node", "inter_node",
              "collective_efficiency", "shared_cores"},
             "");
  Cluster c;
  for (const char* key : {"name", "source"}) {
    if (!j.contains(key)) continue;
    SY_REQUIRE(j.at(key).is_string(), InvalidArgument, "{}: '{}' must be a string, got {}", where,
               key, j.at(key).dump());
    (std::string_view(key) == "name" ? c.name : c.source) = j.at(key).get<std::string>();
  }
  c.nodes = r.Count(j, "nodes");
  c.devices_per_node = r.Count(j, "devices_per_node");
  const json& d = r.Object(j, "device", "");
  r.OnlyKeys(d, {"gemm_tflops", "gemm_half_rows", "memory_gib", "memory_bandwidth_gbps"},
             "device.");
  c.gemm_tflops = r.Number(d, "gemm_tflops", "device.", 0, true);
  if (d.contains("gemm_half_rows")) {
    c.gemm_half_rows = r.Number(d, "gemm_half_rows", "device.", 0, false);
  }
  c.memory_gib = r.Number(d, "memory_gib", "device.", 0, true);
  c.memory_bandwidth_gbps = r.Number(d, "memory_bandwidth_gbps", "device.", 0, true);
  c.intra_node = r.Link(j, "intra_node");
  if (c.nodes > 1 || j.contains("inter_node")) {
    SY_REQUIRE(j.contains("inter_node"), InvalidArgument,
               "{}: missing key 'inter_node' (an object): 'nodes' is {}, so ranks on different "
               "nodes need the link between them",
               where, c.nodes);
    c.inter_node = r.Link(j, "inter_node");
  } else {
    c.inter_node = c.intra_node;
  }
  if (j.contains("collective_efficiency")) {
    const json& e = r.Object(j, "collective_efficiency", "");
    r.OnlyKeys(e, kCollectives, "collective_efficiency.");
    for (const auto& [key, value] : e.items()) {
      c.collective_efficiency[key] = r.Number(e, key, "collective_efficiency.", 0, true, 1);
    }
  }
  if (j.contains("shared_cores")) c.shared_cores = r.Count(j, "shared_cores");
  return c;
}

Cluster LoadClusterFile(const std::string& path) {
  return ParseCluster(ReadTextFile(path), fmt::format("cluster file {}", path));
}

std::string ClusterToJson(const Cluster& c) {
  json j = {
      {"name", c.name},
      {"source", c.source},
      {"nodes", c.nodes},
      {"devices_per_node", c.devices_per_node},
      {"device",
       {{"gemm_tflops", c.gemm_tflops},
        {"gemm_half_rows", c.gemm_half_rows},
        {"memory_gib", c.memory_gib},
        {"memory_bandwidth_gbps", c.memory_bandwidth_gbps}}},
      {"intra_node",
       {{"bandwidth_gbps", c.intra_node.bandwidth_gbps}, {"latency_us", c.intra_node.latency_us}}},
      {"inter_node",
       {{"bandwidth_gbps", c.inter_node.bandwidth_gbps}, {"latency_us", c.inter_node.latency_us}}}};
  if (!c.collective_efficiency.empty()) j["collective_efficiency"] = c.collective_efficiency;
  if (c.shared_cores > 0) j["shared_cores"] = c.shared_cores;
  return j.dump(2);
}

}  // namespace switchyard::plan
