// `switchyard bench pipeline`: a pipeline schedule (parallel/pipeline.h) run by the executor on p
// ranks as threads over emulated stage links, with synthetic stages whose forward takes F ms and
// backward 2F ms (Bi and W F ms each) and keep one activation of the given size from F to the end
// of B (or W): the measured bubble fraction and activation memory per rank next to the
// simulation's and the theory's.
//
// The stages' compute is a sleep, not arithmetic: 4 thread-ranks on a 2-core machine would
// otherwise time-share the cores and measure the machine, not the schedule.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/limits.h"
#include "switchyard/parallel/pipeline.h"

namespace switchyard::cli {
namespace {

struct BenchPipelineOptions {
  int pp = 4;
  int microbatches = 8;
  int virtual_stages = 1;
  std::string kind = "1f1b";
  double forward_ms = 5;
  int64_t activation_kib = 256;
  UniformLinkFlags link{.latency_us = 50, .gbps = 1, .timeout_ms = 60000};
  bool json = false;
};

struct RankResult {
  double seconds = 0, compute = 0, blocked = 0;
  int64_t peak_bytes = 0;
  int peak_in_flight = 0;
};

int RunBenchPipeline(const BenchPipelineOptions& o) {
  parallel::ScheduleConfig c{o.pp, o.microbatches, o.virtual_stages,
                             parallel::ScheduleKindFromName(o.kind)};
  const parallel::Schedule schedule = parallel::MakeSchedule(c);
  const parallel::ScheduleSimulation sim = parallel::SimulateSchedule(schedule);
  const int64_t elements = o.activation_kib * 1024 / 4;
  // Each rank keeps its in-flight activations (the simulation's peak) and has at most a few more
  // tensors of the same size on the way: the forward's output being sent, the received activation
  // and gradient, the backward's output.
  int64_t buffers = 0;
  for (int in_flight : sim.peak_in_flight) buffers += in_flight + 4;
  RequireMemory(static_cast<uint64_t>(CheckedMul(buffers, o.activation_kib * 1024,
                                                 "bench pipeline: activation bytes")),
                fmt::format("bench pipeline: {} activations of --activation-kib {} over --pp {} "
                            "ranks",
                            buffers, o.activation_kib, o.pp));
  std::unique_ptr<comm::Launcher> launcher =
      MakeUniformLinkLauncher(o.pp, o.link, static_cast<uint64_t>(elements) * 4, "bench pipeline");
  std::mutex mu;
  std::vector<RankResult> results(static_cast<size_t>(o.pp));
  const auto work = [](double ms) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  };
  launcher->Run([&](comm::Communicator& group) {
    // The activations this stage keeps between F and the end of B / W, measured in bytes.
    std::map<std::pair<int, int>, Tensor> kept;
    int64_t held = 0, peak = 0;
    const int last = o.pp * o.virtual_stages - 1;
    parallel::PipelineStageCallbacks cb;
    cb.input_shape = [&](int, int) { return Shape{elements}; };
    cb.forward = [&](int mb, int chunk, const Tensor&) {
      work(o.forward_ms);
      Tensor keep = Tensor::Zeros({elements});
      held += static_cast<int64_t>(keep.nbytes());
      peak = std::max(peak, held);
      kept[{mb, chunk}] = keep;
      return chunk * o.pp + group.rank() == last ? Tensor() : Tensor::Zeros({elements});
    };
    auto release = [&](int mb, int chunk) {
      auto it = kept.find({mb, chunk});
      held -= static_cast<int64_t>(it->second.nbytes());
      kept.erase(it);
    };
    cb.backward = [&](int mb, int chunk, const Tensor&, bool input_only) {
      work(input_only ? o.forward_ms : 2 * o.forward_ms);
      if (!input_only) release(mb, chunk);
      return chunk * o.pp + group.rank() == 0 ? Tensor() : Tensor::Zeros({elements});
    };
    cb.backward_weight = [&](int mb, int chunk) {
      work(o.forward_ms);
      release(mb, chunk);
    };
    group.Barrier().Wait();
    const parallel::PipelineRunStats stats = parallel::RunSchedule(group, schedule, cb);
    std::lock_guard<std::mutex> lock(mu);
    results[static_cast<size_t>(group.rank())] = RankResult{
        stats.seconds, stats.compute_seconds, stats.blocked_seconds, peak, stats.peak_in_flight};
  });
  double wall = 0, compute = 0;
  for (const RankResult& r : results) {
    wall = std::max(wall, r.seconds);
    compute += r.compute;
  }
  const double measured = 1.0 - compute / (o.pp * wall);
  const double theory = parallel::TheoreticalBubbleFraction(c);
  if (o.json) {
    nlohmann::json ranks = nlohmann::json::array();
    for (size_t r = 0; r < results.size(); ++r) {
      ranks.push_back({{"rank", r},
                       {"seconds", results[r].seconds},
                       {"compute_seconds", results[r].compute},
                       {"blocked_seconds", results[r].blocked},
                       {"peak_activation_bytes", results[r].peak_bytes},
                       {"peak_in_flight", results[r].peak_in_flight},
                       {"simulated_peak_in_flight", sim.peak_in_flight[r]}});
    }
    fmt::print("{}\n", nlohmann::json{{"kind", o.kind},
                                      {"pp", o.pp},
                                      {"microbatches", o.microbatches},
                                      {"virtual_stages", o.virtual_stages},
                                      {"measured_bubble_fraction", measured},
                                      {"simulated_bubble_fraction", sim.bubble_fraction},
                                      {"theoretical_bubble_fraction", theory},
                                      {"ranks", ranks}}
                           .dump());
    return 0;
  }
  fmt::print(
      "# bench pipeline: {} p {} m {}{}, F {} ms, B {} ms, activation {} KiB, link {} us + "
      "{} GB/s; compute is a sleep (the schedule, not the cores, is measured)\n",
      o.kind, o.pp, o.microbatches,
      o.virtual_stages > 1 ? fmt::format(" v {}", o.virtual_stages) : "", o.forward_ms,
      2 * o.forward_ms, o.activation_kib, o.link.latency_us, o.link.gbps);
  fmt::print("bubble fraction: measured {:.3f}, simulated {:.3f}, theory {:.3f} (step {:.1f} ms)\n",
             measured, sim.bubble_fraction, theory, wall * 1e3);
  for (size_t r = 0; r < results.size(); ++r) {
    fmt::print(
        "rank {}: peak activations {:.0f} KiB = {} micro-batch chunks (simulated {}), "
        "blocked {:.1f} ms\n",
        r, static_cast<double>(results[r].peak_bytes) / 1024,
        results[r].peak_bytes / std::max<int64_t>(1, elements * 4), sim.peak_in_flight[r],
        results[r].blocked * 1e3);
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "pipeline",
    "A pipeline schedule on ranks as threads over emulated links: measured bubble and activation "
    "memory against the simulation and the theory",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchPipelineOptions>();
      AddIntOption(app, "--pp", &o->pp, 1, 64, "pipeline stages (ranks)");
      AddIntOption(app, "--microbatches", &o->microbatches, 1, 4096, "micro-batches");
      AddIntOption(app, "--virtual", &o->virtual_stages, 1, 16, "chunks per rank (interleaved)");
      app.add_option("--kind", o->kind, "fthenb | 1f1b | interleaved | zb-h1")
          ->check(CLI::IsMember({"fthenb", "1f1b", "interleaved", "zb-h1"}));
      app.add_option("--forward-ms", o->forward_ms, "time of one forward (backward: twice)")
          ->check(CLI::Range(0.0, 10000.0));
      AddIntOption(app, "--activation-kib", &o->activation_kib, int64_t{1}, int64_t{1} << 22,
                   "activation size per micro-batch");
      AddUniformLinkFlags(app, &o->link, "consecutive stages");
      app.add_flag("--json", o->json, "print one JSON object");
      return [o] { return RunBenchPipeline(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
