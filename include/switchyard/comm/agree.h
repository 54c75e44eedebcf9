// Agreeing on the configuration at start-up: every rank of a job must run with the same settings
// and inputs. Ranks started separately (processes under mpirun) can be given different flags,
// config files or input files; left unchecked they either compute something silently wrong
// (different learning rates) or wait on each other until a deadline that does not name the cause
// (different step counts). AgreeOnConfig finds that out before the first real collective.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "switchyard/comm/communicator.h"

namespace switchyard::comm {

// A rank's settings as (key, value) text in a canonical form: numbers as the program parsed them
// (so "1e-3" and "0.001" agree), files and tensors as a digest of their content
// (ContentDigest). Keys are unique; their order does not matter.
using ConfigEntries = std::vector<std::pair<std::string, std::string>>;

// Collective over `comm` (one all-gather of the entries, with the communicator's deadline).
// Returns if every rank passed the same entries. Otherwise throws InvalidArgument on every rank,
// naming each differing key with its values and the ranks holding each value, e.g.
//   train: the ranks of group 'world' were started with different settings (every rank must get
//   the same flags, config file and input files); 2 keys differ: 'lr': 0.001 on rank 0, 0.002
//   on rank 1; 'steps': 10 on ranks 0, 2, 20 on rank 1
// (a key missing on a rank shows as "(not set)"); on every rank but 0 the failure is recorded as
// reported by a peer (mpi.h), so rank 0's copy is the one printed. `what` names the program part.
void AgreeOnConfig(Communicator& comm, std::string_view what, const ConfigEntries& entries);

// "fnv1a64:<16 hex digits>/<bytes>": a digest of `bytes` bytes at `data`, for ConfigEntries.
std::string ContentDigest(const void* data, size_t bytes);

}  // namespace switchyard::comm
