// Running W ranks as threads of this process.
#include "switchyard/comm/inprocess.h"

#include <cmath>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/group_communicator.h"
#include "comm/inprocess_transport.h"
#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"

namespace switchyard::comm {

void ValidateEmulationOptions(const EmulationOptions& emulation, Milliseconds deadline) {
  const double deadline_us = static_cast<double>(deadline.count()) * 1e3;
  for (const auto& [name, link] :
       {std::pair<const char*, const LinkModel&>{"intra_node", emulation.intra_node},
        std::pair<const char*, const LinkModel&>{"inter_node", emulation.inter_node}}) {
    SY_REQUIRE(
        std::isfinite(link.latency_us) && link.latency_us >= 0 && link.latency_us < deadline_us,
        InvalidArgument,
        "emulation.{}.latency_us is {:g} us; expected a finite latency >= 0 and below the "
        "collective deadline (timeout {} ms)",
        name, link.latency_us, deadline.count());
    SY_REQUIRE(std::isfinite(link.bandwidth_gbps) &&
                   (link.bandwidth_gbps == 0 || link.bandwidth_gbps >= kMinEmulatedGbps),
               InvalidArgument,
               "emulation.{}.bandwidth_gbps is {:g}; expected 0 (unlimited) or a finite bandwidth "
               ">= {:g} GB/s",
               name, link.bandwidth_gbps, kMinEmulatedGbps);
  }
}

std::vector<std::unique_ptr<Communicator>> CreateInProcessWorld(int world_size,
                                                                const InProcessOptions& options) {
  inproc::InProcessWorld world = inproc::CreateInProcessTransports(world_size, options);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& t : world.transports) {
    comms.push_back(
        std::make_unique<GroupCommunicator>(std::move(t), options.name, options.timeout));
  }
  return comms;
}

void RunInProcess(int world_size, const std::function<void(Communicator&)>& fn,
                  const InProcessOptions& options) {
  inproc::InProcessWorld world = inproc::CreateInProcessTransports(world_size, options);
  std::shared_ptr<inproc::Fabric> fabric = world.fabric;
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& t : world.transports) {
    comms.push_back(
        std::make_unique<GroupCommunicator>(std::move(t), options.name, options.timeout));
  }
  std::mutex mu;
  std::exception_ptr first_error;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      SetThreadName(fmt::format("sy-rank{}", r));
      std::unique_ptr<Communicator>& comm = comms[static_cast<size_t>(r)];
      try {
        fn(*comm);
        comm.reset();  // finishes what is running, fails what was queued and never waited for
        fabric->MarkFailed(r, 0, "left: its thread returned from the rank function");
      } catch (...) {
        // Record before telling the peers, so that the root cause is the error rethrown.
        std::string what = "a non-standard exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first_error) first_error = std::current_exception();
        }
        fabric->MarkFailed(r, 0, fmt::format("failed: its thread threw: {}", what));
        comm.reset();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace switchyard::comm
