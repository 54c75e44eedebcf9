// Preprocessing: text files -> a Megatron indexed dataset (docs/data.md, "Preprocessing"), the
// work of Megatron-LM's tools/preprocess_data.py.
//
// Input: each file is read line by line (never whole). A `.jsonl` or `.json` file holds one JSON
// object per line and the document is the string under `json_key`; any other file holds one
// document per line (the line without its end; "\r\n" ends are accepted). Empty documents are
// skipped and counted. Each document becomes one sequence of the tokenizer's ids, followed by its
// end-of-document id with append_eod.
// Output: PREFIX.bin + PREFIX.idx (MegatronWriter: temporary files renamed when complete; uint16
// elements below 65500 ids, int32 above). Documents are written in input order whatever the
// number of workers, so the output is the same for every `workers`.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/train/dataset/tokenizer.h"

namespace switchyard::train::dataset {

struct PreprocessProgress {
  int64_t bytes_read = 0;   // of the inputs, so far
  int64_t bytes_total = 0;  // sizes of all inputs
  int64_t documents = 0;    // written so far
  int64_t tokens = 0;       // written so far (EOD ids included)
  double seconds = 0;       // since the start
};

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string json_key = "text";
  bool append_eod = false;
  int workers = 1;                 // encoding threads
  int64_t chunk_documents = 4096;  // documents read before they are encoded in parallel
  // Called after every chunk (and once at the end), from the calling thread.
  std::function<void(const PreprocessProgress&)> progress{};
};

struct PreprocessResult {
  int64_t documents = 0;
  int64_t empty_skipped = 0;
  int64_t tokens = 0;
  int64_t text_bytes = 0;  // bytes of the documents' text (bytes per token = text_bytes / tokens
                           // without the EOD ids)
  double seconds = 0;
  std::string bin_path, idx_path;
};

// The ids of each document, followed by the tokenizer's end-of-document id with append_eod
// (InvalidArgument when it has none), encoded on `workers` threads; the order is kept. For text
// held in memory: InMemoryTokenSource(name, EncodeDocuments(...), tokenizer.vocab_size()) is
// then a TokenSource like any token file.
std::vector<std::vector<int32_t>> EncodeDocuments(const Tokenizer& tokenizer,
                                                  std::span<const std::string_view> documents,
                                                  bool append_eod, int workers = 1);

// Errors: IoError naming an input that is missing or not a regular file (checked before anything
// is written), InvalidArgument naming file:line for a JSON line that does not parse or lacks a
// string `json_key`, and for append_eod with a tokenizer that has no end-of-document id; an
// input without any document is an empty dataset (InvalidArgument). Nothing is left at PREFIX on
// error.
PreprocessResult Preprocess(const Tokenizer& tokenizer, const PreprocessOptions& options,
                            const std::string& out_prefix);

}  // namespace switchyard::train::dataset
