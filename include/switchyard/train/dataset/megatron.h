// Megatron-LM's indexed dataset: PREFIX.bin (the tokens of every sequence, back to back) and
// PREFIX.idx (where each sequence starts and how long it is, and which sequences form each
// document). The byte layout is in docs/data.md ("Megatron indexed dataset"); in short, all
// little-endian:
//   idx: "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 sequence count S
//        | u64 document index count D + 1 | int32 lengths[S] | int64 byte pointers[S]
//        | int64 document index[D + 1]
//   bin: the elements of every sequence, of the dtype's size, back to back.
// Document d is made of sequences [index[d], index[d+1]). Preprocessing writes one sequence per
// document (Megatron's preprocess_data.py without sentence splitting); the reader accepts any
// number of sequences per document and presents each document as one run of tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "switchyard/core/file_util.h"
#include "switchyard/train/dataset/token_source.h"

namespace switchyard::train::dataset {

// Element types and their codes in the .idx (Megatron's DType table).
enum class MegatronDtype : uint8_t {
  kUint8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUint16 = 8,
};

// Bytes per element; 0 for a code that is not in the table.
int MegatronDtypeSize(uint8_t code);
// "uint16", ...; "unknown" for a code that is not in the table.
std::string MegatronDtypeName(uint8_t code);
// The element type Megatron's preprocessing picks for a vocabulary: uint16 below 65500 ids,
// int32 otherwise.
MegatronDtype MegatronDtypeForVocabulary(int64_t vocab_size);

inline constexpr char kMegatronIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr int64_t kMegatronIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;

// "PREFIX" from "PREFIX", "PREFIX.bin" or "PREFIX.idx".
std::string MegatronPrefix(const std::string& path);

// Opens a Megatron dataset (memory-mapped). Checks everything but the token values up front:
// magic, version, dtype (an integer type), that the index is as long as its counts say, that the
// document index starts at 0, never decreases and ends at S, and that every sequence lies inside
// the .bin. Token ids: see token_source.h. Errors name the .idx or .bin file and what was
// expected.
std::unique_ptr<TokenSource> OpenMegatronDataset(const std::string& prefix,
                                                 const OpenOptions& options = {});

// Writes a Megatron dataset by streaming appends: tokens go to a temporary PREFIX.bin as they
// come (buffered), the sequence lengths are kept (4 bytes per sequence, 8 per document) and the
// index is written by Finish(). Both files are written under temporary names and renamed into
// place by Finish() (.bin first, then .idx), so a reader never sees a half-written dataset and a
// writer destroyed without Finish() leaves existing files untouched.
// Not thread-safe: one writer belongs to one thread.
class MegatronWriter {
 public:
  MegatronWriter(std::string prefix, MegatronDtype dtype);
  ~MegatronWriter();
  MegatronWriter(const MegatronWriter&) = delete;
  MegatronWriter& operator=(const MegatronWriter&) = delete;

  // Appends one sequence to the current document. InvalidArgument when an id does not fit the
  // dtype (e.g. >= 65536 for uint16).
  void AddSequence(std::span<const int32_t> tokens);
  // Ends the current document (which may have zero sequences, as in Megatron's builder).
  void EndDocument();
  // AddSequence + EndDocument.
  void AddDocument(std::span<const int32_t> tokens);
  // Writes the index and renames both files into place. At most once.
  void Finish();

  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_index_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void Flush();

  std::string prefix_;
  MegatronDtype dtype_;
  int element_size_;
  AtomicFileWriter bin_;
  std::vector<std::byte> buffer_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> document_index_{0};
  int64_t num_tokens_ = 0;
  bool finished_ = false;
};

}  // namespace switchyard::train::dataset
