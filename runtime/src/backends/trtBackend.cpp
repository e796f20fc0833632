//! \file trtBackend.cpp
//! The TensorRT backend of libdflash2: the engines that `dflash2 build-engines` wrote, run from C++.
//!
//! STATUS: NEVER RUN. It is compiled (with -Werror) against the TensorRT 10.14 headers of the kernel-lens wheel
//! and the CUDA toolkit's runtime headers on machines without a GPU or TensorRT libraries; the logic mirrors
//! dflash2_trt/runtime/trt/backend.py (itself tested on the CPU against recording fakes). Run the GPU check
//! (runtime/README.md) before relying on it.
//!
//! libnvinfer is not linked: it is dlopen'ed at model load, and only as libnvinfer.so.<the major of the headers
//! this file was compiled with>, so the library loads and reports DFL2_ERR_UNAVAILABLE on hosts without that
//! TensorRT. A libnvinfer whose getInferLibVersion() reports another major is refused (UNAVAILABLE: its objects
//! are another major's virtual tables); the engines' TensorRT version must equal the library's
//! (major.minor.patch.build, VERSION_MISMATCH). Both are checked before CUDA is touched. CUDA runtime:
//! cudart_static. The parts without CUDA or TensorRT (KV cache, size and version checks, context LRU) live in
//! trtParts.h and are tested on the host.
//!
//! Ownership and lifetime:
//! * TrtModel (one per dfl2_model) owns the IRuntime, the deserialized ICudaEngines and the loaded plugin library;
//!   engines are immutable and shared by the sessions.
//! * TrtRunners (one per dfl2_session) owns everything mutable: its CUDA stream, one scratch allocation per engine
//!   (USER_MANAGED device memory), execution contexts, fixed I/O buffers with pinned host mirrors, the target and
//!   draft KV caches, and its CUDA graphs. Contexts of captured shape buckets are bounded per engine
//!   (kMAX_CAPTURED_CONTEXTS, least recently used dropped with the graphs that used it).
//! * Thread safety: the sessions of one model generate one at a time (Model::generateLock): their contexts share
//!   the engines' optimization profiles, and TensorRT does not promise that contexts of one engine may run one
//!   profile concurrently; execution contexts are therefore also created one at a time.
//! * I/O buffers are allocated once at their largest shape and never move, so captured graphs stay valid; KV
//!   caches move only when they grow past their capacity bucket (kv_capacity_step): every graph is then dropped
//!   before the old buffers are freed. One graph per (step, profile, shape, capacity); a context that a graph
//!   captured is never re-shaped (each shape bucket has its own context). Capture failure -> eager from then on.
//! * The verify step (target rows <= block size) and the draft step (block + head engines) are captured; prefill
//!   and long context updates run eagerly in chunks of the prefill profile's rows.
//! * TrtBatchRunners (one per dfl2_batch; see its comment) owns the batch's stream, the target's scratch, contexts
//!   and I/O buffers, one KV cache [slots, heads, capacity, d] per layer (ragged: each slot its own length) and one
//!   drafter-only TrtRunners per slot. The target runs eagerly (no graphs); the drafters capture as sessions do.
//! * A hybrid target (manifest version 3: "linear" Gated DeltaNet layers beside "attention" layers) takes every
//!   layer's state in layer order (KV of an attention layer; past_conv / past_recurrent of a linear one) and
//!   state_rows, in calls of at most max_rows_per_call rows. Its linear state is a DeviceLinearState (per runner:
//!   one row per session, or per batch slot), allocated once; after a call and on a crop into it the kept row's
//!   window and recurrent state are device copies from the call's present_conv / present_recurrent outputs, as
//!   core/linearState.h says (the ONNX Runtime backend's rule, the Python LinearStates').
//! * A sliding-window target (manifest version 3: "sliding" layers, gpt-oss and Muse Glimmer) keeps its sliding
//!   layers' K/V in a DeviceWindowRing (trtParts.h; per runner: one ring per session, or one per batch slot):
//!   [slots, heads, ring_slots, d] per buffer, allocated once and zeroed, bound in place as the layers' past inputs
//!   (the engines' ring_slots dim is fixed at the ring's size by build-engines), never moved, so captured graphs stay
//!   valid. A call's window_positions (the ring's bookkeeping, core/windowRing.h) go up with its ids; its new rows
//!   come back in present staging buffers and are copied into their ring slots after it (outside the graph); a crop
//!   only drops the cut rows' slots (the rule of the ONNX Runtime backend's rings and the Python DeviceWindowRing).
#include "../core/linearState.h"
#include "../core/prefixCache.h"
#include "../model.h"
#include "trtParts.h"

#include <NvInferRuntime.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace dflash2
{

namespace
{

namespace nv = nvinfer1;

void cudaCheck(cudaError_t e, char const* what)
{
    if (e != cudaSuccess)
    {
        throw Error(DFL2_ERR_BACKEND, std::string(what) + ": " + cudaGetErrorString(e));
    }
}

class Logger : public nv::ILogger
{
public:
    void log(Severity severity, nv::AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kWARNING)
        {
            std::fprintf(stderr, "[dflash2 TensorRT] %s\n", msg);
        }
    }
};

size_t elementSize(nv::DataType t)
{
    switch (t)
    {
    case nv::DataType::kFLOAT: return 4;
    case nv::DataType::kHALF: return 2;
    case nv::DataType::kBF16: return 2;
    case nv::DataType::kINT32: return 4;
    case nv::DataType::kINT64: return 8;
    case nv::DataType::kINT8: return 1;
    case nv::DataType::kUINT8: return 1;
    case nv::DataType::kBOOL: return 1;
    default: throw Error(DFL2_ERR_BACKEND, "unsupported TensorRT tensor type");
    }
}

int64_t volume(std::vector<int64_t> const& shape)
{
    int64_t n = 1;
    for (int64_t s : shape)
    {
        n *= s;
    }
    return n;
}

nv::Dims dimsOf(std::vector<int64_t> const& shape)
{
    nv::Dims d{};
    d.nbDims = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i)
    {
        d.d[i] = shape[i];
    }
    return d;
}

//! The TensorRT library, loaded at run time: libnvinfer.so.<built major> only, and only when it reports that
//! major (a TensorRT of another major has other virtual tables: a crash, not an error).
struct NvInferLib
{
    void* handle{nullptr};
    void* (*createRuntime)(void*, int32_t){nullptr};
    int32_t version{0};          //!< getInferLibVersion(): major * 10000 + minor * 100 + patch
    std::vector<int32_t> parts;  //!< major, minor, patch[, build]

    template <typename Fn>
    Fn symbol(char const* name) const
    {
        void* sym = ::dlsym(handle, name);
        Fn fn{};
        std::memcpy(&fn, &sym, sizeof(fn)); // a cast from void* is not portable C++
        return fn;
    }

    NvInferLib()
    {
        std::string const soname = "libnvinfer.so." + std::to_string(NV_TENSORRT_MAJOR);
        handle = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL);
        if (handle == nullptr)
        {
            throw Error(DFL2_ERR_UNAVAILABLE, "TensorRT " + std::to_string(NV_TENSORRT_MAJOR)
                    + " is not installed here (" + soname + " not found): install TensorRT "
                    + std::to_string(NV_TENSORRT_MAJOR) + ".x >= 10.3 (JetPack 6.2 on Jetson)");
        }
        createRuntime = symbol<void* (*) (void*, int32_t)>("createInferRuntime_INTERNAL");
        auto libVersion = symbol<int32_t (*)()>("getInferLibVersion");
        if (createRuntime == nullptr || libVersion == nullptr)
        {
            throw Error(DFL2_ERR_UNAVAILABLE, soname + " lacks createInferRuntime_INTERNAL / getInferLibVersion");
        }
        version = libVersion();
        checkLibraryMajor(NV_TENSORRT_MAJOR, version);
        parts = {version / 10000, version / 100 % 100, version % 100};
        if (auto build = symbol<int32_t (*)()>("getInferLibBuildVersion"))
        {
            parts.push_back(build());
        }
    }
    NvInferLib(NvInferLib const&) = delete;
    NvInferLib& operator=(NvInferLib const&) = delete;
    ~NvInferLib()
    {
        // kept loaded: TensorRT objects of other models may still live in this process
    }
};

//! DeviceOps over the CUDA runtime. Copies take their direction from the pointers (cudaMemcpyDefault, unified
//! addressing): device to device for the caches' growth and placement, host to device and back for the prefix
//! cache's copies (DeviceKV::rowsOf / loadRows, DeviceWindowRing::snapshot / restore).
class CudaOps : public DeviceOps
{
public:
    void* alloc(size_t bytes) override
    {
        void* p = nullptr;
        cudaCheck(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc KV");
        return p;
    }
    void release(void* p) noexcept override
    {
        cudaFree(p);
    }
    void zero(void* p, size_t bytes, void* stream) override
    {
        cudaCheck(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)), "KV zero");
    }
    void copy2D(void* dst, size_t dpitch, void const* src, size_t spitch, size_t width, size_t height,
        void* stream) override
    {
        if (width != 0 && height != 0)
        {
            cudaCheck(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault,
                          static_cast<cudaStream_t>(stream)),
                "KV copy");
        }
    }
    void sync(void* stream) override
    {
        cudaCheck(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "KV sync");
    }
};

std::vector<int64_t> dimsVector(nv::Dims const& d)
{
    return std::vector<int64_t>(d.d, d.d + std::max(0, d.nbDims));
}

