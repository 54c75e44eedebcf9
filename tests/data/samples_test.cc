// Sample construction: the permutation, the document stream, the blend, and the determinism rule
// (global sample i is a pure function of the seed and i, whatever order or partition reads it).
#include "switchyard/train/dataset/samples.h"

#include <random>
#include <set>

#include "data/dataset_io.h"

namespace switchyard::train::dataset {
namespace {

using testing::ExpectError;

// Documents whose tokens say where they come from: document d of dataset s holds
// s * 100000 + d * 100 + position, so a sample can be traced back.
std::shared_ptr<const TokenSource> Traced(int dataset, int docs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> d(static_cast<size_t>(docs));
  for (size_t i = 0; i < d.size(); ++i) {
    d[i].resize(rng() % 40 + 1);
    for (size_t p = 0; p < d[i].size(); ++p) {
      d[i][p] =
          static_cast<int32_t>(dataset * 100000 + static_cast<int>(i) * 100 + static_cast<int>(p));
    }
  }
  return std::make_shared<InMemoryTokenSource>(fmt::format("set{}", dataset), std::move(d));
}

TEST(Permutation, IsABijectionForManySizesAndDependsOnTheKey) {
  for (int64_t n : {1, 2, 3, 5, 16, 17, 100, 1000, 4097}) {
    const Permutation p(n, 42);
    std::set<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) seen.insert(p(i));
    EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << n;
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), n - 1);
  }
  const Permutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    fixed += a(i) == i;
  }
  EXPECT_LT(same, 20);
  EXPECT_LT(fixed, 20);
}

TEST(DatasetSamples, OneEpochInOrderIsTheDocumentsConcatenatedWithEod) {
  const auto src = std::make_shared<InMemoryTokenSource>(
      "s", std::vector<std::vector<int32_t>>{{1, 2, 3}, {4, 5}, {6, 7, 8, 9}});
  const DatasetSamples samples(*src, {0, 3}, {.seq_len = 3, .shuffle = false, .eod = 0});
  EXPECT_EQ(samples.tokens_per_epoch(), 12);
  EXPECT_EQ(samples.samples_per_epoch(), 3);
  std::vector<int32_t> out(4);
  samples.Sample(0, out);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 3, 0}));
  samples.Sample(1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 4, 5, 0}));  // windows share their boundary token
  samples.Sample(2, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 6, 7, 8}));
  samples.Sample(3, out);  // into the next epoch (same order: shuffle off)
  EXPECT_EQ(out, (std::vector<int32_t>{8, 9, 0, 1}));
}

TEST(DatasetSamples, ShuffledEpochCoversEveryTokenOnceInANewOrderEachEpoch) {
  const auto src = Traced(0, 50, 1);
  const int64_t seq = 8;
  const DatasetSamples samples(*src, {0, 50}, {.seq_len = seq, .seed = 3});
  const int64_t per_epoch = samples.samples_per_epoch();
  // The windows of one block, in their positions, tile the first epoch's stream.
  std::multiset<int32_t> tokens;
  std::vector<int32_t> first_of_epoch[2];
  std::vector<int32_t> out(static_cast<size_t>(seq + 1));
  for (int64_t k = 0; k < per_epoch; ++k) {
    samples.Sample(k, out);
    tokens.insert(out.begin(), out.end() - 1);  // the last token is the next window's first
  }
  std::multiset<int32_t> all;
  for (int64_t d = 0; d < 50; ++d) {
    for (int32_t t : src->Document(d)) all.insert(t);
  }
  // All but the tail that does not fill a whole window come out exactly once.
  EXPECT_EQ(static_cast<int64_t>(tokens.size()), per_epoch * seq);
  int64_t missing = 0;
  for (int32_t t : all) missing += tokens.count(t) == 0;
  EXPECT_EQ(missing, src->num_tokens() - per_epoch * seq);
  for (int32_t t : tokens) EXPECT_EQ(all.count(t), 1u);
  // Document order differs between epochs: compare the streams' first documents.
  for (int e = 0; e < 2; ++e) {
    std::vector<int32_t> w(static_cast<size_t>(seq + 1));
    for (int64_t k = e * per_epoch; k < (e + 1) * per_epoch; ++k) {
      samples.Sample(k, w);
      first_of_epoch[e].push_back(w[0]);
    }
  }
  EXPECT_NE(first_of_epoch[0], first_of_epoch[1]);
}

