// Owned, aligned memory blocks: the one place the core allocates large memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "dataecho/config.hpp"

namespace dataecho {

// A block of `size` bytes aligned to `align`, or a view of memory owned elsewhere
// (pinned host memory from torch, a shared mapping): then `release` runs instead of free.
class Block {
 public:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kHugePageFrom = std::size_t{4} << 20;

  using Release = void (*)(void* context) noexcept;

  Block() = default;

  // Blocks from this size on are mapped from the kernel directly, so that
  // freeing one gives its pages back at once (the allocator would keep them
  // for reuse, and a pool that shrinks would not shrink the process).
  static constexpr std::size_t kMapFrom = std::size_t{256} << 10;

  static Block allocate(std::size_t size, std::size_t align) {
    // Large blocks (an arena, a batch of big examples) are placed on 2 MiB
    // boundaries and offered transparent huge pages, as NumPy does for its own
    // large arrays: random gathers across hundreds of MiB otherwise spend a
    // noticeable share of their time on TLB misses.
    const bool huge = size >= kHugePageFrom;
    if (huge && align < kHugePage) align = kHugePage;
#if defined(__linux__)
    if (size >= kMapFrom) return map(size, align, huge);
#endif
    const std::size_t rounded = round_up(size == 0 ? 1 : size, align);
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) throw std::bad_alloc();
    return Block(static_cast<std::byte*>(p), size, [](void* q) noexcept { std::free(q); }, p);
  }

  // Adopts memory owned by the caller; `release(context)` is called when the block dies.
  static Block adopt(void* data, std::size_t size, Release release, void* context) noexcept {
    return Block(static_cast<std::byte*>(data), size, release, context);
  }

  Block(Block&& other) noexcept { *this = std::move(other); }
  Block& operator=(Block&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      release_ = std::exchange(other.release_, nullptr);
      context_ = std::exchange(other.context_, nullptr);
      mapped_ = std::exchange(other.mapped_, 0);
    }
    return *this;
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() { reset(); }

  std::byte* data() const noexcept { return data_; }

  // Forgets the memory without releasing it (for a forked child, where the
  // owner's bookkeeping may be inconsistent); returns the pointer.
  std::byte* release_unowned() noexcept {
    release_ = nullptr;
    context_ = nullptr;
    mapped_ = 0;
    size_ = 0;
    return std::exchange(data_, nullptr);
  }
  std::size_t size() const noexcept { return size_; }

 private:
#if defined(__linux__)
  // An anonymous private mapping of `size` bytes at an `align` boundary: map
  // align - page more than needed, then unmap the unaligned head and the tail.
  static Block map(std::size_t size, std::size_t align, bool huge) {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    if (align < page) align = page;
    const std::size_t length = round_up(size, page);
    const std::size_t reserved = length + align - page;
    void* p = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(p);
    const std::uintptr_t aligned = round_up(start, align);
    if (aligned > start) (void)munmap(p, aligned - start);
    const std::size_t tail = reserved - (aligned - start) - length;
    if (tail > 0) (void)munmap(reinterpret_cast<void*>(aligned + length), tail);
    auto* data = reinterpret_cast<std::byte*>(aligned);
#if defined(MADV_HUGEPAGE)
    if (huge) (void)madvise(data, length, MADV_HUGEPAGE);  // advice only: failure is harmless
#else
    (void)huge;
#endif
    Block block(data, size, nullptr, nullptr);
    block.mapped_ = length;
    return block;
  }
#endif

  Block(std::byte* data, std::size_t size, Release release, void* context) noexcept
      : data_(data), size_(size), release_(release), context_(context) {}

  void reset() noexcept {
    if (release_ != nullptr) release_(context_);
#if defined(__linux__)
    if (mapped_ != 0) (void)munmap(data_, mapped_);
#endif
    mapped_ = 0;
    data_ = nullptr;
    size_ = 0;
    release_ = nullptr;
    context_ = nullptr;
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  Release release_ = nullptr;
  void* context_ = nullptr;
  std::size_t mapped_ = 0;  // bytes mapped at data_ (0: not a mapping of ours)
};

// Freed blocks kept for the next requests of the same size: a loader's next
// epoch builds its buffer (region and batch blocks) in the memory of the last
// one, whose pages are already faulted in (for large examples, hundreds of MiB
// that the kernel would otherwise map and zero again every epoch). At most
// kMaxKept blocks, the oldest freed first. Thread-safe; the blocks are freed
// with the cache, or by clear(). Blocks of memory owned elsewhere (adopted)
// are never given to it.
class BlockCache {
 public:
  static constexpr std::size_t kMaxKept = 16;

  // A kept block of exactly `size` bytes at an `align` boundary, else a new one.
  Block take(std::size_t size, std::size_t align) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (std::size_t i = kept_.size(); i-- > 0;) {
        if (kept_[i].size() == size && reinterpret_cast<std::uintptr_t>(kept_[i].data()) % align == 0) {
          Block block = std::move(kept_[i]);
          kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
          return block;
        }
      }
    }
    return Block::allocate(size, align);
  }

  // Keeps `block` (if it holds memory), freeing the oldest beyond kMaxKept.
  void give(Block block) {
    if (block.data() == nullptr) return;
    std::vector<Block> surplus;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.push_back(std::move(block));
    while (kept_.size() > kMaxKept) {
      surplus.push_back(std::move(kept_.front()));
      kept_.erase(kept_.begin());
    }
  }

  void clear() noexcept {
    std::vector<Block> surplus;
    std::lock_guard<std::mutex> lock(mutex_);
    surplus.swap(kept_);
  }

  std::size_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t bytes = 0;
    for (const Block& block : kept_) bytes += block.size();
    return bytes;
  }

 private:
  std::mutex mutex_;
  std::vector<Block> kept_;
};

// Debug builds (-DDATAECHO_POISON=1) fill recycled memory with this byte so that a
// reader of memory it no longer owns sees an unmistakable pattern.
inline constexpr unsigned char kPoisonByte = 0xDB;

inline void poison([[maybe_unused]] void* p, [[maybe_unused]] std::size_t n) noexcept {
#if defined(DATAECHO_POISON) && DATAECHO_POISON
  std::memset(p, kPoisonByte, n);
#endif
}

}  // namespace dataecho
