// The fields of a TrainConfig by key, for the config's JSON forms (config.cc) and its
// validation (config_validate.cc), generated from config_keys.def. Private to src/train.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "switchyard/train/config.h"

namespace switchyard::train {

// The vocabulary of config_keys.def's columns.
namespace config_keys {

inline constexpr int64_t kMaxRanks = 4096;  // as `switchyard layer`
inline constexpr int64_t kMaxThreads = 256;
inline constexpr int64_t kMaxExperts = int64_t{1} << 20;
inline constexpr int64_t kNoIntBound = std::numeric_limits<int64_t>::max();
inline constexpr double kNoFloatBound = 1e30;

inline constexpr KeyCategory kModel = KeyCategory::kModel;
inline constexpr KeyCategory kRun = KeyCategory::kRun;
inline constexpr KeyCategory kLayout = KeyCategory::kLayout;
inline constexpr KeyResume kMustMatch = KeyResume::kMustMatch;
inline constexpr KeyResume kMayDiffer = KeyResume::kMayDiffer;

using Kind = KeyValues::Kind;
constexpr KeyValues Int() { return {.kind = Kind::kInt}; }
constexpr KeyValues Int(int64_t lo, int64_t hi = kNoIntBound) {
  return {.kind = Kind::kInt, .ranged = true, .int_lo = lo, .int_hi = hi};
}
constexpr KeyValues Float() { return {.kind = Kind::kFloat}; }
constexpr KeyValues Float(double lo, double hi = kNoFloatBound) {
  return {.kind = Kind::kFloat, .ranged = true, .float_lo = lo, .float_hi = hi};
}
constexpr KeyValues FloatBelow(double lo, double hi) {
  KeyValues v = Float(lo, hi);
  v.open_hi = true;
  return v;
}
constexpr KeyValues MiB(double lo, double hi) {
  KeyValues v = Float(lo, hi);
  v.unit = " MiB";
  return v;
}
constexpr KeyValues Bool() { return {.kind = Kind::kBool}; }
constexpr KeyValues Path() { return {.kind = Kind::kPath}; }
constexpr KeyValues Text() { return {.kind = Kind::kText}; }
constexpr KeyValues Names() { return {.kind = Kind::kChoice}; }
constexpr KeyValues Counts() { return {.kind = Kind::kList}; }
constexpr KeyValues Counts(int64_t lo, int64_t hi) {
  return {.kind = Kind::kList, .ranged = true, .int_lo = lo, .int_hi = hi};
}

template <typename T>
struct IsChoice : std::false_type {};
template <typename E>
struct IsChoice<Choice<E>> : std::true_type {};

// Whether a field of type T can hold a value of `kind` (checked per row at compile time).
template <typename T>
constexpr bool KindFits(Kind kind) {
  switch (kind) {
    case Kind::kInt: return std::is_integral_v<T> && !std::is_same_v<T, bool>;
    case Kind::kFloat: return std::is_floating_point_v<T>;
    case Kind::kBool: return std::is_same_v<T, bool>;
    case Kind::kPath:
    case Kind::kText: return std::is_same_v<T, std::string>;
    case Kind::kChoice: return IsChoice<T>::value || std::is_enum_v<T>;
    case Kind::kList: return std::is_same_v<T, std::vector<int64_t>>;
  }
  return false;
}

}  // namespace config_keys

// Calls fn(info, field) for every key, in config_keys.def's order (the JSON key order), with
// `info` its row of TrainConfigTable().
template <typename Config, typename Fn>
void VisitFields(Config& c, Fn&& fn) {
  const std::vector<ConfigKeyInfo>& table = TrainConfigTable();
  size_t i = 0;
#define SY_TRAIN_KEY(key, ...) fn(table[i++], c.key);
#define SY_MODEL_KEY(key, ...) fn(table[i++], c.model.key);
#include "switchyard/train/config_keys.def"
#undef SY_TRAIN_KEY
#undef SY_MODEL_KEY
}

}  // namespace switchyard::train