std::vector<char> readFile(std::string const& path)
{
    std::ifstream f(path, std::ios::binary);
    if (!f)
    {
        throw Error(DFL2_ERR_NOT_FOUND, path + " cannot be read");
    }
    return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

//! A deserialized engine: names, modes, types and its profiles from the manifest.
struct Engine
{
    std::string key;
    std::unique_ptr<nv::ICudaEngine> engine;
    std::vector<ProfileEntry> profiles;
    std::vector<std::string> names;
    std::map<std::string, nv::DataType> types;
    std::map<std::string, bool> isInput;
    int32_t auxStreams{0}; //!< > 0: never captured (a failed capture could leave TensorRT's own streams capturing)

    int32_t profileIndex(std::string const& name) const
    {
        for (size_t i = 0; i < profiles.size(); ++i)
        {
            if (profiles[i].name == name)
            {
                return static_cast<int32_t>(i);
            }
        }
        throw Error(DFL2_ERR_CORRUPT, "engine " + key + " has no '" + name + "' optimization profile");
    }
    int64_t maxDim(std::string const& profile, std::string const& dim) const
    {
        auto const& dims = profiles[static_cast<size_t>(profileIndex(profile))].dims;
        auto it = dims.find(dim);
        if (it == dims.end())
        {
            throw Error(DFL2_ERR_CORRUPT, "engine " + key + " profile " + profile + " has no dim " + dim);
        }
        return it->second[2];
    }
};

class TrtModel;

//! One device buffer at its largest shape, with an optional pinned host mirror of the same size.
struct IOTensor
{
    nv::DataType type{nv::DataType::kFLOAT};
    size_t bytes{0};
    void* dev{nullptr};
    void* host{nullptr};
};

//! Frees every tensor of ``io`` (device buffer, pinned host mirror) and empties it; the runners' releases.
void freeIo(std::map<std::string, IOTensor>& io) noexcept
{
    for (auto& [name, tensor] : io)
    {
        cudaFree(tensor.dev);
        if (tensor.host != nullptr)
        {
            cudaFreeHost(tensor.host);
        }
    }
    io.clear();
}

//! name -> device address of every tensor of ``io``: the bindings a call starts from.
std::map<std::string, void*> deviceAddresses(std::map<std::string, IOTensor> const& io)
{
    std::map<std::string, void*> addr;
    for (auto const& [name, tensor] : io)
    {
        addr[name] = tensor.dev;
    }
    return addr;
}

//! One sequence's cache ``kv`` bound as the inputs ``names`` (K and V per layer), each [1, heads, C, headDim].
void bindCache(DeviceKV const& kv, std::vector<std::string> const& names, int32_t C,
    std::map<std::string, std::vector<int64_t>>& shapes, std::map<std::string, void*>& addr)
{
    for (size_t i = 0; i < names.size(); ++i)
    {
        shapes[names[i]] = {1, kv.heads, C, kv.headDim};
        addr[names[i]] = kv.ptrs[i];
    }
}

//! Destroys ``stream`` (if any) and leaves it null.
void destroyStream(cudaStream_t& stream) noexcept
{
    if (stream != nullptr)
    {
        cudaStreamDestroy(stream);
        stream = nullptr;
    }
}

//! Writes 0..n-1 / ids / masks into a host mirror in the engine's integer type.
void writeInts(IOTensor const& t, size_t offset, int64_t const* values, size_t n)
{
    if (t.type == nv::DataType::kINT64)
    {
        std::memcpy(static_cast<int64_t*>(t.host) + offset, values, n * sizeof(int64_t));
        return;
    }
    if (t.type == nv::DataType::kINT32)
    {
        for (size_t i = 0; i < n; ++i)
        {
            static_cast<int32_t*>(t.host)[offset + i] = static_cast<int32_t>(values[i]);
        }
        return;
    }
    throw Error(DFL2_ERR_BACKEND, "integer engine input of an unsupported type");
}

float readFloat(IOTensor const& t, size_t i)
{
    switch (t.type)
    {
    case nv::DataType::kFLOAT: return static_cast<float const*>(t.host)[i];
    case nv::DataType::kHALF: return __half2float(static_cast<__half const*>(t.host)[i]);
    default: throw Error(DFL2_ERR_BACKEND, "floating engine output of an unsupported type");
    }
}

int32_t readInt(IOTensor const& t, size_t i)
{
    return t.type == nv::DataType::kINT64 ? static_cast<int32_t>(static_cast<int64_t const*>(t.host)[i])
                                          : static_cast<int32_t const*>(t.host)[i];
}

//! StateCopy over device memory: copies enqueued on one stream (ordered with the target calls).
class CudaStateCopy : public StateCopy
{
public:
    explicit CudaStateCopy(cudaStream_t stream)
        : mStream(stream)
    {
    }
    void copy2D(void* dst, size_t dstPitch, void const* src, size_t srcPitch, size_t width, size_t height) override
    {
        if (width != 0 && height != 0)
        {
            cudaCheck(cudaMemcpy2DAsync(dst, dstPitch, src, srcPitch, width, height, cudaMemcpyDeviceToDevice, mStream),
                "linear state copy");
        }
    }

private:
    cudaStream_t mStream;
};

//! A hybrid target's linear layers' state on the device (core/linearState.h): per linear layer the window and
//! recurrent state of `slots` sequences ([slots, conv_dim, K - 1], [slots, heads, dk, dv]: batch row = slot, what
//! the target is fed) and their copies from before each slot's last call, allocated once and zeroed; the last call's
//! outputs are the target's present_conv.{i} / present_recurrent.{i} I/O buffers. The rollback bookkeeping is the
//! core's LinearStateLog; only the copies are here.
struct DeviceLinearState
{
    LinearStateSpec spec;
    int32_t slots{0};
    size_t convElem{4};
    size_t recurrentElem{4};
    std::vector<int32_t> layers;  //!< the linear layers' indices
    std::vector<void*> window, recurrent, windowBefore, recurrentBefore;  //!< per linear layer, [slots, ...]
    std::unique_ptr<LinearStateLog> log;

    bool active() const
    {
        return log != nullptr;
    }
    size_t windowBytes() const
    {
        return spec.windowElements() * convElem;
    }
    size_t recurrentBytes() const
    {
        return spec.recurrentElements() * recurrentElem;
    }
    //! the buffers (zeroed) for the linear layers of `m`, element types from the target engine `te`
    void allocate(Manifest const& m, Engine const& te, int32_t slotCount, cudaStream_t stream);
    void release() noexcept
    {
        for (auto* v : {&window, &recurrent, &windowBefore, &recurrentBefore})
        {
            for (void* p : *v)
            {
                cudaFree(p);
            }
            v->clear();
        }
        log.reset();
    }
    //! a new sequence in `slot`: zero state, no call to roll back into
    void reset(int32_t slot, cudaStream_t stream)
    {
        for (size_t l = 0; l < layers.size(); ++l)
        {
            cudaCheck(cudaMemsetAsync(slotPart(window[l], windowBytes(), slot), 0, windowBytes(), stream), "zero window");
            cudaCheck(cudaMemsetAsync(slotPart(recurrent[l], recurrentBytes(), slot), 0, recurrentBytes(), stream),
                "zero recurrent state");
        }
        log->reset(slot);
    }
    //! linear layer l of `slot`, whose last call's outputs (over `pitch` columns, `stateRows` states per sequence)
    //! sit at batch row `row` of the target's I/O buffers `io`
    LinearLayerState view(std::map<std::string, IOTensor>& io, size_t l, int32_t slot, int32_t row, int32_t pitch,
        int32_t stateRows)
    {
        std::string const n = std::to_string(layers[l]);
        size_t const inputsBytes = static_cast<size_t>(spec.convDim) * static_cast<size_t>(pitch) * convElem;
        size_t const statesBytes = static_cast<size_t>(stateRows) * recurrentBytes();
        return LinearLayerState{slotPart(window[l], windowBytes(), slot), slotPart(recurrent[l], recurrentBytes(), slot),
            slotPart(windowBefore[l], windowBytes(), slot), slotPart(recurrentBefore[l], recurrentBytes(), slot),
            slotPart(io.at("present_conv." + n).dev, inputsBytes, row),
            slotPart(io.at("present_recurrent." + n).dev, statesBytes, row), convElem, recurrentElem};
    }
    //! a call left `rows` rows of `slot` (from position `start`) at batch row `row` of its outputs: the state after
    //! them (copies on `stream`)
    void called(std::map<std::string, IOTensor>& io, int32_t slot, int32_t row, int32_t start, int32_t rows,
        int32_t pitch, bool everyRow, cudaStream_t stream)
    {
        KeptState const kept = log->called(slot, start, rows, pitch, everyRow);
        CudaStateCopy copy(stream);
        for (size_t l = 0; l < layers.size(); ++l)
        {
            LinearLayerState const v = view(io, l, slot, row, pitch, everyRow ? pitch : 1);
            saveBefore(v, spec, copy);
            applyKept(v, spec, kept, copy);
        }
    }
    //! the prefix cache's snapshot (linear_state.LinearState.snapshot): `slot`'s windows and recurrent states into
    //! `snap`, on the host
    void snapshot(int32_t slot, TrtTargetSnapshot& snap, cudaStream_t stream) const
    {
        snap.windows.assign(layers.size(), std::vector<char>(windowBytes()));
        snap.recurrents.assign(layers.size(), std::vector<char>(recurrentBytes()));
        for (size_t l = 0; l < layers.size(); ++l)
        {
            cudaCheck(cudaMemcpyAsync(snap.windows[l].data(), slotPart(window[l], windowBytes(), slot), windowBytes(),
                          cudaMemcpyDeviceToHost, stream),
                "D2H linear window");
            cudaCheck(cudaMemcpyAsync(snap.recurrents[l].data(), slotPart(recurrent[l], recurrentBytes(), slot),
                          recurrentBytes(), cudaMemcpyDeviceToHost, stream),
                "D2H recurrent state");
        }
        cudaCheck(cudaStreamSynchronize(stream), "linear state snapshot");
    }
    //! snapshot()'s state back into `slot`, a new sequence there: no call to roll back into
    void restore(int32_t slot, TrtTargetSnapshot const& snap, cudaStream_t stream)
    {
        if (snap.windows.size() != layers.size() || snap.recurrents.size() != layers.size())
        {
            throw Error(DFL2_ERR_INTERNAL, "a linear state snapshot of another target");
        }
        for (size_t l = 0; l < layers.size(); ++l)
        {
            cudaCheck(cudaMemcpyAsync(slotPart(window[l], windowBytes(), slot), snap.windows[l].data(), windowBytes(),
                          cudaMemcpyHostToDevice, stream),
                "H2D linear window");
            cudaCheck(cudaMemcpyAsync(slotPart(recurrent[l], recurrentBytes(), slot), snap.recurrents[l].data(),
                          recurrentBytes(), cudaMemcpyHostToDevice, stream),
                "H2D recurrent state");
        }
        cudaCheck(cudaStreamSynchronize(stream), "linear state restore");
        log->reset(slot);
    }
    //! `slot` keeps positions 0..length-1, before the end of its last call (a recorded one: batch row = slot)
    void crop(std::map<std::string, IOTensor>& io, int32_t slot, int32_t length, cudaStream_t stream)
    {
        std::optional<KeptState> const kept = log->crop(slot, length);
        if (!kept)
        {
            return;
        }
        CudaStateCopy copy(stream);
        for (size_t l = 0; l < layers.size(); ++l)
        {
            applyKept(view(io, l, slot, slot, kept->inputsPitch, kept->inputsPitch), spec, *kept, copy);
        }
    }

private:
    static void* slotPart(void* base, size_t bytes, int32_t slot)
    {
        return static_cast<char*>(base) + static_cast<size_t>(slot) * bytes;
    }
};

void DeviceLinearState::allocate(Manifest const& m, Engine const& te, int32_t slotCount, cudaStream_t stream)
{
    spec = m.linearState;
    slots = slotCount;
    for (int32_t i = 0; i < m.targetLayers; ++i)
    {
        if (m.isLinear(i))
        {
            layers.push_back(i);
        }
    }
    std::string const first = std::to_string(layers.at(0));
    convElem = elementSize(te.types.at("past_conv." + first));
    recurrentElem = elementSize(te.types.at("past_recurrent." + first));
    auto const alloc = [&](std::vector<void*>& to, size_t bytes) {
        void* p = nullptr;
        cudaCheck(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc linear state");
        to.push_back(p);
        cudaCheck(cudaMemsetAsync(p, 0, bytes, stream), "zero linear state");
    };
    size_t const n = static_cast<size_t>(slots);
    for (size_t l = 0; l < layers.size(); ++l)
    {
        alloc(window, n * windowBytes());
        alloc(recurrent, n * recurrentBytes());
        alloc(windowBefore, n * windowBytes());
        alloc(recurrentBefore, n * recurrentBytes());
    }
    log = std::make_unique<LinearStateLog>(spec.window(), slots, plantedLinearRollback());
}

class TrtModel : public Model
{
public:
    TrtModel(Manifest const& m, std::string const& dir, Options const& options);
    ~TrtModel() override
    {
        mEngines.clear();  // engines before the runtime
        mRuntime.reset();
    }
    std::unique_ptr<Runners> newRunners() override;
    //! `slots` <= maxBatch (the target engine's profiles' batch): TrtBatchRunners.
    std::unique_ptr<BatchRunners> newBatchRunners(int32_t slots) override;
    //! Sessions of one model generate one at a time (see the file comment).
    std::mutex* generateLock() override
    {
        return &mGenerateLock;
    }

    Engine const& engine(std::string const& key) const
    {
        auto it = mEngines.find(key);
        if (it == mEngines.end())
        {
            throw Error(DFL2_ERR_CORRUPT, "no TensorRT engine for graph '" + key + "'");
        }
        return *it->second;
    }

    Manifest manifest;
    std::string headKeyUsed;
    int device{0};
    bool cudaGraphs{true};

private:
    //! one plan deserialized: its tensors' names, types and directions, its aux streams (fp32 / fp16 logits only)
    std::unique_ptr<Engine> loadEngine(std::string const& key, PlanEntry const& plan, std::string const& dir);

    NvInferLib mLib;
    Logger mLogger;
    std::mutex mGenerateLock;
    std::unique_ptr<nv::IRuntime> mRuntime;
    std::map<std::string, std::unique_ptr<Engine>> mEngines;
};

// ---- prefix reuse (core/prefixCache.h): host copies of a slot's device state, for both runners ------------------

//! a copy of `slot`'s non-croppable state: its linear layers' and rings' (nullptr: an attention-only target)
std::shared_ptr<TargetSnapshot const> targetSnapshotOf(
    DeviceLinearState const& linear, DeviceWindowRing const& ring, int32_t slot, cudaStream_t stream)
{
    if (!linear.active() && !ring.active())
    {
        return nullptr;
    }
    auto snap = std::make_shared<TrtTargetSnapshot>();
    if (linear.active())
    {
        linear.snapshot(slot, *snap, stream);
    }
    if (ring.active())
    {
        ring.snapshot(slot, *snap, stream);
    }
    return snap;
}

//! targetSnapshotOf's copy back into `slot` (nothing for an attention-only target)
void restoreTargetState(
    DeviceLinearState& linear, DeviceWindowRing& ring, int32_t slot, TargetSnapshot const* state, cudaStream_t stream)
{
    if (!linear.active() && !ring.active())
    {
        return;
    }
    if (state == nullptr)
    {
        throw Error(DFL2_ERR_INTERNAL, "a prefix restore of a stateful target without its state");
    }
    auto const& snap = dynamic_cast<TrtTargetSnapshot const&>(*state);
    if (linear.active())
    {
        linear.restore(slot, snap, stream);
    }
    if (ring.active())
    {
        ring.restore(slot, snap, stream);
    }
}

//! The first n positions of a sequence (`slot` of `target`, holding `length`): its K/V rows; with a drafter (`draft`
//! non-null) its context rows and the queued features (`pending`, `pendingRows` of `rowBytes`) of positions past them
std::shared_ptr<PrefixCopy const> hostPrefixCopy(DeviceKV const& target, int32_t slot, int32_t length, int32_t n,
    DeviceKV const* draft, std::vector<char> const& pending, int32_t pendingRows, size_t rowBytes, cudaStream_t stream)
{
    auto c = std::make_shared<HostPrefixCopy>();
    c->n = std::min(n, length);
    c->target = target.rowsOf(slot, c->n, stream);
    if (draft != nullptr)
    {
        c->m = std::min(c->n, draft->length);
        c->drafter = draft->rowsOf(0, c->m, stream);
        c->k = std::min(pendingRows, c->n - c->m);
        c->features.assign(pending.begin(), pending.begin() + static_cast<long>(static_cast<size_t>(c->k) * rowBytes));
    }
    return c;
}

//! The model's sizes for a runner interface (Runners, BatchRunners): both TensorRT runners read them from it.
template <typename Base>
class TrtShapes : public SizedRunners<Base>
{
public:
    explicit TrtShapes(TrtModel& model)
        : SizedRunners<Base>(RunnerSizes::of(model))
        , mModel(model)
    {
    }

protected:
    TrtModel& mModel;
};

class TrtRunners : public TrtShapes<Runners>
{
public:
    //! withTarget false: the drafter engines only (one slot's drafter in TrtBatchRunners; no target buffers, and
    //! the target calls must not be used)
    explicit TrtRunners(TrtModel& model, bool withTarget = true);
    ~TrtRunners() override;
    TrtRunners(TrtRunners const&) = delete;
    TrtRunners& operator=(TrtRunners const&) = delete;

    void targetReset() override
    {
        // every generate starts here; the CUDA device is per thread and a session may move between threads
        cudaCheck(cudaSetDevice(mModel.device), "cudaSetDevice");
        mTargetKV.length = 0;
        if (mLinear.active())
        {
            mLinear.reset(0, mStream);
        }
        if (mRing.active())
        {
            mRing.reset(0);
        }
    }
    void targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits) override;
    //! the KV by its length; a hybrid target's linear state rolled back into the last call (device copies); a
    //! sliding target's rings drop the cut rows' slots
    void targetCrop(int32_t length) override
    {
        int32_t const keep = std::max(0, length);
        if (mLinear.active() && keep < mTargetKV.length)
        {
            mLinear.crop(mTio, 0, keep, mStream);
        }
        if (mRing.active() && keep < mTargetKV.length)
        {
            mRing.crop(0, keep);
        }
        mTargetKV.length = std::min(mTargetKV.length, keep);
    }
    void drafterReset() override
    {
        mDraftKV.length = 0;
        mPending.clear();
        mPendingRows = 0;
    }
    void drafterQueueContext(int32_t rows) override;
    void drafterAddContext(int32_t start) override;
    void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out) override;
    //! features [rows, F] (the target engine's raw bytes, host) of positions start.. join the draft context
    void drafterAddFeatures(char const* feats, int32_t rows, int32_t start);
    //! one feature row's bytes
    size_t featureRowBytes() const
    {
        return static_cast<size_t>(mFeatDim) * mFeatElem;
    }

    // ---- prefix reuse (core/prefixCache.h): TrtTargetRunner.prefix_state / restore_prefix and TrtDraftRunner's
    // context_rows / restore_context (dflash2_trt/runtime/trt/backend.py), host copies of the device caches
    bool keepsPrefix() const override
    {
        return true;
    }
    int32_t targetLength() const override
    {
        return mTargetKV.length;
    }
    std::shared_ptr<TargetSnapshot const> targetSnapshot() override
    {
        return targetSnapshotOf(mLinear, mRing, 0, mStream);
    }
    void targetRestore(int32_t length, TargetSnapshot const* state) override
    {
        if (length < 0 || length > mTargetKV.length)
        {
            throw Error(DFL2_ERR_INTERNAL, "a prefix restore to length " + std::to_string(length) + " of a target at "
                    + std::to_string(mTargetKV.length));
        }
        mTargetKV.length = length;
        mFeatureRows = 0;
        restoreTargetState(mLinear, mRing, 0, state, mStream);
    }
    int32_t drafterLength() const override
    {
        return mDraftKV.length + mPendingRows;
    }
    void drafterRestore(int32_t length) override
    {
        restoreDrafterContext(length, mDraftKV.length, mPending, mPendingRows, featureRowBytes(),
            [this](int32_t start) { drafterAddContext(start); });  // the queue's missing positions, in one pass
    }
    std::shared_ptr<PrefixCopy const> prefixCopy(int32_t n, bool drafter) const override
    {
        return hostPrefixCopy(mTargetKV, 0, mTargetKV.length, n, drafter ? &mDraftKV : nullptr, mPending, mPendingRows,
            featureRowBytes(), mStream);
    }
    void prefixRestore(PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter) override
    {
        auto const& c = dynamic_cast<HostPrefixCopy const&>(rows);
        if (mTargetKV.reserve(c.n, mStream))
        {
            dropGraphs();
        }
        mTargetKV.loadRows(c.target, c.n, 0, mStream);
        mTargetKV.length = c.n;
        targetRestore(length, state);
        if (drafter)
        {
            drafterLoad(c, length);
        }
    }
    //! the drafter's context (just reset) holds a copy's positions < length: its context rows and queued features
    //! loaded, then drafterRestore's rule (the ONNX Runtime runner's prefixRestore does the same)
    void drafterLoad(HostPrefixCopy const& c, int32_t length)
    {
        if (mDraftKV.reserve(c.m, mStream))
        {
            dropGraphs();
        }
        mDraftKV.loadRows(c.drafter, c.m, 0, mStream);
        mDraftKV.length = c.m;
        mPending = c.features;
        mPendingRows = c.k;
        drafterRestore(length);
    }
    DeviceKV const& draftKV() const
    {
        return mDraftKV;
    }

    //! io[name]: a device buffer of maxShape (checked against the engine's static dims), + a pinned host mirror
    static IOTensor& tensor(std::map<std::string, IOTensor>& io, Engine const& e, std::string const& name,
        std::vector<int64_t> const& maxShape, bool host);
    //! sets the input shapes (reshape) and binds every I/O tensor of `e` from `addr`
    static void bind(Engine const& e, nv::IExecutionContext& ctx,
        std::map<std::string, std::vector<int64_t>> const& shapes, std::map<std::string, void*> const& addr,
        bool reshape);

private:
    void setUp();
    void setUpTarget(int32_t maxCap);
    void setUpDrafter(int32_t maxCap);
    void releaseAll() noexcept;
    //! The context of (engine, profile, bucket): "eager" / "fixed" buckets are kept for the session, captured
    //! shape buckets are bounded per engine (LRU; an evicted context's graphs are destroyed first).
    nv::IExecutionContext& context(Engine const& e, int32_t profile, std::string const& bucket, bool captured);
    std::unique_ptr<nv::IExecutionContext> newContext(Engine const& e, int32_t profile);
    void enqueue(Engine const& e, nv::IExecutionContext& ctx);
    //! runs `step` as a CUDA graph keyed by `key` (captured on first use), or eagerly
    //! `contexts`: the context keys the step uses (an evicted context takes its graphs with it)
    template <typename F>
    void runStep(std::string const& key, bool capturable, std::vector<std::string> const& contexts, F&& step);
    void dropGraphs();
    void dropGraphsOf(std::string const& contextKey);
    //! S target rows; a hybrid target's call asks every row's state (everyRow) or its last row's
    void targetCall(int32_t const* ids, int32_t S, bool everyRow, float* logits, std::vector<char>& feats);
    void writeDraftInputs(int32_t anchor, int32_t pos, int32_t C, float temperature, float const* uniforms);
    void readDraft(Draft& out);
    void writeTargetInputs(int32_t const* ids, int32_t S, int32_t n, int32_t C);
    void keepTargetRows(int32_t n, int32_t S, bool everyRow);
    void contextCall(char const* feats, int32_t m, int32_t start);

    bool mWithTarget{true};
    cudaStream_t mStream{nullptr};
    std::map<std::string, void*> mScratch;                   //!< per engine key
    CudaOps mOps;
    std::map<std::string, std::unique_ptr<nv::IExecutionContext>> mContexts;  //!< eager / fixed, per (engine, profile)
    std::map<std::string, LruMap<std::unique_ptr<nv::IExecutionContext>>> mCaptured; //!< per engine: bucket contexts
    std::map<std::string, cudaGraphExec_t> mGraphs;
    std::map<std::string, std::vector<std::string>> mGraphContexts; //!< graph key -> context keys it uses
    bool mGraphsOk{true};
    std::map<std::string, IOTensor> mTio, mCio, mBio, mHio;  //!< target, context, block, head I/O
    DeviceKV mTargetKV, mDraftKV;
    DeviceLinearState mLinear;  //!< a hybrid target's linear layers (inactive otherwise)
    DeviceWindowRing mRing;     //!< a sliding-window target's sliding layers (inactive otherwise)
    std::vector<std::string> mTargetPast, mTargetPresent, mDraftKVNames;
    int64_t mTargetChunk{0}, mTargetStepRows{0}, mContextChunk{0}, mContextStepRows{0};
    int64_t mFeatDim{0};
    size_t mFeatElem{4};
    std::vector<char> mFeatures;  //!< [rows, F] raw bytes of the latest target forward (host)
    int32_t mFeatureRows{0};
    std::vector<char> mPending;   //!< [rows, F] raw bytes queued for the drafter (host)
    int32_t mPendingRows{0};
};

