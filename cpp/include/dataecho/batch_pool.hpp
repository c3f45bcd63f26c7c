// Batch memory: a pool of equally sized blocks, leased out one per batch.
//
// A batch handed to a consumer is a lease on one block. The block goes back to
// the pool only when the last owner of the lease lets go (in Python: when no
// array viewing it is alive), so memory a consumer can see is never reused. If
// consumers keep batches, the pool allocates more blocks instead of waiting or
// overwriting. Of the blocks given back it keeps at most `keep_free` for reuse
// and frees the rest, so memory use is bounded by keep_free + the batches alive
// now, not by the most ever alive at once.
//
// Ragged fields' values (batch_size rows of varying length) take a second kind
// of block, whose size varies from batch to batch: value blocks come in size
// classes (powers of two from 4 KiB), kept per class the same way, and a
// lease grows its value block to the next class when a batch outgrows it.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <unistd.h>

#include "dataecho/memory.hpp"

namespace dataecho {

class BatchPool : public std::enable_shared_from_this<BatchPool> {
 public:
  class Lease;

  // `cache`: where blocks come from, and where the free ones go when the pool
  // dies (see BlockCache); none: allocated and freed.
  static std::shared_ptr<BatchPool> create(std::size_t block_bytes, std::size_t align, std::size_t keep_free,
                                           std::shared_ptr<BlockCache> cache = nullptr) {
    return std::shared_ptr<BatchPool>(new BatchPool(block_bytes, align, keep_free, std::move(cache)));
  }

  // No lease is alive (each holds the pool): no consumer can see these blocks.
  ~BatchPool() {
    if (cache_ == nullptr || getpid() != owner_pid_) return;
    try {
      for (Block& block : free_) cache_->give(std::move(block));
    } catch (...) {  // out of memory for the cache's list: the blocks are freed instead
    }
  }

  // Adds a block supplied from outside (page-locked memory, say) of at least
  // block_bytes(); such blocks are leased before any the pool allocated itself.
  void adopt(Block block) {
    DATAECHO_CHECK(block.size() >= block_bytes_);
    std::lock_guard<std::mutex> lock(mutex_);
    adopted_free_.reserve(adopted_ + 1);
    ++adopted_;
    adopted_free_.push_back(std::move(block));
  }

  // Takes a free block (adopted ones first) or allocates one; throws
  // std::bad_alloc when memory runs out.
  std::shared_ptr<Lease> lease() {
    Block block;
    bool adopted = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!adopted_free_.empty()) {
        block = std::move(adopted_free_.back());
        adopted_free_.pop_back();
        adopted = true;
      } else if (!free_.empty()) {
        block = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (block.data() == nullptr) {
      block = cache_ ? cache_->take(block_bytes_, align_) : Block::allocate(block_bytes_, align_);
      // Debug builds: fresh blocks read as poison too, like recycled ones (a
      // freed block's address may come back as a new one).
      poison(block.data(), block.size());
      std::lock_guard<std::mutex> lock(mutex_);
      free_.reserve(allocated_ + 1);  // so that give_back never reallocates
      ++allocated_;
    }
    return std::shared_ptr<Lease>(new Lease(shared_from_this(), std::move(block), adopted));
  }

  // A value block of at least `bytes` (a whole size class); throws
  // std::bad_alloc when memory runs out.
  Block take_values(std::size_t bytes) {
    const std::size_t c = size_class(bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_values_[c].empty()) {
        Block block = std::move(free_values_[c].back());
        free_values_[c].pop_back();
        return block;
      }
    }
    Block block = Block::allocate(kMinValueBlock << c, kCacheLine);
    poison(block.data(), block.size());
    return block;
  }

  // Takes back a value block (kept for reuse up to keep_free per class).
  void give_values(Block block) noexcept {
    if (block.data() == nullptr) return;
    if (getpid() != owner_pid_) {  // see give_back
      (void)block.release_unowned();
      return;
    }
    poison(block.data(), block.size());
    Block surplus;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(mutex_);
    auto& kept = free_values_[size_class(block.size())];
    if (kept.size() < keep_free_ && kept.size() < kept.capacity())
      kept.push_back(std::move(block));
    else
      surplus = std::move(block);
  }

