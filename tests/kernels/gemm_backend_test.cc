// The GEMM backend selector (gemm_backend.h) and every backend against the float64 reference.
#include "switchyard/kernels/gemm_backend.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/reference.h"
#include "testing/random.h"

namespace switchyard::kernels {
namespace {

using testing::AllClose;
using testing::RandomVector;

CpuFeatures Avx512Cpu() {
  CpuFeatures f;
  f.vendor = "GenuineIntel";
  f.family = 6;
  f.model = 207;  // the model OpenBLAS 0.3.21 does not know
  f.avx2 = f.fma = f.avx512f = f.avx512bw = f.avx512dq = f.avx512vl = true;
  return f;
}

CpuFeatures Avx2Cpu() {
  CpuFeatures f;
  f.vendor = "AuthenticAMD";
  f.avx2 = f.fma = true;
  return f;
}

TEST(SelectGemmBackend, ChoosesByFeaturesNotModel) {
  // AVX-512: oneDNN, whatever OpenBLAS runs.
  for (const char* isa : {"avx512", "avx2", "sse", ""}) {
    EXPECT_EQ(SelectGemmBackend(Avx512Cpu(), isa, "").backend, GemmBackend::kOneDnn) << isa;
  }
  // AVX2 only: OpenBLAS when it runs its AVX2 kernels, oneDNN when it runs anything lower.
  EXPECT_EQ(SelectGemmBackend(Avx2Cpu(), "avx2", "").backend, GemmBackend::kOpenBlas);
  for (const char* isa : {"avx", "sse", ""}) {
    GemmBackendChoice c = SelectGemmBackend(Avx2Cpu(), isa, "");
    EXPECT_EQ(c.backend, GemmBackend::kOneDnn) << isa;
    EXPECT_NE(c.reason.find("OpenBLAS runs"), std::string::npos) << c.reason;
  }
  // Any family / model with the same features gets the same backend.
  CpuFeatures other = Avx512Cpu();
  other.family = 25;
  other.model = 17;
  EXPECT_EQ(SelectGemmBackend(other, "avx2", "").backend, GemmBackend::kOneDnn);
  CpuFeatures other2 = Avx2Cpu();
  other2.family = 6;
  other2.model = 207;
  EXPECT_EQ(SelectGemmBackend(other2, "avx2", "").backend, GemmBackend::kOpenBlas);
  EXPECT_EQ(SelectGemmBackend(other2, "sse", "").backend, GemmBackend::kOneDnn);
  // Without AVX2 + FMA: OpenBLAS's own choice.
  EXPECT_EQ(SelectGemmBackend(CpuFeatures{}, "sse", "").backend, GemmBackend::kOpenBlas);
  CpuFeatures avx2_no_fma = Avx2Cpu();
  avx2_no_fma.fma = false;
  EXPECT_EQ(SelectGemmBackend(avx2_no_fma, "sse", "").backend, GemmBackend::kOpenBlas);
}

TEST(SelectGemmBackend, ForcedOpenBlasWithKernelsTheCpuCannotRunIsAClearError) {
  // OPENBLAS_CORETYPE=SkylakeX on an AVX2-only CPU: every OpenBLAS GEMM would stop with SIGILL.
  try {
    SelectGemmBackend(Avx2Cpu(), "avx512", "openblas");
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("OPENBLAS_CORETYPE"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot execute"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SelectGemmBackend(CpuFeatures{}, "avx2", "openblas"), InvalidArgument);
  // Not forced: oneDNN, and the reason says why.
  GemmBackendChoice c = SelectGemmBackend(Avx2Cpu(), "avx512", "");
  EXPECT_EQ(c.backend, GemmBackend::kOneDnn);
  EXPECT_NE(c.reason.find("cannot execute"), std::string::npos) << c.reason;
  // Kernels at or below the CPU's ISA are accepted when forced.
  EXPECT_EQ(SelectGemmBackend(Avx512Cpu(), "avx512", "openblas").backend, GemmBackend::kOpenBlas);
  EXPECT_EQ(SelectGemmBackend(Avx2Cpu(), "sse", "openblas").backend, GemmBackend::kOpenBlas);
  EXPECT_TRUE(OpenBlasCoreRunsOn(Avx2Cpu(), "avx2"));
  EXPECT_FALSE(OpenBlasCoreRunsOn(Avx2Cpu(), "avx512"));
}

TEST(SelectGemmBackend, OverrideWinsAndBadNamesAreRejected) {
  GemmBackendChoice c = SelectGemmBackend(Avx512Cpu(), "avx512", "openblas");
  EXPECT_EQ(c.backend, GemmBackend::kOpenBlas);
  EXPECT_NE(c.reason.find("SY_GEMM_BACKEND"), std::string::npos);
  EXPECT_EQ(SelectGemmBackend(Avx2Cpu(), "avx2", "onednn").backend, GemmBackend::kOneDnn);
  EXPECT_EQ(SelectGemmBackend(CpuFeatures{}, "sse", "onednn").backend, GemmBackend::kOneDnn);
  try {
    SelectGemmBackend(Avx512Cpu(), "avx512", "mkl");
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'mkl'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("onednn or openblas"), std::string::npos) << e.what();
  }
}

TEST(OpenBlasCoreIsa, KnownAndUnknownCores) {
  EXPECT_STREQ(OpenBlasCoreIsa("SkylakeX"), "avx512");
  EXPECT_STREQ(OpenBlasCoreIsa("Cooperlake"), "avx512");
  EXPECT_STREQ(OpenBlasCoreIsa("Haswell"), "avx2");
  EXPECT_STREQ(OpenBlasCoreIsa("Zen"), "avx2");
  EXPECT_STREQ(OpenBlasCoreIsa("Sandybridge"), "avx");
  EXPECT_STREQ(OpenBlasCoreIsa("Prescott"), "sse");
  EXPECT_STREQ(OpenBlasCoreIsa("Nehalem"), "sse");
  EXPECT_STREQ(OpenBlasCoreIsa("SomeFutureCore"), "sse");
}

TEST(GenericKernelWarning, WarnsOnlyBelowTheCpusIsa) {
  // The failing case of docs/PERFORMANCE.md "GEMM backends": Prescott kernels on an AVX-512 CPU.
  std::string w = GenericKernelWarning(Avx512Cpu(), "OpenBLAS (core: Prescott)", "sse");
  EXPECT_NE(w.find("OpenBLAS (core: Prescott)"), std::string::npos) << w;
  EXPECT_NE(w.find("sse kernel on a cpu with avx512"), std::string::npos) << w;
  EXPECT_FALSE(GenericKernelWarning(Avx512Cpu(), "x", "avx2").empty());
  EXPECT_EQ(GenericKernelWarning(Avx512Cpu(), "x", "avx512"), "");
  EXPECT_EQ(GenericKernelWarning(Avx2Cpu(), "x", "avx2"), "");
  EXPECT_FALSE(GenericKernelWarning(Avx2Cpu(), "x", "sse").empty());
  EXPECT_EQ(GenericKernelWarning(CpuFeatures{}, "x", "sse"), "");
}

TEST(HostCpu, ReportsWhatTheBuildNeeds) {
  const CpuFeatures& f = HostCpuFeatures();
  // The release build is -march=x86-64-v3: if this test runs there, the CPU has AVX2 and FMA.
  EXPECT_EQ(f.HasAvx2Fma(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  EXPECT_EQ(f.avx512f, static_cast<bool>(__builtin_cpu_supports("avx512f")));
  EXPECT_NE(f.ToString().find(f.vendor), std::string::npos);
  // The active backend on this machine runs a kernel at the CPU's ISA (no warning) unless a user
  // forced another backend.
  if (std::getenv("SY_GEMM_BACKEND") == nullptr) {
    // The rule written out for this machine: AVX-512 -> oneDNN; AVX2 only -> OpenBLAS when its
    // core is an AVX2 one, else oneDNN; no AVX2 -> OpenBLAS.
    const std::string core_isa = OpenBlasCoreIsa(OpenBlasCoreName());
    GemmBackend want = GemmBackend::kOpenBlas;
    if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl) {
      want = GemmBackend::kOneDnn;
    } else if (f.avx2 && f.fma) {
      want = core_isa == "avx2" ? GemmBackend::kOpenBlas : GemmBackend::kOneDnn;
    }
    EXPECT_EQ(ActiveGemmBackend(), want) << GemmBackendReason();
    EXPECT_EQ(GemmBackendWarning(), "") << GemmBackendName();
  }
}

// Run by CTest with OPENBLAS_CORETYPE=Prescott (tests/kernels/CMakeLists.txt): OpenBLAS runs its
// generic SSE3 kernels, as it did on the CPU model it did not know. The selector must still pick
// the fast backend, and a forced OpenBLAS must be reported with a warning.
TEST(GenericOpenBlasCore, SelectorStillPicksTheFastPath) {
  const char* expect = std::getenv("SY_EXPECT_OPENBLAS_CORE");
  if (expect == nullptr) {
    // OpenBLAS reads its core type when it loads: run this test again in a child process that
    // starts with it forced (the child takes the branch below; its failure fails this test).
    char self[4096] = {};
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    ASSERT_GT(n, 0);
    const std::string cmd = fmt::format(
        "OPENBLAS_CORETYPE=Prescott SY_EXPECT_OPENBLAS_CORE=Prescott '{}' "
        "--gtest_filter=GenericOpenBlasCore.SelectorStillPicksTheFastPath",
        std::string(self, static_cast<size_t>(n)));
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return;
  }
  ASSERT_EQ(OpenBlasCoreName(), expect);
  const CpuFeatures& f = HostCpuFeatures();
  if (!f.HasAvx2Fma()) GTEST_SKIP() << "cpu without avx2+fma: OpenBLAS is the only backend";
  EXPECT_EQ(ActiveGemmBackend(), GemmBackend::kOneDnn);
  EXPECT_EQ(GemmBackendWarning(), "");
  const std::string w = GenericKernelWarning(f, GemmBackendName(GemmBackend::kOpenBlas),
                                             GemmBackendIsa(GemmBackend::kOpenBlas));
  EXPECT_NE(w.find("Prescott"), std::string::npos) << w;
}

// The threading policy with oneDNN: a thread that calls Gemm runs oneDNN with one OpenMP thread
// (the rank's budget is spent by splitting C over its own pool, never by an OpenMP team).
TEST(OneDnnThreads, CallingThreadUsesOneOpenMpThread) {
  using GetMaxThreads = int (*)();
  auto get = reinterpret_cast<GetMaxThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  if (get == nullptr) GTEST_SKIP() << "oneDNN without an OpenMP runtime";
  SetGemmBackend(GemmBackend::kOneDnn);
  int seen = -1;
  std::thread([&] {
    std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
    Gemm(Trans::kNo, Trans::kNo, 8, 8, 8, 1.0f, a.data(), 8, b.data(), 8, 0.0f, c.data(), 8);
    seen = get();
  }).join();
  SetGemmBackend(
      SelectGemmBackend(HostCpuFeatures(), OpenBlasCoreIsa(OpenBlasCoreName()), "").backend);
  EXPECT_EQ(seen, 1);
}

// Every backend x odd shapes x transposes x padded leading dimensions x beta x threads, against
// the float64 reference, with the tolerance of gemm_test.cc.
using Shape = std::tuple<int, int, int>;
class BackendGemmTest
    : public ::testing::TestWithParam<std::tuple<GemmBackend, Shape, bool, bool, int>> {
 protected:
  void TearDown() override {
    SetGemmBackend(
        SelectGemmBackend(HostCpuFeatures(), OpenBlasCoreIsa(OpenBlasCoreName()), "").backend);
    SetBlasThreads(1);
  }
};

TEST_P(BackendGemmTest, MatchesFloat64Reference) {
  auto [backend, shape, ta, tb, threads] = GetParam();
  auto [m, n, k] = shape;
  SetGemmBackend(backend);
  SetBlasThreads(threads);
  Trans trans_a = ta ? Trans::kYes : Trans::kNo, trans_b = tb ? Trans::kYes : Trans::kNo;
  const int64_t lda = (ta ? m : k) + 5, ldb = (tb ? k : n) + 3, ldc = n + 1;
  auto a = RandomVector(static_cast<size_t>((ta ? k : m) * lda), 11);
  auto b = RandomVector(static_cast<size_t>((tb ? n : k) * ldb), 12);
  auto c0 = RandomVector(static_cast<size_t>(m * ldc), 13);
  for (float beta : {0.0f, 1.0f, -0.5f}) {
    auto c = c0, want = c0;
    Gemm(trans_a, trans_b, m, n, k, 0.75f, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
    ref::Gemm(trans_a, trans_b, m, n, k, 0.75f, a.data(), lda, b.data(), ldb, beta, want.data(),
              ldc);
    EXPECT_TRUE(AllClose(c, want, 1e-5, 1e-4 * std::max(1, k) / 64.0))
        << GemmBackendName(backend) << " beta " << beta;
  }
}

std::string BackendGemmName(const ::testing::TestParamInfo<BackendGemmTest::ParamType>& info) {
  const auto& [backend, shape, ta, tb, threads] = info.param;
  const auto& [m, n, k] = shape;
  return fmt::format("{}_{}x{}x{}_{}{}_t{}", GemmBackendKey(backend), m, n, k, ta ? 'T' : 'N',
                     tb ? 'T' : 'N', threads);
}

INSTANTIATE_TEST_SUITE_P(
    OddShapes, BackendGemmTest,
    ::testing::Combine(::testing::Values(GemmBackend::kOneDnn, GemmBackend::kOpenBlas),
                       ::testing::Values(Shape{1, 1, 1}, Shape{7, 17, 1}, Shape{1, 65, 7},
                                         Shape{17, 1, 65}, Shape{65, 17, 7}, Shape{7, 65, 17},
                                         Shape{130, 33, 257}, Shape{33, 300, 65},
                                         Shape{7, 2100, 80}),
                       ::testing::Bool(), ::testing::Bool(), ::testing::Values(1, 2)),
    BackendGemmName);

// bf16 GEMMs: oneDNN's bf16 matmul exactly when the (forced) feature mask has bf16 arithmetic.
TEST(SelectBf16Gemm, OneDnnOnlyWhereTheCpuHasBf16Arithmetic) {
  CpuFeatures avx512_bf16 = Avx512Cpu(), amx = Avx512Cpu();
  avx512_bf16.avx512_bf16 = true;
  amx.amx_tile = amx.amx_bf16 = true;
  for (const CpuFeatures& cpu : {avx512_bf16, amx}) {
    const Bf16GemmChoice c = SelectBf16Gemm(cpu, "");
    EXPECT_TRUE(c.onednn_bf16) << c.reason;
    EXPECT_NE(c.reason.find(cpu.amx_bf16 ? "amx_bf16" : "avx512_bf16"), std::string::npos);
    EXPECT_FALSE(SelectBf16Gemm(cpu, "fp32").onednn_bf16);
  }
  for (const CpuFeatures& cpu : {Avx512Cpu(), Avx2Cpu(), CpuFeatures{}}) {
    const Bf16GemmChoice c = SelectBf16Gemm(cpu, "");
    EXPECT_FALSE(c.onednn_bf16) << c.reason;
    EXPECT_NE(c.reason.find("saves memory only"), std::string::npos) << c.reason;
    EXPECT_TRUE(SelectBf16Gemm(cpu, "onednn").onednn_bf16);
  }
  try {
    (void)SelectBf16Gemm(Avx2Cpu(), "amx");
    ADD_FAILURE() << "SY_BF16_GEMM=amx accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("fp32 or onednn"), std::string::npos) << e.what();
  }
  // This machine: the choice follows its own cpuid.
  const CpuFeatures& host = HostCpuFeatures();
  EXPECT_EQ(SelectBf16Gemm(host, "").onednn_bf16, host.avx512_bf16 || host.amx_bf16);
}

uint16_t Bf16Bits(float x) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16); }
float Bf16Value(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// oneDNN's bf16 matmul against the float64 product of the same bf16 values, every transpose and
// beta 0 / 1; where oneDNN has no bf16 matmul for this CPU it says so and leaves C untouched.
TEST(OneDnnGemmBf16, MatchesFloat64ReferenceOrDeclines) {
  constexpr int64_t m = 7, n = 19, k = 33;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(fmt::format("trans_a {} trans_b {} beta {}", ta, tb, beta));
        const std::vector<float> af = RandomVector(m * k, 1), bf = RandomVector(k * n, 2);
        std::vector<uint16_t> a(af.size()), b(bf.size());
        for (size_t i = 0; i < a.size(); ++i) a[i] = Bf16Bits(af[i]);
        for (size_t i = 0; i < b.size(); ++i) b[i] = Bf16Bits(bf[i]);
        std::vector<float> c = RandomVector(m * n, 3), want = c;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t p = 0; p < k; ++p)
              s += static_cast<double>(Bf16Value(a[ta ? p * m + i : i * k + p])) *
                   Bf16Value(b[tb ? j * k + p : p * n + j]);
            want[i * n + j] = static_cast<float>(0.5 * s + beta * c[i * n + j]);
          }
        const std::vector<float> before = c;
        std::string impl;
        const bool ran = OneDnnGemmBf16(ta, tb, m, n, k, 0.5f, a.data(), ta ? m : k, b.data(),
                                        tb ? k : n, beta, c.data(), n, &impl);
        if (ran) {
          EXPECT_TRUE(AllClose(c, want, 1e-5, 1e-5)) << impl;
        } else {
          EXPECT_EQ(c, before);
          EXPECT_FALSE(HostCpuFeatures().amx_bf16) << "oneDNN declined bf16 on an AMX cpu";
        }
      }
}

}  // namespace
}  // namespace switchyard::kernels