//! Captured shape-bucket contexts kept per engine and session (each holds TensorRT per-context state).
constexpr size_t kMAX_CAPTURED_CONTEXTS = 8;

void linearTensors(std::map<std::string, IOTensor>& io, Engine const& te, Manifest const& m, int32_t slots, int64_t rows);
void bindLinear(DeviceLinearState& linear, std::map<std::string, IOTensor>& io, int32_t slot, int32_t B, int32_t S,
    bool everyRow, std::map<std::string, std::vector<int64_t>>& shapes, std::map<std::string, void*>& addr);
void ringTensors(DeviceWindowRing& ring, std::map<std::string, IOTensor>& io, Engine const& te, Manifest const& m,
    int32_t slots, int64_t rows, DeviceOps& ops, cudaStream_t stream);
void bindRing(DeviceWindowRing const& ring, std::map<std::string, IOTensor>& io, Manifest const& m,
    std::vector<int32_t> const& slotOfRow, bool slotPart, std::map<std::string, std::vector<int64_t>>& shapes,
    std::map<std::string, void*>& addr);
void placeRows(DeviceWindowRing& ring, std::map<std::string, IOTensor>& io, Manifest const& m, int32_t S, int32_t b,
    int32_t slot, int32_t start, int32_t rows, cudaStream_t stream);

TrtModel::TrtModel(Manifest const& m, std::string const& dir, Options const& options)
    : manifest(m)
{
    if (!m.engines.present)
    {
        throw Error(DFL2_ERR_UNAVAILABLE, dir + " has no TensorRT engines: build them with dflash2 build-engines "
                + dir);
    }
    if (m.hasSlidingLayers() && m.engines.plans.count("target") != 0)  // the rings are sized from the manifest
    {
        checkRingProfiles("target", m.engines.plans.at("target").profiles, m.slidingWindow.ringSlots);
    }
    device = static_cast<int>(options.getInt("device", 0));
    cudaGraphs = options.getBool("cuda_graphs", true);
    std::string const mode = options.getString("draft_mode", "greedy");
    if (mode == "independent")
    {
        // unavailable, not a bad value: backend=auto falls back to ONNX Runtime, which runs independent drafts
        throw Error(DFL2_ERR_UNAVAILABLE, "the TensorRT backend runs the selector modes greedy / viterbi only "
                "(backend=ort runs draft_mode 'independent')");
    }
    // engine identity: TensorRT version (before CUDA is touched), then the GPU
    checkEngineVersion(m.engines.tensorrtVersion, mLib.parts, dir);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev <= device)
    {
        throw Error(DFL2_ERR_UNAVAILABLE, "no CUDA device " + std::to_string(device) + " here");
    }
    cudaCheck(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    cudaCheck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    std::string const cc = std::to_string(prop.major) + "." + std::to_string(prop.minor);
    if (!m.engines.computeCapability.empty() && m.engines.computeCapability != cc)
    {
        throw Error(DFL2_ERR_VERSION_MISMATCH, "engines were built for compute capability "
                + m.engines.computeCapability + ", this GPU (" + prop.name + ") is " + cc + ": rebuild them here");
    }
    mRuntime.reset(static_cast<nv::IRuntime*>(mLib.createRuntime(&mLogger, NV_TENSORRT_VERSION)));
    if (!mRuntime)
    {
        throw Error(DFL2_ERR_UNAVAILABLE, "TensorRT refused to create a runtime (headers newer than the library?)");
    }
    if (!m.engines.pluginFile.empty())
    {
        // the "plugin_library" option, else $DFLASH2_PLUGIN_LIB (as the Python runtime), else the engines' copy
        char const* env = std::getenv("DFLASH2_PLUGIN_LIB");
        std::string plugin = options.getString("plugin_library", "");
        if (plugin.empty())
        {
            plugin = env != nullptr && *env != '\0' ? std::string(env) : dir + "/" + m.engines.pluginFile;
        }
        // load_library returns null for a library already registered in this process: not an error
        (void) mRuntime->getPluginRegistry().loadLibrary(plugin.c_str());
    }
    for (auto const& [key, plan] : m.engines.plans)
    {
        mEngines[key] = loadEngine(key, plan, dir);
    }
    for (bool plugin : {true, false})
    {
        if (headKeyUsed.empty() && mEngines.count(headKey(mode, plugin)) != 0)
        {
            headKeyUsed = headKey(mode, plugin);
        }
    }
    if (headKeyUsed.empty())
    {
        throw Error(DFL2_ERR_CORRUPT, dir + " has no TensorRT engine for the " + mode + " drafter head");
    }
    backend = "tensorrt";
    maxBatch = profilesMaxBatch(engine("target").profiles);  // build-engines --max-batch (1: B = 1 engines)
    vocabSize = m.vocabSize;
    blockSize = m.blockSize;
    topK = m.topK;
    maxPositions = m.maxSeqLen;
    eosIds = m.eosTokenIds;
}

