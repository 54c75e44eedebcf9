// The program's edge: which transport runs the ranks (the CLI's choice, never the library's) and
// the process-wide settings a run needs (BLAS threads, the allocator's policy).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/launcher.h"

namespace switchyard::cli {

// "mpi" or "inproc" for a --transport of auto (mpi when started by an MPI launcher), inproc or
// mpi; InvalidArgument for anything else.
std::string ResolveTransport(std::string_view transport);

// The launcher of a resolved transport: `ranks` threads of this process ("inproc", with
// `inprocess`), or this process as one rank of the MPI job ("mpi"; refused, naming --transport mpi
// and `command`, outside an MPI launcher or without MPI compiled in).
std::unique_ptr<comm::Launcher> MakeLauncher(const std::string& transport, int ranks,
                                             const comm::InProcessOptions& inprocess,
                                             std::string_view command);

// Keeps freed activation memory in the process instead of returning it to the kernel after every
// step and faulting it back in: a training step allocates its activations afresh. glibc hands
// blocks above its mmap threshold (32 MiB at most) to mmap and unmaps them on free, and gives each
// allocating thread (every rank is one) its own arena, whose heaps (64 MiB at most) are unmapped
// when they empty; so no mmap (M_MMAP_MAX 0), one arena for all threads, and no trimming. The
// default settings cost ~15k page faults per default step (~15% of its CPU time); a model with
// 64 MiB activations faulted in its whole working set every step (docs/training.md). Process-wide
// and to be called before the ranks start (a thread keeps the arena it first used): the training
// commands call it once. Returns false if the allocator refused.
bool KeepFreedMemoryForTraining();

}  // namespace switchyard::cli
