#include "switchyard/core/error.h"

namespace switchyard::detail {

void ThrowInternal(const char* file, int line, const char* cond, const std::string& msg) {
  std::string text = fmt::format("{}:{}: internal check '{}' failed", file, line, cond);
  if (!msg.empty()) text += ": " + msg;
  throw InternalError(text);
}

}  // namespace switchyard::detail
