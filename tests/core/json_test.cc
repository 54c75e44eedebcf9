#include "switchyard/core/json.h"

#include <gtest/gtest.h>

#include <string>

#include "switchyard/core/error.h"

namespace switchyard {
namespace {

template <typename E>
std::string ErrorOf(std::string_view text, JsonErrorKind kind = JsonErrorKind::kInvalidArgument) {
  try {
    ParseJsonStrict(text, "cfg.json", kind);
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

TEST(Json, ParsesLikeNlohmann) {
  auto j = ParseJsonStrict(R"({"a": 1, "b": {"a": 2, "c": [{"a": 3}, {"a": 4}]}, "c": "x"})",
                           "cfg.json");
  EXPECT_EQ(j["a"], 1);
  EXPECT_EQ(j["b"]["c"][1]["a"], 4);
  EXPECT_EQ(ParseJsonStrict("[1, 2]", "x").size(), 2u);
  EXPECT_EQ(ParseJsonStrict("{}", "x"), nlohmann::json::object());
}

TEST(Json, DuplicateKeysAreErrorsNamingKeyAndFile) {
  EXPECT_EQ(ErrorOf<InvalidArgument>(R"({"top_k": 1, "x": 2, "top_k": 2})"),
            "cfg.json: key 'top_k' appears twice (a JSON object holds each key once; remove one "
            "of them)");
  EXPECT_NE(ErrorOf<InvalidArgument>(R"({"model": {"dim": 1, "dim": 2}})").find("key 'model.dim'"),
            std::string::npos);
  EXPECT_NE(ErrorOf<InvalidArgument>(R"({"l": [{"a": 1}, {"b": 1, "b": 2}]})").find("key 'l.b'"),
            std::string::npos)
      << ErrorOf<InvalidArgument>(R"({"l": [{"a": 1}, {"b": 1, "b": 2}]})");
  // The same key in sibling objects is fine.
  EXPECT_EQ(ErrorOf<InvalidArgument>(R"({"a": {"k": 1}, "b": {"k": 2}, "k": 3})"), "");
  EXPECT_NE(ErrorOf<IoError>(R"({"a": 1, "a": 1})", JsonErrorKind::kIoError).find("appears twice"),
            std::string::npos);
}

TEST(Json, SyntaxErrorsNameTheFile) {
  std::string msg = ErrorOf<InvalidArgument>(R"({"a": })");
  EXPECT_TRUE(msg.starts_with("cfg.json: invalid JSON: ")) << msg;
  EXPECT_TRUE(ErrorOf<IoError>("{", JsonErrorKind::kIoError).starts_with("cfg.json: invalid JSON"));
}

}  // namespace
}  // namespace switchyard
