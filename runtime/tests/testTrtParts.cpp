// The TensorRT backend's CUDA-free parts (runtime/src/backends/trtParts.h) on the host: the device KV cache over
// memory that starts as garbage (0xFF bytes, a NaN in every float format, as cudaMalloc's may be), one sequence's
// and a batch of slots' (ragged lengths); the inputs of a batched target call (RaggedBatch) checked against a
// reference attention over the same rows; binding sizes against engine shapes, the libnvinfer major and engine
// version rules, the bounded context cache, and the linear layers' state rollback both GPU and host backends use
// (core/linearState.h) against the concatenate-and-slice of dflash2_trt/runtime/linear_state.py, and the sliding
// layers' device rings (DeviceWindowRing: batch slots, wrapped rings rolled back at random lengths) against a host
// twin filled as the ONNX Runtime backend fills its rings, with the planted ring bug as the negative control; and the
// prefix cache's host copies of a KV slot and a ring slot (copied out, restored into another slot, compared).
//
// usage: trtParts
#include "backends/trtParts.h"
#include "core/linearState.h"

#include "dfl2Test.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace dflash2;

namespace
{

//! DeviceOps over host memory: fresh allocations are 0xFF garbage; `failAfter` allocations succeed, then throw;
//! `dropLastRow` (a negative control) makes every 2-D copy leave out its last row.
class HostOps : public DeviceOps
{
public:
    std::vector<std::unique_ptr<std::vector<unsigned char>>> live;
    int allocs{0}, frees{0}, zeros{0}, syncs{0};
    int failAfter{-1};
    bool dropLastRow{false};

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
        for (size_t r = 0; r + (dropLastRow ? 1 : 0) < height; ++r)
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
    DeviceKV kv{&ops, 2, 2, 3, sizeof(float), 4, 10, 0, 0, {}, 1};
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
    DeviceKV small{&tight, 2, 2, 3, sizeof(float), 4, 10, 0, 0, {}, 1};
    small.reserve(2, nullptr);
    tight.failAfter = tight.allocs + 2; // the third buffer of the next growth fails
    std::vector<void*> const kept4 = small.ptrs;
    CHECK(codeOf([&] { small.reserve(6, nullptr); }) == DFL2_ERR_OUT_OF_MEMORY);
    CHECK(small.ptrs == kept4 && small.capacity == 4 && tight.live.size() == 4); // nothing leaked or lost
    small.release();
    kv.release();
    CHECK(ops.live.empty() && tight.live.empty());
}

// A batched cache [slots 3, heads 2, capacity, d 2]: rows appended per slot at its own length from a batched
// present [B, heads, S, d]; a growth keeps every slot's rows at the new pitch and zeroes the rest; a slot's part is
// what a B = 1 call binds.
void testBatchedKv()
{
    HostOps ops;
    DeviceKV kv{&ops, 1, 2, 2, sizeof(float), 4, 12, 0, 0, {}, 3};
    CHECK(kv.reserve(4, nullptr) && kv.capacity == 4 && kv.bufferBytes(4) == 3 * 2 * 4 * 2 * sizeof(float));
    CHECK(allFinite(kv));
    // present [B 3, heads 2, S 3, d 2]: value 1000 * b + 100 * head + 10 * row + k
    int32_t const B = 3, H = 2, S = 3, D = 2;
    std::vector<std::vector<float>> present(2, std::vector<float>(static_cast<size_t>(B * H * S * D)));
    std::vector<void*> pp;
    for (auto& buf : present)
    {
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h)
                for (int r = 0; r < S; ++r)
                    for (int k = 0; k < D; ++k)
                        buf[static_cast<size_t>(((b * H + h) * S + r) * D + k)]
                            = static_cast<float>(1000 * b + 100 * h + 10 * r + k);
        pp.push_back(buf.data());
    }
    std::vector<int32_t> length{0, 2, 0};  // ragged: slot 1 already holds 2 (zero) rows
    kv.appendRows(pp, S, 0, 3, 0, length[0], nullptr);  // batch row 0 -> slot 0, 3 rows at 0
    length[0] += 3;
    kv.appendRows(pp, S, 2, 1, 1, length[1], nullptr);  // batch row 2 -> slot 1, 1 row at 2
    length[1] += 1;
    CHECK(codeOf([&] { kv.appendRows(pp, S, 1, 2, 2, 3, nullptr); }) == DFL2_ERR_INTERNAL);  // 3 + 2 > capacity 4
    CHECK(codeOf([&] { kv.appendRows(pp, S, 1, 1, 3, 0, nullptr); }) == DFL2_ERR_INTERNAL);  // no slot 3
    auto at = [&](size_t buf, int slot, int h, int pos, int k) {
        float const* f = static_cast<float const*>(kv.slotPointer(buf, slot));
        return f[(h * kv.capacity + pos) * D + k];
    };
    auto expectRows = [&](char const* when) {
        bool ok = true;
        for (int h = 0; h < H; ++h)
        {
            for (int k = 0; k < D; ++k)
            {
                for (int pos = 0; pos < kv.capacity; ++pos)
                {
                    ok = ok && at(1, 0, h, pos, k) == (pos < 3 ? static_cast<float>(100 * h + 10 * pos + k) : 0.0F);
                    float const slot1 = pos == 2 ? static_cast<float>(2000 + 100 * h + k) : 0.0F;
                    ok = ok && at(1, 1, h, pos, k) == slot1 && at(1, 2, h, pos, k) == 0.0F;
                }
            }
        }
        CHECK_MSG(ok, "batched KV rows %s", when);
    };
    expectRows("after the appends");
    kv.length = *std::max_element(length.begin(), length.end());  // what TrtBatchRunners sets before growing
    std::vector<void*> const before = kv.ptrs;
    CHECK(kv.reserve(9, nullptr) && kv.capacity == 12 && kv.ptrs != before);
    CHECK(allFinite(kv));
    expectRows("after a growth");
    CHECK(static_cast<char*>(kv.slotPointer(0, 2)) - static_cast<char*>(kv.ptrs[0])
        == static_cast<std::ptrdiff_t>(2 * 2 * 12 * 2 * sizeof(float)));
    kv.release();
    CHECK(ops.live.empty());
}

