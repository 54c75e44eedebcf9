// .npy: NumPy's single-array file format (numpy.save / numpy.load).
//
// Reads format versions 1.0, 2.0 and 3.0 with dtype '<f4' (float32), '<i4' (int32) or '<i8'
// (int64), in C order. Other dtypes (float64, float16, big-endian, structured, object/pickled)
// are rejected with an IoError naming the dtype; fortran_order True is rejected unless the
// layout is the same as C order (at most one dimension larger than 1). bfloat16 has no NumPy
// dtype, so WriteNpy rejects bfloat16 tensors (convert with Tensor::To(DType::kFloat32) first,
// or use safetensors, which has BF16). See docs/formats.md.
//
// Writing produces the bytes numpy.save produces (version 1.0 unless the header needs 2.0,
// header padded to 64 bytes with room for the first dimension to grow), atomically (see
// file_util.h).
//
// Thread-safety: all functions are reentrant.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard {

// Reads a .npy file. Throws IoError naming the file and the problem.
Tensor ReadNpy(const std::string& path);
// Parses .npy bytes held in memory; `what` names them in error messages.
Tensor ParseNpy(std::span<const std::byte> bytes, std::string_view what);

// Writes a float32, int32 or int64 tensor atomically. Throws InvalidArgument for an undefined or
// bfloat16 tensor, IoError when the file cannot be written.
void WriteNpy(const std::string& path, const Tensor& t);
// The bytes WriteNpy writes.
std::vector<std::byte> SerializeNpy(const Tensor& t);

}  // namespace switchyard
