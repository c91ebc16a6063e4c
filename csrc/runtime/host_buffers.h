#pragma once
// Host memory for compiled CPU graphs: a cache of large buffers kept between calls.
//
// Why: glibc serves large blocks with fresh mmaps and gives freed heap tops back to the system, so each call of
// a graph whose intermediates are megabytes touches new pages. On a 2-core VM a page fault costs about 1.3 us:
// conv + ReLU on a 224x224 image took 4.5 ms with 3,048 faults per call and 1.5 ms without; a transformer
// forward ranged from 625 to 734 ms with the number of faults. The cache keeps such blocks for the next call.
#include <cstddef>
#include <cstdint>

namespace kiln::runtime {

/// While an object of this class lives on a thread, the large CPU allocations that thread makes through torch's
/// CPU allocator (kiln's kernel buffers and the results of the ATen calls inside a compiled graph alike) come
/// from kiln's host buffer cache, and go back to it when freed, from any thread. Other threads and allocations
/// outside such a scope use torch's allocator as before. Nests. The first scope installs kiln's allocator in
/// front of torch's CPU allocator (it forwards everything but the scoped large blocks); if another allocator
/// of higher priority is installed, scopes do nothing.
class HostBufferScope {
 public:
  HostBufferScope();
  ~HostBufferScope();
  HostBufferScope(const HostBufferScope&) = delete;
  HostBufferScope& operator=(const HostBufferScope&) = delete;

 private:
  bool previous_;
};

struct HostBufferStats {
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations that took new memory
  size_t cached_bytes = 0;   // free blocks held for reuse
  size_t in_use_bytes = 0;   // blocks of the cache held by live tensors
};

HostBufferStats host_buffer_stats();

/// Frees every cached free block (kiln.reset() calls it). Blocks in use go back to the system when freed.
void release_host_buffers();

}  // namespace kiln::runtime
