// Helpers of the dataset tests: writing raw files and checking the error a reader throws.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::train::dataset::testing {

inline void WriteBytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<char> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename T>
void Put(std::vector<char>& out, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
void PutAt(std::vector<char>& out, size_t offset, T v) {
  std::memcpy(out.data() + offset, &v, sizeof(T));
}

// Runs `f`, which must throw switchyard::Error whose message contains every one of `parts`.
inline void ExpectError(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one containing '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(what.find(p), std::string::npos) << "message: " << what << "\nexpected: " << p;
    }
  }
}

}  // namespace switchyard::train::dataset::testing
