#include "switchyard/kernels/cpu_features.h"

#include <cpuid.h>

#include <cstdint>
#include <cstring>

namespace switchyard::kernels {
namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs CpuId(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d)) return Regs{};
  return r;
}

// XCR0: which register states the OS saves on a context switch.
uint64_t Xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool Bit(unsigned reg, int bit) { return ((reg >> bit) & 1u) != 0; }

CpuFeatures Detect() {
  CpuFeatures f;
  Regs r0 = CpuId(0, 0);
  char vendor[13] = {};
  std::memcpy(vendor, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  f.vendor = vendor;
  const unsigned max_leaf = r0.a;
  Regs r1 = CpuId(1, 0);
  const int base_family = static_cast<int>((r1.a >> 8) & 0xf);
  const int base_model = static_cast<int>((r1.a >> 4) & 0xf);
  f.family = base_family == 0xf ? base_family + static_cast<int>((r1.a >> 20) & 0xff) : base_family;
  f.model = (base_family == 0x6 || base_family == 0xf)
                ? (static_cast<int>((r1.a >> 16) & 0xf) << 4) + base_model
                : base_model;
  const bool osxsave = Bit(r1.c, 27);
  const uint64_t xcr0 = osxsave ? Xcr0() : 0;
  const bool ymm_state = (xcr0 & 0x6) == 0x6;                 // SSE + AVX state
  const bool zmm_state = ymm_state && (xcr0 & 0xe0) == 0xe0;  // opmask + ZMM0-15 hi + ZMM16-31
  const bool amx_state = (xcr0 & 0x60000) == 0x60000;         // XTILECFG + XTILEDATA
  if (max_leaf < 7) return f;
  Regs r7 = CpuId(7, 0);
  Regs r7_1 = CpuId(7, 1);
  f.fma = ymm_state && Bit(r1.c, 12);
  f.avx2 = ymm_state && Bit(r7.b, 5);
  f.avx512f = zmm_state && Bit(r7.b, 16);
  f.avx512dq = f.avx512f && Bit(r7.b, 17);
  f.avx512bw = f.avx512f && Bit(r7.b, 30);
  f.avx512vl = f.avx512f && Bit(r7.b, 31);
  f.avx512_bf16 = f.avx512f && Bit(r7_1.a, 5);
  f.amx_tile = amx_state && Bit(r7.d, 24);
  f.amx_bf16 = f.amx_tile && Bit(r7.d, 22);
  return f;
}

}  // namespace

const char* CpuFeatures::BestFmaIsa() const {
  if (HasAvx512Core()) return "avx512";
  if (HasAvx2Fma()) return "avx2";
  return "sse";
}

std::string CpuFeatures::ToString() const {
  std::string s = vendor + " family " + std::to_string(family) + " model " + std::to_string(model);
  s += ":";
  const std::pair<const char*, bool> flags[] = {{"avx2", avx2},
                                                {"fma", fma},
                                                {"avx512f", avx512f},
                                                {"avx512bw", avx512bw},
                                                {"avx512dq", avx512dq},
                                                {"avx512vl", avx512vl},
                                                {"avx512_bf16", avx512_bf16},
                                                {"amx_tile", amx_tile},
                                                {"amx_bf16", amx_bf16}};
  bool any = false;
  for (const auto& [name, on] : flags) {
    if (!on) continue;
    s += " ";
    s += name;
    any = true;
  }
  if (!any) s += " (no AVX2)";
  return s;
}

const CpuFeatures& HostCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

}  // namespace switchyard::kernels
