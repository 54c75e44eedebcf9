// PageArray: a float array in whole pages of its own (an anonymous mapping), whose pages can be
// handed back to the operating system while the array stays mapped. This is how ZeRO frees memory
// (zero.h) without invalidating the tensor handles that point into the array: the addresses stay
// valid, released pages read as zeros and take memory again only when written.
//
// Memory is measured, not estimated: ResidentBytes() asks the kernel (mincore) which of the
// array's pages are in memory. Transparent huge pages are turned off for the mapping so that one
// write commits one page, which makes the count deterministic for a given sequence of writes and
// releases. Reading a released page maps the system's shared zero page, which counts as in
// memory too (it is not allocated); ZeRO never reads what it released.
//
// Thread-safety: Release and ResidentBytes may run while another thread reads or writes other
// pages; a page released while it is being written ends up in either state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace switchyard::train {

class PageArray {
 public:
  // `elements` floats, all zero (no page is committed until written). Throws Error when the
  // system refuses the mapping.
  explicit PageArray(int64_t elements);
  ~PageArray();
  PageArray(const PageArray&) = delete;
  PageArray& operator=(const PageArray&) = delete;

  // Floats per page of the system (1024 with 4 KiB pages).
  static int64_t PageElements();

  float* data() const { return data_; }
  int64_t size() const { return size_; }
  // Elements [begin, end) read 0 afterwards; the pages wholly inside the range are given back to
  // the system, the elements on pages partly outside it are set to 0.
  void Release(int64_t begin, int64_t end);
  // Bytes of the array's pages in memory (whole pages).
  int64_t ResidentBytes() const;
  // One entry per page of the array: whether it is in memory.
  std::vector<bool> ResidentPages() const;

 private:
  float* data_ = nullptr;
  int64_t size_ = 0;
  size_t bytes_ = 0;  // mapped, whole pages
};

}  // namespace switchyard::train