std::unique_ptr<Engine> TrtModel::loadEngine(std::string const& key, PlanEntry const& plan, std::string const& dir)
{
    std::vector<char> const blob = readFile(dir + "/" + plan.file);
    auto e = std::make_unique<Engine>();
    e->key = key;
    e->profiles = plan.profiles;
    e->engine.reset(mRuntime->deserializeCudaEngine(blob.data(), blob.size()));
    if (!e->engine)
    {
        throw Error(DFL2_ERR_BACKEND, "TensorRT could not deserialize " + plan.file
                + " (other TensorRT version or GPU, corrupt, or the plugin library is missing): rebuild with "
                  "dflash2 build-engines");
    }
    for (int32_t i = 0; i < e->engine->getNbIOTensors(); ++i)
    {
        std::string const name = e->engine->getIOTensorName(i);
        e->names.push_back(name);
        e->types[name] = e->engine->getTensorDataType(name.c_str());
        e->isInput[name] = e->engine->getTensorIOMode(name.c_str()) == nv::TensorIOMode::kINPUT;
    }
    e->auxStreams = e->engine->getNbAuxStreams();
    // the host reads these as fp32 / fp16 (readFloat); a bf16 engine output would be misread
    for (char const* out : {"logits", "proposal_probs"})
    {
        auto t = e->types.find(out);
        if (t != e->types.end() && t->second != nv::DataType::kFLOAT && t->second != nv::DataType::kHALF)
        {
            throw Error(DFL2_ERR_CORRUPT, "engine " + key + ": output " + out
                    + " is neither fp32 nor fp16; rebuild with dflash2 build-engines");
        }
    }
    return e;
}

std::unique_ptr<Runners> TrtModel::newRunners()
{
    return std::make_unique<TrtRunners>(*this);
}

std::unique_ptr<BatchRunners> newTrtBatchRunners(TrtModel& model, int32_t slots);

std::unique_ptr<BatchRunners> TrtModel::newBatchRunners(int32_t slots)
{
    return newTrtBatchRunners(*this, slots);
}

TrtRunners::TrtRunners(TrtModel& model, bool withTarget)
    : TrtShapes(model)
    , mWithTarget(withTarget)
{
    try
    {
        setUp();
    }
    catch (...) // a size check or an allocation failed: free what was made (no destructor runs)
    {
        releaseAll();
        throw;
    }
}

// the stream, the target's tensors (setUpTarget, when this runner has the target), the drafter's (setUpDrafter), each
// engine's scratch memory
void TrtRunners::setUp()
{
    TrtModel& model = mModel;
    Manifest const& m = model.manifest;
    cudaCheck(cudaSetDevice(model.device), "cudaSetDevice");
    cudaCheck(cudaStreamCreateWithFlags(&mStream, cudaStreamNonBlocking), "cudaStreamCreate");
    int32_t const maxCap = (m.maxSeqLen + m.kvCapacityStep - 1) / m.kvCapacityStep * m.kvCapacityStep;
    if (mWithTarget)
    {
        setUpTarget(maxCap);
    }
    setUpDrafter(maxCap);
    Engine const& te = model.engine("target");
    Engine const& ce = model.engine("drafter_context");
    Engine const& be = model.engine("drafter_block");
    Engine const& he = model.engine(model.headKeyUsed);
    for (Engine const* e : {&te, &ce, &be, &he})
    {
        if (e == &te && !mWithTarget)
        {
            continue;
        }
        void* scratch = nullptr;
        cudaCheck(cudaMalloc(&scratch, static_cast<size_t>(std::max<int64_t>(1, e->engine->getDeviceMemorySizeV2()))),
            "cudaMalloc scratch");
        mScratch[e->key] = scratch;
    }
}

// the target engine's tensors: its KV cache (+ linear states and rings), the step and prefill calls' inputs and outputs
void TrtRunners::setUpTarget(int32_t maxCap)
{
    Manifest const& m = mModel.manifest;
    Engine const& te = mModel.engine("target");
    mTargetPast = targetKvNames(m, "past_key_values");
    mTargetPresent = targetKvNames(m, "present");
    mTargetKV = DeviceKV{&mOps, m.kvLayers(), m.targetKvHeads, m.targetHeadDim, elementSize(te.types.at(mTargetPast[0])),
        m.kvCapacityStep, maxCap, 0, 0, {}, 1};
    mTargetChunk = te.maxDim("prefill", "sequence");
    if (m.hasLinearLayers())  // a call of a hybrid target takes at most max_rows_per_call rows
    {
        mTargetChunk = std::min<int64_t>(mTargetChunk, m.linearState.maxRowsPerCall);
        mLinear.allocate(m, te, 1, mStream);
        linearTensors(mTio, te, m, 1, mTargetChunk);
    }
    if (m.hasSlidingLayers())
    {
        ringTensors(mRing, mTio, te, m, 1, mTargetChunk, mOps, mStream);
    }
    mTargetStepRows = te.maxDim("step", "sequence");
    mFeatDim = te.engine->getTensorShape("context_features").d[2];
    mFeatElem = elementSize(te.types.at("context_features"));
    tensor(mTio, te, "input_ids", {1, mTargetChunk}, true);
    tensor(mTio, te, "position_ids", {1, mTargetChunk}, true);
    tensor(mTio, te, "attention_mask", {1, maxCap + mTargetChunk}, true);
    tensor(mTio, te, "logits", {1, mTargetChunk, m.vocabSize}, true);
    tensor(mTio, te, "context_features", {1, mTargetChunk, mFeatDim}, true);
    for (std::string const& p : mTargetPresent)
    {
        tensor(mTio, te, p, {1, m.targetKvHeads, mTargetChunk, m.targetHeadDim}, false);
    }
    for (std::string const& p : mTargetPast) // bound to the KV cache buffers, sized from the manifest
    {
        checkBindingShape(te.key, p, dimsVector(te.engine->getTensorShape(p.c_str())),
            {1, m.targetKvHeads, maxCap, m.targetHeadDim});
    }
}

// the drafter engines' tensors: its context KV cache, the context, block and head calls' inputs and outputs
void TrtRunners::setUpDrafter(int32_t maxCap)
{
    TrtModel& model = mModel;
    Manifest const& m = model.manifest;
    int32_t const bs = m.blockSize;
    int32_t const L = bs - 1;
    int32_t const K = m.topK;
    Engine const& ce = model.engine("drafter_context");
    Engine const& be = model.engine("drafter_block");
    Engine const& he = model.engine(model.headKeyUsed);
    for (int32_t i = 0; i < m.drafterLayers; ++i)
    {
        for (char const* kv : {"key", "value"})
        {
            mDraftKVNames.push_back("context." + std::to_string(i) + "." + kv);
        }
    }
    mDraftKV = DeviceKV{&mOps, m.drafterLayers, m.drafterKvHeads, m.drafterHeadDim, elementSize(ce.types.at(mDraftKVNames[0])),
        m.kvCapacityStep, maxCap, 0, 0, {}, 1};
    if (!mWithTarget) // the features come from TrtBatchRunners' target engine: the context engine's input says their size
    {
        mFeatDim = ce.engine->getTensorShape("context_features").d[2];
        mFeatElem = elementSize(ce.types.at("context_features"));
    }
    mContextChunk = ce.maxDim("prefill", "rows");
    mContextStepRows = ce.maxDim("step", "rows");
    tensor(mCio, ce, "context_features", {1, mContextChunk, mFeatDim}, true);
    tensor(mCio, ce, "position_ids", {1, mContextChunk}, true);
    for (std::string const& n : mDraftKVNames)
    {
        tensor(mCio, ce, n, {1, m.drafterKvHeads, mContextChunk, m.drafterHeadDim}, false);
    }
    for (std::string const& n : mDraftKVNames)
    {
        checkBindingShape(be.key, n, dimsVector(be.engine->getTensorShape(n.c_str())),
            {1, m.drafterKvHeads, maxCap, m.drafterHeadDim});
    }
    tensor(mBio, be, "anchor_ids", {1}, true);
    tensor(mBio, be, "anchor_position", {1}, true);
    tensor(mBio, be, "context_mask", {1, maxCap}, true);
    tensor(mBio, be, "hidden", {1, bs, m.hiddenSize}, false);
    tensor(mHio, he, "anchor_ids", {1}, true);
    tensor(mHio, he, "temperature", {1}, true);
    tensor(mHio, he, "uniforms", {1, L}, true);
    tensor(mHio, he, "cand_ids", {1, L, K}, true);
    tensor(mHio, he, "path_ids", {1, L}, true);
    tensor(mHio, he, "proposal_probs", {1, L, K}, true);
    checkBindingShape(he.key, "hidden", dimsVector(he.engine->getTensorShape("hidden")), {1, bs, m.hiddenSize});
}

TrtRunners::~TrtRunners()
{
    releaseAll();
}

void TrtRunners::releaseAll() noexcept
{
    if (mStream != nullptr)
    {
        cudaStreamSynchronize(mStream);
    }
    dropGraphs();
    mCaptured.clear();
    mContexts.clear();
    for (auto* io : {&mTio, &mCio, &mBio, &mHio})
    {
        freeIo(*io);
    }
    for (auto& [k, p] : mScratch)
    {
        cudaFree(p);
    }
    mScratch.clear();
    mTargetKV.release();
    mDraftKV.release();
    mLinear.release();
    mRing.release();
    destroyStream(mStream);
}

IOTensor& TrtRunners::tensor(std::map<std::string, IOTensor>& io, Engine const& e, std::string const& name,
    std::vector<int64_t> const& maxShape, bool host)
{
    auto it = e.types.find(name);
    if (it == e.types.end())
    {
        throw Error(DFL2_ERR_CORRUPT, "engine " + e.key + " has no tensor " + name);
    }
    // every buffer is sized from the manifest: the engine's static dims must agree, or it writes past them
    checkBindingShape(e.key, name, dimsVector(e.engine->getTensorShape(name.c_str())), maxShape);
    IOTensor& t = io[name]; // recorded before allocating: a failure below leaves nothing unreleased
    t.type = it->second;
    t.bytes = static_cast<size_t>(volume(maxShape)) * elementSize(t.type);
    cudaCheck(cudaMalloc(&t.dev, std::max<size_t>(t.bytes, 1)), "cudaMalloc I/O");
    if (host)
    {
        cudaCheck(cudaMallocHost(&t.host, std::max<size_t>(t.bytes, 1)), "cudaMallocHost");
    }
    return t;
}

//! A hybrid target's linear I/O: state_rows (with a host mirror) and per linear layer present_conv [1, conv_dim,
//! rows] and present_recurrent [1, rows, heads, dk, dv] (`rows`: the most one call of the runner holds), and the
//! state inputs' engine shapes checked against the [slots, ...] DeviceLinearState buffers they are bound to.
void linearTensors(std::map<std::string, IOTensor>& io, Engine const& te, Manifest const& m, int32_t slots, int64_t rows)
{
    LinearStateSpec const& ls = m.linearState;
    TrtRunners::tensor(io, te, kSTATE_ROWS, {rows}, true);
    for (int32_t i = 0; i < m.targetLayers; ++i)
    {
        if (!m.isLinear(i))
        {
            continue;
        }
        std::string const n = std::to_string(i);
        TrtRunners::tensor(io, te, "present_conv." + n, {1, ls.convDim, rows}, false);
        TrtRunners::tensor(io, te, "present_recurrent." + n, {1, rows, ls.numHeads, ls.keyDim, ls.valueDim}, false);
        checkBindingShape(te.key, "past_conv." + n, dimsVector(te.engine->getTensorShape(("past_conv." + n).c_str())),
            {slots, ls.convDim, ls.window()});
        checkBindingShape(te.key, "past_recurrent." + n,
            dimsVector(te.engine->getTensorShape(("past_recurrent." + n).c_str())),
            {slots, ls.numHeads, ls.keyDim, ls.valueDim});
    }
}

