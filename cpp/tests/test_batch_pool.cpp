// Tests of memory.hpp and batch_pool.hpp: blocks of every size class are
// aligned and whole, and the batch pool reuses before allocating and frees
// what it does not keep.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dataecho/batch_pool.hpp"
#include "dataecho/memory.hpp"
#include "harness.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::BatchPool;
using dataecho::Block;

// Blocks of every size class (heap, mapped, mapped and huge) are aligned as
// asked and writable to their last byte (ASan checks the bounds).
void check_block_size_classes() {
  for (std::size_t size : {std::size_t{100}, Block::kMapFrom - 1, Block::kMapFrom, std::size_t{3} << 20,
                           Block::kHugePageFrom + 12345}) {
    for (std::size_t align : {std::size_t{64}, std::size_t{4096}}) {
      Block block = Block::allocate(size, align);
      const std::size_t want = size >= Block::kHugePageFrom ? Block::kHugePage : align;
      CHECK_MSG(reinterpret_cast<std::uintptr_t>(block.data()) % want == 0,
                "block of " << size << " bytes not aligned to " << want);
      CHECK(block.size() == size);
      std::memset(block.data(), 0xAB, size);
      CHECK(static_cast<unsigned char>(block.data()[size - 1]) == 0xAB);
    }
  }
}

// The pool keeps at most keep_free given-back blocks and frees the rest, and
// reuses before allocating: a steady consumer allocates nothing new.
void check_pool_keeps_and_reuses() {
  const std::size_t keep_free = 3;
  auto pool = BatchPool::create(Block::kMapFrom, 64, keep_free);
  std::vector<std::shared_ptr<BatchPool::Lease>> held;
  for (int i = 0; i < 40; ++i) held.push_back(pool->lease());
  CHECK(pool->allocated() == 40);
  held.clear();
  CHECK_MSG(pool->allocated() == keep_free, "allocated " << pool->allocated() << " after all were given back");
  for (int round = 0; round < 100; ++round) {
    auto a = pool->lease();
    auto b = pool->lease();
    CHECK(a->data() != b->data());
  }
  CHECK(pool->allocated() == keep_free);
}

}  // namespace

std::string test_batch_pool() {
  check_block_size_classes();
  check_pool_keeps_and_reuses();
  return "blocks aligned and whole in every size class; the pool frees what it does not keep";
}

}  // namespace dataecho_test
