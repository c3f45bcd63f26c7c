// The slot arena: `capacity` example slots, one after another, in the region.
//
// Slot i starts at base + i * stride. Ownership of a slot is not tracked here: at
// any moment a slot index is in exactly one place (the free ring, a producer's
// hands, the committed ring, or the assembler's reservoir), and whoever holds the
// index may touch the slot's bytes. The rings' release/acquire pairs order those
// touches, so the arena itself needs no atomics. The memory belongs to the
// region (region.hpp), private or shared, so this is a view.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dataecho {

class SlotArena {
 public:
  SlotArena() = default;
  SlotArena(std::byte* base, std::size_t capacity, std::size_t stride)
      : base_(base), capacity_(capacity), stride_(stride) {}

  std::byte* slot(std::uint32_t i) const noexcept { return base_ + std::size_t{i} * stride_; }
  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t stride() const noexcept { return stride_; }

 private:
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t stride_ = 0;
};

}  // namespace dataecho