//! A hybrid target call's linear inputs: state_rows (every row's, or the last row's: R values written to its host
//! mirror) and each linear layer's state, [B, ...] from batch row 0 of `linear` at `slot` -> shapes and addresses
void bindLinear(DeviceLinearState& linear, std::map<std::string, IOTensor>& io, int32_t slot, int32_t B, int32_t S,
    bool everyRow, std::map<std::string, std::vector<int64_t>>& shapes, std::map<std::string, void*>& addr)
{
    int32_t const R = everyRow ? S : 1;
    std::vector<int64_t> rows(static_cast<size_t>(R));
    for (int32_t i = 0; i < R; ++i)
    {
        rows[static_cast<size_t>(i)] = everyRow ? i : S - 1;
    }
    writeInts(io.at(kSTATE_ROWS), 0, rows.data(), rows.size());
    shapes[kSTATE_ROWS] = {R};
    LinearStateSpec const& ls = linear.spec;
    for (size_t l = 0; l < linear.layers.size(); ++l)
    {
        std::string const n = std::to_string(linear.layers[l]);
        LinearLayerState const v = linear.view(io, l, slot, 0, S, R);
        shapes["past_conv." + n] = {B, ls.convDim, ls.window()};
        shapes["past_recurrent." + n] = {B, ls.numHeads, ls.keyDim, ls.valueDim};
        addr["past_conv." + n] = v.window;
        addr["past_recurrent." + n] = v.recurrent;
    }
}

//! A sliding-window target's ring I/O: the rings (`ring`: DeviceWindowRing over `slots` sequences, allocated once and
//! zeroed), window_positions [slots, ring_slots] with a host mirror, per sliding layer present.{i}.key / .value
//! [1, heads, rows, d] (`rows`: the most one call of the runner holds), and the past inputs' engine shapes checked
//! against the [slots, heads, ring_slots, d] ring buffers they are bound to.
void ringTensors(DeviceWindowRing& ring, std::map<std::string, IOTensor>& io, Engine const& te, Manifest const& m,
    int32_t slots, int64_t rows, DeviceOps& ops, cudaStream_t stream)
{
    int32_t const R = m.slidingWindow.ringSlots;
    std::vector<std::string> const past = targetKvNames(m, "past_key_values", "sliding");
    for (std::string const& n : past)
    {
        if (te.types.count(n) == 0)
        {
            throw Error(DFL2_ERR_CORRUPT, "engine " + te.key + " has no tensor " + n
                    + ": the engines do not belong to this export (rebuild with dflash2 build-engines)");
        }
        checkBindingShape(te.key, n, dimsVector(te.engine->getTensorShape(n.c_str())),
            {slots, m.targetKvHeads, R, m.targetHeadDim});
    }
    TrtRunners::tensor(io, te, kWINDOW_POSITIONS, {slots, R}, true);
    for (std::string const& n : targetKvNames(m, "present", "sliding"))
    {
        TrtRunners::tensor(io, te, n, {1, m.targetKvHeads, rows, m.targetHeadDim}, false);
    }
    ring.ops = &ops;
    ring.layers = m.layersOf("sliding");
    ring.heads = m.targetKvHeads;
    ring.headDim = m.targetHeadDim;
    ring.elem = elementSize(te.types.at(past.at(0)));
    ring.allocate(m.slidingWindow, slots, plantedRingKeepCut(), stream);
}

//! A call's sliding-layer inputs: window_positions [B, ring_slots], batch row r from the ring of slotOfRow[r] (written
//! to its host mirror; B = slotOfRow.size()), and the rings: the whole [slots, ...] buffers (batch row = slot), or
//! (slotPart) the part of the one sequence's slot, at batch row 0 -> shapes and addresses
void bindRing(DeviceWindowRing const& ring, std::map<std::string, IOTensor>& io, Manifest const& m,
    std::vector<int32_t> const& slotOfRow, bool slotPart, std::map<std::string, std::vector<int64_t>>& shapes,
    std::map<std::string, void*>& addr)
{
    int32_t const R = ring.ringSlots();
    int64_t const B = static_cast<int64_t>(slotOfRow.size());
    IOTensor const& wp = io.at(kWINDOW_POSITIONS);
    for (size_t r = 0; r < slotOfRow.size(); ++r)
    {
        writeInts(wp, r * static_cast<size_t>(R), ring.positions(slotOfRow[r]), static_cast<size_t>(R));
    }
    shapes[kWINDOW_POSITIONS] = {B, R};
    std::vector<std::string> const past = targetKvNames(m, "past_key_values", "sliding");
    for (size_t i = 0; i < past.size(); ++i)
    {
        shapes[past[i]] = {B, ring.heads, R, ring.headDim};
        addr[past[i]] = slotPart ? ring.slotPointer(i, slotOfRow.at(0)) : ring.ptrs[i];
    }
}

//! After a call: batch row b's first `rows` rows of the sliding layers' present outputs ([B, heads, S, d] in `io`)
//! are `slot`'s positions start.. -> its ring (copies on `stream`)
void placeRows(DeviceWindowRing& ring, std::map<std::string, IOTensor>& io, Manifest const& m, int32_t S, int32_t b,
    int32_t slot, int32_t start, int32_t rows, cudaStream_t stream)
{
    std::vector<void*> present;
    for (std::string const& n : targetKvNames(m, "present", "sliding"))
    {
        present.push_back(io.at(n).dev);
    }
    ring.place(present, S, b, slot, start, rows, stream);
}

std::unique_ptr<nv::IExecutionContext> TrtRunners::newContext(Engine const& e, int32_t profile)
{
    std::unique_ptr<nv::IExecutionContext> ctx(
        e.engine->createExecutionContext(nv::ExecutionContextAllocationStrategy::kUSER_MANAGED));
    if (!ctx)
    {
        throw Error(DFL2_ERR_BACKEND, "TensorRT could not create an execution context for " + e.key);
    }
    ctx->setDeviceMemoryV2(mScratch.at(e.key), std::max<int64_t>(1, e.engine->getDeviceMemorySizeV2()));
    if (!ctx->setOptimizationProfileAsync(profile, mStream))
    {
        throw Error(DFL2_ERR_BACKEND, e.key + ": cannot select optimization profile " + std::to_string(profile));
    }
    return ctx;
}

nv::IExecutionContext& TrtRunners::context(Engine const& e, int32_t profile, std::string const& bucket, bool captured)
{
    std::string const key = e.key + "/" + std::to_string(profile) + "/" + bucket;
    if (!captured)
    {
        auto it = mContexts.find(key);
        if (it != mContexts.end())
        {
            return *it->second;
        }
        return *(mContexts[key] = newContext(e, profile));
    }
    auto& lru = mCaptured.try_emplace(e.key, kMAX_CAPTURED_CONTEXTS).first->second;
    if (auto* ctx = lru.find(key))
    {
        return **ctx;
    }
    return *lru.insert(key, newContext(e, profile), [this](std::string const& old) { dropGraphsOf(old); });
}

void TrtRunners::bind(Engine const& e, nv::IExecutionContext& ctx,
    std::map<std::string, std::vector<int64_t>> const& shapes, std::map<std::string, void*> const& addr, bool reshape)
{
    if (reshape)
    {
        for (auto const& [name, shape] : shapes)
        {
            if (!ctx.setInputShape(name.c_str(), dimsOf(shape)))
            {
                throw Error(DFL2_ERR_BACKEND, e.key + ": input " + name + " shape is outside its optimization profile");
            }
        }
    }
    for (std::string const& name : e.names)
    {
        auto it = addr.find(name);
        if (it == addr.end() || !ctx.setTensorAddress(name.c_str(), it->second))
        {
            throw Error(DFL2_ERR_BACKEND, e.key + ": cannot bind tensor " + name);
        }
    }
}

void TrtRunners::enqueue(Engine const& e, nv::IExecutionContext& ctx)
{
    if (!ctx.enqueueV3(mStream))
    {
        throw Error(DFL2_ERR_BACKEND, "TensorRT execution of " + e.key + " failed (see the TensorRT log)");
    }
}

void TrtRunners::dropGraphs()
{
    for (auto& [k, g] : mGraphs)
    {
        cudaGraphExecDestroy(g);
    }
    mGraphs.clear();
    mGraphContexts.clear();
}

void TrtRunners::dropGraphsOf(std::string const& contextKey)
{
    for (auto it = mGraphContexts.begin(); it != mGraphContexts.end();)
    {
        auto const& used = it->second;
        if (std::find(used.begin(), used.end(), contextKey) == used.end())
        {
            ++it;
            continue;
        }
        cudaGraphExecDestroy(mGraphs.at(it->first));
        mGraphs.erase(it->first);
        it = mGraphContexts.erase(it);
    }
}

template <typename F>
void TrtRunners::runStep(std::string const& key, bool capturable, std::vector<std::string> const& contexts, F&& step)
{
    if (!capturable || !mModel.cudaGraphs || !mGraphsOk)
    {
        step();
        return;
    }
    auto it = mGraphs.find(key);
    if (it != mGraphs.end())
    {
        cudaCheck(cudaGraphLaunch(it->second, mStream), "cudaGraphLaunch");
        return;
    }
    // first use: run eagerly (TensorRT finishes lazy setup outside the capture), then capture thread-locally
    step();
    cudaCheck(cudaStreamSynchronize(mStream), "sync before capture");
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    bool ok = cudaStreamBeginCapture(mStream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok)
    {
        try
        {
            step();
        }
        catch (...) // whatever failed, the capture must end before this stream is used again
        {
            ok = false;
        }
        ok = cudaStreamEndCapture(mStream, &graph) == cudaSuccess && ok;
        ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
        if (graph != nullptr)
        {
            cudaGraphDestroy(graph);
        }
    }
    if (!ok)
    {
        (void) cudaGetLastError();  // clear the capture error; eager from now on
        mGraphsOk = false;
        return;  // the eager run above already produced this step's outputs
    }
    mGraphs[key] = exec;
    mGraphContexts[key] = contexts;
}

// a target call's host inputs: S ids at positions n.., the mask over the C cache slots (valid below n) and the new rows
void TrtRunners::writeTargetInputs(int32_t const* ids, int32_t S, int32_t n, int32_t C)
{
    std::vector<int64_t> buf(static_cast<size_t>(std::max(S, C + S)));
    for (int32_t i = 0; i < S; ++i)
    {
        buf[static_cast<size_t>(i)] = ids[i];
    }
    writeInts(mTio["input_ids"], 0, buf.data(), static_cast<size_t>(S));
    for (int32_t i = 0; i < S; ++i)
    {
        buf[static_cast<size_t>(i)] = n + i;
    }
    writeInts(mTio["position_ids"], 0, buf.data(), static_cast<size_t>(S));
    for (int32_t i = 0; i < C + S; ++i)  // valid cache slots, then the new rows
    {
        buf[static_cast<size_t>(i)] = (i < n || i >= C) ? 1 : 0;
    }
    writeInts(mTio["attention_mask"], 0, buf.data(), static_cast<size_t>(C + S));
}

// a target call's S new rows at position n kept (device copies, outside any captured graph: their destinations move
// every step): the present K/V appended to the cache, the linear state after the rows, the rows into their ring slots
void TrtRunners::keepTargetRows(int32_t n, int32_t S, bool everyRow)
{
    std::vector<void*> present;
    for (std::string const& p : mTargetPresent)
    {
        present.push_back(mTio[p].dev);
    }
    mTargetKV.append(present, S, mStream);
    if (mLinear.active())
    {
        mLinear.called(mTio, 0, 0, n, S, S, everyRow, mStream);
    }
    if (mRing.active())
    {
        placeRows(mRing, mTio, mModel.manifest, S, 0, 0, n, S, mStream);
    }
}

