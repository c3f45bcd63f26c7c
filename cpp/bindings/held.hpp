// Values a buffer holds by reference (layout.hpp's holdable fields): the Python
// objects that own them, kept alive until the core hands their handles back
// with a batch (Batch::unheld), when the last echo of every example holding
// them has been gathered. Which values are held is decided in Python
// (dataecho/native/hold.py); this only keeps their owners.
//
// One strong reference per owner, however many examples hold it (the rows of
// one stacked array, say), with a count of those examples. Used with the GIL
// only: puts take holds before they release it and give back those of the rows
// they did not put after they retake it; next() gives back a batch's handles,
// once per batch, on the consumer's thread. The assembler never touches Python.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "blocking.hpp"

namespace dataecho::py_binding {

class Holdings {
 public:
  Holdings() = default;
  Holdings(const Holdings&) = delete;
  Holdings& operator=(const Holdings&) = delete;

  // Owners still held when the buffer goes (resident examples, batches never
  // taken): the core is gone by then (see PyBuffer), so nothing reads them.
  ~Holdings() {
    if (!Py_IsInitialized() || interpreter_finalizing()) return;  // left alone at exit
    std::vector<PyObject*> owners;
    owners.reserve(counts_.size());
    for (const auto& [owner, count] : counts_) owners.push_back(owner);
    counts_.clear();
    for (PyObject* owner : owners) Py_DECREF(owner);
  }

  // `examples` more examples hold `owner`'s memory; returns its handle (never 0).
  std::uint64_t hold(PyObject* owner, std::size_t examples) {
    auto [it, added] = counts_.try_emplace(owner, 0);
    if (added) Py_INCREF(owner);
    it->second += examples;
    values_ += examples;
    return reinterpret_cast<std::uintptr_t>(owner);
  }

  // `examples` examples no longer hold the owner of `handle`.
  void release(std::uint64_t handle, std::size_t examples = 1) {
    const auto it = counts_.find(reinterpret_cast<PyObject*>(static_cast<std::uintptr_t>(handle)));
    if (it == counts_.end()) return;
    values_ -= std::min(examples, it->second);
    if (it->second > examples) {
      it->second -= examples;
      return;
    }
    PyObject* owner = it->first;
    counts_.erase(it);  // before the decref, which may run any Python code
    Py_DECREF(owner);
  }

  void release_all(const std::vector<std::uint64_t>& handles) {
    for (std::uint64_t handle : handles) release(handle);
  }

  std::size_t values() const noexcept { return values_; }  // (example, field) values held
  std::size_t owners() const noexcept { return counts_.size(); }

 private:
  std::unordered_map<PyObject*, std::size_t> counts_;
  std::size_t values_ = 0;
};

}  // namespace dataecho::py_binding
