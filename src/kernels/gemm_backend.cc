#include "switchyard/kernels/gemm_backend.h"

#include <cblas.h>
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include "switchyard/core/error.h"

namespace switchyard::kernels {
namespace {

int IsaRank(std::string_view isa) {
  if (isa == "avx512") return 3;
  if (isa == "avx2") return 2;
  if (isa == "avx") return 1;
  return 0;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

const char* OneDnnIsaName(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_sse41: return "sse41";
    default: return "unknown";
  }
}

struct State {
  std::once_flag once;
  std::atomic<GemmBackend> backend{GemmBackend::kOneDnn};
  std::mutex mu;
  std::string reason;
};

State& GetState() {
  static State state;
  std::call_once(state.once, [] {
    const char* env = std::getenv("SY_GEMM_BACKEND");
    GemmBackendChoice c =
        SelectGemmBackend(HostCpuFeatures(), OpenBlasCoreIsa(OpenBlasCoreName()), env ? env : "");
    state.backend.store(c.backend);
    state.reason = std::move(c.reason);
  });
  return state;
}

}  // namespace

const char* GemmBackendKey(GemmBackend backend) {
  return backend == GemmBackend::kOneDnn ? "onednn" : "openblas";
}

GemmBackend ParseGemmBackend(std::string_view what, std::string_view name) {
  if (name == "onednn") return GemmBackend::kOneDnn;
  if (name == "openblas") return GemmBackend::kOpenBlas;
  throw InvalidArgument(
      fmt::format("{}: unknown GEMM backend '{}', expected onednn or openblas", what, name));
}

bool OpenBlasCoreRunsOn(const CpuFeatures& cpu, std::string_view core_isa) {
  if (core_isa == "avx512") return cpu.HasAvx512Core();
  if (core_isa == "avx2") return cpu.HasAvx2Fma();
  return true;
}

void RequireOpenBlasRunsHere(const CpuFeatures& cpu, std::string_view core_isa,
                             std::string_view what) {
  SY_REQUIRE(
      OpenBlasCoreRunsOn(cpu, core_isa), InvalidArgument,
      "{}: OpenBLAS runs {} kernels, which this cpu ({}) cannot execute (its core type was "
      "forced, e.g. by OPENBLAS_CORETYPE); unset OPENBLAS_CORETYPE or use the onednn backend",
      what, core_isa, cpu.ToString());
}

GemmBackendChoice SelectGemmBackend(const CpuFeatures& cpu, std::string_view openblas_core_isa,
                                    std::string_view override_name) {
  if (!override_name.empty()) {
    const GemmBackend forced = ParseGemmBackend("SY_GEMM_BACKEND", override_name);
    if (forced == GemmBackend::kOpenBlas) {
      RequireOpenBlasRunsHere(cpu, openblas_core_isa, "SY_GEMM_BACKEND=openblas");
    }
    return {forced, fmt::format("SY_GEMM_BACKEND={}", override_name)};
  }
  if (cpu.HasAvx512Core()) {
    return {GemmBackend::kOneDnn,
            "cpu has avx512 f/bw/dq/vl: oneDNN JIT-compiles its kernels for the cpu's ISA"};
  }
  if (cpu.HasAvx2Fma()) {
    // Measured on an AVX2-only Zen 3: OpenBLAS's own AVX2 kernels are 2-7 points of the FMA peak
    // ahead of oneDNN's on every expert shape (docs/PERFORMANCE.md). They are only used when
    // OpenBLAS runs them, i.e. when the kernel it picked is for the cpu's ISA.
    if (openblas_core_isa == "avx2") {
      return {GemmBackend::kOpenBlas,
              "cpu has avx2+fma (no avx512) and OpenBLAS runs its avx2 kernels on it"};
    }
    return {GemmBackend::kOneDnn,
            fmt::format("cpu has avx2+fma but OpenBLAS runs {} kernels{}: oneDNN JIT-compiles its "
                        "kernels for the cpu's ISA",
                        openblas_core_isa.empty() ? std::string_view("unknown") : openblas_core_isa,
                        OpenBlasCoreRunsOn(cpu, openblas_core_isa)
                            ? ""
                            : ", which this cpu cannot execute (OPENBLAS_CORETYPE?)")};
  }
  return {GemmBackend::kOpenBlas, "cpu has no avx2+fma: OpenBLAS's own choice of kernel"};
}

const char* OpenBlasCoreIsa(std::string_view core) {
  const std::string c = Lower(core);
  for (const char* name : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (c == name) return "avx512";
  }
  for (const char* name : {"haswell", "zen", "skylake"}) {
    if (c == name) return "avx2";
  }
  for (const char* name : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"}) {
    if (c == name) return "avx";
  }
  return "sse";
}

std::string GenericKernelWarning(const CpuFeatures& cpu, std::string_view backend_name,
                                 std::string_view kernel_isa) {
  const char* best = cpu.BestFmaIsa();
  if (IsaRank(kernel_isa) >= IsaRank(best)) return "";
  return fmt::format(
      "warning: {} runs a {} kernel on a cpu with {} ({} of the FMA peak is out of reach); "
      "unset SY_GEMM_BACKEND to let switchyard choose by the cpu's features",
      backend_name, kernel_isa, best, IsaRank(kernel_isa) == 0 ? "most" : "part");
}

const char* GemmBackendIsa(GemmBackend backend) {
  if (backend == GemmBackend::kOpenBlas) return OpenBlasCoreIsa(OpenBlasCoreName());
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  if ((isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core) return "avx512";
  if ((isa & dnnl_cpu_isa_avx2) == dnnl_cpu_isa_avx2) return "avx2";
  if ((isa & dnnl_cpu_isa_avx) == dnnl_cpu_isa_avx) return "avx";
  return "sse";
}

GemmBackend ActiveGemmBackend() { return GetState().backend.load(std::memory_order_relaxed); }

void SetGemmBackend(GemmBackend backend) {
  if (backend == GemmBackend::kOpenBlas) {
    RequireOpenBlasRunsHere(HostCpuFeatures(), OpenBlasCoreIsa(OpenBlasCoreName()),
                            "GEMM backend openblas");
  }
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.backend.store(backend);
  s.reason = fmt::format("set by the program ({})", GemmBackendKey(backend));
}

std::string GemmBackendReason() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.reason;
}

std::string GemmBackendName(GemmBackend backend) {
  if (backend == GemmBackend::kOpenBlas) {
    // openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64"
    std::string config = openblas_get_config();
    std::string version = config.substr(0, config.find(' ', config.find(' ') + 1));
    return fmt::format("{} (core: {})", version, OpenBlasCoreName());
  }
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("oneDNN {}.{}.{} (jit: {})", v->major, v->minor, v->patch,
                     OneDnnIsaName(dnnl_get_effective_cpu_isa()));
}

std::string GemmBackendName() { return GemmBackendName(ActiveGemmBackend()); }

std::string GemmBackendWarning() {
  const GemmBackend b = ActiveGemmBackend();
  return GenericKernelWarning(HostCpuFeatures(), GemmBackendName(b), GemmBackendIsa(b));
}

std::string OpenBlasCoreName() { return openblas_get_corename(); }

}  // namespace switchyard::kernels
