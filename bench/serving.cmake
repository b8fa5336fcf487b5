# Serving benchmarks (issue 3): echo_server, the gRPC floor that attn_bench
# compares attnserve against (bench/overhead.sh). Included from
# bench/CMakeLists.txt; needs no Google Benchmark.
add_executable(echo_server ${CMAKE_CURRENT_LIST_DIR}/echo_server.cc)
target_include_directories(echo_server PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(echo_server PRIVATE
  attnserve_proto gRPC::grpc++ absl::flags absl::flags_parse absl::synchronization)

# The Python client against gRPC Python's floor (bench/pyclient_overhead.sh),
# ten calls a case, in the suite: the script runs, and the echo server's
# answers are the queries the client sent. A few seconds; the measurement is
# the script's own, run by hand (docs/PERFORMANCE.md).
if(ATTNSERVE_BUILD_TESTS)
  add_test(NAME bench.pyclient_overhead_short
           COMMAND ${PROJECT_SOURCE_DIR}/bench/pyclient_overhead.sh ${PROJECT_BINARY_DIR}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench.pyclient_overhead_short PROPERTIES TIMEOUT 300 ENVIRONMENT
    "REQUESTS=10;ROUNDS=1;ATTNSERVE_BUILD_DIR=${PROJECT_BINARY_DIR}")
  # Tensors in system shared memory against tensors in the message
  # (bench/shared_memory.sh), one small round per protocol: both ways answer
  # the same bits. Needs the KServe test's venv (tritonclient).
  add_test(NAME bench.shared_memory_short
           COMMAND ${PROJECT_SOURCE_DIR}/bench/shared_memory.sh ${PROJECT_BINARY_DIR}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench.shared_memory_short PROPERTIES TIMEOUT 300
    DEPENDS integration.test_kserve ENVIRONMENT "CASES=small,3mib;REQUESTS=10;ROUNDS=1")
endif()
