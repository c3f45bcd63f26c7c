// Owned, aligned memory blocks: the one place the core allocates large memory.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
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

  static Block allocate(std::size_t size, std::size_t align) {
    // Large blocks (an arena, a batch of big examples) are placed on 2 MiB
    // boundaries and offered transparent huge pages, as NumPy does for its own
    // large arrays: random gathers across hundreds of MiB otherwise spend a
    // noticeable share of their time on TLB misses.
    const bool huge = size >= kHugePageFrom;
    if (huge && align < kHugePage) align = kHugePage;
    const std::size_t rounded = round_up(size == 0 ? 1 : size, align);
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge) (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
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
    size_ = 0;
    return std::exchange(data_, nullptr);
  }
  std::size_t size() const noexcept { return size_; }

 private:
  Block(std::byte* data, std::size_t size, Release release, void* context) noexcept
      : data_(data), size_(size), release_(release), context_(context) {}

  void reset() noexcept {
    if (release_ != nullptr) release_(context_);
    data_ = nullptr;
    size_ = 0;
    release_ = nullptr;
    context_ = nullptr;
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  Release release_ = nullptr;
  void* context_ = nullptr;
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
