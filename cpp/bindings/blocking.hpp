// GIL policy for blocking native calls: run them without the GIL, in slices, so
// that Ctrl-C reaches the main thread promptly and timeouts are honoured.
//
// Shutdown: while the interpreter finalizes, CPython ends any other thread that
// tries to retake the GIL with pthread_exit, whose forced unwind aborts the
// process if it crosses a noexcept frame (such as pybind11's gil_scoped_release
// destructor). So the GIL is released and retaken here by hand, a thread that
// sees finalization parks instead of retaking it (all but the main thread, which
// is the one finalizing: a finalizer of its may wait here, and must return), and
// the callers' frames hold only borrowed handles, so an unwind in the remaining
// race needs no Python.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <exception>
#include <optional>

#include "dataecho/shuffle_buffer.hpp"
#include "dataecho/wait.hpp"

namespace dataecho::py_binding {

namespace py = pybind11;

// The Python members of _core.Status (an enum.IntEnum), looked up once when the
// module is initialized: casting a Status by value goes through the Python enum
// type's constructor, which costs about half a microsecond per put. Strong
// references, kept for the life of the process (the module is never unloaded).
// GIL: written once, under it, while the module is imported (before any call into
// the module), then only read, each read taking a reference under it. Not checked
// without the GIL (no free-threaded wheel: docs/install.md).
inline py::handle g_status_objects[3];

inline py::object status_object(Status status) {
  return py::reinterpret_borrow<py::object>(g_status_objects[static_cast<int>(status)]);
}

// How long a native wait runs before the GIL is retaken to check for signals.
inline constexpr double kSignalCheckSeconds = 0.05;

inline Deadline deadline_from(std::optional<double> timeout_s) {
  return timeout_s ? Deadline::after_seconds(*timeout_s) : Deadline::never();
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The main thread's id (threading.main_thread().ident), set when the module is
// initialized: the thread that finalizes the interpreter.
inline unsigned long g_main_thread = 0;

// Whether this thread must not retake the GIL: the interpreter finalizes, and
// this is not the thread finalizing it.
inline bool must_park() { return interpreter_finalizing() && PyThread_get_thread_ident() != g_main_thread; }

// A daemon thread has no Python work left once the interpreter finalizes: it
// sleeps here until the process exits.
[[noreturn]] inline void park_forever() {
  static std::atomic<std::uint32_t> never{0};
  for (;;) never.wait(0, std::memory_order_relaxed);  // relaxed: nothing is ever published
}

// `call(Deadline)` returns a Status; kTimeout at the end of a slice means "not yet".
template <class Call>
Status call_blocking(Call&& call, std::optional<double> timeout_s) {
  const Deadline user = deadline_from(timeout_s);
  for (;;) {
    const Deadline slice = user.earlier(Deadline::after_seconds(kSignalCheckSeconds));
    Status status = Status::kOk;
    std::exception_ptr error;
    PyThreadState* thread_state = PyEval_SaveThread();
    try {
      status = call(slice);
    } catch (...) {
      error = std::current_exception();
    }
    if (must_park()) park_forever();
    PyEval_RestoreThread(thread_state);
    if (error) std::rethrow_exception(error);
    if (status != Status::kTimeout) return status;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (user.expired()) return Status::kTimeout;
  }
}

// Runs `work` (no Python in it, not blocking: a large copy, say) without the
// GIL, with the same care at interpreter shutdown as call_blocking.
template <class Work>
void without_gil(Work&& work) {
  std::exception_ptr error;
  PyThreadState* thread_state = PyEval_SaveThread();
  try {
    work();
  } catch (...) {
    error = std::current_exception();
  }
  if (must_park()) park_forever();
  PyEval_RestoreThread(thread_state);
  if (error) std::rethrow_exception(error);
}

}  // namespace dataecho::py_binding
