// GIL policy for blocking native calls: run them without the GIL, in slices, so
// that Ctrl-C reaches the main thread promptly and timeouts are honoured.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>

#include "dataecho/shuffle_buffer.hpp"
#include "dataecho/wait.hpp"

namespace dataecho::py_binding {

namespace py = pybind11;

// How long a native wait runs before the GIL is retaken to check for signals.
inline constexpr double kSignalCheckSeconds = 0.05;

inline Deadline deadline_from(std::optional<double> timeout_s) {
  return timeout_s ? Deadline::after_seconds(*timeout_s) : Deadline::never();
}

// `call(Deadline)` returns a Status; kTimeout at the end of a slice means "not yet".
template <class Call>
Status call_blocking(Call&& call, std::optional<double> timeout_s) {
  const Deadline user = deadline_from(timeout_s);
  for (;;) {
    const Deadline slice = user.earlier(Deadline::after_seconds(kSignalCheckSeconds));
    Status status;
    {
      py::gil_scoped_release nogil;
      status = call(slice);
    }
    if (status != Status::kTimeout) return status;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (user.expired()) return Status::kTimeout;
  }
}

}  // namespace dataecho::py_binding
