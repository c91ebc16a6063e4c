// The host buffer cache (runtime/host_buffers.h).
//
// Design: one allocator object, installed once in front of torch's CPU allocator and never destroyed (tensors
// may outlive everything else). Outside a HostBufferScope, and for small blocks, it forwards to the allocator it
// replaced, whose DataPtrs keep that allocator's own deleter. Inside a scope, a block of at least
// kMinCachedBytes is rounded up to a size class and taken from that class's free list (exact class only, so a
// graph called again with the same shapes always hits); it carries this allocator's deleter, which puts it back
// on its free list unless the free lists already hold kMaxCachedBytes. Blocks come from c10::alloc_cpu, the
// default allocator's own aligned allocation. The raw interface (context == data) works for both kinds of
// block: the raw deleter looks the pointer up among the cache's blocks and forwards the others.
#include "runtime/host_buffers.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/log.h"

namespace kiln::runtime {

namespace {

constexpr size_t kMinCachedBytes = size_t{256} << 10;  // smaller blocks come from the heap's free lists anyway
constexpr size_t kMaxCachedBytes = size_t{1} << 30;    // free blocks held at most; more go back to the system

thread_local bool t_in_scope = false;

// Size classes: 64 KiB steps up to 16 MiB, 2 MiB steps above (at most 12.5% of a block is slack).
size_t size_class(size_t n) {
  const size_t step = n <= (size_t{16} << 20) ? (size_t{64} << 10) : (size_t{2} << 20);
  return (n + step - 1) / step * step;
}

class CachingHostAllocator final : public c10::Allocator {
 public:
  explicit CachingHostAllocator(c10::Allocator* base) : base_(base), base_raw_deleter_(base->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    if (!t_in_scope || n < kMinCachedBytes) return base_->allocate(n);
    const size_t size = size_class(n);
    void* block = take(size);
    if (!block) {
      try {
        block = c10::alloc_cpu(size);
      } catch (const c10::Error&) {
        release();  // out of memory: give the cached blocks back and try once more
        block = c10::alloc_cpu(size);
      }
      std::lock_guard<std::mutex> lock(*mutex_);
      ++stats_.misses;
      in_use_[block] = size;
      stats_.in_use_bytes += size;
    }
    return {block, block, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void give_back(void* block) {
    std::unique_lock<std::mutex> lock(*mutex_);
    auto it = in_use_.find(block);
    if (it == in_use_.end()) {  // a raw block of the allocator this one forwards to
      lock.unlock();
      base_raw_deleter_(block);
      return;
    }
    const size_t size = it->second;
    in_use_.erase(it);
    stats_.in_use_bytes -= size;
    if (stats_.cached_bytes + size > kMaxCachedBytes) {
      lock.unlock();
      c10::free_cpu(block);
      return;
    }
    free_[size].push_back(block);
    stats_.cached_bytes += size;
  }

  void release() {
    std::unordered_map<size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(*mutex_);
      blocks.swap(free_);
      stats_.cached_bytes = 0;
    }
    for (auto& [size, list] : blocks)
      for (void* block : list) c10::free_cpu(block);
  }

  HostBufferStats stats() {
    std::lock_guard<std::mutex> lock(*mutex_);
    return stats_;
  }

  static void delete_block(void* block);

  void after_fork_in_child() { mutex_ = new std::mutex; }  // the old one is never unlocked there: leaked

 private:
  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(*mutex_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* block = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= size;
    stats_.in_use_bytes += size;
    ++stats_.hits;
    in_use_[block] = size;
    return block;
  }

  c10::Allocator* const base_;
  const c10::DeleterFnPtr base_raw_deleter_;
  // A pointer so that a forked child can take a fresh one (after_fork_in_child): a fork while another thread held
  // this lock would leave the child's copy locked forever.
  std::mutex* mutex_ = new std::mutex;
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  std::unordered_map<void*, size_t> in_use_;             // block -> size class
  HostBufferStats stats_;
};

std::atomic<CachingHostAllocator*> g_installed{nullptr};

// The installed allocator, or nullptr when torch keeps another of higher priority. Installed on first use.
CachingHostAllocator* installed() {
  static CachingHostAllocator* const allocator = [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    auto* mine = new CachingHostAllocator(base);  // never deleted: blocks may be freed at any time
    c10::SetCPUAllocator(mine, /*priority=*/0);
    if (c10::GetCPUAllocator() != mine) {
      KILN_LOG(perf) << "kiln: torch's CPU allocator was replaced with a higher priority; the host buffer cache is off";
      return static_cast<CachingHostAllocator*>(nullptr);
    }
    g_installed.store(mine);
    pthread_atfork(nullptr, nullptr, [] {
      if (CachingHostAllocator* allocator = g_installed.load()) allocator->after_fork_in_child();
    });
    return mine;
  }();
  return allocator;
}

void CachingHostAllocator::delete_block(void* block) { installed()->give_back(block); }

}  // namespace

HostBufferScope::HostBufferScope() : previous_(t_in_scope) { t_in_scope = installed() != nullptr; }

HostBufferScope::~HostBufferScope() { t_in_scope = previous_; }

HostBufferStats host_buffer_stats() {
  CachingHostAllocator* allocator = g_installed.load();
  return allocator ? allocator->stats() : HostBufferStats();
}

void release_host_buffers() {
  if (CachingHostAllocator* allocator = g_installed.load()) allocator->release();
}

}  // namespace kiln::runtime
