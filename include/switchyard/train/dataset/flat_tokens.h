// Flat token files: one stream of uint16 token ids, without document boundaries.
//   nanoGPT (prepare.py):  the ids, nothing else (a file of 2 * N bytes);
//   llm.c (dev/data):      a header of 256 int32 (magic 20240520, version 1, token count N,
//                          the rest 0), then N uint16 ids: 1024 + 2 * N bytes.
// Both are memory-mapped. The stream is presented as documents of OpenOptions::
// flat_document_tokens tokens each (the last one shorter), so that the sample construction can
// shuffle and split it like any other dataset.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "switchyard/train/dataset/token_source.h"

namespace switchyard::train::dataset {

inline constexpr int32_t kLlmcTokenMagic = 20240520;
inline constexpr int32_t kLlmcTokenVersion = 1;
inline constexpr int64_t kLlmcHeaderInts = 256;

// Errors (IoError / InvalidArgument naming the file): not a regular file, empty, an odd number
// of bytes (nanoGPT), a short header, wrong magic or version, a token count that does not match
// the file's size (llm.c), ids outside the vocabulary (token_source.h).
std::unique_ptr<TokenSource> OpenNanoGptTokens(const std::string& path,
                                               const OpenOptions& options = {});
std::unique_ptr<TokenSource> OpenLlmcTokens(const std::string& path,
                                            const OpenOptions& options = {});

}  // namespace switchyard::train::dataset
