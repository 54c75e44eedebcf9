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

Bf16GemmChoice SelectBf16Gemm(const CpuFeatures& cpu, std::string_view override_name) {
  if (override_name == "fp32")
    return {false, "SY_BF16_GEMM=fp32: bf16 operands widened to fp32, the fp32 GEMM"};
  if (override_name == "onednn")
    return {true, "SY_BF16_GEMM=onednn: oneDNN's bf16 matmul (fp32 accumulation)"};
  SY_REQUIRE(override_name.empty(), InvalidArgument,
             "SY_BF16_GEMM: unknown value '{}', expected fp32 or onednn", override_name);
  if (cpu.amx_bf16 || cpu.avx512_bf16) {
    return {true, fmt::format("cpu has {}: oneDNN's bf16 matmul (fp32 accumulation)",
                              cpu.amx_bf16 ? "amx_bf16" : "avx512_bf16")};
  }
  return {false,
          "cpu has no bf16 arithmetic (no avx512_bf16, no amx_bf16): bf16 operands widened to "
          "fp32, the fp32 GEMM; bf16 saves memory only"};
}

const Bf16GemmChoice& ActiveBf16Gemm() {
  static const Bf16GemmChoice choice = [] {
    const char* env = std::getenv("SY_BF16_GEMM");
    return SelectBf16Gemm(HostCpuFeatures(), env ? env : "");
  }();
  return choice;
}

namespace {

// Owns oneDNN handles for one call and releases them in reverse order.
struct DnnlCall {
  dnnl_engine_t engine = nullptr;
  dnnl_stream_t stream = nullptr;
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_post_ops_t post_ops = nullptr;
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t mem[3] = {nullptr, nullptr, nullptr};
  ~DnnlCall() {
    for (dnnl_memory_t m : mem)
      if (m != nullptr) dnnl_memory_destroy(m);
    if (prim != nullptr) dnnl_primitive_destroy(prim);
    if (pd != nullptr) dnnl_primitive_desc_destroy(pd);
    if (post_ops != nullptr) dnnl_post_ops_destroy(post_ops);
    if (attr != nullptr) dnnl_primitive_attr_destroy(attr);
    if (stream != nullptr) dnnl_stream_destroy(stream);
    if (engine != nullptr) dnnl_engine_destroy(engine);
  }
};

void DnnlOk(dnnl_status_t s, const char* what) {
  SY_CHECK(s == dnnl_success, "oneDNN bf16 matmul: {} failed (status {})", what,
           static_cast<int>(s));
}

}  // namespace

bool OneDnnGemmBf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, std::string* impl) {
  SY_REQUIRE(m >= 0 && n >= 0 && k >= 0 && lda >= (trans_a ? m : k) && ldb >= (trans_b ? k : n) &&
                 ldc >= n,
             InvalidArgument,
             "bf16 GEMM: sizes m {} n {} k {} with leading dimensions {}, {}, {} are not a "
             "row-major product",
             m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return true;
  DnnlCall d;
  DnnlOk(dnnl_engine_create(&d.engine, dnnl_cpu, 0), "engine");
  dnnl_memory_desc_t md[3];
  const dnnl_dims_t a_dims = {m, k}, b_dims = {k, n}, c_dims = {m, n};
  const dnnl_dims_t a_strides = {trans_a ? 1 : lda, trans_a ? lda : 1};
  const dnnl_dims_t b_strides = {trans_b ? 1 : ldb, trans_b ? ldb : 1};
  const dnnl_dims_t c_strides = {ldc, 1};
  DnnlOk(dnnl_memory_desc_init_by_strides(&md[0], 2, a_dims, dnnl_bf16, a_strides), "A desc");
  DnnlOk(dnnl_memory_desc_init_by_strides(&md[1], 2, b_dims, dnnl_bf16, b_strides), "B desc");
  DnnlOk(dnnl_memory_desc_init_by_strides(&md[2], 2, c_dims, dnnl_f32, c_strides), "C desc");
  dnnl_matmul_desc_t desc;
  DnnlOk(dnnl_matmul_desc_init(&desc, &md[0], &md[1], nullptr, &md[2]), "matmul desc");
  DnnlOk(dnnl_primitive_attr_create(&d.attr), "attr");
  DnnlOk(dnnl_primitive_attr_set_output_scales(d.attr, 1, 0, &alpha), "alpha");
  if (beta != 0.0f) {
    DnnlOk(dnnl_post_ops_create(&d.post_ops), "post ops");
    DnnlOk(dnnl_post_ops_append_sum(d.post_ops, beta), "beta");
    DnnlOk(dnnl_primitive_attr_set_post_ops(d.attr, d.post_ops), "post ops");
  }
  if (dnnl_primitive_desc_create(&d.pd, &desc, d.attr, d.engine, nullptr) != dnnl_success) {
    d.pd = nullptr;
    return false;  // no bf16 matmul on this CPU
  }
  if (impl != nullptr) {
    const char* name = nullptr;
    dnnl_primitive_desc_query(d.pd, dnnl_query_impl_info_str, 0, &name);
    *impl = name != nullptr ? name : "unknown";
  }
  DnnlOk(dnnl_primitive_create(&d.prim, d.pd), "primitive");
  DnnlOk(dnnl_stream_create(&d.stream, d.engine, dnnl_stream_default_flags), "stream");
  void* ptr[3] = {const_cast<uint16_t*>(a), const_cast<uint16_t*>(b), c};
  for (int i = 0; i < 3; ++i)
    DnnlOk(dnnl_memory_create(&d.mem[i], &md[i], d.engine, ptr[i]), "memory");
  const dnnl_exec_arg_t args[3] = {
      {DNNL_ARG_SRC, d.mem[0]}, {DNNL_ARG_WEIGHTS, d.mem[1]}, {DNNL_ARG_DST, d.mem[2]}};
  DnnlOk(dnnl_primitive_execute(d.prim, d.stream, 3, args), "execute");
  DnnlOk(dnnl_stream_wait(d.stream), "wait");
  return true;
}

}  // namespace switchyard::kernels
