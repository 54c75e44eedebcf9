// Tiny random Hugging Face model directories and their PyTorch reference outputs, written once per
// test suite by tests/models/make_tiny_hf.py (tests). The test target defines SY_SYSTEM_PYTHON3
// and SY_MAKE_TINY_HF.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "switchyard/core/file_util.h"
#include "train/temp_dir.h"

namespace switchyard::train::testing {

struct TinyHfDirs {
  std::unique_ptr<TempDir> dir;
  bool has_torch = false;
  bool made = false;

  // Writes the directories (make_tiny_hf.py's `args`, e.g. "--family mixtral") into a fresh
  // temporary directory; nothing is written when python3 cannot import torch.
  void Make(const std::string& args) {
    dir = std::make_unique<TempDir>();
    const std::string probe =
        std::string(SY_SYSTEM_PYTHON3) + " -c 'import torch' > /dev/null 2>&1";
    has_torch = std::system(probe.c_str()) == 0;
    if (!has_torch) return;
    const std::string make = std::string(SY_SYSTEM_PYTHON3) + " " + SY_MAKE_TINY_HF + " --out " +
                             dir->path() + " " + args + " > " + dir->path() + "/log.txt 2>&1";
    made = std::system(make.c_str()) == 0;
  }

  // python3-torch is a test dependency (scripts/setup.sh): its absence fails, never skips.
  void RequireMade() const {
    ASSERT_TRUE(has_torch) << "PyTorch is not importable by " << SY_SYSTEM_PYTHON3
                           << ": install python3-torch (scripts/setup.sh)";
    ASSERT_TRUE(made) << ReadTextFile(*dir / "log.txt");
  }
};

}  // namespace switchyard::train::testing
