//! \file trtParts.h
//! The parts of the TensorRT backend that need neither CUDA nor TensorRT headers, so that host tests run them
//! (runtime/tests/testTrtParts.cpp): the device KV cache over a CUDA seam (one sequence, or a batch of slots with
//! ragged lengths), the sliding layers' device rings over the same seam, the host inputs of a batched target call (RaggedBatch), the binding-size check, the TensorRT
//! library / engine version rules and the bounded (LRU) cache of execution contexts.
#pragma once

#include "../core/batch.h"
#include "../core/decoder.h"
#include "../core/windowRing.h"
#include "../manifest.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dflash2
{

//! What DeviceKV and DeviceWindowRing need from CUDA: trtBackend.cpp implements it over cudart; the host test over
//! memory that, like cudaMalloc's, starts as garbage. `stream` is a cudaStream_t. copy2D copies between any two of
//! device and host memory (the prefix cache's copies go to and from the host).
class DeviceOps
{
public:
    virtual ~DeviceOps() = default;
    virtual void* alloc(size_t bytes) = 0;
    virtual void release(void* p) noexcept = 0;
    virtual void zero(void* p, size_t bytes, void* stream) = 0;
    virtual void copy2D(void* dst, size_t dpitch, void const* src, size_t spitch, size_t width, size_t height,
        void* stream)
        = 0;
    virtual void sync(void* stream) = 0;
};

//! One pitched copy per buffer of a call's new rows: present [B, heads, S, d] (contiguous), batch row b's rows
//! first..first+count-1 -> dst [heads, dstRows, d] (one sequence's part of a buffer) at rows at..at+count-1.
//! The KV cache (DeviceKV, dstRows = its capacity) and the rings (DeviceWindowRing, dstRows = the ring's slots) place
//! rows with it.
inline void copyPresentRows(DeviceOps& ops, void* dst, int32_t dstRows, int32_t at, void const* present, int32_t S,
    int32_t b, int32_t first, int32_t count, int32_t heads, size_t rowBytes, void* stream)
{
    size_t const srcPitch = static_cast<size_t>(S) * rowBytes;
    ops.copy2D(static_cast<char*>(dst) + static_cast<size_t>(at) * rowBytes, static_cast<size_t>(dstRows) * rowBytes,
        static_cast<char const*>(present) + static_cast<size_t>(b) * static_cast<size_t>(heads) * srcPitch
            + static_cast<size_t>(first) * rowBytes,
        srcPitch, static_cast<size_t>(count) * rowBytes, static_cast<size_t>(heads), stream);
}

//! A KV cache on the device: 2 buffers per layer [batch, heads, capacity, d] — one request's (batch 1), or the
//! slots of a batched runner (batch = slots, every slot its own length, kept by the runner: `length` is then the
//! longest slot's, the rows a growth copies).
//! Invariant: every slot is finite — buffers are zeroed when allocated (cudaMalloc memory is garbage, and a NaN
//! in a masked slot still NaNs its row through 0 * NaN in attention), rows 0..length-1 hold the cache.
struct DeviceKV
{
    DeviceOps* ops{nullptr};
    int32_t layers{0}, heads{0}, headDim{0};
    size_t elem{0};
    int32_t step{256}, maxCapacity{0};
    int32_t length{0}, capacity{0};
    std::vector<void*> ptrs;
    int32_t batch{1};

    size_t rowBytes() const
    {
        return static_cast<size_t>(headDim) * elem;
    }
    size_t bufferBytes(int32_t cap) const
    {
        return static_cast<size_t>(batch) * static_cast<size_t>(heads) * static_cast<size_t>(cap) * rowBytes();
    }
    //! Buffer i's rows of batch row `slot` ([1, heads, capacity, d] of its own: what a B = 1 call binds)
    void* slotPointer(size_t i, int32_t slot) const
    {
        return static_cast<char*>(ptrs[i])
            + static_cast<size_t>(slot) * static_cast<size_t>(heads) * static_cast<size_t>(capacity) * rowBytes();
    }
    //! Grows to hold n positions (kv.grown_capacity): zeroed buffers of the next capacity bucket, the cached
    //! rows copied over. Returns true when the buffers moved (graphs that bound them must be dropped).
    bool reserve(int32_t n, void* stream)
    {
        if (n > maxCapacity)
        {
            throw Error(DFL2_ERR_TOO_LONG, "sequence of " + std::to_string(n)
                    + " positions exceeds the exported cache capacity " + std::to_string(maxCapacity));
        }
        if (n <= capacity)
        {
            return false;
        }
        int32_t const cap = std::min(maxCapacity, (n + step - 1) / step * step);
        std::vector<void*> fresh;
        try
        {
            for (size_t i = 0; i < static_cast<size_t>(2 * layers); ++i)
            {
                fresh.push_back(ops->alloc(bufferBytes(cap)));
                ops->zero(fresh.back(), bufferBytes(cap), stream);
            }
            for (size_t i = 0; i < ptrs.size() && length > 0; ++i) // keep rows 0..length-1, (batch, head) by head
            {
                ops->copy2D(fresh[i], static_cast<size_t>(cap) * rowBytes(), ptrs[i],
                    static_cast<size_t>(capacity) * rowBytes(), static_cast<size_t>(length) * rowBytes(),
                    static_cast<size_t>(batch) * static_cast<size_t>(heads), stream);
            }
            ops->sync(stream);
        }
        catch (...)
        {
            for (void* p : fresh)
            {
                ops->release(p);
            }
            throw;
        }
        release();
        ptrs = fresh;
        capacity = cap;
        return true;
    }
    //! present [1, heads, S, d] (contiguous) -> slots length..length+S-1 (batch 1)
    void append(std::vector<void*> const& present, int32_t S, void* stream)
    {
        appendRows(present, S, 0, S, 0, length, stream);
        length += S;
    }
    //! present [B, heads, S, d] (contiguous): batch row b's first `rows` rows -> batch row `slot` of the cache at
    //! positions at..at+rows-1 (the caller keeps the slot's length)
    void appendRows(std::vector<void*> const& present, int32_t S, int32_t b, int32_t rows, int32_t slot, int32_t at,
        void* stream)
    {
        if (slot < 0 || slot >= batch || rows < 0 || rows > S || at < 0 || at + rows > capacity)
        {
            throw Error(DFL2_ERR_INTERNAL, "KV append past the reserved capacity");
        }
        for (size_t i = 0; i < ptrs.size(); ++i)
        {
            copyPresentRows(*ops, slotPointer(i, slot), capacity, at, present[i], S, b, 0, rows, heads, rowBytes(),
                stream);
        }
    }
    //! The prefix cache's copy (kv.KVBuffer.rows): positions 0..n-1 of `slot`, one host array [heads, n, d] per
    //! buffer
    std::vector<std::vector<char>> rowsOf(int32_t slot, int32_t n, void* stream) const
    {
        if (slot < 0 || slot >= batch || n < 0 || n > capacity)
        {
            throw Error(DFL2_ERR_INTERNAL, "KV rows asked past the cache");
        }
        size_t const width = static_cast<size_t>(n) * rowBytes();
        std::vector<std::vector<char>> rows(ptrs.size(), std::vector<char>(static_cast<size_t>(heads) * width));
        for (size_t i = 0; i < ptrs.size() && n > 0; ++i)
        {
            ops->copy2D(rows[i].data(), width, slotPointer(i, slot), static_cast<size_t>(capacity) * rowBytes(), width,
                static_cast<size_t>(heads), stream);
        }
        ops->sync(stream);
        return rows;
    }
    //! rowsOf's arrays (n positions each) back into `slot` at positions 0..n-1 (kv.KVBuffer.load; the capacity
    //! reserved by the caller; the slot's length is the caller's)
    void loadRows(std::vector<std::vector<char>> const& rows, int32_t n, int32_t slot, void* stream)
    {
        size_t const width = static_cast<size_t>(n) * rowBytes();
        if (slot < 0 || slot >= batch || n < 0 || n > capacity || rows.size() != ptrs.size())
        {
            throw Error(DFL2_ERR_INTERNAL, "KV rows restored past the reserved capacity");
        }
        for (size_t i = 0; i < ptrs.size() && n > 0; ++i)
        {
            if (rows[i].size() != static_cast<size_t>(heads) * width)
            {
                throw Error(DFL2_ERR_INTERNAL, "KV rows of another shape");
            }
            ops->copy2D(slotPointer(i, slot), static_cast<size_t>(capacity) * rowBytes(), rows[i].data(), width, width,
                static_cast<size_t>(heads), stream);
        }
        ops->sync(stream);
    }
    void release() noexcept
    {
        for (void* p : ptrs)
        {
            ops->release(p);
        }
        ptrs.clear();
        capacity = 0;
    }
};

//! A TensorRT target's non-croppable state of one sequence, on the host (the prefix cache's snapshot: OrtTargetSnapshot
//! over device memory): per linear layer its window and recurrent state (the engine's bytes), per ring buffer its
//! slot's part, and the ring's window positions and crop floor.
struct TrtTargetSnapshot : TargetSnapshot
{
    std::vector<std::vector<char>> windows, recurrents, rings;
    std::vector<int64_t> positions;
    int64_t floor{0};

    size_t nbytes() const override
    {
        size_t n = positions.size() * sizeof(int64_t);
        for (auto const* parts : {&windows, &recurrents, &rings})
        {
            for (auto const& p : *parts)
            {
                n += p.size();
            }
        }
        return n;
    }
};

//! A sliding-window target's engine: every profile must fix the ring dim (kRING_SLOTS) at the manifest's ring
//! (build-engines does), since the device rings are allocated at that size and bound whole (DFL2_ERR_CORRUPT
//! otherwise, before CUDA is touched).
inline void checkRingProfiles(std::string const& key, std::vector<ProfileEntry> const& profiles, int32_t ringSlots)
{
    for (ProfileEntry const& p : profiles)
    {
        auto const d = p.dims.find(kRING_SLOTS);
        if (d == p.dims.end() || d->second.size() != 3 || d->second[0] != ringSlots || d->second[2] != ringSlots)
        {
            throw Error(DFL2_ERR_CORRUPT, "engine " + key + " profile '" + p.name + "' does not fix " + kRING_SLOTS
                    + " at the manifest's ring of " + std::to_string(ringSlots)
                    + " slots (rebuild with dflash2 build-engines)");
        }
    }
}

//! The sliding layers' K/V on the device, the twin of dflash2_trt/runtime/trt/device_buffers.py DeviceWindowRing
//! (with batch slots): 2 buffers per sliding layer [slots, heads, ringSlots, d] (batch row = slot: what a batched
//! target call binds; a slot's part [1, heads, ringSlots, d] is what a B = 1 call binds), bound in place as the
//! engine's past inputs, and the bookkeeping of core/windowRing.h (which position each ring slot holds: the
//! engine's window_positions; how deep a crop may go).
//! Ownership and lifetime: allocated once at the ring's size (memory per sliding layer is fixed, whatever the
//! context) and zeroed then (cudaMalloc memory is garbage; a NaN in a masked slot still NaNs its row), never moved
//! until release(): CUDA graphs that bound the rings stay valid. A call's new rows arrive in the engine's present
//! staging tensors [B, heads, S, d] and go to their ring slots by pitched 2-D copies (place(): per buffer at most
//! two runs, where the ring wraps), on the caller's stream, outside any captured graph. reset() and crop() change
//! the bookkeeping only: a slot whose position is -1 is masked, whatever it holds (finite: zeroed or engine-written).
struct DeviceWindowRing
{
    DeviceOps* ops{nullptr};
    int32_t layers{0}, heads{0}, headDim{0};  //!< sliding layers, kv heads, head dim
    size_t elem{0};                           //!< bytes of one element (the engine's past type)
    int32_t slots{1};
    std::vector<void*> ptrs;                  //!< 2 per sliding layer (key, value), [slots, heads, ringSlots, d]
    std::unique_ptr<WindowRingLog> log;

    bool active() const
    {
        return log != nullptr;
    }
    int32_t ringSlots() const
    {
        return log->spec().ringSlots;
    }
    size_t rowBytes() const
    {
        return static_cast<size_t>(headDim) * elem;
    }
    //! one slot's part of one buffer: [heads, ringSlots, d]
    size_t slotBytes() const
    {
        return static_cast<size_t>(heads) * static_cast<size_t>(ringSlots()) * rowBytes();
    }
    //! the buffers, zeroed on `stream`, and empty rings for `slotCount` sequences; plantedKeepCut: the tests'
    //! planted bug (core/windowRing.h)
    void allocate(SlidingWindowSpec const& spec, int32_t slotCount, bool plantedKeepCut, void* stream)
    {
        if (!ptrs.empty())
        {
            throw Error(DFL2_ERR_INTERNAL, "window rings allocated twice");
        }
        auto fresh = std::make_unique<WindowRingLog>(spec, slotCount, plantedKeepCut);
        slots = slotCount;
        size_t const bytes = static_cast<size_t>(slots) * static_cast<size_t>(heads)
            * static_cast<size_t>(spec.ringSlots) * rowBytes();
        try
        {
            for (size_t i = 0; i < static_cast<size_t>(2 * layers); ++i)
            {
                ptrs.push_back(ops->alloc(bytes));
                ops->zero(ptrs.back(), bytes, stream);
            }
        }
        catch (...)
        {
            release();
            throw;
        }
        log = std::move(fresh);
    }
    //! Buffer i's ring of `slot` ([1, heads, ringSlots, d] of its own: what a B = 1 call binds)
    void* slotPointer(size_t i, int32_t slot) const
    {
        if (slot < 0 || slot >= slots)
        {
            throw Error(DFL2_ERR_INTERNAL, "window ring slot " + std::to_string(slot) + " out of range");
        }
        return static_cast<char*>(ptrs[i]) + static_cast<size_t>(slot) * slotBytes();
    }
    //! [ringSlots] the window_positions of `slot`
    int64_t const* positions(int32_t slot) const
    {
        if (slot < 0 || slot >= slots)
        {
            throw Error(DFL2_ERR_INTERNAL, "window ring slot " + std::to_string(slot) + " out of range");
        }
        return log->positions(slot);
    }
    //! a new sequence in `slot`: an empty ring
    void reset(int32_t slot)
    {
        log->reset(slot);
    }
    //! present: 2 per sliding layer, [B, heads, S, d] contiguous; batch row b's first `rows` rows are `slot`'s
    //! positions start.. -> their ring slots (the last ringSlots of them)
    void place(std::vector<void*> const& present, int32_t S, int32_t b, int32_t slot, int32_t start, int32_t rows,
        void* stream)
    {
        if (present.size() != ptrs.size() || b < 0 || slot < 0 || slot >= slots || rows < 0 || rows > S || start < 0)
        {
            throw Error(DFL2_ERR_INTERNAL, "window ring: a call's rows do not fit its present tensors");
        }
        for (RingRun const& run : log->place(slot, start, rows))
        {
            for (size_t i = 0; i < ptrs.size(); ++i)
            {
                copyPresentRows(*ops, slotPointer(i, slot), ringSlots(), run.slot, present[i], S, b, run.first,
                    run.count, heads, rowBytes(), stream);
            }
        }
    }
    //! `slot` keeps positions < length (DFL2_ERR_INTERNAL when its ring no longer holds the keys the row at
    //! `length` needs: a crop deeper than a verify into the last call)
    void crop(int32_t slot, int32_t length)
    {
        log->crop(slot, length);
    }
    //! kv.WindowRing.snapshot: `slot`'s rings (rotated as they are) and positions into `snap`
    void snapshot(int32_t slot, TrtTargetSnapshot& snap, void* stream) const
    {
        snap.rings.assign(ptrs.size(), std::vector<char>(slotBytes()));
        for (size_t i = 0; i < ptrs.size(); ++i)
        {
            ops->copy2D(snap.rings[i].data(), slotBytes(), slotPointer(i, slot), slotBytes(), slotBytes(), 1, stream);
        }
        ops->sync(stream);
        std::tie(snap.positions, snap.floor) = log->snapshot(slot);
    }
    //! kv.WindowRing.restore: snapshot()'s rings and positions back into `slot`
    void restore(int32_t slot, TrtTargetSnapshot const& snap, void* stream)
    {
        if (snap.rings.size() != ptrs.size())
        {
            throw Error(DFL2_ERR_INTERNAL, "a ring snapshot of another target");
        }
        for (size_t i = 0; i < ptrs.size(); ++i)
        {
            ops->copy2D(slotPointer(i, slot), slotBytes(), snap.rings[i].data(), slotBytes(), slotBytes(), 1, stream);
        }
        ops->sync(stream);
        log->restore(slot, snap.positions, snap.floor);
    }
    void release() noexcept
    {
        for (void* p : ptrs)
        {
            ops->release(p);
        }
        ptrs.clear();
        log.reset();
    }
};

//! The host inputs of one batched target call (the target graph: input_ids / position_ids [B, S], attention_mask
//! [B, C + S], past K/V [B, heads, C, d] bound to a DeviceKV of batch >= B). Batch row = slot: the call runs
//! B = (the highest slot in it) + 1 rows over the cache's first B slots, so no KV is gathered; a slot in that range
//! that is not in the call rides along as padding (token 0 at position 0 seeing only itself; its outputs dropped).
//! Ragged: sequence i's rows[i] rows sit at its own positions cacheLength .. cacheLength + rows - 1, right-padded to
//! S = the longest; the mask lets each row see its slot's own cacheLength cached positions and (causally, in the
//! graph) its own new rows; padded rows see the same (finite, dropped).
struct RaggedBatch
{
    int32_t batch{0};                   //!< B
    int32_t rows{0};                    //!< S
    int32_t capacity{0};                //!< C
    std::vector<int64_t> inputIds;      //!< [B, S]
    std::vector<int64_t> positionIds;   //!< [B, S]
    std::vector<int64_t> attentionMask; //!< [B, C + S]

    //! Row of sequence `seq`'s j-th new row in [B * S] (logits / features / present rows)
    size_t row(SlotRows const& seq, int32_t j) const
    {
        return static_cast<size_t>(seq.slot) * static_cast<size_t>(rows) + static_cast<size_t>(j);
    }
};

//! `seqs` (distinct slots, rows >= 1, cacheLength + rows <= capacity) -> the call's inputs over `capacity` cached
//! positions per slot (the cache's current capacity: its pitch). `slots`: the cache's batch (slot < slots).
inline RaggedBatch planRaggedBatch(std::vector<SlotRows> const& seqs, int32_t capacity, int32_t slots)
{
    RaggedBatch rb;
    rb.capacity = capacity;
    std::vector<SlotRows const*> bySlot(static_cast<size_t>(std::max(0, slots)), nullptr);
    for (SlotRows const& s : seqs)
    {
        int32_t const n = static_cast<int32_t>(s.ids.size());
        if (s.slot < 0 || s.slot >= slots || bySlot[static_cast<size_t>(s.slot)] != nullptr || n < 1
            || s.cacheLength < 0 || s.cacheLength + n > capacity)
        {
            throw Error(DFL2_ERR_INTERNAL, "batched target call: slot " + std::to_string(s.slot) + " with "
                    + std::to_string(n) + " rows at " + std::to_string(s.cacheLength) + " does not fit "
                    + std::to_string(slots) + " slots of capacity " + std::to_string(capacity)
                    + " (or the slot appears twice)");
        }
        bySlot[static_cast<size_t>(s.slot)] = &s;
        rb.batch = std::max(rb.batch, s.slot + 1);
        rb.rows = std::max(rb.rows, n);
    }
    size_t const B = static_cast<size_t>(rb.batch);
    size_t const S = static_cast<size_t>(rb.rows);
    size_t const W = static_cast<size_t>(capacity) + S;
    rb.inputIds.assign(B * S, 0);
    rb.positionIds.assign(B * S, 0);
    rb.attentionMask.assign(B * W, 0);
    for (size_t b = 0; b < B; ++b)
    {
        SlotRows const* s = bySlot[b];
        size_t const n = s != nullptr ? s->ids.size() : 1;  // padding slot: one row
        int64_t const at = s != nullptr ? s->cacheLength : 0;
        for (size_t j = 0; j < S; ++j)
        {
            rb.inputIds[b * S + j] = s != nullptr && j < n ? s->ids[j] : 0;
            rb.positionIds[b * S + j] = at + static_cast<int64_t>(j);
            rb.attentionMask[b * W + static_cast<size_t>(capacity) + j] = j < n ? 1 : 0;
        }
        for (int64_t c = 0; c < at; ++c)
        {
            rb.attentionMask[b * W + static_cast<size_t>(c)] = 1;
        }
    }
    return rb;
}

//! The batch a target engine takes per call: the smallest upper end of its profiles' "batch" dim (1 without one) —
//! dflash2_trt.manifest.EngineSet.max_batch, read from the same profiles.
inline int32_t profilesMaxBatch(std::vector<ProfileEntry> const& profiles)
{
    int64_t m = -1;
    for (ProfileEntry const& p : profiles)
    {
        auto it = p.dims.find("batch");
        int64_t const hi = it != p.dims.end() && it->second.size() == 3 ? it->second[2] : 1;
        m = m < 0 ? hi : std::min(m, hi);
    }
    return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(m < 0 ? 1 : m, 1 << 20)));
}

