// Tests of page_heap.hpp: pages taken and given back as chains by 8 threads at
// once; a page is never held by two at once, chains are whole, and every page
// is free at the end.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "dataecho/page_heap.hpp"
#include "dataecho/rng.hpp"
#include "dataecho/wait.hpp"
#include "harness.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::Deadline;
using dataecho::PageHeap;
using dataecho::PageHeapState;
using dataecho::Rng;
using dataecho::Status;

constexpr std::size_t kPages = 1000;
constexpr std::size_t kPageBytes = 64;
constexpr int kThreads = 8;

// A heap over its own arrays, and who holds each page.
struct PageHeapRig {
  PageHeapRig() : data(kPages * kPageBytes), next(kPages), held(kPages), state(false),
                  heap(&state, next.data(), data.data(), kPages, kPageBytes) {
    heap.format();
  }
  std::vector<std::byte> data;
  std::vector<std::atomic<std::uint32_t>> next;
  // Only a detector: the exchange must be atomic to catch two holders at once;
  // what orders the pages' bytes between threads is the heap's own push/pop.
  std::vector<std::atomic<std::uint8_t>> held;
  PageHeapState state;
  const PageHeap heap;
};

// One round of thread t: takes a chain of a random length, marks and fills
// every page in it, checks nobody else wrote them, gives the chain back.
// Returns the pages moved, or 0 after recording an error.
std::size_t take_and_give_back(PageHeapRig& rig, Rng& rng, int t, Errors& errors) {
  const PageHeap& heap = rig.heap;
  const std::size_t count = 1 + rng.below(rng.below(4) == 0 ? 300 : 8);
  std::uint32_t first, last;
  const Status st = heap.pop_blocking(count, first, last, Deadline::never(), [] { return false; }, [] {});
  if (st != Status::kOk) return errors.add("pop_blocking failed"), 0;
  std::uint32_t page = first;
  for (std::size_t i = 0; i < count; ++i) {
    if (page >= kPages || rig.held[page].exchange(1) != 0)
      return errors.add("page " + std::to_string(page) + " taken twice (or out of range)"), 0;
    std::memset(heap.page(page), t, kPageBytes);
    if (i + 1 < count) page = heap.next(page);
  }
  if (page != last) return errors.add("the chain does not end at its last page"), 0;
  page = first;
  for (std::size_t i = 0; i < count; ++i) {
    if (static_cast<int>(heap.page(page)[kPageBytes - 1]) != t) errors.add("a page was written by another");
    rig.held[page].store(0);
    if (i + 1 < count) page = heap.next(page);
  }
  heap.push(first, last, count);
  return count;
}

}  // namespace

std::string test_page_heap() {
  PageHeapRig rig;
  Errors errors;
  std::atomic<std::uint64_t> moved{0};
  const std::uint64_t rounds = std::max<std::uint64_t>(2000, g_options.items / 200);
  {
    Threads threads;
    for (int t = 0; t < kThreads; ++t)
      threads.spawn([&, t] {
        Rng rng(run_seed(7000 + static_cast<std::uint64_t>(t)));
        for (std::uint64_t round = 0; round < rounds; ++round) {
          const std::size_t count = take_and_give_back(rig, rng, t, errors);
          if (count == 0) return;  // an error, recorded
          moved.fetch_add(count, std::memory_order_relaxed);  // relaxed: read after join
        }
      });
  }
  CHECK_MSG(errors.count() == 0, errors.summary());
  CHECK(rig.heap.in_use() == 0);
  std::uint32_t first, last;
  CHECK_MSG(rig.heap.try_pop(kPages, first, last), "not every page is free at the end");
  std::ostringstream s;
  s << kThreads << " threads, " << moved.load() << " pages taken and given back in chains of 1 to 300; none held twice";
  return s.str();
}

}  // namespace dataecho_test
