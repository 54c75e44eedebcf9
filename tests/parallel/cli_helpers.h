// Running the `switchyard` executable from tests and comparing the safetensors files it writes.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "switchyard/core/file_util.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"

namespace switchyard::parallel::testing {

struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `command` through the shell with stdout and stderr captured in `dir`.
inline CommandResult RunCommand(const std::string& command, const std::string& dir) {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  int status = std::system((command + " > " + out + " 2> " + err).c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadAll(out);
  r.err = ReadAll(err);
  return r;
}

// A fresh directory for the current test.
inline std::string TestDir(const std::string& prefix) {
  std::string dir = ::testing::TempDir() + "/" + prefix + "_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// layer.json and in.safetensors (x, dy and the parameters) in `dir`.
inline void WriteLayerInputs(const std::string& dir, const std::string& config_json,
                             int64_t tokens) {
  WriteTextFileAtomic(dir + "/layer.json", config_json);
  moe::LayerConfig c = moe::LayerConfigFromJson(config_json);
  TensorMap t = moe::ParamsToMap(c, moe::InitParams(c, 5));
  for (const char* name : {"x", "dy"}) {
    Tensor v = Tensor::Empty({tokens, c.model_dim});
    CounterRng rng(name[0] == 'x' ? 1 : 2, kStreamData);
    for (int64_t i = 0; i < v.numel(); ++i) {
      v.data<float>()[i] = 2.0f * rng.Uniform(static_cast<uint64_t>(i)) - 1.0f;
    }
    t[name] = v;
  }
  WriteSafetensors(dir + "/in.safetensors", t);
}

// Same tensor names, shapes and dtypes; integers equal, floats within tolerance.
inline ::testing::AssertionResult SameOutputs(const std::string& a_path, const std::string& b_path,
                                              double rtol = 2e-4, double atol = 2e-5) {
  TensorMap a = ReadSafetensors(a_path), b = ReadSafetensors(b_path);
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << a.size() << " tensors vs " << b.size();
  }
  for (const auto& [name, ta] : a) {
    auto it = b.find(name);
    if (it == b.end()) return ::testing::AssertionFailure() << "missing " << name;
    const Tensor& tb = it->second;
    if (ta.shape() != tb.shape() || ta.dtype() != tb.dtype()) {
      return ::testing::AssertionFailure()
             << name << ": " << ta.ToString() << " vs " << tb.ToString();
    }
    const bool exact = ta.dtype() == DType::kInt32 || ta.dtype() == DType::kInt64;
    for (int64_t i = 0; i < ta.numel(); ++i) {
      double x = ta.At(i), y = tb.At(i);
      if (x == y) continue;
      if (exact || !(std::abs(x - y) <= atol + rtol * std::abs(y))) {
        return ::testing::AssertionFailure()
               << name << " element " << i << ": " << x << " vs " << y;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace switchyard::parallel::testing
