#include "switchyard/train/parameters.h"

#include <set>

#include "switchyard/core/rng.h"

namespace switchyard::train {

Parameter& ParameterSet::Add(std::string name, Tensor value, ParamOptions options) {
  SY_REQUIRE(!name.empty(), InvalidArgument, "parameter name must not be empty");
  SY_REQUIRE(Find(name) == nullptr, InvalidArgument, "parameter '{}' registered twice", name);
  SY_REQUIRE(value.defined(), InvalidArgument, "parameter '{}': value is undefined", name);
  ExpectDType(name, value, DType::kFloat32);
  Parameter p;
  p.name = std::move(name);
  p.grad = options.trainable ? Tensor::Zeros(value.shape()) : Tensor();
  p.value = std::move(value);
  p.options = options;
  params_.push_back(std::move(p));
  return params_.back();
}

Parameter* ParameterSet::Find(std::string_view name) {
  for (auto& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const Parameter* ParameterSet::Find(std::string_view name) const {
  for (const auto& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Parameter& ParameterSet::Get(std::string_view name) {
  Parameter* p = Find(name);
  SY_REQUIRE(p != nullptr, InvalidArgument, "no parameter named '{}'", name);
  return *p;
}

void ParameterSet::ZeroGrad() {
  for (auto& p : params_) {
    if (p.grad.defined()) p.grad.SetZero();
  }
}

int64_t ParameterSet::NumTrainableElements() const {
  int64_t n = 0;
  for (const auto& p : params_) {
    if (p.options.trainable) n += p.value.numel();
  }
  return n;
}

TensorMap ParameterSet::Values() const {
  TensorMap out;
  for (const auto& p : params_) out.emplace(p.name, p.value);
  return out;
}

void ParameterSet::LoadValues(const TensorMap& tensors, bool allow_extra) {
  std::set<std::string_view> known;
  for (auto& p : params_) {
    known.insert(p.name);
    auto it = tensors.find(p.name);
    SY_REQUIRE(it != tensors.end(), InvalidArgument, "parameter '{}' {} is missing", p.name,
               ShapeToString(p.value.shape()));
    const Tensor& src = it->second;
    SY_REQUIRE(src.shape() == p.value.shape(), InvalidArgument,
               "parameter '{}': expected shape {}, got {}", p.name, ShapeToString(p.value.shape()),
               ShapeToString(src.shape()));
    ExpectFloating(p.name, src);
    p.value.CopyFrom(src.dtype() == DType::kFloat32 ? src : src.To(DType::kFloat32));
  }
  if (!allow_extra) {
    for (const auto& [name, t] : tensors) {
      SY_REQUIRE(known.count(name) != 0, InvalidArgument,
                 "tensor '{}' {} is not a parameter of this model", name, ShapeToString(t.shape()));
    }
  }
}

uint64_t InitStream(std::string_view name) {
  // FNV-1a, 64 bit.
  uint64_t h = 1469598103934665603ull;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return kStreamInit + h;
}

void InitNormal(const Tensor& t, float std, uint64_t seed, std::string_view name) {
  CounterRng rng(seed, InitStream(name));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std * rng.Normal(static_cast<uint64_t>(i));
}

}  // namespace switchyard::train
