// Ranks as threads of this process, behind the Launcher interface.
#include <memory>
#include <utility>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

class InProcessLauncher final : public Launcher {
 public:
  InProcessLauncher(int world_size, InProcessOptions options)
      : world_size_(world_size), options_(std::move(options)) {}

  int world_size() const override { return world_size_; }
  int ranks_in_process() const override { return world_size_; }
  std::string_view kind() const override { return "inprocess"; }
  void Run(const std::function<void(Communicator&)>& fn) override {
    RunInProcess(world_size_, fn, options_);
  }

 private:
  int world_size_;
  InProcessOptions options_;
};

}  // namespace

std::unique_ptr<Launcher> CreateInProcessLauncher(int world_size, const InProcessOptions& options) {
  SY_REQUIRE(world_size >= 1, InvalidArgument, "ranks: expected >= 1, got {}", world_size);
  if (options.emulation) ValidateEmulationOptions(*options.emulation, options.timeout);
  return std::make_unique<InProcessLauncher>(world_size, options);
}

std::optional<LinkModel> EmulatedLink(const InProcessOptions& options, int world_size) {
  if (!options.emulation) return std::nullopt;
  const bool nodes = options.ranks_per_node > 0 && options.ranks_per_node < world_size;
  const LinkModel& link = nodes ? options.emulation->inter_node : options.emulation->intra_node;
  if (link.bandwidth_gbps <= 0) return std::nullopt;
  return link;
}

}  // namespace switchyard::comm