TEST(Blend, FollowsItsWeightsAtEveryPrefix) {
  for (const auto& weights : std::vector<std::vector<double>>{
           {0.7, 0.3}, {1, 1, 1}, {0.5, 0.25, 0.125, 0.125}, {0.01, 0.99}, {3, 0, 1}}) {
    const BlendIndex blend(weights);
    const auto& w = blend.weights();
    std::vector<int64_t> counts(w.size(), 0);
    for (int64_t n = 1; n <= 20000; ++n) {
      const auto where = blend.Locate(n - 1);
      EXPECT_EQ(where.index, counts[static_cast<size_t>(where.dataset)]);
      ++counts[static_cast<size_t>(where.dataset)];
      for (size_t d = 0; d < w.size(); ++d) {
        const double expected = w[d] * static_cast<double>(n);
        // Never more than one sample off its share; so within 1 % from 100 samples on.
        ASSERT_LE(std::abs(static_cast<double>(counts[d]) - expected), 1.0)
            << "weights " << fmt::format("{}", fmt::join(weights, ",")) << " prefix " << n;
        if (n >= 100) {
          ASSERT_LE(std::abs(static_cast<double>(counts[d]) / n - w[d]), 0.01);
        }
      }
    }
    EXPECT_EQ(counts.back() == 0, w.back() == 0);
  }
}

TEST(Blend, RandomAccessEqualsTheSequentialIndexAndBadWeightsAreRefused) {
  const BlendIndex sequential({0.6, 0.3, 0.1});
  std::vector<BlendIndex::Location> all;
  for (int64_t i = 0; i < 5000; ++i) all.push_back(sequential.Locate(i));
  const BlendIndex random_access({0.6, 0.3, 0.1});
  std::mt19937 rng(5);
  for (int k = 0; k < 300; ++k) {
    const int64_t i = rng() % 5000;
    const auto got = random_access.Locate(i);
    EXPECT_EQ(got.dataset, all[static_cast<size_t>(i)].dataset) << i;
    EXPECT_EQ(got.index, all[static_cast<size_t>(i)].index) << i;
  }
  ExpectError([] { BlendIndex({0.5, -0.5}); }, {"weight -0.5 of dataset 2", ">= 0"});
  ExpectError([] { BlendIndex({0, 0}); }, {"sum to 0", "positive"});
  ExpectError([] { BlendIndex({1, std::nan("")}); }, {"dataset 2", "finite"});
  ExpectError([] { BlendIndex({}); }, {"at least one dataset"});
}

SampleStream MakeStream(uint64_t seed) {
  return SampleStream({{0.7, Traced(0, 80, 11), {}}, {0.3, Traced(1, 30, 12), {}}},
                      {.seq_len = 16, .seed = seed, .eod = 99999});
}