// RaggedBatch: slots 0 and 2 in the call (slot 1 rides along as padding), ragged rows and cache lengths. The inputs
// are checked field by field, then through a reference attention: every real row of the batched call sees exactly
// the positions its own B = 1 call would (its slot's cached ones and its own new rows up to itself), and every row
// sees at least one position (no all-masked row: no NaN).
void testRaggedBatch()
{
    std::vector<SlotRows> seqs{{2, 5, {7, 8, 9}}, {0, 0, {4}}};
    RaggedBatch const rb = planRaggedBatch(seqs, 8, 4);
    CHECK(rb.batch == 3 && rb.rows == 3 && rb.capacity == 8);
    CHECK(rb.inputIds == std::vector<int64_t>({4, 0, 0, 0, 0, 0, 7, 8, 9}));
    CHECK(rb.positionIds == std::vector<int64_t>({0, 1, 2, 0, 1, 2, 5, 6, 7}));
    std::vector<int64_t> const mask{
        0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0,  // slot 0: no cache, 1 new row
        0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0,  // slot 1: padding (sees only itself)
        1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1}; // slot 2: 5 cached, 3 new rows
    CHECK(rb.attentionMask == mask);
    CHECK(rb.row(seqs[0], 2) == 8 && rb.row(seqs[1], 0) == 0);
    // the graph's rule (onnx_graphs.TargetGraph): row i of batch row b sees cache slot c when mask[b, c] and new row
    // j <= i when mask[b, C + j]
    size_t const C = 8, S = 3, W = C + S;
    for (size_t b = 0; b < 3; ++b)
    {
        for (size_t i = 0; i < S; ++i)
        {
            int seen = 0;
            for (size_t c = 0; c < C; ++c)
                seen += rb.attentionMask[b * W + c] != 0;
            for (size_t j = 0; j <= i; ++j)
                seen += rb.attentionMask[b * W + C + j] != 0;
            CHECK_MSG(seen >= 1, "batch row %zu row %zu sees nothing", b, i);
        }
    }
    for (SlotRows const& s : seqs)  // a real row j: its B = 1 call's view, cache 0..cacheLength-1 and new rows 0..j
    {
        for (size_t j = 0; j < s.ids.size(); ++j)
        {
            size_t const b = static_cast<size_t>(s.slot);
            bool same = rb.inputIds[rb.row(s, static_cast<int32_t>(j))] == s.ids[j]
                && rb.positionIds[rb.row(s, static_cast<int32_t>(j))] == s.cacheLength + static_cast<int64_t>(j);
            for (size_t c = 0; c < C; ++c)
                same = same && (rb.attentionMask[b * W + c] != 0) == (static_cast<int64_t>(c) < s.cacheLength);
            for (size_t k = 0; k <= j; ++k)
                same = same && rb.attentionMask[b * W + C + k] != 0;
            CHECK_MSG(same, "slot %d row %zu", s.slot, j);
        }
    }
    std::string msg;
    CHECK(codeOf([] { planRaggedBatch({{0, 6, {1, 2, 3}}}, 8, 4); }, &msg) == DFL2_ERR_INTERNAL);  // 6 + 3 > 8
    CHECK_MSG(msg.find("slot 0 with 3 rows at 6 does not fit 4 slots of capacity 8") != std::string::npos, "%s",
        msg.c_str());
    CHECK(codeOf([] { planRaggedBatch({{1, 0, {1}}, {1, 0, {2}}}, 8, 4); }) == DFL2_ERR_INTERNAL);  // slot twice
    CHECK(codeOf([] { planRaggedBatch({{4, 0, {1}}}, 8, 4); }) == DFL2_ERR_INTERNAL);              // no slot 4
    CHECK(codeOf([] { planRaggedBatch({{0, 0, {}}}, 8, 4); }) == DFL2_ERR_INTERNAL);               // no rows
    // B = 1 (a prompt alone): the same inputs as the one-sequence runner writes
    RaggedBatch const one = planRaggedBatch({{0, 2, {5, 6}}}, 4, 1);
    CHECK(one.batch == 1 && one.inputIds == std::vector<int64_t>({5, 6})
        && one.positionIds == std::vector<int64_t>({2, 3})
        && one.attentionMask == std::vector<int64_t>({1, 1, 0, 0, 1, 1}));

    // the engine's batch from its profiles (build-engines --max-batch), 1 for profiles without a batch dim
    ProfileEntry pre{"prefill", {{"batch", {1, 1, 8}}, {"sequence", {1, 128, 256}}}};
    ProfileEntry step{"step", {{"batch", {1, 8, 8}}, {"sequence", {1, 16, 16}}}};
    ProfileEntry old{"step", {{"sequence", {1, 16, 16}}}};
    CHECK(profilesMaxBatch({pre, step}) == 8 && profilesMaxBatch({step, old}) == 1 && profilesMaxBatch({}) == 1);
    step.dims["batch"] = {1, 4, 4};
    CHECK(profilesMaxBatch({pre, step}) == 4);
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

//! After a call of `rows` rows (over `pitch` columns) from a window of W columns: every kept length's state equals
//! the last W columns of [before | inputs[:, :keep]] and the recurrent state of row keep - 1 (keep 0: before).
void testLinearRollback()
{
    LinearStateSpec spec;
    spec.convDim = 3;
    spec.convKernel = 4;  // W = 3
    spec.numHeads = 1;
    spec.keyDim = 2;
    spec.valueDim = 2;
    spec.maxRowsPerCall = 8;
    int32_t const W = spec.window();
    HostStateCopy copy;
    for (int32_t pitch : {2, 5, 8})
    {
        for (int32_t rows = 1; rows <= pitch; ++rows)
        {
            std::vector<float> before(spec.windowElements()), inputs(static_cast<size_t>(spec.convDim * pitch));
            std::vector<float> recBefore(spec.recurrentElements()), states(static_cast<size_t>(pitch) * spec.recurrentElements());
            for (size_t i = 0; i < before.size(); ++i)
            {
                before[i] = 100.0F + static_cast<float>(i);
            }
            for (size_t i = 0; i < inputs.size(); ++i)
            {
                inputs[i] = 200.0F + static_cast<float>(i);
            }
            for (size_t i = 0; i < states.size(); ++i)
            {
                states[i] = 300.0F + static_cast<float>(i);
            }
            for (size_t i = 0; i < recBefore.size(); ++i)
            {
                recBefore[i] = 400.0F + static_cast<float>(i);
            }
            for (int32_t keep = 0; keep <= rows; ++keep)
            {
                std::vector<float> window(before.size(), -1.0F), recurrent(recBefore.size(), -1.0F);
                LinearLayerState const layer{window.data(), recurrent.data(), before.data(), recBefore.data(),
                    inputs.data(), states.data(), sizeof(float), sizeof(float)};
                applyKept(layer, spec, keptState(W, keep, pitch, keep - 1), copy);
                for (int32_t c = 0; c < spec.convDim; ++c)
                {
                    std::vector<float> seq(before.begin() + c * W, before.begin() + (c + 1) * W);  // [before | kept]
                    seq.insert(seq.end(), inputs.begin() + c * pitch, inputs.begin() + c * pitch + keep);
                    for (int32_t j = 0; j < W; ++j)
                    {
                        CHECK(window[static_cast<size_t>(c * W + j)] == seq[seq.size() - static_cast<size_t>(W) + static_cast<size_t>(j)]);
                    }
                }
                size_t const r = spec.recurrentElements();
                for (size_t i = 0; i < r; ++i)
                {
                    CHECK(recurrent[i] == (keep == 0 ? recBefore[i] : states[static_cast<size_t>(keep - 1) * r + i]));
                }
            }
        }
    }
    // the log: a crop keeping every row changes nothing; into the call once; a second crop, a crop into a call that
    // recorded its last row only, or before the call: DFL2_ERR_INTERNAL; the planted bugs keep the state, or the
    // recurrent state alone (the window rolled back)
    LinearStateLog log(W, 2, LinearPlant::kNONE);
    KeptState const after = log.called(1, 10, 4, 6, true);
    CHECK(after.recurrentRow == 3 && after.inputsPitch == 6);
    CHECK(!log.crop(1, 14).has_value());
    std::optional<KeptState> const kept = log.crop(1, 12);
    CHECK(kept.has_value() && kept->recurrentRow == 1 && kept->inputsPitch == 6);
    CHECK(codeOf([&] { log.crop(1, 11); }) == DFL2_ERR_INTERNAL);
    log.called(0, 0, 70, 70, false);
    std::string why;
    CHECK(codeOf([&] { log.crop(0, 3); }, &why) == DFL2_ERR_INTERNAL && why.find("last call") != std::string::npos);
    log.called(0, 5, 3, 3, true);
    CHECK(codeOf([&] { log.crop(0, 4); }) == DFL2_ERR_INTERNAL);
    log.reset(1);
    CHECK(codeOf([&] { log.crop(1, 0); }) == DFL2_ERR_INTERNAL);
    LinearStateLog planted(W, 1, LinearPlant::kSKIP_ROLLBACK);
    planted.called(0, 0, 5, 5, true);
    CHECK(!planted.crop(0, 2).has_value());
    LinearStateLog keepSsm(W, 1, LinearPlant::kKEEP_RECURRENT);
    keepSsm.called(0, 0, 5, 5, true);
    std::optional<KeptState> const ssm = keepSsm.crop(0, 2);
    KeptState const right = keptState(W, 2, 5, 1);
    CHECK(ssm.has_value() && ssm->recurrentRow == 4 && ssm->spanCount == right.spanCount);
    for (int32_t i = 0; ssm.has_value() && i < right.spanCount; ++i)
    {
        ConvSpan const& a = ssm->spans[static_cast<size_t>(i)];
        ConvSpan const& b = right.spans[static_cast<size_t>(i)];
        CHECK(a.fromInputs == b.fromInputs && a.srcCol == b.srcCol && a.dstCol == b.dstCol && a.cols == b.cols);
    }
}

// ---- the sliding layers' device rings (DeviceWindowRing) against a host twin -----------------------------------

//! The host twin of DeviceWindowRing: the ONNX Runtime backend's way (a WindowRingLog of its own, never planted, and
//! plain vectors [slots, heads, ringSlots, d] per buffer filled by its runs row by row).
struct HostRingTwin
{
    HostRingTwin(SlidingWindowSpec spec, int32_t slotCount, int32_t buffers, int32_t headCount, int32_t headDim)
        : log(spec, slotCount, false)
        , heads(headCount)
        , dim(headDim)
        , arrays(static_cast<size_t>(buffers),
              std::vector<float>(static_cast<size_t>(slotCount * headCount * spec.ringSlots * headDim), 0.0F))
    {
    }
    //! present [B, heads, S, d] per buffer: batch row b's first `rows` rows -> `slot`'s ring at positions start..
    void write(std::vector<std::vector<float>> const& present, int32_t S, int32_t b, int32_t slot, int32_t start,
        int32_t rows)
    {
        size_t const R = static_cast<size_t>(log.spec().ringSlots);
        size_t const H = static_cast<size_t>(heads);
        size_t const d = static_cast<size_t>(dim);
        for (RingRun const& run : log.place(slot, start, rows))
        {
            for (size_t a = 0; a < arrays.size(); ++a)
            {
                for (size_t h = 0; h < H; ++h)
                {
                    size_t const src = ((static_cast<size_t>(b) * H + h) * static_cast<size_t>(S)
                                           + static_cast<size_t>(run.first)) * d;
                    size_t const dst = ((static_cast<size_t>(slot) * H + h) * R + static_cast<size_t>(run.slot)) * d;
                    std::copy_n(present[a].begin() + static_cast<long>(src), static_cast<size_t>(run.count) * d,
                        arrays[a].begin() + static_cast<long>(dst));
                }
            }
        }
    }

    WindowRingLog log;
    int32_t heads;
    int32_t dim;
    std::vector<std::vector<float>> arrays;
};

//! One random scenario over a device ring of 3 slots (2 sliding layers: 4 buffers, 2 heads, d 3, window 5 in 9
//! ring slots): batched calls (padded rows, batch row = slot), long calls of one slot at batch row 0 (rings wrapped
//! within a call), crops back to random lengths into the last call, too-deep crops (refused), resets. After every
//! step the device ring is compared with the host twin (window positions, and the rows of every held slot) and
//! with the spec: the cached positions the next row's window takes (a row at p sees p - window + 1..p, as
//! targets/dense.py attention_biases) are each held once, every held position with the rows it was given, and no
//! slot holds a position at or past the length. Returns the mismatches.
int ringScenario(uint32_t seed, bool planted, bool dropLastRow = false)
{
    int32_t const H = 2, D = 3, slots = 3, layers = 2;
    SlidingWindowSpec const spec{5, 9};
    int32_t const R = spec.ringSlots, W = spec.window;
    int32_t const verifyRows = R - W + 1;  // the most rows a crop may cut back into
    HostOps ops;
    ops.dropLastRow = dropLastRow;
    DeviceWindowRing ring{&ops, layers, H, D, sizeof(float), 1, {}, nullptr};
    ring.allocate(spec, slots, planted, nullptr);
    CHECK(ring.ptrs.size() == 4 && ops.allocs == 4 && ops.zeros == 4);
    bool zeroed = true;
    for (void* p : ring.ptrs)
    {
        float const* f = static_cast<float const*>(p);
        for (size_t i = 0; i < static_cast<size_t>(slots * H * R * D); ++i)
        {
            zeroed = zeroed && f[i] == 0.0F;  // 0xFF garbage (a NaN) before
        }
    }
    CHECK(zeroed);
    std::vector<void*> const ptrs = ring.ptrs;
    HostRingTwin twin(spec, slots, 2 * layers, H, D);
    std::mt19937 rng(seed);
    auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
    std::uniform_real_distribution<float> value(-1.0F, 1.0F);
    size_t const rowValues = static_cast<size_t>(2 * layers * H * D);  // one position's K/V, [buffer, head, d]
    std::vector<std::vector<std::vector<float>>> history(static_cast<size_t>(slots));  // per slot, per position
    // per slot: its last call's first position and rows, and the lowest length a crop can return to
    std::vector<int32_t> lastStart(static_cast<size_t>(slots), 0), lastRows(static_cast<size_t>(slots), 0);
    std::vector<int32_t> floorOf(static_cast<size_t>(slots), 0);
    int mismatches = 0;
    int wrapped = 0, rolledBack = 0, refused = 0;

    // present [B, heads, S, d] per buffer, random; sequence i's rows[i] rows (batch row slotOf[i], or 0 when B = 1)
    // go to slot slotOf[i]'s ring
    auto call = [&](std::vector<int32_t> const& slotOf, std::vector<int32_t> const& rows, int32_t B) {
        int32_t const S = *std::max_element(rows.begin(), rows.end());
        std::vector<std::vector<float>> present(static_cast<size_t>(2 * layers),
            std::vector<float>(static_cast<size_t>(B * H * S * D)));
        std::vector<void*> pp;
        for (auto& buf : present)
        {
            for (float& v : buf)
            {
                v = value(rng);
            }
            pp.push_back(buf.data());
        }
        for (size_t i = 0; i < slotOf.size(); ++i)
        {
            int32_t const slot = slotOf[i];
            int32_t const b = B == 1 ? 0 : slot;
            int32_t const start = static_cast<int32_t>(history[static_cast<size_t>(slot)].size());
            ring.place(pp, S, b, slot, start, rows[i], nullptr);
            twin.write(present, S, b, slot, start, rows[i]);
            for (int32_t r = 0; r < rows[i]; ++r)
            {
                std::vector<float> row(rowValues);
                for (size_t a = 0; a < present.size(); ++a)
                    for (int32_t h = 0; h < H; ++h)
                        for (int32_t k = 0; k < D; ++k)
                            row[(a * static_cast<size_t>(H) + static_cast<size_t>(h)) * static_cast<size_t>(D)
                                + static_cast<size_t>(k)]
                                = present[a][static_cast<size_t>(((b * H + h) * S + r) * D + k)];
                history[static_cast<size_t>(slot)].push_back(row);
            }
            lastStart[static_cast<size_t>(slot)] = start;
            lastRows[static_cast<size_t>(slot)] = rows[i];
            int32_t& floor = floorOf[static_cast<size_t>(slot)];  // windowRing.cpp's rule: it never falls
            floor = std::max(floor, start + rows[i] - (R - W) - 1);
            wrapped += (start % R) + rows[i] > R;
        }
    };
    auto compare = [&] {
        for (int32_t slot = 0; slot < slots; ++slot)
        {
            auto const& hist = history[static_cast<size_t>(slot)];
            int64_t const L = static_cast<int64_t>(hist.size());
            int64_t const* pos = ring.positions(slot);
            int64_t const* twinPos = twin.log.positions(slot);
            auto rowMatches = [&](int32_t j, std::vector<float> const& want, bool twinToo) {
                bool same = true;
                for (size_t a = 0; a < ring.ptrs.size(); ++a)
                {
                    float const* f = static_cast<float const*>(ring.slotPointer(a, slot));
                    for (int32_t h = 0; h < H; ++h)
                    {
                        for (int32_t k = 0; k < D; ++k)
                        {
                            float const got = f[(h * R + j) * D + k];
                            size_t const t = ((static_cast<size_t>(slot) * H + static_cast<size_t>(h)) * R
                                                 + static_cast<size_t>(j)) * D + static_cast<size_t>(k);
                            same = same && got == want[(a * H + static_cast<size_t>(h)) * D + static_cast<size_t>(k)];
                            same = same && (!twinToo || got == twin.arrays[a][t]);
                        }
                    }
                }
                return same;
            };
            for (int32_t j = 0; j < R; ++j)
            {
                mismatches += pos[j] != twinPos[j];
                mismatches += pos[j] >= L;  // a cut (or never written) position still valid
                if (pos[j] >= 0 && pos[j] < L)
                {
                    mismatches += !rowMatches(j, hist[static_cast<size_t>(pos[j])], pos[j] == twinPos[j]);
                }
            }
            for (int64_t p = std::max<int64_t>(0, L - W + 1); p < L; ++p)  // the next row's keys (position L sees
            {                                                               // L - W + 1..L): each held once
                int held = 0;
                for (int32_t j = 0; j < R; ++j)
                {
                    held += pos[j] == p;
                }
                mismatches += held != 1;
            }
        }
    };

    for (int step = 0; step < 400; ++step)
    {
        int32_t const op = uniform(0, 9);
        if (op <= 3)  // a batched call of some slots, ragged rows (a verify's at most)
        {
            std::vector<int32_t> slotOf, rows;
            for (int32_t s = 0; s < slots; ++s)
            {
                if (uniform(0, 2) != 0)
                {
                    slotOf.push_back(s);
                    rows.push_back(uniform(1, verifyRows));
                }
            }
            if (!slotOf.empty())
            {
                call(slotOf, rows, slotOf.back() + 1);
            }
        }
        else if (op <= 5)  // one slot's call at batch row 0 (a prompt chunk: up to 2 rings' rows)
        {
            call({uniform(0, slots - 1)}, {uniform(1, 2 * R + 3)}, 1);
        }
        else if (op <= 8)  // a crop back into the slot's last call, to a random length its ring can return to
        {
            size_t const s = static_cast<size_t>(uniform(0, slots - 1));
            int32_t const L = static_cast<int32_t>(history[s].size());
            if (lastRows[s] == 0)
            {
                continue;
            }
            if (floorOf[s] > 0 && uniform(0, 3) == 0)  // deeper than the ring holds: refused, nothing changes
            {
                int32_t const deep = uniform(0, floorOf[s] - 1);
                refused += codeOf([&] { ring.crop(static_cast<int32_t>(s), deep); }) == DFL2_ERR_INTERNAL;
                mismatches += codeOf([&] { twin.log.crop(static_cast<int32_t>(s), deep); }) != DFL2_ERR_INTERNAL;
                compare();
                continue;
            }
            int32_t const keep = uniform(std::min(std::max(floorOf[s], lastStart[s]), L), L);
            ring.crop(static_cast<int32_t>(s), keep);
            twin.log.crop(static_cast<int32_t>(s), keep);
            history[s].resize(static_cast<size_t>(keep));
            rolledBack += keep < L && lastStart[s] % R + lastRows[s] > R;
        }
        else  // a new sequence in a slot
        {
            size_t const s = static_cast<size_t>(uniform(0, slots - 1));
            ring.reset(static_cast<int32_t>(s));
            twin.log.reset(static_cast<int32_t>(s));
            history[s].clear();
            lastStart[s] = 0;
            lastRows[s] = 0;
            floorOf[s] = 0;
        }
        compare();
    }
    CHECK(ring.ptrs == ptrs && ops.allocs == 4 && ops.zeros == 4);  // allocated once, zeroed once, never moved
    CHECK_MSG(wrapped > 10 && rolledBack > 3 && refused > 3, "seed %u: %d wrapped calls, %d wrapped calls rolled back, "
        "%d refused crops", seed, wrapped, rolledBack, refused);
    ring.release();
    CHECK(ops.live.empty() && ring.ptrs.empty() && !ring.active());
    return mismatches;
}

void testWindowRing()
{
    for (uint32_t seed : {1U, 2U, 3U, 4U, 5U})
    {
        int const mismatches = ringScenario(seed, plantedRingKeepCut());
        CHECK_MSG(mismatches == 0, "seed %u: %d mismatches between the device ring and its host twin", seed, mismatches);
    }
    // the negative control: the planted bug ($DFLASH2_PLANT_RING_KEEP_CUT=1, a crop leaves the cut rows' slots
    // valid) makes the comparison differ
    ::setenv("DFLASH2_PLANT_RING_KEEP_CUT", "1", 1);
    bool const planted = plantedRingKeepCut();
    ::unsetenv("DFLASH2_PLANT_RING_KEEP_CUT");
    CHECK(planted && !plantedRingKeepCut());
    for (uint32_t seed : {1U, 2U})
    {
        CHECK_MSG(ringScenario(seed, planted) > 0, "seed %u: the planted ring bug went unnoticed", seed);
        // and a placement that loses rows (every pitched copy one row short: DeviceWindowRing's own arithmetic
        // wrong) makes it differ too
        CHECK_MSG(ringScenario(seed, false, true) > 0, "seed %u: a ring placement one row short went unnoticed", seed);
    }

    // the floor never falls within a sequence: after a crop, a call shorter than the cut rows leaves the positions
    // its cut rows overwrote lost (tests/test_target_families.py test_the_ring_floor_is_exact, the Python twin)
    WindowRingLog floorLog(SlidingWindowSpec{8, 24}, 1, false);
    floorLog.place(0, 0, 30);  // positions 0..5 overwritten by 24..29
    floorLog.crop(0, 28);
    floorLog.place(0, 28, 1);
    CHECK(codeOf([&] { floorLog.crop(0, 12); }) == DFL2_ERR_INTERNAL);  // the row at 12 needs position 5
    CHECK(codeOf([&] { floorLog.crop(0, 13); }) == DFL2_OK);  // at 13, positions 6..12: held

    // the engines' profiles must fix the ring dim at the manifest's ring, in every profile
    ProfileEntry fixed{"step", {{"batch", {1, 1, 4}}, {kRING_SLOTS, {24, 24, 24}}}};
    ProfileEntry prefill{"prefill", {{kRING_SLOTS, {24, 24, 24}}}};
    CHECK(codeOf([&] { checkRingProfiles("target", {fixed, prefill}, 24); }) == DFL2_OK);
    std::string message;
    CHECK(codeOf([&] { checkRingProfiles("target", {fixed, prefill}, 20); }, &message) == DFL2_ERR_CORRUPT);
    CHECK(message.find("profile 'step' does not fix ring_slots at the manifest's ring of 20 slots") != std::string::npos);
    ProfileEntry loose{"prefill", {{kRING_SLOTS, {1, 24, 24}}}};  // a ring smaller than the buffers it would bind
    CHECK(codeOf([&] { checkRingProfiles("target", {fixed, loose}, 24); }) == DFL2_ERR_CORRUPT);
    ProfileEntry none{"prefill", {{"sequence", {1, 64, 128}}}};
    CHECK(codeOf([&] { checkRingProfiles("target", {fixed, none}, 24); }) == DFL2_ERR_CORRUPT);

    // a slot's part is what a B = 1 call binds; rows outside the present tensors or the slots are refused
    HostOps ops;
    DeviceWindowRing ring{&ops, 1, 2, 4, sizeof(float), 1, {}, nullptr};
    ring.allocate(SlidingWindowSpec{4, 20}, 3, false, nullptr);
    CHECK(ring.slotBytes() == 2 * 20 * 4 * sizeof(float) && ring.ringSlots() == 20);
    CHECK(static_cast<char*>(ring.slotPointer(1, 2)) - static_cast<char*>(ring.ptrs[1])
        == static_cast<std::ptrdiff_t>(2 * ring.slotBytes()));
    std::vector<float> rows(2 * 2 * 4, 1.0F);
    std::vector<void*> const present{rows.data(), rows.data()};
    CHECK(codeOf([&] { ring.place(present, 2, 0, 3, 0, 1, nullptr); }) == DFL2_ERR_INTERNAL);   // no slot 3
    CHECK(codeOf([&] { ring.place(present, 2, 0, 0, 0, 3, nullptr); }) == DFL2_ERR_INTERNAL);   // 3 rows of 2
    CHECK(codeOf([&] { ring.place({rows.data()}, 2, 0, 0, 0, 1, nullptr); }) == DFL2_ERR_INTERNAL);  // 1 buffer of 2
    CHECK(codeOf([&] { ring.allocate(SlidingWindowSpec{4, 20}, 3, false, nullptr); }) == DFL2_ERR_INTERNAL);  // twice
    CHECK(ring.positions(0)[0] == -1);  // nothing recorded by the refused calls
    ring.release();
    // an allocation that fails midway leaves nothing allocated
    HostOps tight;
    tight.failAfter = 1;
    DeviceWindowRing failing{&tight, 1, 2, 4, sizeof(float), 1, {}, nullptr};
    CHECK(codeOf([&] { failing.allocate(SlidingWindowSpec{4, 20}, 3, false, nullptr); }) == DFL2_ERR_OUT_OF_MEMORY);
    CHECK(tight.live.empty() && failing.ptrs.empty() && !failing.active());
    CHECK(ops.live.empty());
}

// The prefix cache's host copies of device state (TrtRunners / TrtBatchRunners prefixCopy, prefixRestore,
// targetSnapshot): a batched cache's slot copied out (DeviceKV::rowsOf, [heads, n, d] per buffer) and loaded into
// another slot of a cache of another capacity (loadRows) holds the same rows and touches nothing else; a ring's slot
// snapshotted (rotated as it is, with its positions and floor) and restored into another ring's slot is the same
// ring. A copy one row short (HostOps::dropLastRow) is caught.
int kvCopyMismatches(bool dropLastRow)
{
    HostOps ops;
    ops.dropLastRow = dropLastRow;
    int32_t const H = 2, D = 3, n = 5;
    DeviceKV from{&ops, 1, H, D, sizeof(float), 4, 16, 0, 0, {}, 3};
    from.reserve(8, nullptr);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0F, 1.0F);
    for (size_t i = 0; i < from.ptrs.size(); ++i)  // slot 1's rows 0..n-1: random; the rest stays zero
    {
        float* f = static_cast<float*>(from.slotPointer(i, 1));
        for (int h = 0; h < H; ++h)
            for (int r = 0; r < n * D; ++r)
                f[h * from.capacity * D + r] = u(rng);
    }
    std::vector<std::vector<char>> const rows = from.rowsOf(1, n, nullptr);
    DeviceKV to{&ops, 1, H, D, sizeof(float), 4, 16, 0, 0, {}, 3};
    to.reserve(12, nullptr);  // another pitch
    to.loadRows(rows, n, 2, nullptr);
    int bad = 0;
    for (size_t i = 0; i < from.ptrs.size(); ++i)
    {
        float const* a = static_cast<float const*>(from.slotPointer(i, 1));
        float const* b = static_cast<float const*>(to.slotPointer(i, 2));
        float const* other = static_cast<float const*>(to.slotPointer(i, 1));
        for (int h = 0; h < H; ++h)
        {
            for (int r = 0; r < to.capacity * D; ++r)
            {
                float const want = r < n * D ? a[h * from.capacity * D + r] : 0.0F;
                bad += b[h * to.capacity * D + r] != want;
                bad += other[h * to.capacity * D + r] != 0.0F;
            }
        }
    }
    CHECK(codeOf([&] { to.loadRows(rows, 13, 2, nullptr); }) == DFL2_ERR_INTERNAL);  // past the capacity
    CHECK(codeOf([&] { to.loadRows(rows, n - 1, 2, nullptr); }) == DFL2_ERR_INTERNAL);  // rows of another length
    CHECK(codeOf([&] { to.rowsOf(3, 1, nullptr); }) == DFL2_ERR_INTERNAL);  // no slot 3
    from.release();
    to.release();
    return bad;
}

