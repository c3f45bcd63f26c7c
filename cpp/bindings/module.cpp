// dataecho._core: the compiled half of dataecho. Private; see python/dataecho.
#include <pybind11/pybind11.h>

#include "blocking.hpp"
#include "dataecho/memory.hpp"

namespace dataecho::py_binding {
void register_types(pybind11::module_& m);
void register_buffer(pybind11::module_& m);
void register_producer(pybind11::module_& m);
void register_ledger(pybind11::module_& m);
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native core of dataecho (private: use the dataecho package).";
#if defined(DATAECHO_POISON) && DATAECHO_POISON
  m.attr("POISON") = true;
#else
  m.attr("POISON") = false;
#endif
  m.attr("POISON_BYTE") = static_cast<int>(dataecho::kPoisonByte);
  dataecho::py_binding::g_main_thread =
      pybind11::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  dataecho::py_binding::register_types(m);
  dataecho::py_binding::register_buffer(m);
  dataecho::py_binding::register_producer(m);
  dataecho::py_binding::register_ledger(m);
}
