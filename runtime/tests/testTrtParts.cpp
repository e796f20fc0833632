// The TensorRT backend's CUDA-free parts (runtime/src/backends/trtParts.h) on the host: the device KV cache over
// memory that starts as garbage (0xFF bytes, a NaN in every float format, as cudaMalloc's may be), binding sizes
// against engine shapes, the libnvinfer major and engine version rules, and the bounded context cache.
//
// usage: trtParts
#include "backends/trtParts.h"

#include "dfl2Test.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using namespace dflash2;

namespace
{

//! DeviceOps over host memory: fresh allocations are 0xFF garbage; `failAfter` allocations succeed, then throw.
class HostOps : public DeviceOps
{
public:
    std::vector<std::unique_ptr<std::vector<unsigned char>>> live;
    int allocs{0}, frees{0}, zeros{0}, syncs{0};
    int failAfter{-1};

    void* alloc(size_t bytes) override
    {
        if (failAfter >= 0 && allocs >= failAfter)
        {
            throw Error(DFL2_ERR_OUT_OF_MEMORY, "fake out of memory");
        }
        ++allocs;
        live.push_back(std::make_unique<std::vector<unsigned char>>(bytes, 0xFF));
        return live.back()->data();
    }
    void release(void* p) noexcept override
    {
        for (auto it = live.begin(); it != live.end(); ++it)
        {
            if ((*it)->data() == p)
            {
                live.erase(it);
                ++frees;
                return;
            }
        }
        std::fprintf(stderr, "release of an unknown pointer\n");
        std::abort();
    }
    void zero(void* p, size_t bytes, void*) override
    {
        ++zeros;
        std::memset(p, 0, bytes);
    }
    void copy2D(void* dst, size_t dpitch, void const* src, size_t spitch, size_t width, size_t height, void*) override
    {
        for (size_t r = 0; r < height; ++r)
        {
            std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<char const*>(src) + r * spitch, width);
        }
    }
    void sync(void*) override
    {
        ++syncs;
    }
};

template <typename F>
dfl2_code codeOf(F&& f, std::string* message = nullptr)
{
    try
    {
        f();
    }
    catch (Error const& e)
    {
        if (message != nullptr)
        {
            *message = e.what();
        }
        return e.code();
    }
    return DFL2_OK;
}

bool allFinite(DeviceKV const& kv)
{
    for (void* p : kv.ptrs)
    {
        float const* f = static_cast<float const*>(p);
        for (size_t i = 0; i < kv.bufferBytes(kv.capacity) / sizeof(float); ++i)
        {
            if (!std::isfinite(f[i]))
            {
                return false;
            }
        }
    }
    return true;
}

void testKvZeroedAndGrown()
{
    HostOps ops;
    // 2 layers (4 buffers) [1, heads 2, capacity, d 3] fp32, buckets of 4, at most 10 positions
    DeviceKV kv{&ops, 2, 2, 3, sizeof(float), 4, 10, 0, 0, {}};
    CHECK(kv.reserve(3, nullptr) && kv.capacity == 4 && kv.ptrs.size() == 4);
    CHECK(allFinite(kv)); // fresh cudaMalloc memory is garbage: zeroed, NaN never reaches a masked slot
    CHECK(ops.zeros == 4);
    // present [1, heads, S = 3, d] with value 100 * head + 10 * row + k
    std::vector<std::vector<float>> present(4, std::vector<float>(2 * 3 * 3));
    std::vector<void*> pp;
    for (auto& buf : present)
    {
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < 3; ++r)
                for (int k = 0; k < 3; ++k)
                    buf[static_cast<size_t>((h * 3 + r) * 3 + k)] = static_cast<float>(100 * h + 10 * r + k);
        pp.push_back(buf.data());
    }
    kv.append(pp, 3, nullptr);
    CHECK(kv.length == 3);
    std::vector<void*> const before = kv.ptrs;
    CHECK(!kv.reserve(4, nullptr) && kv.ptrs == before); // fits: nothing moves
    CHECK(kv.reserve(7, nullptr) && kv.capacity == 8 && kv.ptrs != before && ops.frees == 4);
    CHECK(allFinite(kv));
    float const* f = static_cast<float const*>(kv.ptrs[3]);
    bool kept = true, zero = true;
    for (int h = 0; h < 2; ++h)
    {
        for (int slot = 0; slot < 8; ++slot)
        {
            for (int k = 0; k < 3; ++k)
            {
                float const v = f[(h * 8 + slot) * 3 + k];
                if (slot < 3)
                {
                    kept = kept && v == static_cast<float>(100 * h + 10 * slot + k);
                }
                else
                {
                    zero = zero && v == 0.0F;
                }
            }
        }
    }
    CHECK(kept && zero);
    CHECK(kv.reserve(10, nullptr) && kv.capacity == 10); // the last bucket is the exported capacity
    CHECK(codeOf([&] { kv.reserve(11, nullptr); }) == DFL2_ERR_TOO_LONG);
    CHECK(codeOf([&] { kv.append(pp, 3, nullptr); kv.append(pp, 3, nullptr); kv.append(pp, 3, nullptr); })
        == DFL2_ERR_INTERNAL); // 3 + 9 rows > capacity 10

    HostOps tight;
    DeviceKV small{&tight, 2, 2, 3, sizeof(float), 4, 10, 0, 0, {}};
    small.reserve(2, nullptr);
    tight.failAfter = tight.allocs + 2; // the third buffer of the next growth fails
    std::vector<void*> const kept4 = small.ptrs;
    CHECK(codeOf([&] { small.reserve(6, nullptr); }) == DFL2_ERR_OUT_OF_MEMORY);
    CHECK(small.ptrs == kept4 && small.capacity == 4 && tight.live.size() == 4); // nothing leaked or lost
    small.release();
    kv.release();
    CHECK(ops.live.empty() && tight.live.empty());
}