// The first 100 global batches are the same however they are fetched: in order by one reader,
// backwards, or as the row shards of 4 data-parallel ranks (each also reading its steps in a
// shuffled order), or from a fresh stream "resumed" at step 37.
TEST(SampleStream, FirstHundredGlobalBatchesDependOnlyOnSeedAndIndex) {
  constexpr int64_t kSteps = 100, kBatch = 8;
  const SampleStream one = MakeStream(1234);
  std::vector<std::vector<int32_t>> reference;
  for (int64_t s = 0; s < kSteps; ++s) reference.push_back(one.Batch(s, kBatch, 0, kBatch));

  const SampleStream backwards = MakeStream(1234);
  for (int64_t s = kSteps - 1; s >= 0; --s) {
    ASSERT_EQ(backwards.Batch(s, kBatch, 0, kBatch), reference[static_cast<size_t>(s)]) << s;
  }
  const SampleStream sharded = MakeStream(1234);
  std::vector<int64_t> steps(kSteps);
  std::iota(steps.begin(), steps.end(), 0);
  std::shuffle(steps.begin(), steps.end(), std::mt19937(9));
  const int64_t width = 17;
  for (int64_t s : steps) {
    for (int64_t rank = 3; rank >= 0; --rank) {  // dp 4: two rows each
      const auto rows = sharded.Batch(s, kBatch, rank * 2, rank * 2 + 2);
      const auto& full = reference[static_cast<size_t>(s)];
      ASSERT_TRUE(std::equal(rows.begin(), rows.end(), full.begin() + rank * 2 * width)) << s;
    }
  }
  const SampleStream resumed = MakeStream(1234);
  for (int64_t s = 37; s < kSteps; ++s) {
    ASSERT_EQ(resumed.Batch(s, kBatch, 0, kBatch), reference[static_cast<size_t>(s)]) << s;
  }
  // Concurrent readers (ranks as threads) see the same batches too.
  const SampleStream shared = MakeStream(1234);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t s = t; s < kSteps; s += 4) {
        mismatches += shared.Batch(s, kBatch, 0, kBatch) != reference[static_cast<size_t>(s)];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  // Another seed, another stream.
  EXPECT_NE(MakeStream(1235).Batch(0, kBatch, 0, kBatch), reference[0]);
}

TEST(SampleStream, SamplesComeFromTheDatasetTheBlendPicks) {
  const SampleStream stream = MakeStream(7);
  std::vector<int32_t> out(17);
  for (int64_t i = 0; i < 200; ++i) {
    stream.Sample(i, out);
    const int d = stream.Locate(i).dataset;
    for (int32_t t : out) {
      if (t != 99999) {
        EXPECT_EQ(t / 100000, d) << i;
      }
    }
  }
}

TEST(Split, HoldsOutTheLastDocuments) {
  const auto s = SplitDocuments(100, 0.05, "x");
  EXPECT_EQ(s.train.begin, 0);
  EXPECT_EQ(s.train.end, 95);
  EXPECT_EQ(s.val.begin, 95);
  EXPECT_EQ(s.val.end, 100);
  EXPECT_EQ(SplitDocuments(10, 0.01, "x").val.size(), 1);  // at least one
  EXPECT_EQ(SplitDocuments(10, 0, "x").val.size(), 0);
  ExpectError([] { SplitDocuments(1, 0.1, "one.bin"); },
              {"one.bin", "1 documents", "nothing would be left to train on"});
  ExpectError([] { SplitDocuments(10, 0.9, "x"); }, {"val_fraction 0.9", "[0, 0.5]"});
  // Held-out samples read the held-out documents only, in order.
  const auto src = Traced(0, 20, 2);
  const auto split = SplitDocuments(20, 0.25, "set0");
  const DatasetSamples val(*src, split.val, {.seq_len = 4, .shuffle = false});
  std::vector<int32_t> out(5);
  val.Sample(0, out);
  EXPECT_EQ(out[0], 15 * 100);
  for (int64_t k = 0; k < val.samples_per_epoch(); ++k) {
    val.Sample(k, out);
    for (int32_t t : out) EXPECT_GE(t / 100, 15);
  }
  ExpectError([&] { DatasetSamples(*src, {5, 5}, {.seq_len = 4}); }, {"set0", "[5, 5)"});
  ExpectError([&] { DatasetSamples(*src, {0, 5}, {.seq_len = 0}); }, {"seq_len 0"});
  const InMemoryTokenSource small("small", {{1, 2}}, 10);
  ExpectError(
      [&] {
        DatasetSamples(small, {0, 1}, {.seq_len = 1, .eod = 10});
      },
      {"small", "end-of-document id 10", "[0, 10)"});
}

}  // namespace
}  // namespace switchyard::train::dataset
