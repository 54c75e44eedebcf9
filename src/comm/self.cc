#include "switchyard/comm/self.h"

#include "switchyard/comm/inprocess.h"

namespace switchyard::comm {

std::unique_ptr<Communicator> CreateSelfCommunicator(const std::string& name) {
  // A world of one rank over the in-process fabric: nothing is ever sent between ranks.
  InProcessOptions options;
  options.name = name;
  return std::move(CreateInProcessWorld(1, options).front());
}

}  // namespace switchyard::comm