inline std::string shapeString(std::vector<int64_t> const& s)
{
    std::ostringstream o;
    o << "(";
    for (size_t i = 0; i < s.size(); ++i)
    {
        o << (i ? ", " : "") << s[i];
    }
    o << ")";
    return o.str();
}

//! A buffer the runner sized from the manifest (`bufferShape`, its largest shape) must match the engine's
//! tensor shape (`engineDims`, -1 = dynamic) in rank and every static dim; else TensorRT could write past it.
inline void checkBindingShape(std::string const& engine, std::string const& tensor,
    std::vector<int64_t> const& engineDims, std::vector<int64_t> const& bufferShape)
{
    bool ok = engineDims.size() == bufferShape.size();
    for (size_t i = 0; ok && i < engineDims.size(); ++i)
    {
        ok = engineDims[i] < 0 || engineDims[i] == bufferShape[i];
    }
    if (!ok)
    {
        throw Error(DFL2_ERR_CORRUPT, "engine " + engine + ": tensor " + tensor + " has shape "
                + shapeString(engineDims) + ", the manifest implies " + shapeString(bufferShape)
                + ": the engines do not belong to this export (rebuild with dflash2 build-engines)");
    }
}

//! "10.3.0.30" -> {10, 3, 0, 30} (missing parts are absent)
inline std::vector<int32_t> versionParts(std::string const& v)
{
    std::vector<int32_t> parts;
    std::stringstream ss(v);
    std::string p;
    while (std::getline(ss, p, '.') && !p.empty() && std::isdigit(static_cast<unsigned char>(p[0])))
    {
        parts.push_back(std::atoi(p.c_str()));
    }
    return parts;
}

