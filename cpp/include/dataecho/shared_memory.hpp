// Named POSIX shared memory, for a region that worker processes map too.
//
// The creator makes a uniquely named segment; workers open it by name; the
// creator unlinks the name as soon as every worker has attached (the mapping
// lives on until the last process unmaps it), so a crash afterwards leaves
// nothing behind in /dev/shm.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

#include "dataecho/memory.hpp"

namespace dataecho {

class SharedMemory {
 public:
  // Creates and maps a new segment of `bytes`; its name is name().
  static SharedMemory create(std::size_t bytes) {
    static std::atomic<std::uint64_t> counter{0};
    std::random_device entropy;
    for (int attempt = 0; attempt < 16; ++attempt) {
      // relaxed: only uniqueness within this process matters.
      const std::string name = "/dataecho-" + std::to_string(getpid()) + "-" +
                               std::to_string(counter.fetch_add(1, std::memory_order_relaxed)) + "-" +
                               std::to_string(entropy());
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno == EEXIST) continue;
      if (fd < 0) fail_errno("shm_open");
      // Reserve the pages now: a sparse segment larger than /dev/shm's free space
      // would map fine and then kill the process with SIGBUS on first touch.
      const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
      if (error != 0) {
        close(fd);
        shm_unlink(name.c_str());
        errno = error;
        fail_errno("cannot reserve " + std::to_string(bytes) + " bytes in /dev/shm (is it too small?)");
      }
      try {
        return SharedMemory(name, map(fd, bytes, name), /*owner=*/true);
      } catch (...) {
        shm_unlink(name.c_str());
        throw;
      }
    }
    throw std::runtime_error("shared memory: could not find a free name");
  }

  // Maps the segment called `name`; throws if it does not exist.
  static SharedMemory attach(const std::string& name) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) fail_errno("shm_open " + name);
    struct stat info {};
    if (fstat(fd, &info) != 0) {
      close(fd);
      fail_errno("fstat");
    }
    return SharedMemory(name, map(fd, static_cast<std::size_t>(info.st_size), name), /*owner=*/false);
  }

  // Removes the name if this process created it (idempotent); mappings stay valid.
  void unlink() noexcept {
    // acq_rel exchange: exactly one caller (the monitor thread or the owner) unlinks.
    if (linked_.exchange(false, std::memory_order_acq_rel)) shm_unlink(name_.c_str());
  }

  SharedMemory(SharedMemory&& other) noexcept
      : name_(std::move(other.name_)), memory_(std::move(other.memory_)), linked_(other.linked_.exchange(false, std::memory_order_relaxed)) {}
  SharedMemory& operator=(SharedMemory&&) = delete;
  ~SharedMemory() = default;  // unmapping is the Block's job; unlinking is the creator's

  const std::string& name() const noexcept { return name_; }
  std::byte* data() const noexcept { return memory_.data(); }
  std::size_t size() const noexcept { return memory_.size(); }
  bool linked() const noexcept { return linked_.load(std::memory_order_acquire); }

 private:
  // Only the creator (owner) unlinks the name.
  SharedMemory(std::string name, Block memory, bool owner)
      : name_(std::move(name)), memory_(std::move(memory)), linked_(owner) {}

  static Block map(int fd, std::size_t bytes, const std::string& name) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int error = errno;
    close(fd);  // the mapping keeps the segment
    if (p == MAP_FAILED) {
      errno = error;
      fail_errno("mmap " + name);
    }
    struct Mapping {
      void* address;
      std::size_t bytes;
    };
    auto* mapping = new Mapping{p, bytes};
    return Block::adopt(
        p, bytes,
        [](void* context) noexcept {
          auto* m = static_cast<Mapping*>(context);
          munmap(m->address, m->bytes);
          delete m;
        },
        mapping);
  }

  [[noreturn]] static void fail_errno(const std::string& what) {
    throw std::runtime_error("shared memory: " + what + ": " + std::strerror(errno));
  }

  std::string name_;
  Block memory_;
  std::atomic<bool> linked_{false};
};

}  // namespace dataecho
