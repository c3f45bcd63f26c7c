// Field declarations and the arrays a put hands over: conversion and the
// memory-safety checks shared by _core.Buffer and _core.Producer.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dataecho::py_binding {

namespace py = pybind11;

using FieldDecl = std::pair<std::vector<py::ssize_t>, py::dtype>;

struct FieldSpec {
  py::dtype dtype;
  std::vector<py::ssize_t> shape;
  std::size_t bytes;
};

// Field declarations -> specs, with sizes checked against overflow.
inline std::vector<FieldSpec> field_specs(const std::vector<FieldDecl>& fields) {
  if (fields.empty()) throw py::value_error("fields: expected at least one field");
  std::vector<FieldSpec> specs;
  for (const auto& [shape, dtype] : fields) {
    std::size_t n = static_cast<std::size_t>(dtype.itemsize());
    for (py::ssize_t d : shape) {
      if (d <= 0) throw py::value_error("fields: dimensions must be positive");
      if (n > SIZE_MAX / static_cast<std::size_t>(d)) throw py::value_error("fields: size overflows");
      n *= static_cast<std::size_t>(d);
    }
    if (n == 0) throw py::value_error("fields: zero-size field");
    specs.push_back({dtype, shape, n});
  }
  return specs;
}

inline std::vector<std::size_t> field_bytes(const std::vector<FieldSpec>& specs) {
  std::vector<std::size_t> bytes;
  for (const FieldSpec& spec : specs) bytes.push_back(spec.bytes);
  return bytes;
}

// One pointer per field of `arrays` (a list), after checking that each is a
// C-contiguous array of exactly the declared byte count (times `rows` for
// stacked arrays). The temporaries it makes are gone when it returns, so the
// caller's frame holds only borrowed references (see blocking.hpp).
inline std::vector<const void*> field_pointers(const std::vector<FieldSpec>& specs, py::handle arrays,
                                               std::optional<std::size_t> rows) {
  if (!PyList_Check(arrays.ptr())) throw py::type_error("arrays: expected a list of arrays, one per field");
  const auto items = py::reinterpret_borrow<py::list>(arrays);
  if (items.size() != specs.size())
    throw py::value_error("example: expected " + std::to_string(specs.size()) + " fields, got " +
                          std::to_string(items.size()));
  std::vector<const void*> pointers;
  pointers.reserve(items.size());
  for (std::size_t f = 0; f < items.size(); ++f) {
    if (!py::isinstance<py::array>(items[f]))
      throw py::type_error("example: field " + std::to_string(f) + " is not a NumPy array");
    const auto a = py::reinterpret_borrow<py::array>(items[f]);
    const std::size_t expected = specs[f].bytes * rows.value_or(1);
    if (!(a.flags() & py::array::c_style) || static_cast<std::size_t>(a.nbytes()) != expected ||
        (rows && (a.ndim() < 1 || static_cast<std::size_t>(a.shape(0)) != *rows)))
      throw py::value_error("example: field " + std::to_string(f) +
                            " is not a C-contiguous array of the declared size");
    pointers.push_back(a.data());
  }
  return pointers;
}

}  // namespace dataecho::py_binding
