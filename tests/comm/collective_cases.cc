#include "comm/collective_cases.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "switchyard/core/dtype.h"

namespace switchyard::comm::testing {
namespace {

constexpr size_t kGuardBytes = 64;
constexpr unsigned char kFill = 0xa5;

uint64_t Hash(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Input element `index` of `rank`: an integer in [-8, 8] (spread to high bits for int64).
double Value(int rank, uint64_t index, DType dtype, uint64_t salt) {
  auto v = static_cast<int64_t>(
               Hash(salt * 1000003u + static_cast<uint64_t>(rank) * 7919u + Hash(index)) % 17) -
           8;
  if (dtype == DType::kInt64) return static_cast<double>(v * (int64_t{1} << 35) + v);
  return static_cast<double>(v);
}

void Store(std::byte* base, size_t i, DType dtype, double v) {
  switch (dtype) {
    case DType::kFloat32: reinterpret_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::kBFloat16:
      reinterpret_cast<BFloat16*>(base)[i] = BFloat16(static_cast<float>(v));
      return;
    case DType::kInt32: reinterpret_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::kInt64: reinterpret_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::kInt16: reinterpret_cast<int16_t*>(base)[i] = static_cast<int16_t>(v); return;
  }
}

double Load(const std::byte* base, size_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return reinterpret_cast<const float*>(base)[i];
    case DType::kBFloat16: return static_cast<float>(reinterpret_cast<const BFloat16*>(base)[i]);
    case DType::kInt32: return reinterpret_cast<const int32_t*>(base)[i];
    case DType::kInt64: return static_cast<double>(reinterpret_cast<const int64_t*>(base)[i]);
    case DType::kInt16: return reinterpret_cast<const int16_t*>(base)[i];
  }
  return 0;
}

// v as stored in dtype and read back.
double Representable(double v, DType dtype) {
  std::byte tmp[8];
  Store(tmp, 0, dtype, v);
  return Load(tmp, 0, dtype);
}

double Combine(double a, double b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kMin: return std::min(a, b);
  }
  return 0;
}

// A buffer of n elements followed by a guard zone, filled with a pattern.
struct Buffer {
  Buffer(size_t n, DType t)
      : dtype(t), elems(n), bytes(n * DTypeSize(t) + kGuardBytes, std::byte{kFill}) {}
  std::byte* data() { return bytes.data(); }
  void Set(size_t i, double v) { Store(bytes.data(), i, dtype, v); }
  double Get(size_t i) const { return Load(bytes.data(), i, dtype); }
  bool GuardIntact() const {
    for (size_t i = elems * DTypeSize(dtype); i < bytes.size(); ++i) {
      if (bytes[i] != std::byte{kFill}) return false;
    }
    return true;
  }
  DType dtype;
  size_t elems;
  std::vector<std::byte> bytes;
};

// Elements rank p sends to rank q in the all-to-all-v cases (zeros included).
int64_t VCount(int p, int q, size_t count) {
  if ((p + 2 * q + static_cast<int>(count)) % 4 == 0) return 0;
  return static_cast<int64_t>(count) + (p * 3 + q) % 3;
}

bool IsReduction(CollectiveKind kind) {
  return kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduce ||
         kind == CollectiveKind::kReduceScatter;
}

std::vector<Algorithm> AlgorithmsOf(CollectiveKind kind, bool native) {
  using A = Algorithm;
  std::vector<Algorithm> a;
  switch (kind) {
    case CollectiveKind::kBarrier: a = {A::kAuto, A::kDissemination}; break;
    case CollectiveKind::kBroadcast: a = {A::kAuto, A::kTree, A::kScatterAllGather}; break;
    case CollectiveKind::kReduce: a = {A::kAuto, A::kTree, A::kReduceScatterGather}; break;
    case CollectiveKind::kAllReduce: a = {A::kAuto, A::kRing, A::kTree}; break;
    case CollectiveKind::kAllGather: a = {A::kAuto, A::kRing, A::kLinear}; break;
    case CollectiveKind::kReduceScatter: a = {A::kAuto, A::kRing}; break;
    case CollectiveKind::kAllToAll:
      a = {A::kAuto, A::kPairwise, A::kLinear, A::kHierarchical};
      break;
    case CollectiveKind::kAllToAllV: a = {A::kAuto, A::kPairwise, A::kLinear}; break;
    case CollectiveKind::kAllToAllVDynamic: a = {A::kAuto, A::kPairwise, A::kLinear}; break;
    case CollectiveKind::kScatter: a = {A::kAuto, A::kLinear}; break;
    case CollectiveKind::kGather: a = {A::kAuto, A::kLinear}; break;
    case CollectiveKind::kSplit: break;
  }
  if (native) a.push_back(A::kNative);
  return a;
}

// Every divisor of w: the ranks per node L of the hierarchical cases (L = 1 and L = w are the
// degenerate layouts, one exchange of the two doing all the work).
std::vector<int> Divisors(int w) {
  std::vector<int> d;
  for (int l = 1; l <= w; ++l) {
    if (w % l == 0) d.push_back(l);
  }
  return d;
}

::testing::AssertionResult Mismatch(const Case& c, int rank, const std::string& what, size_t i,
                                    double got, double want) {
  return ::testing::AssertionFailure() << c.Name() << " rank " << rank << ": " << what << "[" << i
                                       << "] = " << got << ", expected " << want;
}

// Element i of rank p in the bfloat16 sum cases. Every sum of them is exact in float32, so the
// expected result does not depend on the summation order; rounding partial sums to bfloat16 would
// change it:
//   even i: rank 0 holds L = +-(1 + k/128), every other rank a value of the same sign below half
//     of L's bfloat16 ulp (m 2^-15, m in [96, 127]): added to L one at a time each rounds back to
//     L, but two or more together (W >= 3) move the sum past it;
//   odd i: m 2^-3, m 2^-7 or m 2^-11 with m odd in [-127, 127] (bits from 2^-11 to 2^8).
float BFloat16SumValue(int p, uint64_t i) {
  uint64_t h = Hash(i * 8191 + static_cast<uint64_t>(p) * 131071 + 12345);
  if (i % 2 == 0) {
    const float sign = Hash(i) % 2 ? -1.0f : 1.0f;
    if (p == 0) return sign * (1.0f + static_cast<float>(h % 128) / 128.0f);
    return sign * std::ldexp(static_cast<float>(96 + h % 32), -15);
  }
  int m = static_cast<int>(h % 128) * 2 - 127;
  return std::ldexp(static_cast<float>(m), -3 - 4 * static_cast<int>((h >> 20) % 3));
}

}  // namespace

