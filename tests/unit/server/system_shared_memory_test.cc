// Triton's system shared-memory extension: the table of registered regions
// (system_shared_memory.h) against a real POSIX shared-memory object the test
// creates and maps itself, and the KServe decoding of tensors that name a
// region (kserve_codec.h). The oracle is the test's own mapping: bytes it
// writes are what the server reads, bytes the server writes are what it
// reads back.
#include "server/transport/system_shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"
#include "server/transport/kserve_codec.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A shared-memory object of `size` bytes, mapped by the test, unlinked at the
// end.
class ShmObject {
 public:
  explicit ShmObject(size_t size) : key_(absl::StrCat("/attnserve-test-", getpid(), "-", ++n_)) {
    fd_ = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << key_ << ": " << std::strerror(errno);
    Resize(size);
  }
  ~ShmObject() {
    if (data_ != nullptr) munmap(data_, size_);
    close(fd_);
    shm_unlink(key_.c_str());
  }
  void Resize(size_t size) {
    if (data_ != nullptr) munmap(data_, size_);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
    size_ = size;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
  }
  const std::string& key() const { return key_; }
  char* data() const { return data_; }

 private:
  static inline int n_ = 0;
  std::string key_;
  int fd_ = -1;
  size_t size_ = 0;
  char* data_ = nullptr;
};

TEST(SystemSharedMemoryTest, ReadsAndWritesTheClientsBytesInPlace) {
  ShmObject object(3 * 4096);
  for (int i = 0; i < 3 * 4096; ++i) object.data()[i] = static_cast<char>(i * 7);
  SystemSharedMemory regions;
  // An offset that is not a page's start.
  ASSERT_TRUE(regions.Register("r", object.key(), 5000, 3000).ok());
  absl::StatusOr<SystemSharedMemory::Span> span = regions.Find("input 'query'", "r", 100, 64);
  ASSERT_TRUE(span.ok()) << span.status();
  ASSERT_EQ(span->size, 64u);
  EXPECT_EQ(std::memcmp(span->data, object.data() + 5100, 64), 0);
  // What the server writes, the client sees.
  std::memset(span->data, 0x5a, 64);
  EXPECT_EQ(object.data()[5100], 0x5a);
  EXPECT_EQ(object.data()[5163], 0x5a);
  EXPECT_EQ(object.data()[5164], static_cast<char>(5164 * 7));

  auto status = regions.Status("");
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->size(), 1u);
  EXPECT_EQ((*status)[0].name, "r");
  EXPECT_EQ((*status)[0].key, object.key());
  EXPECT_EQ((*status)[0].offset, 5000u);
  EXPECT_EQ((*status)[0].byte_size, 3000u);
}

TEST(SystemSharedMemoryTest, RefusesWhatItCannotMapNamingTheField) {
  ShmObject object(4096);
  SystemSharedMemory regions;
  EXPECT_THAT(regions.Register("", object.key(), 0, 10).message(), HasSubstr("name"));
  EXPECT_THAT(regions.Register("r", "", 0, 10).message(), HasSubstr("key must not be empty"));
  EXPECT_THAT(regions.Register("r", object.key(), 0, 0).message(),
              HasSubstr("byte_size must be > 0"));
  const absl::Status missing = regions.Register("r", "/attnserve-test-no-such-key", 0, 10);
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("/attnserve-test-no-such-key"));
  EXPECT_THAT(missing.message(), HasSubstr("shm_open"));
  const absl::Status past = regions.Register("r", object.key(), 4000, 97);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.message(), HasSubstr("runs past the end"));
  EXPECT_THAT(past.message(), HasSubstr("4096 bytes"));
  EXPECT_THAT(regions.Register("r", object.key(), ~uint64_t{0}, 2).message(),
              HasSubstr("not a valid range"));
  // Only shared-memory objects (regular files under /dev/shm), not a FIFO
  // someone left there.
  const std::string fifo = absl::StrCat("attnserve-test-fifo-", getpid());
  ASSERT_EQ(mkfifo(("/dev/shm/" + fifo).c_str(), 0600), 0);
  EXPECT_THAT(regions.Register("r", "/" + fifo, 0, 1).message(),
              HasSubstr("is not a shared-memory object"));
  unlink(("/dev/shm/" + fifo).c_str());
  EXPECT_EQ(regions.size(), 0);

  ASSERT_TRUE(regions.Register("r", object.key(), 4000, 96).ok());
  EXPECT_EQ(regions.Register("r", object.key(), 0, 10).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(regions.Unregister("other").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.Status("other").status().code(), absl::StatusCode::kNotFound);

  const auto unknown = regions.Find("input 'key'", "other", 0, 1);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("input 'key'"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("'other' is not registered"));
  for (auto [offset, size] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 97}, {90, 7}, {97, 0}, {-1, 2}, {0, -1}, {INT64_MAX, INT64_MAX}}) {
    const auto outside = regions.Find("input 'value'", "r", offset, size);
    EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument) << offset;
    EXPECT_THAT(outside.status().message(), HasSubstr("outside shared memory region 'r'"));
  }
  EXPECT_TRUE(regions.Find("input 'value'", "r", 96, 0).ok());  // empty, at the end
}

