// Where each field of an example lives, in a slot and in a batch.
//
// Slot: the fields of one example packed one after another, each at a 16-byte
// aligned offset; the slot stride is 64-byte aligned (4096 when an example is at
// least 4 KiB), so slots never share a cache line (or a page, for large ones).
//
// Batch: one contiguous region per field, [batch_size][field bytes], each region
// aligned like a slot. A field's batch is therefore a C-contiguous array that
// Python can view without a copy.
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

#include "dataecho/config.hpp"

namespace dataecho {

class ExampleLayout {
 public:
  static constexpr std::size_t kFieldAlign = 16;

  ExampleLayout(std::vector<std::size_t> field_bytes, std::size_t batch_size)
      : field_bytes_(std::move(field_bytes)), batch_size_(batch_size) {
    DATAECHO_CHECK(!field_bytes_.empty() && batch_size_ >= 1);
    std::size_t offset = 0;
    for (std::size_t bytes : field_bytes_) {
      DATAECHO_CHECK(bytes >= 1);
      offset = round_up(offset, kFieldAlign);
      slot_offsets_.push_back(offset);
      offset += bytes;
    }
    example_bytes_ = offset;
    slot_stride_ = round_up(example_bytes_, alignment_for(example_bytes_));

    std::size_t batch_offset = 0;
    for (std::size_t bytes : field_bytes_) {
      batch_offset = round_up(batch_offset, alignment_for(bytes));
      batch_offsets_.push_back(batch_offset);
      batch_offset += bytes * batch_size_;
    }
    batch_bytes_ = batch_offset;
  }

  std::size_t fields() const noexcept { return field_bytes_.size(); }
  std::size_t field_bytes(std::size_t f) const noexcept { return field_bytes_[f]; }
  std::size_t slot_offset(std::size_t f) const noexcept { return slot_offsets_[f]; }
  std::size_t batch_offset(std::size_t f) const noexcept { return batch_offsets_[f]; }
  std::size_t example_bytes() const noexcept { return example_bytes_; }
  std::size_t slot_stride() const noexcept { return slot_stride_; }
  std::size_t slot_align() const noexcept { return alignment_for(example_bytes_); }
  std::size_t batch_size() const noexcept { return batch_size_; }
  std::size_t batch_bytes() const noexcept { return batch_bytes_; }
  std::size_t batch_align() const noexcept { return kPageAlign; }

  // Writes one example, given one pointer per field, into a slot.
  void scatter(const void* const* fields, std::byte* slot) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      std::memcpy(slot + slot_offsets_[f], fields[f], field_bytes_[f]);
  }

  // Same, for example `i` of stacked per-field arrays.
  void scatter_row(const void* const* fields, std::size_t i, std::byte* slot) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      std::memcpy(slot + slot_offsets_[f],
                  static_cast<const std::byte*>(fields[f]) + i * field_bytes_[f], field_bytes_[f]);
  }

  // Copies the example in `slot` to row `row` of the batch at `batch`.
  void gather(const std::byte* slot, std::byte* batch, std::size_t row) const noexcept {
    for (std::size_t f = 0; f < field_bytes_.size(); ++f)
      std::memcpy(batch + batch_offsets_[f] + row * field_bytes_[f], slot + slot_offsets_[f],
                  field_bytes_[f]);
  }

 private:
  std::vector<std::size_t> field_bytes_;
  std::vector<std::size_t> slot_offsets_;
  std::vector<std::size_t> batch_offsets_;
  std::size_t batch_size_;
  std::size_t example_bytes_ = 0;
  std::size_t slot_stride_ = 0;
  std::size_t batch_bytes_ = 0;
};

}  // namespace dataecho
