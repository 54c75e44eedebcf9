// The per-thread worker pools and ParallelFor: every index once, errors rethrown on the caller,
// nested loops run inline (no deadlock), and callers on different threads (ranks as threads) with
// their own pools. Run under ThreadSanitizer too.
#include "switchyard/core/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace switchyard {
namespace {

TEST(ParallelForTest, CoversTheRangeOnceAndPropagatesErrors) {
  for (int threads : {1, 2, 4}) {
    for (int64_t n : {0, 1, 3, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (int rep = 0; rep < 3; ++rep) {  // the pool is reused
        ParallelFor(n, threads, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
        });
      }
      for (auto& h : hits) ASSERT_EQ(h.load(), 3);
    }
    EXPECT_THROW(ParallelFor(10, threads, 1,
                             [](int64_t b, int64_t) {
                               if (b == 0) throw std::runtime_error("boom");
                             }),
                 std::runtime_error);
    ParallelFor(4, threads, 1, [](int64_t, int64_t) {});  // usable after an error
  }
}

TEST(ParallelForTest, ChunksDependOnlyOnSizeThreadsAndGrain) {
  // min(threads, n / grain) chunks, chunk i = [n*i/chunks, n*(i+1)/chunks).
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  ParallelFor(100, 3, 10, [&](int64_t b, int64_t e) {
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(b, e);
  });
  std::sort(chunks.begin(), chunks.end());
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 33}, {33, 66}, {66, 100}}));
  chunks.clear();
  ParallelFor(15, 4, 10, [&](int64_t b, int64_t e) {
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(b, e);
  });
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 15}}));  // 15 / 10 -> 1 chunk
}

TEST(ParallelForTest, NestedLoopsRunInline) {
  std::atomic<int64_t> total{0};
  ParallelFor(8, 2, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      ParallelFor(16, 2, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
    }
  });
  EXPECT_EQ(total.load(), 8 * 16);
}

TEST(ParallelForTest, EachCallingThreadHasItsOwnPool) {
  std::vector<std::jthread> ranks;
  std::atomic<int64_t> total{0};
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) {
        ParallelFor(64, 2, 1, [&](int64_t b, int64_t e) { total += e - b; });
      }
    });
  }
  ranks.clear();
  EXPECT_EQ(total.load(), 3 * 50 * 64);
}

}  // namespace
}  // namespace switchyard