void TrtRunners::targetCall(int32_t const* ids, int32_t S, bool everyRow, float* logits, std::vector<char>& feats)
{
    Engine const& e = mModel.engine("target");
    DeviceKV& kv = mTargetKV;
    int32_t const n = kv.length;
    if (kv.reserve(n + S, mStream))
    {
        dropGraphs();  // the graphs read the old cache addresses
    }
    int32_t const C = kv.capacity;
    bool const stepProfile = S <= mTargetStepRows;
    bool const captured = stepProfile && e.auxStreams == 0;
    int32_t const profile = e.profileIndex(stepProfile ? "step" : "prefill");
    writeTargetInputs(ids, S, n, C);
    std::map<std::string, std::vector<int64_t>> shapes{
        {"input_ids", {1, S}}, {"position_ids", {1, S}}, {"attention_mask", {1, C + S}}};
    std::map<std::string, void*> addr = deviceAddresses(mTio);
    bindCache(kv, mTargetPast, C, shapes, addr);
    if (mLinear.active())
    {
        bindLinear(mLinear, mTio, 0, 1, S, everyRow, shapes, addr);
    }
    if (mRing.active())  // the ring bound in place, its window positions up with the ids
    {
        bindRing(mRing, mTio, mModel.manifest, {0}, false, shapes, addr);
    }
    std::string const rowsAsked = mLinear.active() && !everyRow ? "r1" : "";  // state_rows [1], not [S]
    std::string const bucket = captured ? std::to_string(S) + "x" + std::to_string(C) + rowsAsked : "eager";
    nv::IExecutionContext& ctx = context(e, profile, bucket, captured);
    bind(e, ctx, shapes, addr, !captured || mGraphs.count("target/" + bucket) == 0);
    std::string const ctxKey = e.key + "/" + std::to_string(profile) + "/" + bucket;
    size_t const V = static_cast<size_t>(mModel.vocabSize);
    size_t const idBytes = static_cast<size_t>(S) * elementSize(mTio["input_ids"].type);
    size_t const maskBytes = static_cast<size_t>(C + S) * elementSize(mTio["attention_mask"].type);
    size_t const logitBytes = static_cast<size_t>(S) * V * elementSize(mTio["logits"].type);
    size_t const featBytes = static_cast<size_t>(S) * static_cast<size_t>(mFeatDim) * mFeatElem;
    auto step = [&] {
        cudaCheck(cudaMemcpyAsync(mTio["input_ids"].dev, mTio["input_ids"].host, idBytes, cudaMemcpyHostToDevice, mStream),
            "H2D ids");
        cudaCheck(cudaMemcpyAsync(mTio["position_ids"].dev, mTio["position_ids"].host, idBytes, cudaMemcpyHostToDevice,
                      mStream),
            "H2D positions");
        cudaCheck(cudaMemcpyAsync(mTio["attention_mask"].dev, mTio["attention_mask"].host, maskBytes,
                      cudaMemcpyHostToDevice, mStream),
            "H2D mask");
        if (mLinear.active())
        {
            IOTensor& rows = mTio[kSTATE_ROWS];
            size_t const rowBytes = static_cast<size_t>(everyRow ? S : 1) * elementSize(rows.type);
            cudaCheck(cudaMemcpyAsync(rows.dev, rows.host, rowBytes, cudaMemcpyHostToDevice, mStream), "H2D state rows");
        }
        if (mRing.active())
        {
            IOTensor& wp = mTio[kWINDOW_POSITIONS];
            size_t const wpBytes = static_cast<size_t>(mRing.ringSlots()) * elementSize(wp.type);
            cudaCheck(cudaMemcpyAsync(wp.dev, wp.host, wpBytes, cudaMemcpyHostToDevice, mStream), "H2D window positions");
        }
        enqueue(e, ctx);
        cudaCheck(cudaMemcpyAsync(mTio["logits"].host, mTio["logits"].dev, logitBytes, cudaMemcpyDeviceToHost, mStream),
            "D2H logits");
        cudaCheck(cudaMemcpyAsync(mTio["context_features"].host, mTio["context_features"].dev, featBytes,
                      cudaMemcpyDeviceToHost, mStream),
            "D2H features");
    };
    runStep("target/" + bucket, captured, {ctxKey}, step);
    keepTargetRows(n, S, everyRow);
    cudaCheck(cudaStreamSynchronize(mStream), "target sync");
    for (size_t i = 0; i < static_cast<size_t>(S) * V; ++i)
    {
        logits[i] = readFloat(mTio["logits"], i);
    }
    char const* f = static_cast<char const*>(mTio["context_features"].host);
    feats.insert(feats.end(), f, f + featBytes);
}

void TrtRunners::targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits)
{
    size_t const V = static_cast<size_t>(mModel.vocabSize);
    logits.assign(static_cast<size_t>(n) * V, 0.0F);
    mFeatures.clear();
    mFeatureRows = 0;
    bool const everyRow = n <= mTargetChunk;  // a hybrid target: one call that a crop may roll back (a verify)
    for (int32_t i = 0; i < n; i += static_cast<int32_t>(mTargetChunk))
    {
        int32_t const S = std::min<int32_t>(static_cast<int32_t>(mTargetChunk), n - i);
        targetCall(ids + i, S, everyRow, logits.data() + static_cast<size_t>(i) * V, mFeatures);
    }
    mFeatureRows = n;
}

void TrtRunners::contextCall(char const* feats, int32_t m, int32_t start)
{
    Engine const& e = mModel.engine("drafter_context");
    if (mDraftKV.reserve(mDraftKV.length + m, mStream))
    {
        dropGraphs();
    }
    bool const stepProfile = m <= mContextStepRows;
    bool const captured = stepProfile && e.auxStreams == 0;
    int32_t const profile = e.profileIndex(stepProfile ? "step" : "prefill");
    size_t const featBytes = static_cast<size_t>(m) * static_cast<size_t>(mFeatDim) * mFeatElem;
    std::memcpy(mCio["context_features"].host, feats, featBytes);
    std::vector<int64_t> pos(static_cast<size_t>(m));
    for (int32_t i = 0; i < m; ++i)
    {
        pos[static_cast<size_t>(i)] = start + i;
    }
    writeInts(mCio["position_ids"], 0, pos.data(), pos.size());
    std::map<std::string, void*> addr = deviceAddresses(mCio);
    std::string const bucket = captured ? std::to_string(m) : "eager";
    nv::IExecutionContext& ctx = context(e, profile, bucket, captured);
    bind(e, ctx, {{"context_features", {1, m, mFeatDim}}, {"position_ids", {1, m}}}, addr,
        !captured || mGraphs.count("context/" + bucket) == 0);
    std::string const ctxKey = e.key + "/" + std::to_string(profile) + "/" + bucket;
    size_t const posBytes = static_cast<size_t>(m) * elementSize(mCio["position_ids"].type);
    auto step = [&] {
        cudaCheck(cudaMemcpyAsync(mCio["context_features"].dev, mCio["context_features"].host, featBytes,
                      cudaMemcpyHostToDevice, mStream),
            "H2D context features");
        cudaCheck(cudaMemcpyAsync(mCio["position_ids"].dev, mCio["position_ids"].host, posBytes, cudaMemcpyHostToDevice,
                      mStream),
            "H2D context positions");
        enqueue(e, ctx);
    };
    runStep("context/" + bucket, captured, {ctxKey}, step);
    std::vector<void*> present;
    for (std::string const& n : mDraftKVNames)
    {
        present.push_back(mCio[n].dev);
    }
    mDraftKV.append(present, m, mStream);
}

void TrtRunners::drafterQueueContext(int32_t rows)
{
    if (rows < 0 || rows > mFeatureRows)
    {
        throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the last target forward made");
    }
    mPending.insert(mPending.end(), mFeatures.begin(),
        mFeatures.begin() + static_cast<long>(static_cast<size_t>(rows) * featureRowBytes()));
    mPendingRows += rows;
}

void TrtRunners::drafterAddContext(int32_t start)
{
    std::vector<char> const feats = std::move(mPending);
    int32_t const rows = mPendingRows;
    mPending.clear();
    mPendingRows = 0;
    drafterAddFeatures(feats.data(), rows, start);
}

void TrtRunners::drafterAddFeatures(char const* feats, int32_t rows, int32_t start)
{
    if (start != mDraftKV.length)
    {
        throw Error(DFL2_ERR_INTERNAL, "draft context is at length " + std::to_string(mDraftKV.length)
                + ", got features for position " + std::to_string(start));
    }
    size_t const rowBytes = featureRowBytes();
    for (int32_t i = 0; i < rows; i += static_cast<int32_t>(mContextChunk))
    {
        int32_t const m = std::min<int32_t>(static_cast<int32_t>(mContextChunk), rows - i);
        contextCall(feats + static_cast<size_t>(i) * rowBytes, m, start + i);
    }
}

void TrtRunners::drafterPropose(
    int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out)
{
    Engine const& be = mModel.engine("drafter_block");
    Engine const& he = mModel.engine(mModel.headKeyUsed);
    DeviceKV& kv = mDraftKV;
    if (kv.length != pos)
    {
        throw Error(DFL2_ERR_INTERNAL,
            "draft context holds " + std::to_string(kv.length) + " positions, anchor is at " + std::to_string(pos));
    }
    if (kv.reserve(std::max(1, pos), mStream))
    {
        dropGraphs();
    }
    int32_t const C = kv.capacity;
    int32_t const L = mModel.blockSize - 1;
    writeDraftInputs(anchor, pos, C, temperature, uniforms);
    std::map<std::string, std::vector<int64_t>> bshapes{{"anchor_ids", {1}}, {"anchor_position", {1}}, {"context_mask", {1, C}}};
    std::map<std::string, void*> baddr = deviceAddresses(mBio);
    bindCache(kv, mDraftKVNames, C, bshapes, baddr);
    std::map<std::string, void*> haddr = deviceAddresses(mHio);
    haddr["hidden"] = mBio["hidden"].dev;  // the block's output is the head's input: no copy
    std::string const key = "draft/" + std::to_string(C);
    bool const capturable = be.auxStreams == 0 && he.auxStreams == 0;
    nv::IExecutionContext& bctx = context(be, 0, std::to_string(C), capturable);
    nv::IExecutionContext& hctx = context(he, 0, "fixed", false); // fixed shapes: one context for every graph
    bool const fresh = mGraphs.count(key) == 0;
    bind(be, bctx, bshapes, baddr, fresh);
    bind(he, hctx, {{"hidden", {1, mModel.blockSize, mModel.manifest.hiddenSize}}, {"anchor_ids", {1}},
        {"temperature", {1}}, {"uniforms", {1, L}}}, haddr, fresh);
    auto h2d = [&](IOTensor& t, size_t bytes) {
        cudaCheck(cudaMemcpyAsync(t.dev, t.host, bytes, cudaMemcpyHostToDevice, mStream), "H2D draft input");
    };
    auto d2h = [&](IOTensor& t) {
        cudaCheck(cudaMemcpyAsync(t.host, t.dev, t.bytes, cudaMemcpyDeviceToHost, mStream), "D2H draft output");
    };
    auto step = [&] {
        h2d(mBio["anchor_ids"], elementSize(mBio["anchor_ids"].type));
        h2d(mBio["anchor_position"], elementSize(mBio["anchor_position"].type));
        h2d(mBio["context_mask"], static_cast<size_t>(C) * elementSize(mBio["context_mask"].type));
        h2d(mHio["anchor_ids"], elementSize(mHio["anchor_ids"].type));
        h2d(mHio["temperature"], sizeof(float));
        h2d(mHio["uniforms"], static_cast<size_t>(L) * sizeof(float));
        enqueue(be, bctx);
        if (rows < L)  // a final partial block: the rows past the verified ones get zero hidden states
        {
            IOTensor& hid = mBio["hidden"];
            size_t const rowBytes = static_cast<size_t>(mModel.manifest.hiddenSize) * elementSize(hid.type);
            cudaCheck(cudaMemsetAsync(static_cast<char*>(hid.dev) + static_cast<size_t>(1 + rows) * rowBytes, 0,
                          static_cast<size_t>(L - rows) * rowBytes, mStream),
                "zero unverified draft rows");
        }
        enqueue(he, hctx);
        d2h(mHio["cand_ids"]);
        d2h(mHio["path_ids"]);
        d2h(mHio["proposal_probs"]);
    };
    // a partial block (once per request) runs eagerly
    runStep(key, capturable && rows == L, {be.key + "/0/" + std::to_string(C)}, step);
    cudaCheck(cudaStreamSynchronize(mStream), "draft sync");
    readDraft(out);
}

// the drafter block's and head's host inputs: the anchor and its position, the context mask over the C slots (valid
// below the context's length), the temperature and the L uniforms (zeros at T <= 0)
void TrtRunners::writeDraftInputs(int32_t anchor, int32_t pos, int32_t C, float temperature, float const* uniforms)
{
    int32_t const L = mModel.blockSize - 1;
    int64_t const a = anchor;
    int64_t const p = pos;
    writeInts(mBio["anchor_ids"], 0, &a, 1);
    writeInts(mBio["anchor_position"], 0, &p, 1);
    std::vector<int64_t> mask(static_cast<size_t>(C));
    for (int32_t i = 0; i < C; ++i)
    {
        mask[static_cast<size_t>(i)] = i < mDraftKV.length ? 1 : 0;
    }
    writeInts(mBio["context_mask"], 0, mask.data(), mask.size());
    writeInts(mHio["anchor_ids"], 0, &a, 1);
    static_cast<float*>(mHio["temperature"].host)[0] = temperature;
    for (int32_t i = 0; i < L; ++i)
    {
        static_cast<float*>(mHio["uniforms"].host)[i] = uniforms != nullptr ? uniforms[i] : 0.0F;
    }
}

