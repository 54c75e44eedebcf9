// The choice keys of a TrainConfig (dispatch, cp_algo, pipeline_schedule, ...): an enum each,
// spelled in config.json and on the command line by the names of ChoiceTraits<E>.
//
// Choice<E> is the field type: it holds the enum and converts to it, so the code compares and
// switches on enums (`config.cp_algo == CpAlgorithm::kUlysses`). The JSON and flag boundary
// (TrainConfigFromJson, SetTrainConfigValue) refuses an unknown name at once. A name assigned
// in code (`c.dispatch = "alltoallv"`, as tests write layouts) is parsed there; one that is none
// of the choices is kept and refused by ValidateTrainConfig, like any other value out of range.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "switchyard/core/error.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/context_parallel.h"

namespace switchyard::train {

// What a step whose loss or gradient norm is not finite does ('nonfinite').
enum class NonFinite : uint8_t { kStop, kSkip };
// The MoE token all-to-all ('a2a_algo'): flat, or Tutel's two-dimensional hierarchical one.
enum class A2aAlgo : uint8_t { kFlat, k2dh };
// What the router's expert groups are ('router_group_by'): as num_groups says, the expert-parallel
// ranks' expert sets (DeepSeek-V3's device-limited routing) or the 2dh nodes' (node-limited).
enum class RouterGroupBy : uint8_t { kNone, kEpRank, kNode };
// Where the experts sit beside tp ('arrangement'); kAuto resolves in ResolveLayout.
enum class ArrangementChoice : uint8_t { kAuto, kDeepSpeed, kMegatron };
// The attention core ('attention_core'); kAuto resolves in ResolveLayout (flash with cp > 1).
enum class AttentionCore : uint8_t { kAuto, kSoftmax, kFlash };

// Per enum: kValues (every value, in the order help texts list them) and Name(value).
template <typename E>
struct ChoiceTraits;

template <>
struct ChoiceTraits<NonFinite> {
  static constexpr std::array kValues = {NonFinite::kStop, NonFinite::kSkip};
  static std::string_view Name(NonFinite v) { return v == NonFinite::kStop ? "stop" : "skip"; }
};
template <>
struct ChoiceTraits<A2aAlgo> {
  static constexpr std::array kValues = {A2aAlgo::kFlat, A2aAlgo::k2dh};
  static std::string_view Name(A2aAlgo v) { return v == A2aAlgo::kFlat ? "flat" : "2dh"; }
};
template <>
struct ChoiceTraits<RouterGroupBy> {
  static constexpr std::array kValues = {RouterGroupBy::kNone, RouterGroupBy::kEpRank,
                                         RouterGroupBy::kNode};
  static std::string_view Name(RouterGroupBy v) {
    return v == RouterGroupBy::kNone ? "none" : v == RouterGroupBy::kEpRank ? "ep_rank" : "node";
  }
};
template <>
struct ChoiceTraits<ArrangementChoice> {
  static constexpr std::array kValues = {ArrangementChoice::kAuto, ArrangementChoice::kDeepSpeed,
                                         ArrangementChoice::kMegatron};
  static std::string_view Name(ArrangementChoice v) {
    return v == ArrangementChoice::kAuto        ? "auto"
           : v == ArrangementChoice::kDeepSpeed ? "deepspeed"
                                                : "megatron";
  }
};
template <>
struct ChoiceTraits<AttentionCore> {
  static constexpr std::array kValues = {AttentionCore::kAuto, AttentionCore::kSoftmax,
                                         AttentionCore::kFlash};
  static std::string_view Name(AttentionCore v) {
    return v == AttentionCore::kAuto ? "auto" : v == AttentionCore::kSoftmax ? "softmax" : "flash";
  }
};
template <>
struct ChoiceTraits<CpAlgorithm> {
  static constexpr std::array kValues = {CpAlgorithm::kRing, CpAlgorithm::kUlysses};
  static std::string_view Name(CpAlgorithm v) {
    return v == CpAlgorithm::kRing ? "ring" : "ulysses";
  }
};
template <>
struct ChoiceTraits<parallel::DispatchKind> {
  static constexpr std::array kValues = {parallel::DispatchKind::kAllToAll,
                                         parallel::DispatchKind::kAllToAllV,
                                         parallel::DispatchKind::kAllGather};
  static std::string_view Name(parallel::DispatchKind v) { return parallel::DispatchKindName(v); }
};
template <>
struct ChoiceTraits<parallel::BatchScope> {
  static constexpr std::array kValues = {parallel::BatchScope::kGlobal,
                                         parallel::BatchScope::kPerRank};
  static std::string_view Name(parallel::BatchScope v) { return parallel::BatchScopeName(v); }
};
template <>
struct ChoiceTraits<parallel::ScheduleKind> {
  // The training schedules (kForwardOnly is evaluation's: no key chooses it).
  static constexpr std::array kValues = {
      parallel::ScheduleKind::kFthenB, parallel::ScheduleKind::k1F1B,
      parallel::ScheduleKind::kInterleaved1F1B, parallel::ScheduleKind::kZeroBubbleH1};
  static std::string_view Name(parallel::ScheduleKind v) { return parallel::ScheduleKindName(v); }
};

// "\"a\", \"b\" or \"c\"": the names of E, for messages.
template <typename E>
std::string ChoiceNamesText() {
  std::string out;
  const auto& values = ChoiceTraits<E>::kValues;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += i + 1 == values.size() ? " or " : ", ";
    out += '"';
    out += ChoiceTraits<E>::Name(values[i]);
    out += '"';
  }
  return out;
}

