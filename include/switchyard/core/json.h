// Strict JSON parsing for every JSON input switchyard reads (layer.json, train configs,
// checkpoint state): nlohmann's parser, except that a key repeated inside one object is an
// error. A JSON object keeps one value per key, so "last one wins" would otherwise silently drop
// what the user wrote first (safetensors headers are held to the same rule, safetensors.h).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

namespace switchyard {

enum class JsonErrorKind : uint8_t {
  kInvalidArgument,  // input the user wrote (configs): InvalidArgument (CLI exit code 2)
  kIoError           // files switchyard wrote and reads back (checkpoints): IoError
};

// Parses `text`. Throws InvalidArgument (or IoError, by `kind`) naming `what` (the file) and
// the problem: "layer.json: invalid JSON: ..." or
// "layer.json: key 'top_k' appears twice (a JSON object holds each key once)"; a repeated key
// inside a nested object is named with its path ("key 'model.dim' appears twice").
nlohmann::json ParseJsonStrict(std::string_view text, std::string_view what,
                               JsonErrorKind kind = JsonErrorKind::kInvalidArgument);

}  // namespace switchyard