// the head's outputs (on the host after the step's sync): the path's L tokens, each row's K candidates and proposal
void TrtRunners::readDraft(Draft& out)
{
    int32_t const L = mModel.blockSize - 1;
    int32_t const K = mModel.topK;
    out.tokens.resize(static_cast<size_t>(L));
    out.cand.resize(static_cast<size_t>(L * K));
    out.proposal.resize(static_cast<size_t>(L * K));
    out.hasVocabProposal = false;
    for (size_t i = 0; i < static_cast<size_t>(L); ++i)
    {
        out.tokens[i] = readInt(mHio["path_ids"], i);
    }
    for (size_t i = 0; i < static_cast<size_t>(L * K); ++i)
    {
        out.cand[i] = readInt(mHio["cand_ids"], i);
        out.proposal[i] = readFloat(mHio["proposal_probs"], i);
    }
}

// ---- batched decoding (dfl2_batch) -------------------------------------------------------------------------

//! dfl2_batch over TensorRT (NEVER RUN: no GPU where it was written; its host parts, RaggedBatch and the batched
//! DeviceKV, are the trtParts ctest's). The target engine runs a step's sequences in one call (the batch dim of its
//! profiles: build-engines --max-batch); each slot's drafter is a drafter-only TrtRunners (the B = 1 drafter
//! engines, with that slot's own stream, contexts, scratch, draft KV and CUDA graphs).
//!
//! Target: one KV cache [slots, heads, capacity, d] per layer (DeviceKV with batch = slots; every slot its own
//! length, mLength: ragged). A forward's sequences of at most the step profile's rows run together in one call on
//! the step profile (RaggedBatch: batch row = slot, B = the highest slot + 1, right-padded rows, per-slot masks); a
//! sequence with more rows (a long prompt) runs alone on the prefill profile at batch 1 in chunks of its rows,
//! bound to its slot's part of the cache. Eager: the target is not captured (B and S change from call to call). A
//! sliding-window target's rings are one DeviceWindowRing of `slots` rings (batch row = slot, as the cache); a
//! slot's window_positions row goes up with the call, its new rows go into its own ring after it.
//!
//! Ownership: everything here belongs to the batch (dfl2_batch -> BatchDecoder -> this): its stream, the target's
//! scratch, contexts (one per profile, made on first use: under the model's lock, as sessions' are), I/O buffers
//! (allocated once at their largest shape) and KV cache; the drafters own theirs. Threads: the batch's stepping
//! thread, under the model's lock (capi.cpp); the CUDA device is set on entry to every call (steps may come from
//! different threads).
class TrtBatchRunners : public TrtShapes<BatchRunners>
{
public:
    TrtBatchRunners(TrtModel& model, int32_t slots);
    ~TrtBatchRunners() override
    {
        releaseAll();
    }
    TrtBatchRunners(TrtBatchRunners const&) = delete;
    TrtBatchRunners& operator=(TrtBatchRunners const&) = delete;

    int32_t slots() const override
    {
        return mSlots;
    }
    void targetReset(int32_t slot) override
    {
        forget(slot);
        mLength[index(slot)] = 0;
        if (mLinear.active())
        {
            device();
            mLinear.reset(slot, mStream);
        }
        if (mRing.active())
        {
            mRing.reset(slot);
        }
    }
    void targetRelease(int32_t slot) override
    {
        forget(slot);
        mLength[index(slot)] = 0;  // its rows stay in the cache, masked (finite: zeroed or written by the engine)
    }
    void targetForward(std::vector<SlotRows> const& seqs, bool lastLogits, std::vector<float>& logits) override;
    //! the slot's KV by its length; a hybrid target's linear state rolled back into the slot's last batched call; a
    //! sliding target's slot ring drops the cut rows' slots
    void targetCrop(int32_t slot, int32_t length) override
    {
        int32_t& n = mLength[index(slot)];
        int32_t const keep = std::max(0, length);
        if (mLinear.active() && keep < n)
        {
            device();
            mLinear.crop(mTio, slot, keep, mStream);
        }
        if (mRing.active() && keep < n)
        {
            mRing.crop(slot, keep);
        }
        n = std::min(n, keep);
    }
    void drafterReset(int32_t slot) override
    {
        size_t const b = index(slot);
        mPending[b].clear();
        mPendingRows[b] = 0;
        mDrafters[b]->drafterReset();
    }
    void drafterQueueContext(int32_t slot, int32_t rows) override
    {
        size_t const b = index(slot);
        if (rows < 0 || rows > mFeatureRows[b])
        {
            throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the slot's last target forward made");
        }
        size_t const bytes = static_cast<size_t>(rows) * featureRowBytes();
        mPending[b].insert(mPending[b].end(), mFeatures[b].begin(), mFeatures[b].begin() + static_cast<long>(bytes));
        mPendingRows[b] += rows;
    }
    void drafterAddContext(int32_t slot, int32_t start) override
    {
        size_t const b = index(slot);
        device();
        std::vector<char> const feats = std::move(mPending[b]);
        int32_t const rows = mPendingRows[b];
        mPending[b].clear();
        mPendingRows[b] = 0;
        mDrafters[b]->drafterAddFeatures(feats.data(), rows, start);
    }
    void drafterPropose(int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
        float const* uniforms, Draft& out) override
    {
        size_t const b = index(slot);
        device();
        mDrafters[b]->drafterPropose(anchor, pos, rows, temperature, uniforms, out);
    }

    // ---- prefix reuse across slots (core/prefixCache.h SharedPrefixCache): host copies of a slot's device state
    bool keepsPrefix() const override
    {
        return true;
    }
    std::shared_ptr<TargetSnapshot const> targetSnapshot(int32_t slot) override
    {
        index(slot);
        device();
        return targetSnapshotOf(mLinear, mRing, slot, mStream);
    }
    std::shared_ptr<PrefixCopy const> prefixCopy(int32_t slot, int32_t n, bool drafter) override
    {
        size_t const b = index(slot);
        device();
        return hostPrefixCopy(mKV, slot, mLength[b], n, drafter ? &mDrafters[b]->draftKV() : nullptr, mPending[b],
            mPendingRows[b], featureRowBytes(), mStream);
    }
    void prefixRestore(
        int32_t slot, PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter) override
    {
        size_t const b = index(slot);
        auto const& c = dynamic_cast<HostPrefixCopy const&>(rows);
        if (length < 0 || length > c.n)
        {
            throw Error(DFL2_ERR_INTERNAL, "a prefix restore to length " + std::to_string(length) + " of a copy of "
                    + std::to_string(c.n));
        }
        device();
        forget(slot);
        mKV.length = *std::max_element(mLength.begin(), mLength.end());  // the rows a growth keeps, in every slot
        mKV.reserve(c.n, mStream);
        mKV.loadRows(c.target, c.n, slot, mStream);
        mLength[b] = length;
        restoreTargetState(mLinear, mRing, slot, state, mStream);
        if (drafter)
        {
            mDrafters[b]->drafterLoad(c, length);
        }
    }

private:
    //! Where a piece of a call puts its logits: row j at logits + j * V, or (lastOnly) its last row at logits;
    //! nullptr: nowhere (a long prompt's earlier chunks under last_logits)
    struct CallOut
    {
        float* logits;
        bool lastOnly;
    };
    void setUp();
    void releaseAll() noexcept;
    void device()
    {
        cudaCheck(cudaSetDevice(mModel.device), "cudaSetDevice");
    }
    size_t index(int32_t slot) const
    {
        if (slot < 0 || slot >= mSlots)
        {
            throw Error(DFL2_ERR_INTERNAL, "slot " + std::to_string(slot) + " outside the batch's " + std::to_string(mSlots));
        }
        return static_cast<size_t>(slot);
    }
    size_t featureRowBytes() const
    {
        return static_cast<size_t>(mFeatDim) * mFeatElem;
    }
    void forget(int32_t slot)
    {
        size_t const b = index(slot);
        mFeatures[b].clear();
        mFeatureRows[b] = 0;
        mPending[b].clear();
        mPendingRows[b] = 0;
    }
    nv::IExecutionContext& context(int32_t profile);
    //! One engine call: `part` (cacheLength = each slot's length now) batched on the step profile, or (single) its
    //! one sequence at batch 1 on the prefill profile. Appends the new rows to the slots' caches and features.
    void call(std::vector<SlotRows> const& part, std::vector<CallOut> const& out, bool single);
    void keepRows(std::vector<SlotRows> const& part, std::vector<SlotRows> const& planned, int32_t S, bool everyRow);
    void readRows(std::vector<SlotRows> const& part, std::vector<SlotRows> const& planned, RaggedBatch const& rb,
        std::vector<CallOut> const& out);

    int32_t mSlots;
    cudaStream_t mStream{nullptr};
    CudaOps mOps;
    void* mScratch{nullptr};  //!< the target engine's, shared by its contexts (one stream, in order)
    std::map<int32_t, std::unique_ptr<nv::IExecutionContext>> mContexts;  //!< per profile
    std::map<std::string, IOTensor> mTio;
    DeviceKV mKV;
    DeviceLinearState mLinear;     //!< a hybrid target's linear layers, one row per slot (inactive otherwise)
    DeviceWindowRing mRing;        //!< a sliding target's rings, one per slot (inactive otherwise)
    std::vector<int32_t> mLength;  //!< per slot: its cached positions
    std::vector<std::string> mPast, mPresent;
    int64_t mChunk{0}, mStepRows{0};
    int32_t mStepProfile{0}, mPrefillProfile{0};
    int64_t mFeatDim{0};
    size_t mFeatElem{4};
    std::vector<std::vector<char>> mFeatures;  //!< per slot: [rows, F] raw bytes of its latest target forward
    std::vector<int32_t> mFeatureRows;
    std::vector<std::vector<char>> mPending;   //!< per slot: [rows, F] queued for its drafter
    std::vector<int32_t> mPendingRows;
    std::vector<std::unique_ptr<TrtRunners>> mDrafters;  //!< per slot: drafter-only
};

TrtBatchRunners::TrtBatchRunners(TrtModel& model, int32_t slots)
    : TrtShapes(model)
    , mSlots(slots)
    , mLength(static_cast<size_t>(slots), 0)
    , mFeatures(static_cast<size_t>(slots))
    , mFeatureRows(static_cast<size_t>(slots), 0)
    , mPending(static_cast<size_t>(slots))
    , mPendingRows(static_cast<size_t>(slots), 0)
{
    try
    {
        setUp();
    }
    catch (...)  // free what was made (no destructor runs)
    {
        releaseAll();
        throw;
    }
}

void TrtBatchRunners::setUp()
{
    Manifest const& m = mModel.manifest;
    device();
    cudaCheck(cudaStreamCreateWithFlags(&mStream, cudaStreamNonBlocking), "cudaStreamCreate");
    int32_t const maxCap = (m.maxSeqLen + m.kvCapacityStep - 1) / m.kvCapacityStep * m.kvCapacityStep;
    Engine const& te = mModel.engine("target");
    mPast = targetKvNames(m, "past_key_values");
    mPresent = targetKvNames(m, "present");
    mKV = DeviceKV{&mOps, m.kvLayers(), m.targetKvHeads, m.targetHeadDim, elementSize(te.types.at(mPast[0])),
        m.kvCapacityStep, maxCap, 0, 0, {}, mSlots};
    mStepProfile = te.profileIndex("step");
    mPrefillProfile = te.profileIndex("prefill");
    mChunk = te.maxDim("prefill", "sequence");
    mStepRows = te.maxDim("step", "sequence");
    if (m.hasLinearLayers())  // a call of a hybrid target takes at most max_rows_per_call rows per sequence
    {
        mChunk = std::min<int64_t>(mChunk, m.linearState.maxRowsPerCall);
        mStepRows = std::min<int64_t>(mStepRows, m.linearState.maxRowsPerCall);
    }
    if (profilesMaxBatch(te.profiles) < mSlots)  // (dfl2_batch_create refuses more slots than the model's maxBatch)
    {
        throw Error(DFL2_ERR_INTERNAL, "the target engine takes fewer sequences per call than the batch's slots");
    }
    mFeatDim = te.engine->getTensorShape("context_features").d[2];
    mFeatElem = elementSize(te.types.at("context_features"));
    // rows of one call: a batched step's slots x step rows, or one prompt chunk; the mask adds the capacity per row
    int64_t const R = std::max<int64_t>(mChunk, mSlots * mStepRows);
    int64_t const W = std::max<int64_t>(maxCap + mChunk, mSlots * (maxCap + mStepRows));
    TrtRunners::tensor(mTio, te, "input_ids", {1, R}, true);
    TrtRunners::tensor(mTio, te, "position_ids", {1, R}, true);
    TrtRunners::tensor(mTio, te, "attention_mask", {1, W}, true);
    TrtRunners::tensor(mTio, te, "logits", {1, R, m.vocabSize}, true);
    TrtRunners::tensor(mTio, te, "context_features", {1, R, mFeatDim}, true);
    for (std::string const& p : mPresent)
    {
        TrtRunners::tensor(mTio, te, p, {1, m.targetKvHeads, R, m.targetHeadDim}, false);
    }
    if (m.hasLinearLayers())
    {
        mLinear.allocate(m, te, mSlots, mStream);
        linearTensors(mTio, te, m, mSlots, R);
    }
    if (m.hasSlidingLayers())
    {
        ringTensors(mRing, mTio, te, m, mSlots, R, mOps, mStream);
    }
    for (std::string const& p : mPast)  // bound to the batched cache [slots, heads, capacity, d]
    {
        checkBindingShape(te.key, p, dimsVector(te.engine->getTensorShape(p.c_str())),
            {mSlots, m.targetKvHeads, maxCap, m.targetHeadDim});
    }
    cudaCheck(cudaMalloc(&mScratch, static_cast<size_t>(std::max<int64_t>(1, te.engine->getDeviceMemorySizeV2()))),
        "cudaMalloc scratch");
    for (int32_t b = 0; b < mSlots; ++b)
    {
        mDrafters.push_back(std::make_unique<TrtRunners>(mModel, false));
        if (mDrafters.back()->featureRowBytes() != featureRowBytes())
        {
            throw Error(DFL2_ERR_CORRUPT, "the target engine's context_features rows (" + std::to_string(featureRowBytes())
                    + " bytes) are not the drafter context engine's (" + std::to_string(mDrafters.back()->featureRowBytes())
                    + "): rebuild with dflash2 build-engines");
        }
    }
}

