#include "switchyard/core/json.h"

#include <set>
#include <string>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard {
namespace {

[[noreturn]] void Fail(JsonErrorKind kind, std::string message) {
  if (kind == JsonErrorKind::kIoError) throw IoError(std::move(message));
  throw InvalidArgument(std::move(message));
}

std::string Shown(const std::string& key) {
  return key.size() > 60 ? key.substr(0, 60) + "..." : key;
}

}  // namespace

nlohmann::json ParseJsonStrict(std::string_view text, std::string_view what, JsonErrorKind kind) {
  using Json = nlohmann::json;
  // One set of keys per open object; `path` holds the key of each open object's parent entry
  // (empty for array elements and the root) and `last_key` the key just read at each level.
  std::vector<std::set<std::string>> open;
  std::vector<std::string> last_key;
  std::vector<std::string> path;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        path.push_back(last_key.empty() ? "" : last_key.back());
        open.emplace_back();
        last_key.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        open.pop_back();
        last_key.pop_back();
        path.pop_back();
        break;
      case Json::parse_event_t::array_start:
        // Objects inside an array are named by the array's key (without the index).
        last_key.push_back(last_key.empty() ? "" : last_key.back());
        break;
      case Json::parse_event_t::array_end: last_key.pop_back(); break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        last_key.back() = key;
        if (!open.back().insert(key).second) {
          std::string full;
          for (const std::string& p : path) {
            if (!p.empty()) full += p + ".";
          }
          full += key;
          Fail(kind, fmt::format("{}: key '{}' appears twice (a JSON object holds each key once; "
                                 "remove one of them)",
                                 what, Shown(full)));
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    Fail(kind, fmt::format("{}: invalid JSON: {}", what, e.what()));
  }
}

}  // namespace switchyard
