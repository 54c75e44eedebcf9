// Fault injection under MPI: the last rank leaves (finalizes and exits) while the others run a
// collective. They must fail within their deadline with an error naming the collective, the
// group and the missing rank, then exit cleanly. Exit code 0 on every rank means success.
//   scripts/mpirun.sh -np 4 build/release/tests/comm/comm_mpi_exit_test
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"

int main() {
  using namespace switchyard;
  using namespace switchyard::comm;
  std::unique_ptr<Communicator> world = CreateMpiWorld({.timeout = Milliseconds(2000)});
  const int rank = world->rank(), leaver = world->size() - 1;
  world->Barrier().Wait();
  if (rank == leaver) {
    world.reset();
    FinalizeMpi();
    return 0;  // this process exits
  }
  int rc = 0;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> x(256, 1.0f);
  try {
    world->AllReduce(x.data(), x.data(), x.size(), DType::kFloat32, {.algorithm = Algorithm::kRing})
        .Wait();
    std::fprintf(stderr, "rank %d: FAIL: allreduce without rank %d succeeded\n", rank, leaver);
    rc = 1;
  } catch (const Error& e) {
    std::string what = e.what();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Ring: only the leaver's successor waits for the leaver itself; the others wait on live
    // neighbours. The timeout consensus (every timed-out rank announces whom it waited for) lets
    // every rank name the rank that never arrived.
    bool names = what.find("allreduce (ring") != std::string::npos &&
                 what.find("group 'world'") != std::string::npos &&
                 what.find("rank " + std::to_string(leaver)) != std::string::npos;
    std::fprintf(stderr, "rank %d: %s after %.2f s: %s\n", rank, names ? "ok" : "FAIL", s,
                 what.c_str());
    if (!names || s > 10.0) rc = 1;
  }
  world.reset();
  FinalizeMpi();
  return rc;
}