// The value of E named `name`; false when none is.
template <typename E>
bool ChoiceFromName(std::string_view name, E& out) {
  for (E v : ChoiceTraits<E>::kValues) {
    if (ChoiceTraits<E>::Name(v) == name) {
      out = v;
      return true;
    }
  }
  return false;
}

template <typename E>
class Choice {
 public:
  using Enum = E;
  Choice(E value) : value_(value) {}  // NOLINT(google-explicit-constructor): a typed value
  // Parses `name`; a name that is none of the choices is kept for ValidateTrainConfig.
  Choice(std::string_view name) {  // NOLINT(google-explicit-constructor)
    if (!ChoiceFromName(name, value_)) unknown_ = name;
  }
  Choice(const char* name) : Choice(std::string_view(name)) {}         // NOLINT
  Choice(const std::string& name) : Choice(std::string_view(name)) {}  // NOLINT

  // The enum; a Choice holding an unknown name is a bug past ValidateTrainConfig.
  E value() const {
    SY_CHECK(valid(), "choice \"{}\" used before ValidateTrainConfig refused it", unknown_);
    return value_;
  }
  operator E() const { return value(); }  // NOLINT(google-explicit-constructor)
  bool valid() const { return unknown_.empty(); }
  // The JSON and flag spelling (the unknown name as given).
  std::string_view name() const {
    return valid() ? ChoiceTraits<E>::Name(value_) : std::string_view(unknown_);
  }

  friend bool operator==(const Choice& a, const Choice& b) { return a.name() == b.name(); }
  friend bool operator==(const Choice& a, E b) { return a.valid() && a.value_ == b; }
  // By name, as configs are written ("per_rank").
  friend bool operator==(const Choice& a, std::string_view b) { return a.name() == b; }
  friend bool operator==(const Choice& a, const char* b) { return a.name() == b; }
  friend std::ostream& operator<<(std::ostream& os, const Choice& c) { return os << c.name(); }

 private:
  E value_{};
  std::string unknown_;  // "" when value_ holds the choice
};

}  // namespace switchyard::train

// fmt prints a Choice by its name.
template <typename E>
struct fmt::formatter<switchyard::train::Choice<E>> : fmt::formatter<std::string_view> {
  auto format(const switchyard::train::Choice<E>& c, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(c.name(), ctx);
  }
};