  // Blocks allocated and not yet freed, leased or free (adopted ones not
  // counted); a steady value means consumers release what they take.
  std::size_t allocated() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocated_;
  }

  std::size_t adopted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return adopted_;
  }

  // One block, owned by whoever holds the lease, and the value blocks of its
  // ragged fields; returned to the pool on destruction.
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      for (Values& v : values_) pool_->give_values(std::move(v.block));
      pool_->give_back(std::move(block_), adopted_);
    }
    std::byte* data() const noexcept { return block_.data(); }

    // Ragged field r's value block (nullptr until reserved) and bytes used in it.
    std::byte* values(std::size_t r) const noexcept { return r < values_.size() ? values_[r].block.data() : nullptr; }
    std::size_t values_used(std::size_t r) const noexcept { return r < values_.size() ? values_[r].used : 0; }
    void set_values_used(std::size_t r, std::size_t used) noexcept { values_[r].used = used; }

    // Makes ragged field r's value block hold at least `bytes`, keeping the
    // bytes used so far; returns it. Only the batch's assembler (or copier)
    // calls this, before the batch is handed out.
    std::byte* reserve_values(std::size_t r, std::size_t bytes) {
      if (values_.size() <= r) values_.resize(r + 1);
      Values& v = values_[r];
      if (v.block.data() != nullptr && v.block.size() >= bytes) return v.block.data();
      if (bytes == 0 && v.block.data() == nullptr) return nullptr;
      Block grown = pool_->take_values(std::max(bytes, v.block.size() * 2));
      if (v.used > 0) std::memcpy(grown.data(), v.block.data(), v.used);
      pool_->give_values(std::exchange(v.block, std::move(grown)));
      return v.block.data();
    }

   private:
    friend class BatchPool;
    struct Values {
      Block block;
      std::size_t used = 0;
    };
    Lease(std::shared_ptr<BatchPool> pool, Block block, bool adopted)
        : pool_(std::move(pool)), block_(std::move(block)), adopted_(adopted) {}
    std::shared_ptr<BatchPool> pool_;  // keeps the pool alive while a batch is
    Block block_;
    bool adopted_;
    std::vector<Values> values_;
  };

 private:
  static constexpr std::size_t kMinValueBlock = 4096;
  static constexpr std::size_t kValueClasses = 41;  // 4 KiB .. 4 PiB

  BatchPool(std::size_t block_bytes, std::size_t align, std::size_t keep_free, std::shared_ptr<BlockCache> cache)
      : block_bytes_(block_bytes), align_(align), keep_free_(keep_free), cache_(std::move(cache)) {
    for (auto& kept : free_values_) kept.reserve(keep_free_);  // so that give_values never reallocates
  }

  static std::size_t size_class(std::size_t bytes) noexcept {
    if (bytes <= kMinValueBlock) return 0;
    const auto c = static_cast<std::size_t>(std::bit_width((bytes - 1) / kMinValueBlock));
    DATAECHO_CHECK(c < kValueClasses);
    return c;
  }

  void give_back(Block block, bool adopted) noexcept {
    // In a forked child the mutex may have been copied locked by a thread that no
    // longer exists: leak the block there rather than deadlock.
    if (getpid() != owner_pid_) {
      (void)block.release_unowned();
      return;
    }
    poison(block.data(), block.size());
    Block surplus;  // freed after the lock is released
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Capacity reserved in lease() and adopt(): neither push can throw.
      if (adopted) {
        adopted_free_.push_back(std::move(block));
      } else if (free_.size() < keep_free_) {
        free_.push_back(std::move(block));
      } else {
        surplus = std::move(block);
        --allocated_;
      }
    }
  }

  const std::size_t block_bytes_;
  const std::size_t align_;
  const std::size_t keep_free_;
  const std::shared_ptr<BlockCache> cache_;
  const pid_t owner_pid_ = getpid();
  mutable std::mutex mutex_;
  std::vector<Block> free_;
  std::vector<Block> adopted_free_;
  std::array<std::vector<Block>, kValueClasses> free_values_;
  std::size_t allocated_ = 0;
  std::size_t adopted_ = 0;
};

// An assembled batch: `rows` examples laid out as ExampleLayout's batch regions.
struct Batch {
  std::shared_ptr<BatchPool::Lease> lease;
  std::size_t rows = 0;
  std::vector<std::uint64_t> seqs;      // each row's sequence number (checkpoints, the delivery ledger)
  std::vector<std::uint64_t> released;  // keys of examples freed while it was assembled (see BufferConfig::key_field)
  std::vector<std::uint64_t> unheld;    // owner handles of held values freed meanwhile (see layout.hpp)
};

}  // namespace dataecho