//! The libnvinfer that was opened must have the major version of the headers this library was compiled with:
//! TensorRT's C++ objects are virtual tables of one major (another major's would crash, not fail).
inline void checkLibraryMajor(int32_t builtMajor, int32_t loadedVersion)
{
    int32_t const major = loadedVersion / 10000;
    if (major != builtMajor)
    {
        throw Error(DFL2_ERR_UNAVAILABLE, "libnvinfer reports TensorRT " + std::to_string(major) + "."
                + std::to_string(loadedVersion / 100 % 100) + ", this libdflash2 was built against TensorRT "
                + std::to_string(builtMajor) + " headers: install TensorRT " + std::to_string(builtMajor)
                + " or rebuild libdflash2 against TensorRT " + std::to_string(major));
    }
}

//! Engines load only in the TensorRT that built them: the manifest's version (major.minor.patch[.build]) must
//! equal the loaded library's, part for part (`here` = major, minor, patch[, build] of the library).
inline void checkEngineVersion(std::string const& built, std::vector<int32_t> const& here, std::string const& dir)
{
    std::vector<int32_t> const b = versionParts(built);
    size_t const n = std::min(b.size(), here.size());
    bool same = n >= 3;
    for (size_t i = 0; same && i < n; ++i)
    {
        same = b[i] == here[i];
    }
    if (!same)
    {
        std::string h;
        for (size_t i = 0; i < here.size(); ++i)
        {
            h += (i ? "." : "") + std::to_string(here[i]);
        }
        throw Error(DFL2_ERR_VERSION_MISMATCH, "engines were built with TensorRT " + built + ", this is TensorRT " + h
                + " (TensorRT engines only load in the version that built them): rebuild them here with dflash2 "
                  "build-engines "
                + dir);
    }
}

