// Build-wide constants and small helpers shared by every header of the core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace dataecho {

// Size of the unit of cache coherence: two atomics written by different threads
// must be at least this far apart or every write invalidates the other's line.
// Apple and POWER cores use 128-byte lines; x86-64 and most aarch64 cores use 64,
// but adjacent-line prefetch on x86 pulls pairs, so 128 also avoids that sharing.
#if defined(__APPLE__) || defined(__powerpc64__)
inline constexpr std::size_t kCacheLine = 128;
#else
inline constexpr std::size_t kCacheLine = 64;
#endif

// Alignment of every slot and batch field, and of large ones: a page lets the
// kernel pin or register the memory for DMA without straddling pages.
inline constexpr std::size_t kSlotAlign = 64;
inline constexpr std::size_t kPageAlign = 4096;
inline constexpr std::size_t kPageAlignFrom = 4096;  // examples this large get page alignment

// The most bytes of one example (checked where sizes are multiplied).
inline constexpr std::size_t kMaxExampleBytes = std::size_t{1} << 40;

constexpr std::size_t round_up(std::size_t n, std::size_t align) {
  return (n + align - 1) / align * align;
}

constexpr std::size_t alignment_for(std::size_t bytes) {
  return bytes >= kPageAlignFrom ? kPageAlign : kSlotAlign;
}

// The outcome of a blocking call.
enum class Status : int { kOk = 0, kClosed = 1, kTimeout = 2 };

// Invariant checks that stay on in release builds: they guard memory safety, and
// a core dump with a message beats silent corruption in a week-long run.
[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "dataecho: internal invariant violated: %s (%s:%d)\n", what, file, line);
  std::abort();
}

}  // namespace dataecho

#define DATAECHO_CHECK(cond) \
  ((cond) ? (void)0 : ::dataecho::fail(#cond, __FILE__, __LINE__))