std::string Case::Name() const {
  // Appended piece by piece: `"/" + std::string(...)` (a prepend) trips a GCC 12 -Wrestrict false
  // positive.
  std::string s = std::string(CollectiveName(kind)) + "/" + std::string(AlgorithmName(algorithm)) +
                  "/" + std::string(DTypeName(dtype));
  if (IsReduction(kind)) s.append("/").append(ReduceOpName(reduce_op));
  s.append("/n").append(std::to_string(count));
  if (kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kReduce ||
      kind == CollectiveKind::kScatter || kind == CollectiveKind::kGather) {
    s.append("/root").append(std::to_string(root));
  }
  if (ranks_per_node > 0) s.append("/L").append(std::to_string(ranks_per_node));
  if (in_place) s += "/inplace";
  return s;
}

std::vector<size_t> Counts(size_t large) { return {0, 1, 37, large}; }

std::vector<CollectiveKind> CoveredKinds() {
  using K = CollectiveKind;
  return {K::kBarrier,          K::kBroadcast,     K::kReduce,   K::kAllReduce,
          K::kAllGather,        K::kReduceScatter, K::kAllToAll, K::kAllToAllV,
          K::kAllToAllVDynamic, K::kScatter,       K::kGather};
}

std::vector<Case> CasesFor(CollectiveKind kind, int w, bool native, size_t large) {
  std::vector<Case> cases;
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16, DType::kInt32,
                                     DType::kInt64};
  std::vector<ReduceOp> ops = {ReduceOp::kSum};
  if (IsReduction(kind)) ops = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
  for (Algorithm a : AlgorithmsOf(kind, native)) {
    const std::vector<int> layouts = a == Algorithm::kHierarchical ? Divisors(w) : std::vector{0};
    for (int ranks_per_node : layouts) {
      for (DType dtype : dtypes) {
        for (ReduceOp op : ops) {
          for (size_t count : Counts(large)) {
            if (kind == CollectiveKind::kBarrier && (count != 0 || dtype != DType::kFloat32)) {
              continue;
            }
            Case c{kind, a, dtype, op, count};
            c.root =
                static_cast<int>((count + static_cast<size_t>(dtype) + 1) % static_cast<size_t>(w));
            c.ranks_per_node = ranks_per_node;
            c.in_place =
                kind == CollectiveKind::kAllReduce && count % 2 == 1 && op != ReduceOp::kMin;
            cases.push_back(c);
          }
        }
      }
    }
  }
  return cases;
}

