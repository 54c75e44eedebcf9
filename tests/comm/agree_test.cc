// AgreeOnConfig on ranks as threads: equal settings pass; differing ones fail on every rank with
// one message naming every differing key, its values and the ranks holding each.
#include "switchyard/comm/agree.h"

#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Runs AgreeOnConfig on W ranks with entries_of(rank); returns each rank's error ("" if none).
std::vector<std::string> Agree(int w, const std::function<ConfigEntries(int)>& entries_of) {
  std::vector<std::string> errors(static_cast<size_t>(w));
  std::mutex mu;
  RunInProcess(w, [&](Communicator& comm) {
    try {
      AgreeOnConfig(comm, "test", entries_of(comm.rank()));
    } catch (const InvalidArgument& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

TEST(AgreeOnConfig, EqualSettingsInAnyOrderAgree) {
  for (int w : {1, 2, 3}) {
    auto errors = Agree(w, [](int rank) {
      ConfigEntries e{{"lr", "0.001"}, {"steps", "10"}};
      if (rank % 2 == 1) std::swap(e[0], e[1]);
      return e;
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "") << w;
  }
}

TEST(AgreeOnConfig, EveryDifferingKeyIsNamedWithItsRanksOnEveryRank) {
  auto errors = Agree(3, [](int rank) {
    ConfigEntries e{{"lr", rank == 1 ? "0.002" : "0.001"}, {"seed", "1"}};
    if (rank != 2) e.emplace_back("steps", std::to_string(10 * (rank + 1)));
    return e;
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("test: the ranks of group 'world' were started with different settings"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("2 keys differ: 'lr': 0.001 on ranks 0, 2, 0.002 on rank 1; 'steps': 10 on "
                     "rank 0, 20 on rank 1, (not set) on rank 2"),
              std::string::npos)
        << e;
    EXPECT_EQ(e.find("'seed'"), std::string::npos) << e;
    EXPECT_EQ(e, errors[0]);
  }
}

TEST(AgreeOnConfig, ContentDigestTellsContentsApart) {
  const std::string a = "the quick brown fox", b = "the quick brown fix";
  EXPECT_EQ(ContentDigest(a.data(), a.size()), ContentDigest(a.data(), a.size()));
  EXPECT_NE(ContentDigest(a.data(), a.size()), ContentDigest(b.data(), b.size()));
  EXPECT_EQ(ContentDigest(a.data(), 0), "fnv1a64:cbf29ce484222325/0");
}

}  // namespace
}  // namespace switchyard::comm
