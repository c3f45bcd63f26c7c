// Where each field of an example lives, in a slot and in a batch.
//
// Slot: the fields of one example packed one after another, each at a 16-byte
// aligned offset; the slot stride is 64-byte aligned (4096 when an example is at
// least 4 KiB), so slots never share a cache line (or a page, for large ones).
//
// Batch: one contiguous region per field, [batch_size][field bytes], each region
// aligned like a slot. A field's batch is therefore a C-contiguous array that
// Python can view without a copy.
//
// Ragged fields (a first axis whose length varies: token ids, boxes) keep only
// a RaggedRef in the slot: the row count and the chain of pages of the page
// heap (page_heap.hpp) that holds the values. In a batch they are packed
// values, in a block of their own (the batch's lease owns it; its size varies
// from batch to batch), plus an offsets region here of batch_size + 1 int64:
// row i's values are [offsets[i], offsets[i + 1]) (cu_seqlens).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "dataecho/config.hpp"
#include "dataecho/stream_copy.hpp"

namespace dataecho {

// Where an example's values of one ragged field are: `rows` rows, in the page
// chain first -> ... -> last (kNoPage both when rows is 0).
struct RaggedRef {
  std::uint64_t rows;
  std::uint32_t first;
  std::uint32_t last;
};

// A holdable field's value for one slot: held at `data` for `owner` (a handle
// the caller chose, never 0), or copied into the slot (data == nullptr).
struct HeldRef {
  const std::byte* data;
  std::uint64_t owner;
};

class ExampleLayout {
 public:
  static constexpr std::size_t kFieldAlign = 16;

  // `field_bytes`: bytes of each field per example, or per row for a ragged
  // field; `ragged`: which fields are ragged (empty: none); fixed fields of at
  // least `hold_min_bytes` are holdable (0: none).
  ExampleLayout(std::vector<std::size_t> field_bytes, std::size_t batch_size, std::vector<bool> ragged = {},
                std::size_t hold_min_bytes = 0)
      : field_bytes_(std::move(field_bytes)), ragged_(std::move(ragged)), batch_size_(batch_size) {
    DATAECHO_CHECK(!field_bytes_.empty() && batch_size_ >= 1);
    if (ragged_.empty()) ragged_.assign(field_bytes_.size(), false);
    DATAECHO_CHECK(ragged_.size() == field_bytes_.size());
    std::size_t offset = 0;
    for (std::size_t f = 0; f < field_bytes_.size(); ++f) {
      DATAECHO_CHECK(field_bytes_[f] >= 1);
      offset = round_up(offset, kFieldAlign);
      slot_offsets_.push_back(offset);
      offset += ragged_[f] ? sizeof(RaggedRef) : field_bytes_[f];
      if (ragged_[f]) ragged_fields_.push_back(f);
      const bool holdable = !ragged_[f] && hold_min_bytes != 0 && field_bytes_[f] >= hold_min_bytes;
      held_index_.push_back(holdable ? holdable_fields_.size() : kNotHeld);
      if (holdable) holdable_fields_.push_back(f);
    }
    example_bytes_ = offset;
    slot_stride_ = round_up(example_bytes_, alignment_for(example_bytes_));

    std::size_t batch_offset = 0;
    for (std::size_t f = 0; f < field_bytes_.size(); ++f) {
      const std::size_t row = ragged_[f] ? sizeof(std::int64_t) : field_bytes_[f];
      batch_offset = round_up(batch_offset, alignment_for(row));
      batch_offsets_.push_back(batch_offset);
      batch_offset += row * (batch_size_ + (ragged_[f] ? 1 : 0));
    }
    batch_bytes_ = batch_offset;
  }

