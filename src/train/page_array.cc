#include "switchyard/train/page_array.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::train {
namespace {

size_t PageBytes() {
  static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return bytes;
}

}  // namespace

int64_t PageArray::PageElements() { return static_cast<int64_t>(PageBytes() / sizeof(float)); }

PageArray::PageArray(int64_t elements) : size_(elements) {
  SY_REQUIRE(elements >= 0, InvalidArgument, "PageArray: elements must be >= 0, got {}", elements);
  if (elements == 0) return;
  const size_t page = PageBytes();
  bytes_ = (static_cast<size_t>(elements) * sizeof(float) + page - 1) / page * page;
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  SY_REQUIRE(p != MAP_FAILED, Error, "PageArray: mapping {} bytes failed: {}", bytes_,
             std::strerror(errno));
  // Best effort: without it a write may commit a 2 MiB page, which only changes the counts.
  (void)madvise(p, bytes_, MADV_NOHUGEPAGE);
  data_ = static_cast<float*>(p);
}

PageArray::~PageArray() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

void PageArray::Release(int64_t begin, int64_t end) {
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, size_);
  if (begin >= end) return;
  const int64_t pe = PageElements();
  const int64_t first = (begin + pe - 1) / pe * pe;  // first whole page inside
  const int64_t last = end == size_ ? (end + pe - 1) / pe * pe : end / pe * pe;
  if (first >= last) {
    std::fill(data_ + begin, data_ + end, 0.0f);
    return;
  }
  std::fill(data_ + begin, data_ + first, 0.0f);
  if (last < end) std::fill(data_ + last, data_ + end, 0.0f);  // (past the end: the mapping's)
  const size_t bytes = std::min(static_cast<size_t>(last - first) * sizeof(float),
                                bytes_ - static_cast<size_t>(first) * sizeof(float));
  SY_REQUIRE(madvise(data_ + first, bytes, MADV_DONTNEED) == 0, Error,
             "PageArray: releasing {} bytes failed: {}", bytes, std::strerror(errno));
}

int64_t PageArray::ResidentBytes() const {
  int64_t pages = 0;
  for (bool in : ResidentPages()) pages += in ? 1 : 0;
  return pages * static_cast<int64_t>(PageBytes());
}

std::vector<bool> PageArray::ResidentPages() const {
  const size_t pages = bytes_ / PageBytes();
  std::vector<unsigned char> in(pages);
  if (pages > 0) {
    SY_REQUIRE(mincore(data_, bytes_, in.data()) == 0, Error, "PageArray: mincore failed: {}",
               std::strerror(errno));
  }
  std::vector<bool> out(pages);
  for (size_t i = 0; i < pages; ++i) out[i] = (in[i] & 1) != 0;
  return out;
}

}  // namespace switchyard::train
