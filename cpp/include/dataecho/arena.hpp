// The slot arena: `capacity` example slots in one allocation.
//
// Slot i starts at base + i * stride. Ownership of a slot is not tracked here: at
// any moment a slot index is in exactly one place (the free ring, a producer's
// hands, the committed ring, or the assembler's reservoir), and whoever holds the
// index may touch the slot's bytes. The rings' release/acquire pairs order those
// touches, so the arena itself needs no atomics.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dataecho/config.hpp"
#include "dataecho/memory.hpp"

namespace dataecho {

class SlotArena {
 public:
  // Allocates capacity * stride bytes aligned to `align`.
  SlotArena(std::size_t capacity, std::size_t stride, std::size_t align)
      : SlotArena(capacity, stride, align, Block::allocate(checked_bytes(capacity, stride), align)) {}

  // Builds the arena over memory supplied from outside (pinned or shared); the
  // block must hold capacity * stride bytes and be aligned to `align`.
  SlotArena(std::size_t capacity, std::size_t stride, std::size_t align, Block memory)
      : memory_(std::move(memory)), capacity_(capacity), stride_(stride) {
    DATAECHO_CHECK(stride_ % align == 0);
    DATAECHO_CHECK(reinterpret_cast<std::uintptr_t>(memory_.data()) % align == 0);
    DATAECHO_CHECK(memory_.size() >= checked_bytes(capacity, stride));
  }

  std::byte* slot(std::uint32_t i) const noexcept { return memory_.data() + std::size_t{i} * stride_; }
  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t stride() const noexcept { return stride_; }

 private:
  static std::size_t checked_bytes(std::size_t capacity, std::size_t stride) {
    if (stride != 0 && capacity > SIZE_MAX / stride) throw std::bad_alloc();
    return capacity * stride;
  }

  Block memory_;
  std::size_t capacity_;
  std::size_t stride_;
};

}  // namespace dataecho
