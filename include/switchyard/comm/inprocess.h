// The in-process transport: W ranks as threads of one process (the embedded default; tests run
// on it). leveldb's in-memory Env is the model: a first-class implementation, not a mock.
//
// A message is copied exactly once, from the sender's buffer straight into the receiver's (or
// reduced straight into it): whichever rank posts second matches the pair, and from then on the
// waiting threads of both ranks copy it together, chunk by chunk. No staging buffers.
//
// Emulated topology. With `emulation` set, the ranks are laid out as nodes x ranks_per_node and
// every message is charged an alpha-beta cost on its link class (intra-node or inter-node): a
// rank's messages on one link class are serialized, message i completing no earlier than
//   t_i = max(t_match_i, t_{i-1}) + latency + bytes / bandwidth,
// and its completion is delayed until then. This is EMULATION on one machine, used to show where
// hierarchical all-to-all and overlap schedules pay off; the bytes still move at memory speed.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/launcher.h"
#include "switchyard/comm/types.h"

namespace switchyard::comm {

// Cost of one link class. bandwidth_gbps 0 = no bandwidth charge.
struct LinkModel {
  double latency_us = 0;
  double bandwidth_gbps = 0;  // GB/s (1e9 bytes per second)
};

struct EmulationOptions {
  LinkModel intra_node;
  LinkModel inter_node;
};

// The smallest emulated bandwidth (GB/s) other than 0 (unlimited): 1 KB/s.
inline constexpr double kMinEmulatedGbps = 1e-6;

// Throws InvalidArgument naming the field ("emulation.intra_node.latency_us: ...") unless every
// latency is finite, >= 0 and below `deadline` (the collective deadline, InProcessOptions::timeout:
// a message could never complete before it), and every bandwidth is finite and 0 or at least
// kMinEmulatedGbps. CreateInProcessWorld and RunInProcess call it.
void ValidateEmulationOptions(const EmulationOptions& emulation, Milliseconds deadline);

struct InProcessOptions {
  // Default deadline of every collective.
  Milliseconds timeout{60000};
  // Ranks per node for topology() and emulation; 0 = all ranks on one node. Must divide W.
  int ranks_per_node = 0;
  // Set to charge every message the alpha-beta cost of its link (see above).
  std::optional<EmulationOptions> emulation;
  // Large messages are copied in chunks of this many bytes, shared by the two ranks' threads.
  size_t copy_chunk_bytes = size_t{256} << 10;
  std::string name = "world";
};

// W communicators over one in-process fabric, communicator r being rank r. Each must be driven
// by its own thread (collectives block until every rank joins).
std::vector<std::unique_ptr<Communicator>> CreateInProcessWorld(
    int world_size, const InProcessOptions& options = {});

// Runs fn(communicator of rank r) on W threads and joins them. When a rank's fn throws or
// returns, its peers are told (their waits on it fail at once, naming it). Rethrows the first
// error thrown by any rank, after every thread finished.
void RunInProcess(int world_size, const std::function<void(Communicator&)>& fn,
                  const InProcessOptions& options = {});

// A launcher running `world_size` ranks as threads of this process (RunInProcess), each rank's
// communicator over one fabric built with `options`. Throws InvalidArgument for a world_size < 1
// or bad options. Reusable: every Run builds a new fabric.
std::unique_ptr<Launcher> CreateInProcessLauncher(int world_size,
                                                  const InProcessOptions& options = {});

// The emulated link a layout's cost model should assume, if `options` emulate one with a
// bandwidth: the inter-node link when the world spans several emulated nodes, else the
// intra-node one.
std::optional<LinkModel> EmulatedLink(const InProcessOptions& options, int world_size);

}  // namespace switchyard::comm
