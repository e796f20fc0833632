//! \file trtParts.h
//! The parts of the TensorRT backend that need neither CUDA nor TensorRT headers, so that host tests run them
//! (runtime/tests/testTrtParts.cpp): the device KV cache over a CUDA seam, the binding-size check, the TensorRT
//! library / engine version rules and the bounded (LRU) cache of execution contexts.
#pragma once

#include "../core/decoder.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <list>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dflash2
{

//! What DeviceKV needs from CUDA: trtBackend.cpp implements it over cudart; the host test over memory that,
//! like cudaMalloc's, starts as garbage. `stream` is a cudaStream_t.
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

//! One request's KV cache on the device: 2 buffers per layer [1, heads, capacity, d].
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

    size_t rowBytes() const
    {
        return static_cast<size_t>(headDim) * elem;
    }
    size_t bufferBytes(int32_t cap) const
    {
        return static_cast<size_t>(heads) * static_cast<size_t>(cap) * rowBytes();
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
            for (size_t i = 0; i < ptrs.size() && length > 0; ++i) // keep slots 0..length-1, head by head
            {
                ops->copy2D(fresh[i], static_cast<size_t>(cap) * rowBytes(), ptrs[i],
                    static_cast<size_t>(capacity) * rowBytes(), static_cast<size_t>(length) * rowBytes(),
                    static_cast<size_t>(heads), stream);
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
    //! present [1, heads, S, d] (contiguous) -> slots length..length+S-1
    void append(std::vector<void*> const& present, int32_t S, void* stream)
    {
        if (length + S > capacity)
        {
            throw Error(DFL2_ERR_INTERNAL, "KV append past the reserved capacity");
        }
        for (size_t i = 0; i < ptrs.size(); ++i)
        {
            ops->copy2D(static_cast<char*>(ptrs[i]) + static_cast<size_t>(length) * rowBytes(),
                static_cast<size_t>(capacity) * rowBytes(), present[i], static_cast<size_t>(S) * rowBytes(),
                static_cast<size_t>(S) * rowBytes(), static_cast<size_t>(heads), stream);
        }
        length += S;
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
