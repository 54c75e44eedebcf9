// This process as one rank of an MPI job, behind the Launcher interface (built with or without
// MPI: without it, CreateMpiWorld says so).
#include <memory>

#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

class MpiLauncher final : public Launcher {
 public:
  explicit MpiLauncher(const MpiOptions& options) : world_(CreateMpiWorld(options)) {}

  int world_size() const override { return world_->size(); }
  int ranks_in_process() const override { return 1; }
  std::string_view kind() const override { return "mpi"; }
  void Run(const std::function<void(Communicator&)>& fn) override { fn(*world_); }

 private:
  std::unique_ptr<Communicator> world_;
};

}  // namespace

std::unique_ptr<Launcher> CreateMpiLauncher(const MpiOptions& options) {
  SY_REQUIRE(MpiCompiledIn(), InvalidArgument,
             "the MPI transport is not available: switchyard was built with SY_WITH_MPI=OFF");
  SY_REQUIRE(RunningUnderMpi(), InvalidArgument,
             "transport mpi: this process was not started by an MPI launcher, so it would run "
             "alone; start every rank with one (e.g. mpirun)");
  return std::make_unique<MpiLauncher>(options);
}

}  // namespace switchyard::comm
