#include "cli/plan_calibrate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <thread>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/plan/step_model.h"

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

// The mean of `reps` runs of fn, seconds (a rate under contention: every run counts).
template <typename Fn>
double Mean(int reps, Fn&& fn) {
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - t0).count() / reps;
}

// FLOP/s of C[m, n] = A[m, k] B[k, n] on this thread.
double GemmRate(int64_t m, int64_t n, int64_t k) {
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n, 0.0f);
  const int64_t reps = std::max<int64_t>(3, 200'000'000 / (2 * m * n * k));
  const double s = Mean(5, [&] {
    for (int64_t r = 0; r < reps; ++r) {
      kernels::Gemm(kernels::Trans::kNo, kernels::Trans::kNo, m, n, k, 1.0f, a.data(), k, b.data(),
                    n, 0.0f, c.data(), n);
    }
  });
  return 2.0 * static_cast<double>(m * n * k * reps) / s;
}

// Bytes read and written per second by memcpy of 16 MiB.
double MemcpyBandwidth() {
  const size_t bytes = size_t{16} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);  // pages touched once, outside the timing
  const double s = Mean(5, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  return 2.0 * static_cast<double>(bytes) / s;
}

// The slowest of `threads` threads started together running fn() (each thread's own rate): what
// a step of ranks kept in step by their collectives gets, every phase waiting for the rank the
// shared cores served last.
template <typename Fn>
double SlowestOverThreads(int threads, Fn&& fn) {
  std::vector<double> out(static_cast<size_t>(threads), 0);
  std::latch start(threads);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      out[static_cast<size_t>(t)] = fn();
    });
  }
  for (std::thread& th : pool) th.join();
  return *std::min_element(out.begin(), out.end());
}

// Seconds of an in-process all-reduce of `bytes` over `ranks` ranks (the fastest of 20, the
// slowest rank).
double AllReduceSeconds(int ranks, size_t bytes) {
  auto launcher = comm::CreateInProcessLauncher(ranks);
  std::vector<double> seconds(static_cast<size_t>(ranks), 0);
  launcher->Run([&](comm::Communicator& world) {
    const size_t count = bytes / 4;
    std::vector<float> send(count, 1.0f), recv(count, 0.0f);
    world.AllReduce(send.data(), recv.data(), count, DType::kFloat32).Wait();  // warm-up
    seconds[static_cast<size_t>(world.rank())] = Fastest(
        20, [&] { world.AllReduce(send.data(), recv.data(), count, DType::kFloat32).Wait(); });
  });
  return *std::max_element(seconds.begin(), seconds.end());
}

}  // namespace

double LoadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

plan::Cluster CalibrateThisMachine(const CalibrationOptions& o) {
  kernels::SetBlasThreads(1);
  plan::Cluster c;
  c.nodes = 1;
  c.devices_per_node = o.ranks;
  const int cores = UsableCores();
  // The rates of the slowest rank while all ranks compute at once (each on one BLAS thread): the
  // share of the cores a rank really gets, other processes' load included. With fewer ranks than
  // cores a rank computes on cores / ranks threads: shared_cores tells the step model to scale.
  c.shared_cores = o.ranks < cores ? cores : 0;
  // (At most 64 threads: a plan for more ranks than that is not run here.)
  const int threads = std::clamp(o.ranks, 1, 64);
  // GEMM rate by rows: 1 / rate = 1 / peak + half_rows / (peak m), fitted at m = 32 and 512.
  const double small = SlowestOverThreads(threads, [] { return GemmRate(32, 512, 512); });
  const double large = SlowestOverThreads(threads, [] { return GemmRate(512, 512, 2048); });
  const double a = (512.0 / large - 32.0 / small) / (512.0 - 32.0);  // 1 / peak
  const double b = 32.0 / small - 32.0 * a;                          // half_rows / peak
  c.gemm_tflops = (a > 0 ? 1.0 / a : large) / 1e12;
  c.gemm_half_rows = a > 0 ? std::max(0.0, b / a) : 0.0;
  c.memory_bandwidth_gbps = SlowestOverThreads(threads, MemcpyBandwidth) / 1e9;
  c.memory_gib = static_cast<double>(AvailableMemoryBytes()) / o.ranks / (1024.0 * 1024 * 1024);
  // The all-reduce of the ranks themselves (its thread hand-offs on the shared cores included),
  // at two sizes: t = messages alpha + bytes sent / beta with the messages and bytes of the
  // algorithm comm picks for each (CostOfCollective), solved for alpha and beta.
  const int group = std::max(2, threads);
  const double n1 = 4096, n2 = 4 << 20;
  const double t1 = AllReduceSeconds(group, static_cast<size_t>(n1));
  const double t2 = AllReduceSeconds(group, static_cast<size_t>(n2));
  const plan::LinkSpec unit{.bandwidth_gbps = 1e-9, .latency_us = 1e6};
  const plan::CollectiveCost c1 =
      plan::CostOfCollective(plan::Collective::kAllReduce, n1, group, unit, 1.0);
  const plan::CollectiveCost c2 =
      plan::CostOfCollective(plan::Collective::kAllReduce, n2, group, unit, 1.0);
  const double m1 = static_cast<double>(c1.messages), m2 = static_cast<double>(c2.messages);
  const double det = m1 * c2.bytes_sent - m2 * c1.bytes_sent;
  double inv_beta = det != 0 ? (m1 * t2 - m2 * t1) / det : t2 / c2.bytes_sent;
  inv_beta = std::max(1e-12, inv_beta);
  const double alpha = std::max(0.0, (t1 - c1.bytes_sent * inv_beta) / m1);
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
      "this machine: {} ranks as threads on {} cores{}", o.ranks, cores,
      o.link_latency_us > 0 || o.link_gbps > 0
          ? fmt::format(", emulated links {} us / {} GB/s", o.link_latency_us, o.link_gbps)
          : std::string());
  c.source = fmt::format(
      "measured now, the slowest of {} ranks computing at once: {} GEMM {:.1f} GFLOP/s at "
      "(32,512,512), {:.1f} at (512,512,2048); memcpy {:.1f} GB/s; {}-rank in-process allreduce "
      "{:.1f} us at 4 KiB, {:.0f} us at 4 MiB; load average {:.1f}",
      threads, kernels::GemmBackendName(kernels::ActiveGemmBackend()), small / 1e9, large / 1e9,
      c.memory_bandwidth_gbps, group, t1 * 1e6, t2 * 1e6, LoadAverage());
  return c;
}

}  // namespace switchyard::cli