::testing::AssertionResult RunCase(Communicator& comm, const Case& c) {
  const int w = comm.size(), r = comm.rank();
  const auto uw = static_cast<size_t>(w);
  const size_t n = c.count;
  const DType dt = c.dtype;
  const uint64_t salt = Hash(static_cast<uint64_t>(c.kind) * 131 + static_cast<uint64_t>(dt) * 17 +
                             n + static_cast<uint64_t>(c.reduce_op));
  auto x = [&](int p, uint64_t i) { return Value(p, i, dt, salt); };
  auto reduce_all = [&](uint64_t i) {
    double acc = x(0, i);
    for (int p = 1; p < w; ++p) acc = Combine(acc, x(p, i), c.reduce_op);
    return acc;
  };
  auto check = [&](const Buffer& out, size_t elems, auto expected,
                   const char* what) -> ::testing::AssertionResult {
    for (size_t i = 0; i < elems; ++i) {
      // Expected values are exact in every dtype; compare after the same conversion.
      double want = Representable(expected(i), dt);
      if (out.Get(i) != want) return Mismatch(c, r, what, i, out.Get(i), want);
    }
    if (!out.GuardIntact()) {
      return ::testing::AssertionFailure()
             << c.Name() << " rank " << r << ": wrote past the end of " << what;
    }
    return ::testing::AssertionSuccess();
  };

  switch (c.kind) {
    case CollectiveKind::kBarrier: {
      comm.Barrier({.algorithm = c.algorithm}).Wait();
      return ::testing::AssertionSuccess();
    }
    case CollectiveKind::kBroadcast: {
      Buffer buf(n, dt);
      if (r == c.root) {
        for (size_t i = 0; i < n; ++i) buf.Set(i, x(c.root, i));
      }
      comm.Broadcast(buf.data(), n, dt, {.root = c.root, .algorithm = c.algorithm}).Wait();
      return check(
          buf, n, [&](size_t i) { return x(c.root, i); }, "buffer");
    }
    case CollectiveKind::kReduce: {
      Buffer in(n, dt), out(n, dt);
      for (size_t i = 0; i < n; ++i) in.Set(i, x(r, i));
      void* recv = r == c.root ? out.data() : nullptr;
      comm.Reduce(in.data(), recv, n, dt,
                  {.root = c.root, .reduce_op = c.reduce_op, .algorithm = c.algorithm})
          .Wait();
      if (r != c.root)
        return check(
            in, n, [&](size_t i) { return x(r, i); }, "send (unchanged)");
      return check(out, n, reduce_all, "recv");
    }
    case CollectiveKind::kAllReduce: {
      Buffer in(n, dt), out(n, dt);
      for (size_t i = 0; i < n; ++i) in.Set(i, x(r, i));
      Buffer& result = c.in_place ? in : out;
      comm.AllReduce(in.data(), result.data(), n, dt,
                     {.reduce_op = c.reduce_op, .algorithm = c.algorithm})
          .Wait();
      if (!c.in_place) {
        auto unchanged = check(
            in, n, [&](size_t i) { return x(r, i); }, "send (unchanged)");
        if (!unchanged) return unchanged;
      }
      return check(result, n, reduce_all, "recv");
    }
    case CollectiveKind::kAllGather: {
      Buffer in(n, dt), out(n * uw, dt);
      for (size_t i = 0; i < n; ++i) in.Set(i, x(r, i));
      comm.AllGather(in.data(), out.data(), n, dt, {.algorithm = c.algorithm}).Wait();
      return check(
          out, n * uw,
          [&](size_t i) {
            return x(static_cast<int>(i / std::max<size_t>(n, 1)), i % std::max<size_t>(n, 1));
          },
          "recv");
    }
    case CollectiveKind::kReduceScatter: {
      Buffer in(n * uw, dt), out(n, dt);
      for (size_t i = 0; i < n * uw; ++i) in.Set(i, x(r, i));
      comm.ReduceScatter(in.data(), out.data(), n, dt,
                         {.reduce_op = c.reduce_op, .algorithm = c.algorithm})
          .Wait();
      return check(
          out, n, [&](size_t i) { return reduce_all(static_cast<size_t>(r) * n + i); }, "recv");
    }
    case CollectiveKind::kAllToAll: {
      Buffer in(n * uw, dt), out(n * uw, dt);
      for (size_t i = 0; i < n * uw; ++i) in.Set(i, x(r, i));
      comm.AllToAll(in.data(), out.data(), n, dt,
                    {.algorithm = c.algorithm, .ranks_per_node = c.ranks_per_node})
          .Wait();
      return check(
          out, n * uw,
          [&](size_t i) {
            size_t q = i / std::max<size_t>(n, 1), k = i % std::max<size_t>(n, 1);
            return x(static_cast<int>(q), static_cast<size_t>(r) * n + k);
          },
          "recv");
    }
    case CollectiveKind::kAllToAllV:
    case CollectiveKind::kAllToAllVDynamic: {
      // Rank p's element k for rank q is x(p, q * 1000003 + k). Send blocks are laid out with a
      // gap of one element (explicit displacements), receives packed.
      std::vector<int64_t> sc(uw), sd(uw), rc(uw), rd(uw);
      int64_t s_off = 0, r_off = 0;
      for (size_t q = 0; q < uw; ++q) {
        sc[q] = VCount(r, static_cast<int>(q), n);
        sd[q] = s_off;
        s_off += sc[q] + 1;
        rc[q] = VCount(static_cast<int>(q), r, n);
        rd[q] = r_off;
        r_off += rc[q];
      }
      Buffer in(static_cast<size_t>(s_off), dt);
      for (size_t q = 0; q < uw; ++q) {
        for (int64_t k = 0; k < sc[q]; ++k) {
          in.Set(static_cast<size_t>(sd[q] + k), x(r, q * 1000003 + static_cast<uint64_t>(k)));
        }
      }
      auto expected = [&](size_t i) {
        size_t q = 0;
        while (static_cast<int64_t>(i) >= rd[q] + rc[q]) ++q;
        return x(static_cast<int>(q),
                 static_cast<uint64_t>(r) * 1000003 + (i - static_cast<size_t>(rd[q])));
      };
      if (c.kind == CollectiveKind::kAllToAllV) {
        Buffer out(static_cast<size_t>(r_off), dt);
        comm.AllToAllV(in.data(), sc, sd, out.data(), rc, rd, dt, {.algorithm = c.algorithm})
            .Wait();
        return check(out, static_cast<size_t>(r_off), expected, "recv");
      }
      // Dynamic: send must be packed, so pack it first.
      Buffer packed(static_cast<size_t>(s_off), dt);
      size_t at = 0;
      for (size_t q = 0; q < uw; ++q) {
        for (int64_t k = 0; k < sc[q]; ++k)
          packed.Set(at++, in.Get(static_cast<size_t>(sd[q] + k)));
      }
      AllToAllVResult result;
      comm.AllToAllVDynamic(packed.data(), sc, dt, &result, {.algorithm = c.algorithm}).Wait();
      if (result.recv_counts != rc || result.recv_displs != rd) {
        return ::testing::AssertionFailure()
               << c.Name() << " rank " << r << ": received counts/displs differ from the senders'";
      }
      if (result.output.numel() != r_off || result.output.dtype() != dt) {
        return ::testing::AssertionFailure()
               << c.Name() << " rank " << r << ": output " << result.output.ToString()
               << ", expected " << r_off << " elements";
      }
      Buffer out(static_cast<size_t>(r_off), dt);
      if (r_off > 0) std::memcpy(out.data(), result.output.raw(), result.output.nbytes());
      return check(out, static_cast<size_t>(r_off), expected, "output");
    }
    case CollectiveKind::kScatter: {
      Buffer in(r == c.root ? n * uw : 0, dt), out(n, dt);
      if (r == c.root) {
        for (size_t i = 0; i < n * uw; ++i) in.Set(i, x(c.root, i));
      }
      comm.Scatter(r == c.root ? in.data() : nullptr, out.data(), n, dt,
                   {.root = c.root, .algorithm = c.algorithm})
          .Wait();
      return check(
          out, n, [&](size_t i) { return x(c.root, static_cast<size_t>(r) * n + i); }, "recv");
    }
    case CollectiveKind::kGather: {
      Buffer in(n, dt), out(r == c.root ? n * uw : 0, dt);
      for (size_t i = 0; i < n; ++i) in.Set(i, x(r, i));
      comm.Gather(in.data(), r == c.root ? out.data() : nullptr, n, dt,
                  {.root = c.root, .algorithm = c.algorithm})
          .Wait();
      if (r != c.root) return ::testing::AssertionSuccess();
      return check(
          out, n * uw,
          [&](size_t i) {
            return x(static_cast<int>(i / std::max<size_t>(n, 1)), i % std::max<size_t>(n, 1));
          },
          "recv");
    }
    case CollectiveKind::kSplit: break;
  }
  return ::testing::AssertionFailure() << "unknown case " << c.Name();
}