void testBindingShapes()
{
    CHECK(codeOf([] { checkBindingShape("drafter_head", "cand_ids", {1, 15, 16}, {1, 15, 16}); }) == DFL2_OK);
    CHECK(codeOf([] { checkBindingShape("target", "logits", {1, -1, 512}, {1, 256, 512}); }) == DFL2_OK);
    std::string msg;
    CHECK(codeOf([] { checkBindingShape("drafter_head", "cand_ids", {1, 15, 32}, {1, 15, 16}); }, &msg)
        == DFL2_ERR_CORRUPT);
    CHECK_MSG(msg.find("cand_ids has shape (1, 15, 32), the manifest implies (1, 15, 16)") != std::string::npos, "%s",
        msg.c_str());
    CHECK(codeOf([] { checkBindingShape("target", "logits", {-1, 512}, {1, 256, 512}); }) == DFL2_ERR_CORRUPT);
}

void testVersions()
{
    std::string msg;
    CHECK(codeOf([] { checkLibraryMajor(10, 100300); }) == DFL2_OK);
    CHECK(codeOf([] { checkLibraryMajor(10, 110400); }, &msg) == DFL2_ERR_UNAVAILABLE);
    CHECK_MSG(msg.find("libnvinfer reports TensorRT 11.4, this libdflash2 was built against TensorRT 10 headers")
            != std::string::npos,
        "%s", msg.c_str());
    CHECK(codeOf([] { checkLibraryMajor(11, 101401); }) == DFL2_ERR_UNAVAILABLE);
    CHECK(codeOf([] { checkEngineVersion("10.13.0.35", {10, 13, 0, 35}, "d"); }) == DFL2_OK);
    CHECK(codeOf([] { checkEngineVersion("10.13.0.35", {10, 13, 0}, "d"); }) == DFL2_OK); // no build number here
    CHECK(codeOf([] { checkEngineVersion("10.13.0.35", {10, 13, 0, 36}, "d"); }, &msg) == DFL2_ERR_VERSION_MISMATCH);
    CHECK_MSG(msg.find("engines were built with TensorRT 10.13.0.35, this is TensorRT 10.13.0.36") != std::string::npos,
        "%s", msg.c_str());
    CHECK(codeOf([] { checkEngineVersion("10.13.1.35", {10, 13, 0, 35}, "d"); }) == DFL2_ERR_VERSION_MISMATCH);
    CHECK(codeOf([] { checkEngineVersion("10.13", {10, 13, 0, 35}, "d"); }) == DFL2_ERR_VERSION_MISMATCH);
    CHECK(versionParts("10.3.0.30") == std::vector<int32_t>({10, 3, 0, 30}));
}

void testLru()
{
    LruMap<std::unique_ptr<int>> lru(2);
    std::vector<std::string> evicted;
    auto note = [&](std::string const& k) { evicted.push_back(k); };
    lru.insert("a", std::make_unique<int>(1), note);
    lru.insert("b", std::make_unique<int>(2), note);
    CHECK(lru.find("a") != nullptr && **lru.find("a") == 1); // a is now the most recently used
    lru.insert("c", std::make_unique<int>(3), note);
    CHECK(evicted == std::vector<std::string>({"b"}) && lru.size() == 2 && lru.evicted() == 1);
    CHECK(lru.find("b") == nullptr && lru.find("c") != nullptr);
    lru.insert("d", std::make_unique<int>(4), note);
    CHECK(evicted == std::vector<std::string>({"b", "a"}));
}

} // namespace

int main()
{
    testKvZeroedAndGrown();
    testBindingShapes();
    testVersions();
    testLru();
    return dfl2TestReport("trtParts");
}
