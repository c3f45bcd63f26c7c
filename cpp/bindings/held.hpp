// Values a buffer holds by reference (layout.hpp's holdable fields): the Python
// objects that own them, kept alive until the core hands their handles back
// with a batch (Batch::unheld), when the last echo of every example holding
// them has been gathered, or with the end of the stream (echoes never drawn). Which values are held is decided in Python
// (dataecho/native/hold.py); this only keeps their owners, and their flag.
//
// One strong reference per owner, however many examples hold it (the rows of
// one stacked array, say), with a count of those examples. Used with the GIL
// only: puts take holds before they release it and give back those of the rows
// they did not put after they retake it; next() gives back a batch's handles,
// once per batch, on the consumer's thread. The assembler never touches Python.
//
// GIL: it is this class's only lock. Producer threads' puts and the consumer's
// next() change counts_ and the owners' reference counts from different threads,
// and the GIL keeps them one at a time; without it (a free-threaded build) they
// would race. The owners' flags (writeable) rely on it the same way.
//
// An owner handed over (not a source array, which is read and never changed)
// is lent: a NumPy array writeable when first held is made read-only, so that
// no write through it changes memory a held example still uses, and writeable
// again when its last hold goes (a caller's staging array is theirs again).
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
    std::vector<std::pair<PyObject*, bool>> owners;
    owners.reserve(counts_.size());
    for (const auto& [owner, held] : counts_) owners.emplace_back(owner, held.lent);
    counts_.clear();
    for (const auto& [owner, lent] : owners) let_go(owner, lent);
  }

  // `examples` more examples hold `owner`'s memory; `lend`: it was handed over
  // (see above). Returns its handle (never 0).
  std::uint64_t hold(PyObject* owner, std::size_t examples, bool lend) {
    auto it = counts_.find(owner);
    const bool lent = lend && (it == counts_.end() || !it->second.lent) && made_read_only(owner);
    if (it == counts_.end()) {
      it = counts_.emplace(owner, Held{}).first;
      Py_INCREF(owner);
    }
    it->second.examples += examples;
    it->second.lent = it->second.lent || lent;
    values_ += examples;
    return reinterpret_cast<std::uintptr_t>(owner);
  }

  // `examples` examples no longer hold the owner of `handle`.
  void release(std::uint64_t handle, std::size_t examples = 1) {
    const auto it = counts_.find(reinterpret_cast<PyObject*>(static_cast<std::uintptr_t>(handle)));
    if (it == counts_.end()) return;
    values_ -= std::min(examples, it->second.examples);
    if (it->second.examples > examples) {
      it->second.examples -= examples;
      return;
    }
    const auto [owner, held] = *it;
    counts_.erase(it);  // before the decref, which may run any Python code
    let_go(owner, held.lent);
  }

  void release_all(const std::vector<std::uint64_t>& handles) {
    for (std::uint64_t handle : handles) release(handle);
  }

  std::size_t values() const noexcept { return values_; }  // (example, field) values held
  std::size_t owners() const noexcept { return counts_.size(); }

 private:
  struct Held {
    std::size_t examples = 0;
    bool lent = false;  // made read-only by its first hold: made writeable again by the last
  };

  // Makes `owner` read-only if it is a writeable NumPy array; returns whether it did.
  static bool made_read_only(PyObject* owner) {
    if (!py::isinstance<py::array>(owner) || !py::reinterpret_borrow<py::array>(owner).writeable()) return false;
    py::handle(owner).attr("flags").attr("writeable") = false;
    return true;
  }

  // Gives up the reference to `owner`, first making it writeable again if its
  // hold made it read-only. NumPy refuses if its base was made read-only since:
  // it then stays read-only, which is safe. A pending exception (a caller
  // unwinding through a buffer's deallocation) is kept as it is.
  static void let_go(PyObject* owner, bool lent) noexcept {
    if (lent) {
      py::error_scope pending;
      PyObject* flags = PyObject_GetAttrString(owner, "flags");
      if (flags == nullptr || PyObject_SetAttrString(flags, "writeable", Py_True) != 0) PyErr_Clear();
      Py_XDECREF(flags);
    }
    Py_DECREF(owner);
  }

  std::unordered_map<PyObject*, Held> counts_;
  std::size_t values_ = 0;
};

}  // namespace dataecho::py_binding