::testing::AssertionResult RunBFloat16SumCase(Communicator& comm, CollectiveKind kind,
                                              Algorithm algorithm, size_t count) {
  const int w = comm.size(), r = comm.rank();
  const size_t in_count =
      kind == CollectiveKind::kReduceScatter ? count * static_cast<size_t>(w) : count;
  // Global index of output element j (reduce-scatter: block r).
  const size_t first = kind == CollectiveKind::kReduceScatter ? static_cast<size_t>(r) * count : 0;
  constexpr size_t kGuard = 16;
  const BFloat16 fill(-1234.0f);
  std::vector<BFloat16> in(in_count), out(count + kGuard, fill);
  for (size_t i = 0; i < in_count; ++i) in[i] = BFloat16(BFloat16SumValue(r, i));
  const std::string name = fmt::format("bfloat16 sum {} ({}) n{} on {} ranks", CollectiveName(kind),
                                       AlgorithmName(algorithm), count, w);
  switch (kind) {
    case CollectiveKind::kAllReduce:
      comm.AllReduce(in.data(), out.data(), count, DType::kBFloat16, {.algorithm = algorithm})
          .Wait();
      break;
    case CollectiveKind::kReduce:
      comm.Reduce(in.data(), out.data(), count, DType::kBFloat16,
                  {.root = 0, .algorithm = algorithm})
          .Wait();
      if (r != 0) return ::testing::AssertionSuccess();
      break;
    case CollectiveKind::kReduceScatter:
      comm.ReduceScatter(in.data(), out.data(), count, DType::kBFloat16, {.algorithm = algorithm})
          .Wait();
      break;
    default: return ::testing::AssertionFailure() << name << ": not a reduction";
  }
  size_t per_step_differs = 0;
  for (size_t j = 0; j < count; ++j) {
    // Reference: the float64 sum (exact), rounded to bfloat16 once.
    double exact = 0;
    for (int p = 0; p < w; ++p) exact += BFloat16SumValue(p, first + j);
    const BFloat16 want(static_cast<float>(exact));
    if (out[j].bits != want.bits) {
      return ::testing::AssertionFailure()
             << name << " rank " << r << ": element " << j << " = " << static_cast<float>(out[j])
             << ", expected " << static_cast<float>(want) << " (the exact sum " << exact
             << " rounded once to bfloat16)";
    }
    // What rounding every partial sum to bfloat16 (in rank order) would give instead.
    BFloat16 acc(BFloat16SumValue(0, first + j));
    for (int p = 1; p < w; ++p) {
      acc = BFloat16(static_cast<float>(acc) + BFloat16SumValue(p, first + j));
    }
    if (acc.bits != want.bits) ++per_step_differs;
  }
  for (size_t j = count; j < out.size(); ++j) {
    if (out[j].bits != fill.bits) {
      return ::testing::AssertionFailure() << name << " rank " << r << ": wrote past the output";
    }
  }
  // The inputs must tell the two roundings apart, or the check above proves nothing.
  if (w >= 3 && count >= 37 && per_step_differs * 4 < count) {
    return ::testing::AssertionFailure() << name << ": only " << per_step_differs << " of " << count
                                         << " elements differ between per-step and final rounding";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace switchyard::comm::testing
