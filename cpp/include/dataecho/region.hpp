// The region: everything producers touch, in one block of memory that may be
// private to the process or shared with worker processes.
//
//   [RegionHeader][free ring][committed ring][slot sequence numbers][arena: capacity slots]
//   [page links][pages]   (the page heap of ragged values, when there are ragged fields)
//
// It holds no pointers, only offsets, sizes, 32- and 64-bit atomics and futex
// words, so every process can map it at its own address. The header's first
// fields describe the layout; a process that attaches checks them before it
// touches anything else.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

#include "dataecho/arena.hpp"
#include "dataecho/config.hpp"
#include "dataecho/layout.hpp"
#include "dataecho/page_heap.hpp"
#include "dataecho/ring.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

inline constexpr std::uint64_t kRegionMagic = 0x6F68636561746164ull;  // "dataecho"
inline constexpr std::uint64_t kRegionVersion = 3;
inline constexpr std::size_t kMaxWorkers = 256;

// Counters one producer (a worker process, say) keeps for stats(); written only
// by that producer, read by anyone.
struct alignas(kCacheLine) WorkerCounters {
  std::atomic<std::uint64_t> produced{0};
  std::atomic<std::uint64_t> busy_ns{0};
};

struct RegionHeader {
  explicit RegionHeader(bool process_shared) : intake_advanced(process_shared), heap(process_shared) {}

  // Written once by the creator before the region is shared; read-only after.
  std::uint64_t magic = 0;
  std::uint64_t version = 0;
  std::uint64_t capacity = 0;
  std::uint64_t ring_cells = 0;
  std::uint64_t slot_stride = 0;
  std::uint64_t layout_hash = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t free_offset = 0;
  std::uint64_t committed_offset = 0;
  std::uint64_t seq_offset = 0;
  std::uint64_t arena_offset = 0;
  std::uint64_t pages = 0;  // the page heap (0: none)
  std::uint64_t page_bytes = 0;
  std::uint64_t page_links_offset = 0;
  std::uint64_t page_data_offset = 0;
  // Deterministic intake (0: off): a put with sequence number s waits until
  // s < intake_seq + window, so that at most window - 1 examples wait, out of
  // order, for an earlier one (see ShuffleBuffer's deterministic mode).
  std::uint64_t window = 0;

  // closed: end of input (puts fail, the rest drains). stop: abandon at once.
  // 32-bit so that they are address-free everywhere.
  alignas(kCacheLine) std::atomic<std::uint32_t> closed{0};
  std::atomic<std::uint32_t> stop{0};
  alignas(kCacheLine) std::atomic<std::uint64_t> in_flight{0};  // puts under way
  alignas(kCacheLine) std::atomic<std::uint64_t> fresh{0};      // examples accepted
  std::atomic<std::uint64_t> producer_wait_ns{0};
  // Work claiming for map-style sources: producers take positions [0, index_end)
  // of the epoch's order with fetch_add.
  alignas(kCacheLine) std::atomic<std::uint64_t> next_index{0};
  std::atomic<std::uint64_t> index_end{0};
  // The next sequence number the assembler takes in (deterministic mode);
  // stored by the assembler, read by producers waiting on the window.
  alignas(kCacheLine) std::atomic<std::uint64_t> intake_seq{0};
  EventCount intake_advanced;
  PageHeapState heap;
  WorkerCounters workers[kMaxWorkers];
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free,
              "region atomics must be lock-free to be address-free across processes");

// The page heap's size: `pages` pages of `page_bytes` (a power of two); none
// when pages is 0.
struct HeapConfig {
  std::size_t pages = 0;
  std::size_t page_bytes = 0;
};

// Where each part of a region lives, for a given layout, capacity and heap.
struct RegionLayout {
  std::size_t ring_cells;
  std::size_t free_offset;
  std::size_t committed_offset;
  std::size_t seq_offset;
  std::size_t arena_offset;
  std::size_t page_links_offset;
  std::size_t page_data_offset;
  std::size_t total_bytes;
  std::size_t align;

  RegionLayout(const ExampleLayout& layout, std::size_t capacity, HeapConfig heap = {}) {
    DATAECHO_CHECK(heap.pages <= kMaxPages &&
                   (heap.pages == 0 || (std::has_single_bit(heap.page_bytes) && heap.page_bytes >= kMinPageBytes &&
                                        heap.page_bytes <= kMaxPageBytes)));
    ring_cells = std::max(Ring::kMinCapacity, std::bit_ceil(capacity));
    const std::size_t page_align = heap.pages ? std::min(heap.page_bytes, kPageAlign) : 1;
    align = std::max(layout.slot_align(), page_align);
    free_offset = round_up(sizeof(RegionHeader), kCacheLine);
    committed_offset = free_offset + Ring::bytes(ring_cells);
    seq_offset = committed_offset + Ring::bytes(ring_cells);
    if (capacity > (SIZE_MAX - seq_offset) / sizeof(std::uint64_t)) throw std::bad_alloc();
    arena_offset = round_up(seq_offset + capacity * sizeof(std::uint64_t), layout.slot_align());
    if (capacity > (SIZE_MAX - arena_offset) / layout.slot_stride()) throw std::bad_alloc();
    page_links_offset = round_up(arena_offset + capacity * layout.slot_stride(), kCacheLine);
    page_data_offset = round_up(page_links_offset + heap.pages * sizeof(std::uint32_t), page_align);
    if (heap.pages > (SIZE_MAX - page_data_offset) / std::max<std::size_t>(heap.page_bytes, 1)) throw std::bad_alloc();
    total_bytes = page_data_offset + heap.pages * heap.page_bytes;
  }
};

