// A communicator of one rank, for code that runs the same collectives on a group that may have a
// single member (the trainer's pipeline executor with one stage). Its collectives copy or return
// the caller's data; it needs no other rank and no transport choice by the caller.
#pragma once

#include <memory>
#include <string>

#include "switchyard/comm/communicator.h"

namespace switchyard::comm {

// A new one-rank communicator named `name` (rank 0 of size 1).
std::unique_ptr<Communicator> CreateSelfCommunicator(const std::string& name = "self");

}  // namespace switchyard::comm
