// Which library computes kernels::Gemm (and so every grouped and batched GEMM): chosen in ONE
// place, SelectGemmBackend, from the CPU's features (kernels/cpu_features.h) and, on AVX2-only
// CPUs, the ISA of the kernel OpenBLAS actually runs -- never from a list of CPU models of our own.
// A BLAS's model table lags behind new CPUs (OpenBLAS 0.3.21 runs its Prescott SSE3 kernels on
// CPUs it does not know, at ~12 % of the FMA peak): such a CPU gets oneDNN.
//
// Backends:
//   kOneDnn    oneDNN's dnnl_sgemm: JIT-generated kernels for the ISA that oneDNN reads from
//              cpuid (avx2, avx512_core, avx512_core_bf16, avx512_core_amx). Runs single-
//              threaded per call; kernels::Gemm splits C over the rank's compute threads.
//   kOpenBlas  OpenBLAS's cblas_sgemm: kernels picked by OpenBLAS from its CPU-model table
//              (or OPENBLAS_CORETYPE, read when the library loads). Its own thread pool.
// The measurements behind the choice are in docs/PERFORMANCE.md ("GEMM backends").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "switchyard/kernels/cpu_features.h"

namespace switchyard::kernels {

enum class GemmBackend : uint8_t { kOneDnn, kOpenBlas };

// "onednn" / "openblas".
const char* GemmBackendKey(GemmBackend backend);
// Parses "onednn" / "openblas" (case-sensitive); throws InvalidArgument naming `what` and the
// accepted values otherwise.
GemmBackend ParseGemmBackend(std::string_view what, std::string_view name);

struct GemmBackendChoice {
  GemmBackend backend = GemmBackend::kOneDnn;
  std::string reason;  // one line: why this backend
};

// The selection rule. `openblas_core_isa` is the ISA of the kernel OpenBLAS picked on this
// machine (OpenBlasCoreIsa(OpenBlasCoreName())); `override_name` is the value of SY_GEMM_BACKEND
// ("" = not set): when set it wins. Otherwise, by the CPU's features:
//   AVX-512 F/BW/DQ/VL            oneDNN (its JIT follows the same cpuid features)
//   AVX2 + FMA, no AVX-512        OpenBLAS when it runs its AVX2 kernels here (measured faster
//                                 than oneDNN on such a CPU), oneDNN when OpenBLAS runs a kernel
//                                 below the CPU's ISA (e.g. a CPU model it does not know)
//   neither                       OpenBLAS (nothing faster is available there)
// The CPU's family and model never enter: OpenBLAS's model table only decides whether its
// kernel is the CPU's ISA, and a CPU it does not know gets oneDNN.
// SY_GEMM_BACKEND=openblas is refused (InvalidArgument naming OPENBLAS_CORETYPE) when OpenBLAS
// runs kernels the CPU cannot execute: its core was forced above the CPU's ISA, and every GEMM
// would stop with an illegal instruction.
GemmBackendChoice SelectGemmBackend(const CpuFeatures& cpu, std::string_view openblas_core_isa,
                                    std::string_view override_name);

// Whether kernels of OpenBLAS's core ISA ("avx512", "avx2", ...) execute on `cpu`.
bool OpenBlasCoreRunsOn(const CpuFeatures& cpu, std::string_view core_isa);

// The ISA of an OpenBLAS core (openblas_get_corename()): "avx512" (SkylakeX, Cooperlake,
// SapphireRapids), "avx2" (Haswell, Zen, ...), "avx" (SandyBridge, Bulldozer, ...) or "sse"
// (Prescott, Nehalem, Core2, Atom, generic cores and any name it does not know).
const char* OpenBlasCoreIsa(std::string_view core);

// A warning when a backend runs a kernel for a lower ISA (`kernel_isa`: "avx512", "avx2", "avx"
// or "sse") than `cpu` has -- the failing case: OpenBLAS on its Prescott core on an AVX-512 CPU;
// "" when there is nothing to warn about. `backend_name` is what the warning calls the backend.
std::string GenericKernelWarning(const CpuFeatures& cpu, std::string_view backend_name,
                                 std::string_view kernel_isa);

// The ISA of the kernel `backend` runs on this machine (same spelling as OpenBlasCoreIsa).
const char* GemmBackendIsa(GemmBackend backend);

// The backend kernels::Gemm uses now: SelectGemmBackend(HostCpuFeatures(), OpenBLAS's core ISA,
// $SY_GEMM_BACKEND) on first use, unless SetGemmBackend chose another. Thread-safe.
GemmBackend ActiveGemmBackend();
// Switches the backend for the whole process (benchmarks, tests). Call it while no GEMM runs.
// OpenBLAS is refused (InvalidArgument) when its core's kernels cannot execute on this CPU.
void SetGemmBackend(GemmBackend backend);
// Why the active backend was chosen ("SY_GEMM_BACKEND=openblas", "cpu has avx2+fma: ...").
std::string GemmBackendReason();

// What runs for `backend` on this machine: library, version and kernel, e.g.
// "oneDNN 2.6.3 (jit: avx512_core_bf16)" or "OpenBLAS 0.3.21 (core: Cooperlake)".
std::string GemmBackendName(GemmBackend backend);
// GemmBackendName(ActiveGemmBackend()).
std::string GemmBackendName();
// GenericKernelWarning for the active backend on this machine ("" = none).
std::string GemmBackendWarning();

// OpenBLAS's core name on this machine (openblas_get_corename()), e.g. "Cooperlake".
std::string OpenBlasCoreName();

// ---- bfloat16 GEMMs (`precision bf16`) ----
// Where the CPU has bf16 arithmetic (AVX512-BF16 or AMX-BF16, from cpuid), the bf16 operands go
// to oneDNN's matmul primitive as bf16 with float32 accumulation and output; elsewhere they are
// widened to float32 and run the float32 GEMM (bf16 then saves memory only). The CPU's family and
// model never enter.
struct Bf16GemmChoice {
  bool onednn_bf16 = false;  // true: OneDnnGemmBf16; false: widen to float32
  std::string reason;        // one line: why
};
// The rule. `override_name` is $SY_BF16_GEMM ("" = not set): "fp32" always widens, "onednn"
// always uses oneDNN's bf16 matmul (where oneDNN has one: to measure it on CPUs without bf16
// arithmetic); anything else is InvalidArgument naming the accepted values.
Bf16GemmChoice SelectBf16Gemm(const CpuFeatures& cpu, std::string_view override_name);
// SelectBf16Gemm(HostCpuFeatures(), $SY_BF16_GEMM), decided once per process.
const Bf16GemmChoice& ActiveBf16Gemm();
// C[m, n] = alpha * op(A) op(B) + beta * C through oneDNN's matmul primitive: A and B bfloat16
// (their bits, row-major; op(A) = A [m, k] with lda, or A^T stored [k, m]; likewise B), C
// float32 with ldc. One call builds and runs one primitive (threads: oneDNN's). Returns false
// and leaves C untouched when oneDNN has no bf16 matmul for this CPU. `impl` (may be null)
// receives oneDNN's implementation name, e.g. "brg:avx512_core_amx_bf16".
bool OneDnnGemmBf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, std::string* impl = nullptr);

}  // namespace switchyard::kernels
