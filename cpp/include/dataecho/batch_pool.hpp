// Batch memory: a pool of equally sized blocks, leased out one per batch.
//
// A batch handed to a consumer is a lease on one block. The block goes back to
// the pool only when the last owner of the lease lets go (in Python: when no
// array viewing it is alive), so memory a consumer can see is never reused. If
// consumers keep batches, the pool allocates more blocks instead of waiting or
// overwriting. Of the blocks given back it keeps at most `keep_free` for reuse
// and frees the rest, so memory use is bounded by keep_free + the batches alive
// now, not by the most ever alive at once.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
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

  // One block, owned by whoever holds the lease; returned to the pool on destruction.
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { pool_->give_back(std::move(block_), adopted_); }
    std::byte* data() const noexcept { return block_.data(); }

   private:
    friend class BatchPool;
    Lease(std::shared_ptr<BatchPool> pool, Block block, bool adopted)
        : pool_(std::move(pool)), block_(std::move(block)), adopted_(adopted) {}
    std::shared_ptr<BatchPool> pool_;  // keeps the pool alive while a batch is
    Block block_;
    bool adopted_;
  };

 private:
  BatchPool(std::size_t block_bytes, std::size_t align, std::size_t keep_free, std::shared_ptr<BlockCache> cache)
      : block_bytes_(block_bytes), align_(align), keep_free_(keep_free), cache_(std::move(cache)) {}

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
  std::size_t allocated_ = 0;
  std::size_t adopted_ = 0;
};

// An assembled batch: `rows` examples laid out as ExampleLayout's batch regions.
struct Batch {
  std::shared_ptr<BatchPool::Lease> lease;
  std::size_t rows = 0;
  std::vector<std::uint64_t> seqs;  // each row's sequence number (for checkpoints)
};

}  // namespace dataecho