int ringCopyMismatches(bool dropLastRow)
{
    HostOps ops;
    SlidingWindowSpec const spec{4, 6};
    DeviceWindowRing from{&ops, 2, 2, 2, sizeof(float), 1, {}, nullptr};
    from.allocate(spec, 2, false, nullptr);
    // 9 positions into slot 1 (the ring wraps), then a crop: rotated rows, positions and a floor to carry
    std::vector<std::vector<float>> present(4, std::vector<float>(2 * 9 * 2));
    std::vector<void*> pp;
    for (size_t i = 0; i < present.size(); ++i)
    {
        for (size_t k = 0; k < present[i].size(); ++k)
        {
            present[i][k] = static_cast<float>(1000 * i + k);
        }
        pp.push_back(present[i].data());
    }
    from.place(pp, 9, 0, 1, 0, 9, nullptr);
    from.crop(1, 8);
    TrtTargetSnapshot snap;
    from.snapshot(1, snap, nullptr);
    CHECK(snap.nbytes() == 4 * from.slotBytes() + 6 * sizeof(int64_t));
    HostOps copying;
    copying.dropLastRow = dropLastRow;
    DeviceWindowRing to{&copying, 2, 2, 2, sizeof(float), 1, {}, nullptr};
    to.allocate(spec, 2, false, nullptr);
    to.restore(0, snap, nullptr);
    int bad = 0;
    for (size_t i = 0; i < from.ptrs.size(); ++i)
    {
        bad += std::memcmp(from.slotPointer(i, 1), to.slotPointer(i, 0), from.slotBytes()) != 0;
    }
    bad += !std::equal(from.positions(1), from.positions(1) + 6, to.positions(0));
    // the same floor: a crop the source refuses is refused by the copy, one it takes is taken
    bad += codeOf([&] { from.crop(1, 1); }) != codeOf([&] { to.crop(0, 1); });
    bad += codeOf([&] { from.crop(1, 7); }) != DFL2_OK || codeOf([&] { to.crop(0, 7); }) != DFL2_OK;
    TrtTargetSnapshot other;
    other.rings.resize(2);
    CHECK(codeOf([&] { to.restore(1, other, nullptr); }) == DFL2_ERR_INTERNAL);  // another target's snapshot
    from.release();
    to.release();
    return bad;
}

void testPrefixCopies()
{
    CHECK_MSG(kvCopyMismatches(false) == 0, "a KV slot copied and loaded into another differs");
    CHECK_MSG(kvCopyMismatches(true) > 0, "a KV copy one row short went unnoticed");
    CHECK_MSG(ringCopyMismatches(false) == 0, "a ring snapshot restored into another slot differs");
    CHECK_MSG(ringCopyMismatches(true) > 0, "a ring restore one row short went unnoticed");
}

} // namespace

int main()
{
    testKvZeroedAndGrown();
    testBatchedKv();
    testRaggedBatch();
    testBindingShapes();
    testVersions();
    testLru();
    testLinearRollback();
    testWindowRing();
    testPrefixCopies();
    return dfl2TestReport("trtParts");
}