void TrtBatchRunners::releaseAll() noexcept
{
    if (mStream != nullptr)
    {
        cudaStreamSynchronize(mStream);
    }
    mDrafters.clear();
    mContexts.clear();
    freeIo(mTio);
    if (mScratch != nullptr)
    {
        cudaFree(mScratch);
        mScratch = nullptr;
    }
    mKV.release();
    mLinear.release();
    mRing.release();
    destroyStream(mStream);
}

nv::IExecutionContext& TrtBatchRunners::context(int32_t profile)
{
    auto it = mContexts.find(profile);
    if (it != mContexts.end())
    {
        return *it->second;
    }
    Engine const& e = mModel.engine("target");
    std::unique_ptr<nv::IExecutionContext> ctx(
        e.engine->createExecutionContext(nv::ExecutionContextAllocationStrategy::kUSER_MANAGED));
    if (!ctx)
    {
        throw Error(DFL2_ERR_BACKEND, "TensorRT could not create an execution context for " + e.key);
    }
    ctx->setDeviceMemoryV2(mScratch, std::max<int64_t>(1, e.engine->getDeviceMemorySizeV2()));
    if (!ctx->setOptimizationProfileAsync(profile, mStream))
    {
        throw Error(DFL2_ERR_BACKEND, e.key + ": cannot select optimization profile " + std::to_string(profile));
    }
    return *(mContexts[profile] = std::move(ctx));
}

void TrtBatchRunners::targetForward(std::vector<SlotRows> const& seqs, bool lastLogits, std::vector<float>& logits)
{
    device();
    size_t const V = static_cast<size_t>(mModel.vocabSize);
    size_t total = 0;
    for (SlotRows const& s : seqs)
    {
        total += s.ids.size();
    }
    logits.assign((lastLogits ? seqs.size() : total) * V, 0.0F);
    std::vector<SlotRows> batched;
    std::vector<CallOut> batchedOut;
    size_t row = 0;
    for (size_t i = 0; i < seqs.size(); ++i)
    {
        SlotRows const& s = seqs[i];
        size_t const b = index(s.slot);
        if (s.cacheLength != mLength[b] || s.ids.empty())
        {
            throw Error(DFL2_ERR_INTERNAL, "slot " + std::to_string(s.slot) + " holds " + std::to_string(mLength[b])
                    + " positions, the call says " + std::to_string(s.cacheLength));
        }
        mFeatures[b].clear();
        mFeatureRows[b] = 0;
        float* dst = logits.data() + (lastLogits ? i : row) * V;
        row += s.ids.size();
        if (static_cast<int64_t>(s.ids.size()) <= mStepRows)
        {
            batched.push_back(s);
            batchedOut.push_back(CallOut{dst, lastLogits});
            continue;
        }
        // a long prompt: alone, in chunks of the prefill profile's rows
        size_t const chunk = static_cast<size_t>(mChunk);
        for (size_t a = 0; a < s.ids.size(); a += chunk)
        {
            size_t const m = std::min(chunk, s.ids.size() - a);
            bool const last = a + m == s.ids.size();
            SlotRows piece{s.slot, mLength[b], std::vector<int32_t>(s.ids.begin() + static_cast<long>(a),
                                                    s.ids.begin() + static_cast<long>(a + m))};
            CallOut const o = lastLogits ? CallOut{last ? dst : nullptr, true} : CallOut{dst + a * V, false};
            call({piece}, {o}, true);
        }
    }
    if (!batched.empty())
    {
        call(batched, batchedOut, false);
    }
}

void TrtBatchRunners::call(std::vector<SlotRows> const& part, std::vector<CallOut> const& out, bool single)
{
    Engine const& e = mModel.engine("target");
    int32_t need = 0;
    for (SlotRows const& s : part)
    {
        need = std::max(need, mLength[index(s.slot)] + static_cast<int32_t>(s.ids.size()));
    }
    mKV.length = *std::max_element(mLength.begin(), mLength.end());  // the rows a growth keeps, in every slot
    mKV.reserve(need, mStream);
    int32_t const C = mKV.capacity;
    // single: the sequence at batch row 0 of a B = 1 call, bound to its slot's part of the cache
    std::vector<SlotRows> planned = part;
    if (single)
    {
        planned[0].slot = 0;
    }
    RaggedBatch const rb = planRaggedBatch(planned, C, single ? 1 : mSlots);
    int32_t const B = rb.batch;
    int32_t const S = rb.rows;
    writeInts(mTio["input_ids"], 0, rb.inputIds.data(), rb.inputIds.size());
    writeInts(mTio["position_ids"], 0, rb.positionIds.data(), rb.positionIds.size());
    writeInts(mTio["attention_mask"], 0, rb.attentionMask.data(), rb.attentionMask.size());
    std::map<std::string, std::vector<int64_t>> shapes{
        {"input_ids", {B, S}}, {"position_ids", {B, S}}, {"attention_mask", {B, C + S}}};
    std::map<std::string, void*> addr = deviceAddresses(mTio);
    for (size_t i = 0; i < mPast.size(); ++i)
    {
        shapes[mPast[i]] = {B, mKV.heads, C, mKV.headDim};
        addr[mPast[i]] = single ? mKV.slotPointer(i, part[0].slot) : mKV.ptrs[i];
    }
    // a hybrid target: a batched call records every row's state (a verify may roll back), a prompt chunk its last
    // row's (never rolled back); the state inputs from the slot's row (single) or the batch's first B rows
    bool const everyRow = !single;
    if (mLinear.active())
    {
        bindLinear(mLinear, mTio, single ? part[0].slot : 0, B, S, everyRow, shapes, addr);
        for (int32_t b = 0; b < mSlots; ++b)  // this call overwrites the outputs the others' last calls left
        {
            mLinear.log->reset(b);
        }
    }
    if (mRing.active())  // the rings of batch rows 0..B-1 (batch row = slot), or the one sequence's slot's at row 0
    {
        std::vector<int32_t> slotOfRow(static_cast<size_t>(B));
        for (int32_t b = 0; b < B; ++b)
        {
            slotOfRow[static_cast<size_t>(b)] = single ? part[0].slot : b;
        }
        bindRing(mRing, mTio, mModel.manifest, slotOfRow, single, shapes, addr);
    }
    nv::IExecutionContext& ctx = context(single ? mPrefillProfile : mStepProfile);
    TrtRunners::bind(e, ctx, shapes, addr, true);
    size_t const n = static_cast<size_t>(B) * static_cast<size_t>(S);
    size_t const V = static_cast<size_t>(mModel.vocabSize);
    auto h2d = [&](char const* name, size_t count) {
        IOTensor& t = mTio[name];
        cudaCheck(cudaMemcpyAsync(t.dev, t.host, count * elementSize(t.type), cudaMemcpyHostToDevice, mStream),
            "H2D batched target input");
    };
    h2d("input_ids", n);
    h2d("position_ids", n);
    h2d("attention_mask", rb.attentionMask.size());
    if (mLinear.active())
    {
        h2d(kSTATE_ROWS, static_cast<size_t>(everyRow ? S : 1));
    }
    if (mRing.active())
    {
        h2d(kWINDOW_POSITIONS, static_cast<size_t>(B) * static_cast<size_t>(mRing.ringSlots()));
    }
    if (!ctx.enqueueV3(mStream))
    {
        throw Error(DFL2_ERR_BACKEND, "TensorRT execution of the batched target failed (see the TensorRT log)");
    }
    IOTensor& lg = mTio["logits"];
    IOTensor& ft = mTio["context_features"];
    cudaCheck(cudaMemcpyAsync(lg.host, lg.dev, n * V * elementSize(lg.type), cudaMemcpyDeviceToHost, mStream),
        "D2H logits");
    cudaCheck(cudaMemcpyAsync(ft.host, ft.dev, n * featureRowBytes(), cudaMemcpyDeviceToHost, mStream), "D2H features");
    keepRows(part, planned, S, everyRow);
    cudaCheck(cudaStreamSynchronize(mStream), "batched target sync");
    readRows(part, planned, rb, out);
}

// commit a call's new rows (device copies on the stream): each sequence's present K/V, linear state and ring rows at
// its slot's own length (`planned`: the call's batch row of each sequence of `part`)
void TrtBatchRunners::keepRows(
    std::vector<SlotRows> const& part, std::vector<SlotRows> const& planned, int32_t S, bool everyRow)
{
    std::vector<void*> present;
    for (std::string const& p : mPresent)
    {
        present.push_back(mTio[p].dev);
    }
    for (size_t i = 0; i < part.size(); ++i)
    {
        int32_t const rows = static_cast<int32_t>(part[i].ids.size());
        mKV.appendRows(present, S, planned[i].slot, rows, part[i].slot, mLength[index(part[i].slot)], mStream);
        if (mLinear.active())
        {
            mLinear.called(mTio, part[i].slot, planned[i].slot, mLength[index(part[i].slot)], rows, S, everyRow, mStream);
        }
        if (mRing.active())
        {
            placeRows(mRing, mTio, mModel.manifest, S, planned[i].slot, part[i].slot, mLength[index(part[i].slot)],
                rows, mStream);
        }
    }
}

// after the call's sync: each sequence's logits (every row, or its last) into its CallOut, its features kept for its
// drafter, its slot's length advanced
void TrtBatchRunners::readRows(std::vector<SlotRows> const& part, std::vector<SlotRows> const& planned,
    RaggedBatch const& rb, std::vector<CallOut> const& out)
{
    size_t const V = static_cast<size_t>(mModel.vocabSize);
    IOTensor& lg = mTio["logits"];
    IOTensor& ft = mTio["context_features"];
    for (size_t i = 0; i < part.size(); ++i)
    {
        size_t const b = index(part[i].slot);
        int32_t const rows = static_cast<int32_t>(part[i].ids.size());
        for (int32_t j = 0; j < rows; ++j)
        {
            size_t const r = rb.row(planned[i], j);
            float* dst = out[i].logits == nullptr ? nullptr
                : out[i].lastOnly                 ? (j == rows - 1 ? out[i].logits : nullptr)
                                                  : out[i].logits + static_cast<size_t>(j) * V;
            for (size_t v = 0; dst != nullptr && v < V; ++v)
            {
                dst[v] = readFloat(lg, r * V + v);
            }
            char const* f = static_cast<char const*>(ft.host) + r * featureRowBytes();
            mFeatures[b].insert(mFeatures[b].end(), f, f + featureRowBytes());
        }
        mFeatureRows[b] += rows;
        mLength[b] += rows;
    }
}

std::unique_ptr<BatchRunners> newTrtBatchRunners(TrtModel& model, int32_t slots)
{
    return std::make_unique<TrtBatchRunners>(model, slots);
}

} // namespace

std::unique_ptr<Model> loadTensorRTModel(Manifest const& manifest, std::string const& dir, Options const& options)
{
    return std::make_unique<TrtModel>(manifest, dir, options);
}

} // namespace dflash2