//! A map bounded to `capacity` entries that drops the least recently used one (after `onEvict` saw its key)
//! when a new one would exceed it. Not thread safe (one per session).
template <typename V>
class LruMap
{
public:
    explicit LruMap(size_t capacity)
        : mCapacity(std::max<size_t>(1, capacity))
    {
    }
    //! The entry of `key` (now the most recently used), or nullptr.
    V* find(std::string const& key)
    {
        auto it = mIndex.find(key);
        if (it == mIndex.end())
        {
            return nullptr;
        }
        mOrder.splice(mOrder.end(), mOrder, it->second);
        return &it->second->second;
    }
    V& insert(std::string const& key, V value, std::function<void(std::string const&)> const& onEvict)
    {
        while (mIndex.size() >= mCapacity)
        {
            std::string const old = mOrder.front().first;
            onEvict(old);
            mIndex.erase(old);
            mOrder.pop_front();
            ++mEvicted;
        }
        mOrder.emplace_back(key, std::move(value));
        mIndex[key] = std::prev(mOrder.end());
        return mOrder.back().second;
    }
    size_t size() const
    {
        return mIndex.size();
    }
    size_t evicted() const
    {
        return mEvicted;
    }
    void clear()
    {
        mIndex.clear();
        mOrder.clear();
    }

private:
    size_t mCapacity;
    size_t mEvicted{0};
    std::list<std::pair<std::string, V>> mOrder; //!< least recently used first
    std::map<std::string, typename std::list<std::pair<std::string, V>>::iterator> mIndex;
};

} // namespace dflash2
