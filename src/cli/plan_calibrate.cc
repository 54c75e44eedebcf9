#include "cli/plan_calibrate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"

namespace switchyard::cli {

namespace {

using Clock = std::chrono::steady_clock;

// The fastest of `reps` runs of fn, seconds.
template <typename Fn>
double Fastest(int reps, Fn&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// FLOP/s of C[m, n] = A[m, k] B[k, n] on this thread.
double GemmRate(int64_t m, int64_t n, int64_t k) {
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n, 0.0f);
  const int64_t reps = std::max<int64_t>(3, 400'000'000 / (2 * m * n * k));
  const double s = Fastest(5, [&] {
    for (int64_t r = 0; r < reps; ++r) {
      kernels::Gemm(kernels::Trans::kNo, kernels::Trans::kNo, m, n, k, 1.0f, a.data(), k, b.data(),
                    n, 0.0f, c.data(), n);
    }
  });
  return 2.0 * static_cast<double>(m * n * k * reps) / s;
}

// Bytes read and written per second by memcpy of 64 MiB.
double MemcpyBandwidth() {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const double s = Fastest(5, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  return 2.0 * static_cast<double>(bytes) / s;
}

// Seconds of a two-rank in-process all-reduce of `bytes` (median-free: the fastest of a few).
double AllReduceSeconds(size_t bytes) {
  auto launcher = comm::CreateInProcessLauncher(2);
  std::vector<double> seconds(2, 0);
  launcher->Run([&](comm::Communicator& world) {
    const size_t count = bytes / 4;
    std::vector<float> send(count, 1.0f), recv(count, 0.0f);
    world.AllReduce(send.data(), recv.data(), count, DType::kFloat32).Wait();  // warm-up
    seconds[world.rank()] = Fastest(
        20, [&] { world.AllReduce(send.data(), recv.data(), count, DType::kFloat32).Wait(); });
  });
  return std::max(seconds[0], seconds[1]);
}

}  // namespace

plan::Cluster CalibrateThisMachine(const CalibrationOptions& o) {
  kernels::SetBlasThreads(1);
  plan::Cluster c;
  c.nodes = 1;
  c.devices_per_node = o.ranks;
  c.shared_cores = UsableCores();
  // GEMM rate by rows: 1 / rate = 1 / peak + half_rows / (peak m), fitted at m = 32 and 512.
  const double small = GemmRate(32, 512, 512), large = GemmRate(512, 512, 2048);
  const double a = (512.0 / large - 32.0 / small) / (512.0 - 32.0);  // 1 / peak
  const double b = 32.0 / small - 32.0 * a;                          // half_rows / peak
  c.gemm_tflops = (a > 0 ? 1.0 / a : large) / 1e12;
  c.gemm_half_rows = a > 0 ? std::max(0.0, b / a) : 0.0;
  c.memory_bandwidth_gbps = MemcpyBandwidth() / 1e9;
  c.memory_gib = static_cast<double>(AvailableMemoryBytes()) / o.ranks / (1024.0 * 1024 * 1024);
  // A two-rank ring all-reduce sends 2 messages of N / 2 bytes: t = 2 alpha + N / beta.
  const double n1 = 4096, n2 = 4 << 20;
  const double t1 = AllReduceSeconds(static_cast<size_t>(n1));
  const double t2 = AllReduceSeconds(static_cast<size_t>(n2));
  const double inv_beta = std::max(1e-12, (t2 - t1) / (n2 - n1));
  const double alpha = std::max(0.0, (t1 - n1 * inv_beta) / 2);
  c.intra_node = {.bandwidth_gbps = 1.0 / inv_beta / 1e9, .latency_us = alpha * 1e6};
  if (o.link_latency_us > 0 || o.link_gbps > 0) {
    // The emulation charges each message its link's cost on top of the copy.
    c.intra_node.latency_us += o.link_latency_us;
    if (o.link_gbps > 0) {
      c.intra_node.bandwidth_gbps = 1.0 / (1.0 / c.intra_node.bandwidth_gbps + 1.0 / o.link_gbps);
    }
  }
  c.inter_node = c.intra_node;
  c.name = fmt::format(
      "this machine: {} ranks as threads on {} cores{}", o.ranks, c.shared_cores,
      o.link_latency_us > 0 || o.link_gbps > 0
          ? fmt::format(", emulated links {} us / {} GB/s", o.link_latency_us, o.link_gbps)
          : std::string());
  c.source = fmt::format(
      "measured now: {} GEMM {:.1f} GFLOP/s at (32,512,512), {:.1f} at (512,512,2048) on one "
      "thread; memcpy {:.1f} GB/s; 2-rank in-process allreduce {:.1f} us at 4 KiB, {:.0f} us at "
      "4 MiB",
      kernels::GemmBackendName(kernels::ActiveGemmBackend()), small / 1e9, large / 1e9,
      c.memory_bandwidth_gbps, t1 * 1e6, t2 * 1e6);
  return c;
}

}  // namespace switchyard::cli
