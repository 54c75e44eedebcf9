// Runs the `switchyard` executable (SY_SWITCHYARD_BIN) for the cli tests, capturing its exit
// code, stdout and stderr.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace switchyard::testing {

struct CliResult {
  int exit_code = -1;  // -1: killed by a signal (a crash)
  std::string out, err;
};

// `<shell_prefix> switchyard <args>` run by sh -c, e.g. with the prefix "ulimit -v 400000;" or
// "timeout 30" (which makes a command that hangs exit with code 124).
inline CliResult RunSwitchyardAfter(const std::string& shell_prefix, const std::string& args) {
  static int counter = 0;
  const std::string err_path = ::testing::TempDir() + "/sy_cli_" +
                               ::testing::UnitTest::GetInstance()->current_test_info()->name() +
                               "_" + std::to_string(counter++) + ".stderr";
  const std::string command =
      shell_prefix + " " + std::string(SY_SWITCHYARD_BIN) + " " + args + " 2> " + err_path;
  CliResult r;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.out.append(buffer, n);
  int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  std::stringstream ss;
  ss << err.rdbuf();
  r.err = ss.str();
  return r;
}

// `switchyard <args>` (args as a shell would split them).
inline CliResult RunSwitchyard(const std::string& args) { return RunSwitchyardAfter("", args); }

inline std::vector<nlohmann::json> JsonLinesOf(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

}  // namespace switchyard::testing
