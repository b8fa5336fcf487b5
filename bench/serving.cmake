# Serving benchmarks (issue 3): echo_server, the gRPC floor that attn_bench
# compares attnserve against (bench/overhead.sh). Included from
# bench/CMakeLists.txt; needs no Google Benchmark.
add_executable(echo_server ${CMAKE_CURRENT_LIST_DIR}/echo_server.cc)
target_include_directories(echo_server PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(echo_server PRIVATE
  attnserve_proto gRPC::grpc++ absl::flags absl::flags_parse absl::synchronization)

# Can a batch's projection GEMMs be stacked without breaking bitwise batch
# invariance, and what does the per-request default cost? (docs/PERFORMANCE.md)
add_executable(stacked_gemm_probe ${CMAKE_CURRENT_LIST_DIR}/stacked_gemm_probe.cc)
target_include_directories(stacked_gemm_probe PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(stacked_gemm_probe PRIVATE attnserve_engine DNNL::dnnl)
find_package(OpenMP)  # the chunked variant spreads chunks over OpenMP threads
if(OpenMP_CXX_FOUND)
  target_link_libraries(stacked_gemm_probe PRIVATE OpenMP::OpenMP_CXX)
endif()
