// The tests, by the file that defines them. main.cpp lists them in the order
// they run; each returns a one-line summary or throws TestFailure.
#pragma once

#include <string>

namespace dataecho_test {

// test_rng_reservoir.cpp
std::string test_rng();
std::string test_reservoir();

// test_ring.cpp
std::string test_ring_basic();
std::string test_ring_blocking();
std::string test_ring_stress();

// test_batch_pool.cpp
std::string test_batch_pool();

// test_buffer_accounting.cpp
std::string test_buffer_accounting();
std::string test_buffer_fractional_and_drop_last();
std::string test_buffer_deterministic();
std::string test_buffer_put_each();
std::string test_buffer_put_into();
std::string test_buffer_held();

// test_buffer_snapshot.cpp
std::string test_buffer_in_order();
std::string test_buffer_snapshot();

// test_buffer_lifecycle.cpp
std::string test_buffer_timeouts();
std::string test_buffer_close();
std::string test_buffer_stop();
std::string test_buffer_destroy();

// test_page_heap.cpp
std::string test_page_heap();

// test_spread.cpp
std::string test_spread();

// test_buffer_ragged.cpp
std::string test_buffer_ragged();
std::string test_buffer_ragged_modes();
std::string test_buffer_ragged_blocking();

}  // namespace dataecho_test