// A fingerprint of where fields sit in a slot, so that a producer built from a
// different field list cannot attach to a region.
inline std::uint64_t layout_hash(const ExampleLayout& layout) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the offsets and sizes
  auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  };
  mix(layout.fields());
  for (std::size_t f = 0; f < layout.fields(); ++f) {
    mix(layout.field_bytes(f));
    mix(layout.slot_offset(f));
  }
  for (std::size_t f = 0; f < layout.fields(); ++f) mix(layout.ragged(f) ? 1 : 0);
  mix(layout.slot_stride());
  return h;
}

inline std::uint64_t* zeroed_u64(std::byte* at, std::size_t n) noexcept {
  auto* words = reinterpret_cast<std::uint64_t*>(at);  // trivial type: implicitly created
  std::fill_n(words, n, std::uint64_t{0});
  return words;
}

// Views of the parts of a region; `base` must hold RegionLayout::total_bytes.
struct RegionView {
  RegionHeader* header = nullptr;
  Ring* free = nullptr;
  Ring* committed = nullptr;
  // The sequence number of the example in each slot: plain, written by the
  // producer holding the slot before its commit (P2) and read by the assembler
  // after its pop (C1).
  std::uint64_t* slot_seq = nullptr;
  SlotArena arena;
  PageHeap heap;  // ragged values (no pages without ragged fields)
  // The holdable fields' HeldRefs (layout.hpp), held_per_slot per slot, in this
  // process's memory, since pointers mean nothing in another: private regions
  // only, none otherwise. Written and read like slot bytes (P2 / C1).
  HeldRef* held = nullptr;
  std::size_t held_per_slot = 0;

  HeldRef* refs(std::uint32_t slot) const noexcept { return held == nullptr ? nullptr : held + slot * held_per_slot; }

  // Builds a new region in `base`: header, both rings, every slot and page free.
  static RegionView create(std::byte* base, const ExampleLayout& layout, std::size_t capacity,
                           bool process_shared, std::uint64_t window = 0, HeapConfig heap = {}) {
    const RegionLayout where(layout, capacity, heap);
    std::memset(base, 0, sizeof(RegionHeader));  // memory may be reused (BlockCache): nothing is assumed zero
    auto* header = new (base) RegionHeader(process_shared);
    header->window = window;
    header->capacity = capacity;
    header->ring_cells = where.ring_cells;
    header->slot_stride = layout.slot_stride();
    header->layout_hash = layout_hash(layout);
    header->total_bytes = where.total_bytes;
    header->free_offset = where.free_offset;
    header->committed_offset = where.committed_offset;
    header->seq_offset = where.seq_offset;
    header->arena_offset = where.arena_offset;
    header->pages = heap.pages;
    header->page_bytes = heap.page_bytes;
    header->page_links_offset = where.page_links_offset;
    header->page_data_offset = where.page_data_offset;
    RegionView view{header, Ring::create(base + where.free_offset, where.ring_cells, process_shared),
                    Ring::create(base + where.committed_offset, where.ring_cells, process_shared),
                    zeroed_u64(base + where.seq_offset, capacity),
                    SlotArena(base + where.arena_offset, capacity, layout.slot_stride()),
                    heap_view(base, *header)};
    for (std::uint32_t slot = 0; slot < capacity; ++slot) DATAECHO_CHECK(view.free->try_push(slot));
    // The page links are written as pages are first used (PageHeap::refill):
    // a heap larger than what is ever in use costs no memory for the rest.
    if (heap.pages) view.heap.format();
    // Other processes attach only after they are started, which orders these
    // plain writes before their reads.
    header->version = kRegionVersion;
    header->magic = kRegionMagic;
    return view;
  }

  // Views an existing region; false if `base` does not hold a region of this
  // layout (wrong magic, version, layout or size).
  static bool attach(std::byte* base, std::size_t bytes, const ExampleLayout& layout, RegionView& out) {
    if (bytes < sizeof(RegionHeader)) return false;
    auto* header = std::launder(reinterpret_cast<RegionHeader*>(base));
    if (header->magic != kRegionMagic || header->version != kRegionVersion) return false;
    if (header->layout_hash != layout_hash(layout) || header->total_bytes > bytes) return false;
    if (header->pages > kMaxPages || (header->pages != 0 && (!std::has_single_bit(header->page_bytes) ||
                                                             header->page_bytes < kMinPageBytes ||
                                                             header->page_bytes > kMaxPageBytes)))
      return false;
    const RegionLayout where(layout, header->capacity, {header->pages, header->page_bytes});
    if (where.total_bytes != header->total_bytes || where.arena_offset != header->arena_offset) return false;
    if (where.seq_offset != header->seq_offset || where.page_data_offset != header->page_data_offset) return false;
    out = {header, std::launder(reinterpret_cast<Ring*>(base + header->free_offset)),
           std::launder(reinterpret_cast<Ring*>(base + header->committed_offset)),
           std::launder(reinterpret_cast<std::uint64_t*>(base + header->seq_offset)),
           SlotArena(base + header->arena_offset, header->capacity, header->slot_stride), heap_view(base, *header)};
    return true;
  }

 private:
  static PageHeap heap_view(std::byte* base, RegionHeader& header) noexcept {
    if (header.pages == 0) return {};
    return PageHeap(&header.heap,
                    std::launder(reinterpret_cast<std::atomic<std::uint32_t>*>(base + header.page_links_offset)),
                    base + header.page_data_offset, header.pages, header.page_bytes);
  }
};

}  // namespace dataecho
