// What the CPU this process runs on can execute, read from cpuid (and xgetbv: whether the OS
// saves the vector registers), never from a list of CPU models. The GEMM backend selector
// (kernels/gemm_backend.h) and the hand-written kernels dispatch on it at run time.
#pragma once

#include <string>

namespace switchyard::kernels {

struct CpuFeatures {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ...
  int family = 0;      // display family and model (for reports only; nothing selects on them)
  int model = 0;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;

  // AVX2 + FMA (x86-64-v3): what the release build's own code needs.
  bool HasAvx2Fma() const { return avx2 && fma; }
  // AVX-512 F/BW/DQ/VL ("avx512_core"): what the AVX-512 kernels use.
  bool HasAvx512Core() const { return avx512f && avx512bw && avx512dq && avx512vl; }
  // The best float32 FMA level: "avx512", "avx2" or "sse".
  const char* BestFmaIsa() const;
  // E.g. "AuthenticAMD family 25 model 17: avx2 fma avx512f avx512bw avx512dq avx512vl
  // avx512_bf16".
  std::string ToString() const;
};

// The features of this machine, detected once.
const CpuFeatures& HostCpuFeatures();

}  // namespace switchyard::kernels
