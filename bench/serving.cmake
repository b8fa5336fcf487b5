# Serving benchmarks (issue 3): echo_server, the gRPC floor that attn_bench
# compares attnserve against (bench/overhead.sh). Included from
# bench/CMakeLists.txt; needs no Google Benchmark.
add_executable(echo_server ${CMAKE_CURRENT_LIST_DIR}/echo_server.cc)
target_include_directories(echo_server PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(echo_server PRIVATE
  attnserve_proto gRPC::grpc++ absl::flags absl::flags_parse absl::synchronization)