TEST(SystemSharedMemoryTest, UnregisteredRegionsStayMappedForRequestsThatHoldThem) {
  ShmObject object(4096);
  object.data()[10] = 42;
  SystemSharedMemory regions;
  ASSERT_TRUE(regions.Register("a", object.key(), 0, 4096).ok());
  ASSERT_TRUE(regions.Register("b", object.key(), 0, 16).ok());
  auto held = regions.Find("input 'query'", "a", 8, 8);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(regions.Unregister("a").ok());
  EXPECT_EQ(regions.Find("input 'query'", "a", 8, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(held->data[2], 42);  // still mapped: a use after unmap would fault here
  ASSERT_TRUE(regions.Unregister("").ok());  // every region
  EXPECT_EQ(regions.size(), 0);
  EXPECT_TRUE(regions.Status("")->empty());
}

TEST(SystemSharedMemoryTest, AnObjectShrunkUnderItsRegionIsRefusedNotRead) {
  ShmObject object(8192);
  SystemSharedMemory regions;
  ASSERT_TRUE(regions.Register("r", object.key(), 4096, 4096).ok());
  ASSERT_TRUE(regions.Find("output", "r", 0, 4096).ok());
  object.Resize(4096);  // the region's pages are gone: reading them would raise SIGBUS
  const auto shrunk = regions.Find("requested output 'output'", "r", 0, 16);
  EXPECT_EQ(shrunk.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(shrunk.status().message(), HasSubstr("is now 4096 bytes"));
  object.Resize(8192);
  EXPECT_TRUE(regions.Find("output", "r", 0, 16).ok());
}

TEST(SystemSharedMemoryTest, HoldsAtMostItsLimitOfRegions) {
  rlimit limit;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < SystemSharedMemory::kMaxRegions + 64) {
    GTEST_SKIP() << "RLIMIT_NOFILE " << limit.rlim_cur << " is below the region limit";
  }
  ShmObject object(4096);
  SystemSharedMemory regions;
  for (int i = 0; i < SystemSharedMemory::kMaxRegions; ++i) {
    ASSERT_TRUE(regions.Register(absl::StrCat("r", i), object.key(), 0, 64).ok()) << i;
  }
  EXPECT_EQ(regions.Register("one-more", object.key(), 0, 64).code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(regions.Unregister("r7").ok());
  EXPECT_TRUE(regions.Register("one-more", object.key(), 0, 64).ok());
}

TEST(SystemSharedMemoryTest, RequestsReadWhileOthersRegisterAndUnregister) {
  // Run under TSan by scripts/sanitize.sh tsan: the table's lock, and
  // mappings that outlive their unregistering while a reader holds them.
  ShmObject object(8192);
  std::memset(object.data(), 7, 8192);
  SystemSharedMemory regions;
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        const std::string name = absl::StrCat("r", (i + t) % 4);
        (void)regions.Register(name, object.key(), 4096 * (i % 2), 4096);
        if (i % 3 == 0) (void)regions.Unregister(name);
        if (i % 50 == 0) (void)regions.Status("");
      }
    });
  }
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      while (!stop.load()) {
        auto span = regions.Find("input 'query'", absl::StrCat("r", t), 100, 1000);
        if (!span.ok()) continue;
        int sum = 0;
        for (size_t j = 0; j < span->size; ++j) sum += span->data[j];
        if (sum != 7 * 1000) bad.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  threads[0].join();
  threads[1].join();
  // Both readers' regions registered: each reads at least once more.
  (void)regions.Register("r0", object.key(), 0, 4096);
  (void)regions.Register("r1", object.key(), 0, 4096);
  const int before = reads.load();
  while (reads.load() < before + 2) std::this_thread::yield();
  stop = true;
  threads[2].join();
  threads[3].join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_TRUE(regions.Unregister("").ok());
}

// ---------------------------------------------------------------- decoding

void SetRegion(google::protobuf::Map<std::string, inference::InferParameter>* params,
               const std::string& region, int64_t offset, int64_t byte_size) {
  (*params)["shared_memory_region"].set_string_param(region);
  (*params)["shared_memory_byte_size"].set_int64_param(byte_size);
  if (offset != 0) (*params)["shared_memory_offset"].set_int64_param(offset);
}

inference::ModelInferRequest::InferInputTensor* AddInput(inference::ModelInferRequest* r,
                                                         const std::string& name,
                                                         const std::string& datatype,
                                                         std::vector<int64_t> shape) {
  auto* t = r->add_inputs();
  t->set_name(name);
  t->set_datatype(datatype);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  return t;
}

class SharedMemoryDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4096; ++i) object_.data()[i] = static_cast<char>(i);
    ASSERT_TRUE(regions_.Register("in", object_.key(), 0, 2048).ok());
    ASSERT_TRUE(regions_.Register("out", object_.key(), 2048, 2048).ok());
    access_.regions = &regions_;
  }
  ShmObject object_{4096};
  SystemSharedMemory regions_;
  SharedMemoryAccess access_;
};

TEST_F(SharedMemoryDecodeTest, InputsViewTheirRegionAndRawEntriesGoToTheOthers) {
  inference::ModelInferRequest r;
  r.set_model_name("sdpa");
  SetRegion(AddInput(&r, "query", "FP32", {1, 1, 2, 4})->mutable_parameters(), "in", 0, 32);
  AddInput(&r, "key", "FP32", {1, 1, 2, 4});  // raw entry 0
  SetRegion(AddInput(&r, "value", "FP32", {1, 1, 2, 4})->mutable_parameters(), "in", 64, 32);
  SetRegion(AddInput(&r, "key_lengths", "INT32", {1})->mutable_parameters(), "in", 128, 4);
  const int32_t two = 2;
  std::memcpy(object_.data() + 128, &two, 4);
  r.add_raw_input_contents(std::string(32, 'k'));
  auto* out = r.add_outputs();
  out->set_name("output");
  SetRegion(out->mutable_parameters(), "out", 16, 32);

  KServeRequest d;
  const absl::Status s = DecodeModelInferRequest(r, &d, {}, access_);
  ASSERT_TRUE(s.ok()) << s;
  // The server's own mapping of the client's bytes (another address than
  // the test's): the same bytes, and a change the client makes shows.
  EXPECT_EQ(d.inputs.query.data, std::string(object_.data(), 32));
  EXPECT_EQ(d.inputs.value.data, std::string(object_.data() + 64, 32));
  object_.data()[65] = 'X';
  EXPECT_EQ(d.inputs.value.data[1], 'X');
  EXPECT_EQ(d.inputs.key.data, std::string(32, 'k'));
  EXPECT_THAT(d.key_lengths, ::testing::ElementsAre(2));
  EXPECT_EQ(d.shared_inputs.size(), 3u);
  EXPECT_EQ(d.shared_output.region, "out");
  EXPECT_EQ(d.shared_output.span.size, 32u);
  EXPECT_TRUE(d.shared_weights.region.empty());

  // The result goes into the region: an empty raw entry, the region named.
  inference::ModelInferResponse response;
  auto view = AddSharedMemoryOutput(&response, OutputName::kOutput, DType::kFloat32,
                                    {1, 1, 2, 4}, d.shared_output);
  ASSERT_TRUE(view.ok()) << view.status();
  std::memset(view->data, 0x33, view->byte_size());  // as the engine writes it
  EXPECT_EQ(object_.data()[2048 + 15], static_cast<char>(2048 + 15));
  EXPECT_EQ(object_.data()[2048 + 16], 0x33);
  EXPECT_EQ(object_.data()[2048 + 47], 0x33);
  EXPECT_EQ(object_.data()[2048 + 48], static_cast<char>(2048 + 48));
  ASSERT_EQ(response.raw_output_contents_size(), 1);
  EXPECT_TRUE(response.raw_output_contents(0).empty());
  const auto& params = response.outputs(0).parameters();
  EXPECT_EQ(params.at("shared_memory_region").string_param(), "out");
  EXPECT_EQ(params.at("shared_memory_byte_size").int64_param(), 32);
  EXPECT_EQ(params.at("shared_memory_offset").int64_param(), 16);
  // Too small for the result: refused, naming the output and both sizes.
  inference::ModelInferResponse small;
  auto refused = AddSharedMemoryOutput(&small, OutputName::kOutput, DType::kFloat32,
                                       {1, 1, 4, 4}, d.shared_output);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("requested output 'output'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("32 is too small for the result (64 bytes)"));
}

TEST_F(SharedMemoryDecodeTest, BadParametersAndMixturesAreRefusedNamingTheTensor) {
  struct Case {
    std::string what;
    std::function<void(inference::ModelInferRequest*)> build;
    std::string message;
  };
  auto base = [](inference::ModelInferRequest* r) {
    r->set_model_name("sdpa");
    return AddInput(r, "query", "FP32", {1, 1, 2, 4});
  };
  const std::vector<Case> cases = {
      {"region without size",
       [&](auto* r) {
         (*base(r)->mutable_parameters())["shared_memory_region"].set_string_param("in");
       },
       "input 'query': shared_memory_region needs shared_memory_byte_size"},
      {"size without region",
       [&](auto* r) {
         (*base(r)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(32);
       },
       "input 'query': shared_memory_byte_size needs shared_memory_region"},
      {"negative offset",
       [&](auto* r) {
         auto* p = base(r)->mutable_parameters();
         SetRegion(p, "in", 0, 32);
         (*p)["shared_memory_offset"].set_int64_param(-8);
       },
       "'shared_memory_offset' must be an integer >= 0"},
      {"region as a number",
       [&](auto* r) {
         auto* p = base(r)->mutable_parameters();
         SetRegion(p, "in", 0, 32);
         (*p)["shared_memory_region"].set_int64_param(3);
       },
       "'shared_memory_region' must be a region's name"},
      {"unknown tensor parameter",
       [&](auto* r) { (*base(r)->mutable_parameters())["classification"].set_int64_param(3); },
       "input 'query': parameter 'classification' is not supported"},
      {"two unknown parameters: the first by name",
       [&](auto* r) {
         auto* p = base(r)->mutable_parameters();
         for (const char* name : {"zz", "shared_memory_zz", "aa", "mm"}) {
           (*p)[name].set_int64_param(1);
         }
       },
       "input 'query': parameter 'aa' is not supported"},
      {"contents and a region",
       [&](auto* r) {
         auto* t = base(r);
         SetRegion(t->mutable_parameters(), "in", 0, 32);
         t->mutable_contents()->add_fp32_contents(1);
       },
       "input 'query': contents and shared_memory_region are both set"},
      {"a raw entry for the input in shared memory too",
       [&](auto* r) {
         SetRegion(base(r)->mutable_parameters(), "in", 0, 32);
         AddInput(r, "key", "FP32", {1, 1, 2, 4});
         r->add_raw_input_contents(std::string(32, 'q'));
         r->add_raw_input_contents(std::string(32, 'k'));
       },
       "raw_input_contents: expected one entry per input not in shared memory (1), got 2"},
      {"an unregistered region",
       [&](auto* r) { SetRegion(base(r)->mutable_parameters(), "nope", 0, 32); },
       "input 'query': shared memory region 'nope' is not registered"},
      {"past the region's end",
       [&](auto* r) { SetRegion(base(r)->mutable_parameters(), "in", 2040, 32); },
       "input 'query': shared_memory_offset 2040 + shared_memory_byte_size 32 is outside"},
      {"an output over an input's bytes",
       [&](auto* r) {
         SetRegion(base(r)->mutable_parameters(), "in", 0, 32);
         auto* o = r->add_outputs();
         o->set_name("output");
         SetRegion(o->mutable_parameters(), "in", 16, 32);
       },
       "requested output 'output': its shared memory overlaps the bytes of an input"},
      {"output and weights over the same bytes",
       [&](auto* r) {
         base(r);
         for (const char* name : {"output", "weights"}) {
           auto* o = r->add_outputs();
           o->set_name(name);
           SetRegion(o->mutable_parameters(), "out", 0, 64);
         }
       },
       "requested outputs 'output' and 'weights': their shared memory overlaps"},
      {"an output asked for twice",
       [&](auto* r) {
         base(r);
         r->add_outputs()->set_name("output");
         r->add_outputs()->set_name("output");
       },
       "requested output 'output' is given more than once"},
      {"an unknown output parameter",
       [&](auto* r) {
         base(r);
         auto* o = r->add_outputs();
         o->set_name("weights");
         (*o->mutable_parameters())["binary_data"].set_bool_param(true);
       },
       "requested output 'weights': parameter 'binary_data' is not supported"},
  };
  for (const Case& c : cases) {
    inference::ModelInferRequest r;
    c.build(&r);
    KServeRequest d;
    const absl::Status s = DecodeModelInferRequest(r, &d, {}, access_);
    EXPECT_NE(s.code(), absl::StatusCode::kOk) << c.what;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.what;
  }
}

TEST_F(SharedMemoryDecodeTest, WithoutRegionsATensorInSharedMemoryGetsTheRefusal) {
  inference::ModelInferRequest r;
  r.set_model_name("sdpa");
  SetRegion(AddInput(&r, "query", "FP32", {1, 1, 2, 4})->mutable_parameters(), "in", 0, 32);
  KServeRequest d;
  SharedMemoryAccess off;  // no regions, no reason given
  EXPECT_THAT(DecodeModelInferRequest(r, &d, {}, off).message(),
              HasSubstr("input 'query': this server takes no tensors in shared memory"));
  SharedMemoryAccess denied;
  denied.refusal = absl::PermissionDeniedError("shared_memory_region: restricted token");
  KServeRequest d2;
  const absl::Status s = DecodeModelInferRequest(r, &d2, {}, denied);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "input 'query': shared_memory_region: restricted token");
}

}  // namespace
}  // namespace attnserve