  std::size_t fields() const noexcept { return field_bytes_.size(); }
  // Bytes per example, or per row of a ragged field.
  std::size_t field_bytes(std::size_t f) const noexcept { return field_bytes_[f]; }
  bool ragged(std::size_t f) const noexcept { return ragged_[f]; }
  // The ragged fields' indices, in order.
  const std::vector<std::size_t>& ragged_fields() const noexcept { return ragged_fields_; }
  // The holdable fields' indices, in order: a slot has one HeldRef for each.
  const std::vector<std::size_t>& holdable_fields() const noexcept { return holdable_fields_; }
  RaggedRef& ref(std::byte* slot, std::size_t f) const noexcept {
    return *std::launder(reinterpret_cast<RaggedRef*>(slot + slot_offsets_[f]));
  }
  const RaggedRef& ref(const std::byte* slot, std::size_t f) const noexcept {
    return *std::launder(reinterpret_cast<const RaggedRef*>(slot + slot_offsets_[f]));
  }
  std::int64_t* offsets(std::byte* batch, std::size_t f) const noexcept {
    return std::launder(reinterpret_cast<std::int64_t*>(batch + batch_offsets_[f]));
  }
  std::size_t slot_offset(std::size_t f) const noexcept { return slot_offsets_[f]; }
  std::size_t batch_offset(std::size_t f) const noexcept { return batch_offsets_[f]; }
  std::size_t example_bytes() const noexcept { return example_bytes_; }
  // Whether scatter() may write with streaming stores (a fixed field of
  // kStreamFrom bytes or more): stream_fence() must then run before the slot
  // is published.
  bool streams() const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      if (!ragged_[f] && field_bytes_[f] >= kStreamFrom) return true;
    return false;
  }
  std::size_t slot_stride() const noexcept { return slot_stride_; }
  std::size_t slot_align() const noexcept { return alignment_for(example_bytes_); }
  std::size_t batch_size() const noexcept { return batch_size_; }
  std::size_t batch_bytes() const noexcept { return batch_bytes_; }
  std::size_t batch_align() const noexcept { return kPageAlign; }

  // Writes the fixed fields of one example, given one pointer per field, into
  // a slot (ragged fields: see Producer). `refs`: the slot's HeldRefs;
  // `owners`: one per holdable field, the owner handle of a value handed over
  // by reference, or 0 (or no owners at all) for a value to copy.
  void scatter(const void* const* fields, std::byte* slot, HeldRef* refs = nullptr,
               const std::uint64_t* owners = nullptr) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      if (!ragged_[f]) put_field(f, fields[f], slot, refs, owners);
  }

  // Same, for example `i` of stacked per-field arrays (no ragged fields).
  void scatter_row(const void* const* fields, std::size_t i, std::byte* slot, HeldRef* refs = nullptr,
                   const std::uint64_t* owners = nullptr) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      put_field(f, static_cast<const std::byte*>(fields[f]) + i * field_bytes_[f], slot, refs, owners);
  }

  // Copies the fixed fields of the example in `slot` (its values held
  // elsewhere, by `refs`, or in the slot) to row `row` of the batch at `batch`
  // (ragged fields: see Assembler::gather_row).
  void gather(const std::byte* slot, const HeldRef* refs, std::byte* batch, std::size_t row) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f) {
      if (ragged_[f]) continue;
      const std::size_t h = held_index_[f];
      const std::byte* from = h != kNotHeld && refs[h].data != nullptr ? refs[h].data : slot + slot_offsets_[f];
      std::byte* to = batch + batch_offsets_[f] + row * field_bytes_[f];
      if (field_bytes_[f] >= kStreamFrom)
        stream_copy(to, from, field_bytes_[f]);  // the caller fences before publishing (stream_copy.hpp)
      else
        std::memcpy(to, from, field_bytes_[f]);
    }
  }

 private:
  static constexpr std::size_t kNotHeld = ~std::size_t{0};

  void put_field(std::size_t f, const void* from, std::byte* slot, HeldRef* refs,
                 const std::uint64_t* owners) const noexcept {
    const std::size_t h = held_index_[f];
    if (h != kNotHeld) {
      const std::uint64_t owner = owners != nullptr ? owners[h] : 0;
      refs[h] = HeldRef{owner != 0 ? static_cast<const std::byte*>(from) : nullptr, owner};
      if (owner != 0) return;
    }
    // A large value is read next by the assembler, on another core and long
    // after it has left this one's cache: streamed, as gather() streams (the
    // producer fences before it commits the slot: see streams()).
    if (field_bytes_[f] >= kStreamFrom)
      stream_copy(slot + slot_offsets_[f], static_cast<const std::byte*>(from), field_bytes_[f]);
    else
      std::memcpy(slot + slot_offsets_[f], from, field_bytes_[f]);
  }

  std::vector<std::size_t> field_bytes_;
  std::vector<bool> ragged_;
  std::vector<std::size_t> ragged_fields_;
  std::vector<std::size_t> holdable_fields_;
  std::vector<std::size_t> held_index_;  // per field: its index among the holdable ones, or kNotHeld
  std::vector<std::size_t> slot_offsets_;
  std::vector<std::size_t> batch_offsets_;
  std::size_t batch_size_;
  std::size_t example_bytes_ = 0;
  std::size_t slot_stride_ = 0;
  std::size_t batch_bytes_ = 0;
};

}  // namespace dataecho
