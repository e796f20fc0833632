//! \file ortBackend.cpp
//! The ONNX Runtime backend: an export folder's graphs run by libonnxruntime on the CPU, through its C API (opened at
//! run time, ortApi.h). The twin of dflash2_trt/runtime/ort/backend.py with its custom-op library off (the graphs
//! the Python backend runs where libdflash2_ort_ops.so is not found):
//!
//!   target            target_ort.onnx (the fused flavour: GroupQueryAttention writes each call's K/V rows into the
//!                     bound capacity buffers, past and present one buffer) when the export has it, else target.onnx
//!                     (the whole buffer in, the new rows out, appended here); a hybrid target (manifest version
//!                     3: Gated DeltaNet "linear" layers beside attention layers) runs target.onnx with every
//!                     layer's state in layer order (KV of an attention layer, convolution window and recurrent
//!                     state of a linear one) and state_rows, in calls of at most max_rows_per_call rows; a
//!                     sliding-window target (version 3: "sliding" layers) its sliding layers' rings (HostRing over
//!                     core/windowRing.h, the twin of runtime/kv.py WindowRing) and window_positions
//!   drafter           drafter_context.onnx (context K/V of committed positions), drafter_block.onnx (the block's
//!                     hidden states over the context), drafter_head_<mode>.onnx (the selector: candidates, path,
//!                     proposal; greedy | viterbi), or drafter_head_independent.onnx (each row's logits; the drafts
//!                     core/decoder.h independentDraft makes of them, the twin of protocol.independent_draft)
//!
//! Exports: fp32, --quantize int4 (the *_ort variants with MatMulNBits; with the op library the target's exact ones
//! become PanelMatMulQ4, onnxRewrite.h) and fp16 (the standard graphs; KV caches, rings, convolution windows, context
//! features and hidden states in fp16 as the Python backend's be.dtype, recurrent states, logits and proposals
//! fp32): the element types are read from the sessions and checked across each graph boundary (checkTypes), and the
//! host buffers hold that many bytes an element. bf16 exports are refused, as the Python backend refuses them.
//!
//! The KV caches are host buffers [1, heads, capacity, head_dim] per layer, grown as the Python KVBuffer grows them
//! (a multiple of the export's kv_capacity_step, kv.grown_capacity), so every graph sees the inputs the Python
//! backend feeds, bit for bit. The fused target's buffers are bound once per capacity (an OrtIoBinding: past and
//! present the same OrtValue over the buffer); a call binds only its ids and its output rows (logits straight into
//! the core's buffer). A hybrid target's linear state (HostLinearState over core/linearState.h, the twin of
//! runtime/linear_state.py LinearStates) is per OrtRunners, so per session and per batch slot; its buffers are made
//! once, and a crop into the last call takes the kept row's window and recurrent state from that call's outputs (a
//! slice, never a recomputation). A session's caches stay between requests for its prefix reuse (core/prefixCache.h):
//! a hit crops the K/V and the drafter's context by their lengths and puts a linear or sliding target's state back from
//! an OrtTargetSnapshot (copies of the linear layers' windows and recurrent states, the rings, their positions and
//! floor). Options: "threads" (intra-op threads of every session; 0: ONNX Runtime's default) and
//! $DFLASH2_ORT_SPINNING (as the Python backend: 1, the default, lets the target session's workers spin; 0 none).
//!
//! Ownership and threads: an OrtModel owns its sessions, which ONNX Runtime runs concurrently; each OrtRunners (a
//! session's) owns one request's caches and bindings and is used by one thread at a time. A batch (dfl2_batch) holds
//! one OrtRunners per slot and runs the slots' rows one sequence after another, so a batched request's tokens are its
//! single run's.
#include "../core/linearState.h"
#include "../core/prefixCache.h"
#include "../core/windowRing.h"
#include "../model.h"
#include "onnxRewrite.h"
#include "ortApi.h"

#include <dlfcn.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <fstream>
#include <sstream>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dflash2
{

namespace
{

constexpr char const* kSPINNING_ENV = "DFLASH2_ORT_SPINNING";
constexpr char const* kOPS_ENV = "DFLASH2_ORT_OPS";        // the custom-op library (decode_attention.LIBRARY_ENV)
constexpr char const* kPANELS_ENV = "DFLASH2_ORT_PANELS";  // 0: keep ORT's MatMul, 1: PanelMatMul (decode_attention)
constexpr char const* kOPS_NAME = "libdflash2_ort_ops.so";

//! decode_attention.find_library: the "ort_ops_library" option, else $DFLASH2_ORT_OPS (a file, else none), else
//! libdflash2_ort_ops.so beside libdflash2 -> "" when none
std::string findOpsLibrary(std::string const& option)
{
    auto isFile = [](std::string const& p) { return !p.empty() && std::ifstream(p).good(); };
    if (!option.empty())
    {
        if (!isFile(option))
        {
            throw Error(DFL2_ERR_NOT_FOUND, "option ort_ops_library: no file " + option);
        }
        return option;
    }
    char const* env = std::getenv(kOPS_ENV);
    if (env != nullptr && env[0] != '\0')
    {
        return isFile(env) ? std::string(env) : std::string();
    }
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(&findOpsLibrary), &info) != 0 && info.dli_fname != nullptr)
    {
        std::string const self = info.dli_fname;
        std::string const beside = self.substr(0, self.rfind('/') + 1) + kOPS_NAME;
        if (self.find('/') != std::string::npos && isFile(beside))
        {
            return beside;
        }
    }
    return "";
}

//! decode_attention.panels_wanted: $DFLASH2_ORT_PANELS, else where the library's kernels run AVX-512
bool panelsWanted(std::string const& ops)
{
    char const* v = std::getenv(kPANELS_ENV);
    if (v != nullptr)
    {
        return std::string(v) != "0";
    }
    void* h = ::dlopen(ops.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr)
    {
        return false;
    }
    using Isa = int32_t (*)();
    auto const isa = reinterpret_cast<Isa>(::dlsym(h, "dflash2OrtKernelIsa"));
    return isa != nullptr && isa() == 512;  // the handle stays open: ORT opens the same file for the sessions
}

std::string readFile(std::string const& path)
{
    std::ifstream f(path, std::ios::binary);
    if (!f)
    {
        throw Error(DFL2_ERR_NOT_FOUND, "cannot read " + path);
    }
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

//! kv.grown_capacity: the capacity holding n positions (capacity when it fits, else n rounded up to a multiple of
//! step, at most maxCapacity); beyond maxCapacity DFL2_ERR_TOO_LONG.
int32_t grownCapacity(int32_t n, int32_t capacity, int32_t step, int32_t maxCapacity)
{
    if (n > maxCapacity)
    {
        throw Error(DFL2_ERR_TOO_LONG, "sequence of " + std::to_string(n) + " positions exceeds the exported cache "
            "capacity " + std::to_string(maxCapacity) + " (re-export with a larger --max-seq-len)");
    }
    if (n <= capacity)
    {
        return capacity;
    }
    return std::min(maxCapacity, (n + step - 1) / step * step);
}

//! Bytes of one element of a tensor type the graphs exchange in floating point (fp32, or an fp16 export's fp16).
size_t elementBytes(ONNXTensorElementDataType type)
{
    return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4;
}

//! kv.KVBuffer: K/V of one sequence, 2 buffers per layer [1, heads, capacity, dim] of the graph's element type (fp32,
//! fp16: elem bytes each). Slots 0..length-1 hold positions 0..length-1; the others are stale (masked or past the
//! attention's length). Growing copies the held positions into zeroed buffers (as the Python buffer does); cropping
//! only lowers the length.
struct HostKV
{
    HostKV(int32_t layers, int32_t heads_, int32_t dim_, int32_t step_, int32_t maxLength, size_t elem_)
        : count(2 * layers)
        , heads(heads_)
        , dim(dim_)
        , step(std::max(1, step_))
        , maxCapacity((maxLength + std::max(1, step_) - 1) / std::max(1, step_) * std::max(1, step_))
        , elem(elem_)
    {
    }
    //! bytes of one position of one head
    size_t rowBytes() const
    {
        return static_cast<size_t>(dim) * elem;
    }
    //! room for n positions -> whether the buffers were reallocated (bindings over them are then stale)
    bool reserve(int32_t n)
    {
        int32_t const cap = grownCapacity(n, capacity, step, maxCapacity);
        if (cap == capacity)
        {
            return false;
        }
        size_t const rb = rowBytes();
        std::vector<std::vector<char>> grown(static_cast<size_t>(count));
        for (size_t a = 0; a < grown.size(); ++a)
        {
            grown[a].assign(static_cast<size_t>(heads) * static_cast<size_t>(cap) * rb, 0);
            for (size_t h = 0; h < static_cast<size_t>(heads) && !arrays.empty(); ++h)
            {
                std::memcpy(grown[a].data() + h * static_cast<size_t>(cap) * rb,
                    arrays[a].data() + h * static_cast<size_t>(capacity) * rb, static_cast<size_t>(length) * rb);
            }
        }
        arrays = std::move(grown);
        capacity = cap;
        return true;
    }
    //! a copy of positions < n: [count][heads, n, dim] (append's layout)
    std::vector<std::vector<char>> rowsOf(int32_t n) const
    {
        size_t const rb = rowBytes();
        std::vector<std::vector<char>> rows(static_cast<size_t>(count));
        for (size_t a = 0; a < rows.size() && !arrays.empty(); ++a)
        {
            rows[a].resize(static_cast<size_t>(heads) * static_cast<size_t>(n) * rb);
            for (size_t h = 0; h < static_cast<size_t>(heads); ++h)
            {
                std::memcpy(rows[a].data() + h * static_cast<size_t>(n) * rb,
                    arrays[a].data() + h * static_cast<size_t>(capacity) * rb, static_cast<size_t>(n) * rb);
            }
        }
        return rows;
    }
    //! rows [count][heads, m, dim] -> slots length..length+m-1
    void append(std::vector<std::vector<char>> const& rows, int32_t m)
    {
        reserve(length + m);
        size_t const rb = rowBytes();
        for (size_t a = 0; a < arrays.size(); ++a)
        {
            for (size_t h = 0; h < static_cast<size_t>(heads); ++h)
            {
                std::memcpy(arrays[a].data() + (h * static_cast<size_t>(capacity) + static_cast<size_t>(length)) * rb,
                    rows[a].data() + h * static_cast<size_t>(m) * rb, static_cast<size_t>(m) * rb);
            }
        }
        length += m;
    }
    std::vector<int64_t> shape() const
    {
        return {1, heads, capacity, dim};
    }
    std::vector<int64_t> validMask() const
    {
        std::vector<int64_t> mask(static_cast<size_t>(capacity), 0);
        std::fill_n(mask.begin(), length, 1);
        return mask;
    }

    int32_t count;
    int32_t heads;
    int32_t dim;
    int32_t step;
    int32_t maxCapacity;
    size_t elem;  //!< bytes per element
    int32_t length{0};
    int32_t capacity{0};
    std::vector<std::vector<char>> arrays;
};

//! linear_state.LinearStates of one sequence over host buffers (core/linearState.h): per linear layer the window and
//! recurrent state the next call is fed, their copies from before the last call, and the last call's outputs (the
//! convolution inputs [conv_dim, S] and the asked rows' recurrent states [R, heads, dk, dv]); every buffer is
//! allocated once, for the graph's largest call (max_rows_per_call rows).
struct HostLinearState
{
    struct Layer
    {
        std::vector<char> window;  //!< the convolution's (window, windowBefore, inputs): convElem bytes an element
        std::vector<float> recurrent;
        std::vector<char> windowBefore;
        std::vector<float> recurrentBefore;
        std::vector<char> inputs;
        std::vector<float> states;
        size_t convElem{4};

        LinearLayerState view()
        {
            return LinearLayerState{window.data(), recurrent.data(), windowBefore.data(), recurrentBefore.data(),
                inputs.data(), states.data(), convElem, sizeof(float)};
        }
    };

    //! convElem: bytes of a convolution window element (fp32; fp16 in an fp16 export); recurrent states are fp32
    HostLinearState(Manifest const& m, size_t convElem)
        : spec(m.linearState)
        , log(m.linearState.window(), 1, plantedLinearRollback())
    {
        size_t const rows = static_cast<size_t>(spec.maxRowsPerCall);
        for (int32_t i = 0; i < m.targetLayers; ++i)
        {
            if (m.isLinear(i))
            {
                Layer l;
                l.convElem = convElem;
                l.window.assign(spec.windowElements() * convElem, 0);
                l.recurrent.assign(spec.recurrentElements(), 0.0F);
                l.windowBefore.assign(spec.windowElements() * convElem, 0);
                l.recurrentBefore.assign(spec.recurrentElements(), 0.0F);
                l.inputs.assign(static_cast<size_t>(spec.convDim) * rows * convElem, 0);
                l.states.assign(rows * spec.recurrentElements(), 0.0F);
                layers.push_back(std::move(l));
            }
        }
    }
    //! a new sequence: zero state, no call to roll back into
    void reset()
    {
        for (Layer& l : layers)
        {
            std::fill(l.window.begin(), l.window.end(), 0);
            std::fill(l.recurrent.begin(), l.recurrent.end(), 0.0F);
        }
        log.reset(0);
    }
    //! a call of S rows from position `start` left its outputs in inputs / states -> the state after its rows
    void called(int32_t start, int32_t S, bool everyRow)
    {
        KeptState const kept = log.called(0, start, S, S, everyRow);
        for (Layer& l : layers)
        {
            saveBefore(l.view(), spec, copy);
            applyKept(l.view(), spec, kept, copy);
        }
    }
    //! the sequence keeps positions 0..length-1 (length before the end of the last call): the kept rows' state
    void crop(int32_t length)
    {
        if (std::optional<KeptState> const kept = log.crop(0, length))
        {
            for (Layer& l : layers)
            {
                applyKept(l.view(), spec, *kept, copy);
            }
        }
    }

    LinearStateSpec spec;
    LinearStateLog log;
    HostStateCopy copy;
    std::vector<Layer> layers;
};

//! kv.WindowRing of one sequence over host buffers (core/windowRing.h): per sliding layer a key and a value ring
//! [heads, ringSlots, dim] (allocated once: the layer's memory, whatever the context) and the ring's window positions.
struct HostRing
{
    //! elem: bytes of a K/V element (fp32; fp16 in an fp16 export)
    HostRing(Manifest const& m, size_t elem)
        : log(m.slidingWindow, 1, plantedRingKeepCut())
        , heads(m.targetKvHeads)
        , rowBytes(static_cast<size_t>(m.targetHeadDim) * elem)
        , arrays(2 * static_cast<size_t>(m.layersOf("sliding")),
              std::vector<char>(static_cast<size_t>(m.targetKvHeads) * static_cast<size_t>(m.slidingWindow.ringSlots)
                  * rowBytes, 0))
    {
    }
    //! a call of S rows from position `start` returned `rows` (per ring: [heads, S, dim]) -> into the rings
    void write(int32_t start, int32_t S, std::vector<std::vector<char>> const& rows)
    {
        size_t const R = static_cast<size_t>(log.spec().ringSlots);
        for (RingRun const& run : log.place(0, start, S))
        {
            for (size_t a = 0; a < arrays.size(); ++a)
            {
                for (size_t h = 0; h < static_cast<size_t>(heads); ++h)
                {
                    std::memcpy(arrays[a].data() + (h * R + static_cast<size_t>(run.slot)) * rowBytes,
                        rows[a].data() + (h * static_cast<size_t>(S) + static_cast<size_t>(run.first)) * rowBytes,
                        static_cast<size_t>(run.count) * rowBytes);
                }
            }
        }
    }

    WindowRingLog log;
    int32_t heads;
    size_t rowBytes;  //!< one position of one head
    std::vector<std::vector<char>> arrays;  //!< 2 per sliding layer, in layer order
};

//! One graph's session (owned: released with the Graph, also when a model's construction fails midway) and its
//! interface (names in the graph's order).
struct Graph
{
    Graph() = default;
    Graph(Graph&& o) noexcept
    {
        *this = std::move(o);
    }
    Graph& operator=(Graph&& o) noexcept
    {
        std::swap(api, o.api);
        std::swap(session, o.session);
        key = std::move(o.key);
        file = std::move(o.file);
        inputs = std::move(o.inputs);
        outputs = std::move(o.outputs);
        shapes = std::move(o.shapes);
        types = std::move(o.types);
        return *this;
    }
    Graph(Graph const&) = delete;
    Graph& operator=(Graph const&) = delete;
    ~Graph()
    {
        if (session != nullptr)
        {
            api->ReleaseSession(session);
        }
    }

    OrtApi const* api{nullptr};
    std::string key;
    std::string file;
    OrtSession* session{nullptr};
    std::vector<std::string> inputs;
    std::vector<std::string> outputs;
    std::map<std::string, std::vector<int64_t>> shapes;  //!< tensor name -> dims (-1: symbolic)
    std::map<std::string, ONNXTensorElementDataType> types;  //!< tensor name -> element type

    bool hasInput(std::string const& name) const
    {
        return std::find(inputs.begin(), inputs.end(), name) != inputs.end();
    }
};

std::vector<std::string> kvNames(int32_t layers, std::string const& prefix)
{
    std::vector<std::string> out;
    for (int32_t i = 0; i < layers; ++i)
    {
        out.push_back(prefix + "." + std::to_string(i) + ".key");
        out.push_back(prefix + "." + std::to_string(i) + ".value");
    }
    return out;
}

std::vector<char const*> cNames(std::vector<std::string> const& names)
{
    std::vector<char const*> out;
    for (std::string const& n : names)
    {
        out.push_back(n.c_str());
    }
    return out;
}

bool targetSpins()
{
    char const* v = std::getenv(kSPINNING_ENV);
    std::string const s = v != nullptr ? v : "1";
    if (s != "0" && s != "1")
    {
        throw Error(DFL2_ERR_OPTION_VALUE, std::string("$") + kSPINNING_ENV + "='" + s
            + "': expected 1 (the target session spins) or 0 (no session spins)");
    }
    return s == "1";
}

class OrtModel : public Model
{
public:
    OrtModel(Manifest const& m, std::string const& dir, Options const& o)
        : mManifest(m)
        , mDir(dir)
    {
        std::string const mode = o.getString("draft_mode", "greedy");
        mIndependent = mode == "independent";
        if (m.dtype == "bf16")
        {
            throw Error(DFL2_ERR_UNAVAILABLE, dir + " is a bf16 export: ONNX Runtime's CPU provider has no bf16 kernels, "
                "so neither libdflash2 nor the Python runtime runs it with ONNX Runtime (export --dtype fp32 or fp16)");
        }
        OrtLibrary const& lib = openOrtLibrary(o.getString("ort_library", ""));
        mApi = lib.api;
        mThreads = static_cast<int32_t>(o.getInt("threads", 0));
        ortCheck(mApi, mApi->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "dflash2", &mEnv.env), "CreateEnv");
        mEnv.api = mApi;
        bool const spin = targetSpins();
        mFused = m.graphs.count("target_ort") != 0;
        if (mFused && !m.kvOnly())
        {
            throw Error(DFL2_ERR_UNAVAILABLE, dir + " has a fused target_ort graph for a target with linear or sliding "
                "layers: libdflash2 runs such a target's standard target.onnx (re-export)");
        }
        // the custom-op library as the Python backend uses it (OrtBackend: attention "auto", the fused target)
        mOps = mFused ? findOpsLibrary(o.getString("ort_ops_library", "")) : std::string();
        mPanels = !mOps.empty() && panelsWanted(mOps);
        mTarget = open(mFused ? "target_ort" : "target", spin, kTARGET);
        mContext = open(variant("drafter_context"), false, kDRAFTER);
        mBlock = open(libraryGraph("drafter_block_layers", "drafter_block"), false, kDRAFTER);
        mHead = open(mIndependent ? variant(headKey(mode, false)) : libraryGraph(headKey(mode, true), headKey(mode, false)),
            false, kDRAFTER);

        backend = "onnxruntime";
        vocabSize = m.vocabSize;
        blockSize = m.blockSize;
        topK = m.topK;
        maxPositions = m.maxSeqLen;
        maxBatch = kMAX_BATCH;
        eosIds = m.eosTokenIds;
        note = "ONNX Runtime " + lib.version + " (" + lib.how + ": " + lib.path + "), CPU, graphs "
            + mTarget.file + " + " + mContext.file + ", " + mBlock.file + ", " + mHead.file + ", attention "
            + (mRewritten ? "DecodeAttention" : "GroupQueryAttention") + (mPanels && mRewritten ? " + PanelMatMul" : "")
            + (mOps.empty() ? ", no op library" : ", op library " + mOps) + ", intra-op threads "
            + (mThreads > 0 ? std::to_string(mThreads) : std::string("ONNX Runtime's default"))
            + (mSwaps.fp32 + mSwaps.int4 > 0 ? ", panels " + std::to_string(mSwaps.fp32) + " PanelMatMul + "
                      + std::to_string(mSwaps.int4) + " PanelMatMulQ4"
                                             : std::string())
            + (m.dtype != "fp32" ? ", " + m.dtype + " caches" : std::string());
        mFeatureDim = static_cast<int32_t>(featureDim());
        checkInterface();
        checkTypes();
    }
    std::unique_ptr<Runners> newRunners() override;
    std::unique_ptr<BatchRunners> newBatchRunners(int32_t slots) override;

    OrtApi const* api() const
    {
        return mApi;
    }
    Manifest const& manifest() const
    {
        return mManifest;
    }
    bool fused() const
    {
        return mFused;
    }
    //! the fused target rewritten with DecodeAttention (takes past_seqlens and logits_index)
    bool rewritten() const
    {
        return mRewritten;
    }
    int32_t featureDim() const
    {
        auto const it = mTarget.shapes.find("context_features");
        return it != mTarget.shapes.end() && it->second.size() == 3 && it->second[2] > 0 ? static_cast<int32_t>(it->second[2])
                                                                                          : 0;
    }
    int32_t fdim() const
    {
        return mFeatureDim;
    }
    Graph const& target() const
    {
        return mTarget;
    }
    Graph const& context() const
    {
        return mContext;
    }
    Graph const& block() const
    {
        return mBlock;
    }
    Graph const& head() const
    {
        return mHead;
    }
    //! the head is drafter_head_independent (each row's logits; no selector)
    bool independent() const
    {
        return mIndependent;
    }
    //! element types of the target's KV, its context features, the drafter's context K/V and the block's hidden
    //! states: fp32, or fp16 in an fp16 export (the Python backend's be.dtype)
    ONNXTensorElementDataType targetKvType() const
    {
        return mTargetKvType;
    }
    ONNXTensorElementDataType featureType() const
    {
        return mFeatureType;
    }
    ONNXTensorElementDataType drafterKvType() const
    {
        return mDrafterKvType;
    }
    ONNXTensorElementDataType hiddenType() const
    {
        return mHiddenType;
    }
    //! a hybrid target's convolution windows (past_conv / present_conv): fp32, or fp16 in an fp16 export; the
    //! recurrent states are fp32 in every export
    ONNXTensorElementDataType convType() const
    {
        return mConvType;
    }

    static constexpr int32_t kMAX_BATCH = 16;

private:
    enum Kind
    {
        kTARGET,
        kDRAFTER
    };

    //! OrtBackend.session: the ONNX Runtime variant K_ort of a graph where the fused flavour runs and the export has it
    std::string variant(std::string const& key) const
    {
        return mFused && mManifest.graphs.count(key + "_ort") != 0 ? key + "_ort" : key;
    }

    //! OrtBackend._library_graph: a graph only the op library runs where it is in use and the standard one has no
    //! ONNX Runtime variant, else the standard one
    std::string libraryGraph(std::string const& libraryKey, std::string const& standard) const
    {
        if (!mOps.empty() && mManifest.graphs.count(libraryKey) != 0 && mManifest.graphs.count(standard + "_ort") == 0)
        {
            return libraryKey;
        }
        return variant(standard);
    }

    Graph open(std::string const& key, bool spin, Kind kind)
    {
        auto const it = mManifest.graphs.find(key);
        if (it == mManifest.graphs.end())
        {
            throw Error(DFL2_ERR_NOT_FOUND, mDir + " has no '" + key + "' graph (re-export)");
        }
        Graph g;
        g.api = mApi;
        g.key = key;
        g.file = it->second.file;
        OrtSessionOptions* so = nullptr;
        ortCheck(mApi, mApi->CreateSessionOptions(&so), "CreateSessionOptions");
        try
        {
            ortCheck(mApi, mApi->SetSessionLogSeverityLevel(so, 3), "SetSessionLogSeverityLevel");
            ortCheck(mApi, mApi->SetSessionGraphOptimizationLevel(so, ORT_ENABLE_ALL), "SetSessionGraphOptimizationLevel");
            if (mThreads > 0)
            {
                ortCheck(mApi, mApi->SetIntraOpNumThreads(so, mThreads), "SetIntraOpNumThreads");
            }
            ortCheck(mApi, mApi->AddSessionConfigEntry(so, "session.intra_op.allow_spinning", spin ? "1" : "0"),
                "AddSessionConfigEntry");
            std::string const path = mDir + "/" + g.file;
            // _Session: the fused target rewritten (DecodeAttention, PanelMatMul), a drafter graph's MatMuls swapped,
            // or a graph holding a library node as it is; each with the library registered
            std::string bytes;
            bool library = it->second.selector == "plugin" || key == "drafter_block_layers";
            if (!mOps.empty() && (kind == kTARGET || mPanels))
            {
                std::string const model = readFile(path);
                bytes = kind == kTARGET ? rewriteTarget(model, mPanels, &mSwaps) : swapMatMuls(model, &mSwaps);
                library = library || !bytes.empty();
                mRewritten = mRewritten || (kind == kTARGET && !bytes.empty());
            }
            if (library)
            {
                ortCheck(mApi, mApi->RegisterCustomOpsLibrary_V2(so, mOps.c_str()), "registering " + mOps);
                ortCheck(mApi, mApi->AddSessionConfigEntry(so, "session.model_external_initializers_file_folder_path",
                    mDir.c_str()), "AddSessionConfigEntry");
            }
            OrtStatus* st = bytes.empty()
                ? mApi->CreateSession(mEnv.env, path.c_str(), so, &g.session)
                : mApi->CreateSessionFromArray(mEnv.env, bytes.data(), bytes.size(), so, &g.session);
            ortCheck(mApi, st, "ONNX Runtime cannot load " + g.file);
#if defined(__GLIBC__)
            if (!bytes.empty())
            {
                ::malloc_trim(0);  // the folded panels freed the [K, N] weights (decode_attention.release_freed_memory)
            }
#endif
        }
        catch (...)
        {
            mApi->ReleaseSessionOptions(so);
            throw;
        }
        mApi->ReleaseSessionOptions(so);
        readInterface(g);
        return g;
    }

    void readInterface(Graph& g)
    {
        OrtAllocator* alloc = nullptr;
        ortCheck(mApi, mApi->GetAllocatorWithDefaultOptions(&alloc), "GetAllocatorWithDefaultOptions");
        for (bool const input : {true, false})
        {
            size_t n = 0;
            ortCheck(mApi, input ? mApi->SessionGetInputCount(g.session, &n) : mApi->SessionGetOutputCount(g.session, &n),
                "SessionGet*Count");
            for (size_t i = 0; i < n; ++i)
            {
                char* name = nullptr;
                ortCheck(mApi, input ? mApi->SessionGetInputName(g.session, i, alloc, &name)
                                     : mApi->SessionGetOutputName(g.session, i, alloc, &name),
                    "SessionGet*Name");
                std::string const s = name;
                ortCheck(mApi, mApi->AllocatorFree(alloc, name), "AllocatorFree");
                OrtTypeInfo* type = nullptr;
                ortCheck(mApi, input ? mApi->SessionGetInputTypeInfo(g.session, i, &type)
                                     : mApi->SessionGetOutputTypeInfo(g.session, i, &type),
                    "SessionGet*TypeInfo");
                OrtTensorTypeAndShapeInfo const* info = nullptr;
                std::vector<int64_t> dims;
                ONNXTensorElementDataType elem = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
                if (mApi->CastTypeInfoToTensorInfo(type, &info) == nullptr && info != nullptr)
                {
                    ortCheck(mApi, mApi->GetTensorElementType(info, &elem), "GetTensorElementType");
                    size_t rank = 0;
                    ortCheck(mApi, mApi->GetDimensionsCount(info, &rank), "GetDimensionsCount");
                    dims.resize(rank);
                    ortCheck(mApi, mApi->GetDimensions(info, dims.data(), rank), "GetDimensions");
                }
                mApi->ReleaseTypeInfo(type);
                (input ? g.inputs : g.outputs).push_back(s);
                g.shapes[s] = dims;
                g.types[s] = elem;
            }
        }
    }

    //! Each graph has the tensors this backend feeds and reads with the export's fixed sizes: a graph of another
    //! export is refused here, not met as a shape error mid-decode.
    void checkInterface() const
    {
        Manifest const& m = mManifest;
        auto need = [](Graph const& g, std::string const& name, std::vector<int64_t> const& want) {
            auto const it = g.shapes.find(name);
            bool ok = it != g.shapes.end() && it->second.size() == want.size();
            for (size_t i = 0; ok && i < want.size(); ++i)
            {
                ok = want[i] < 0 || it->second[i] < 0 || it->second[i] == want[i];
            }
            if (!ok)
            {
                std::string have = "missing";
                if (it != g.shapes.end())
                {
                    have = "[";
                    for (int64_t d : it->second)
                    {
                        have += (have.size() > 1 ? ", " : "") + std::to_string(d);
                    }
                    have += "]";
                }
                throw Error(DFL2_ERR_CORRUPT, g.file + ": tensor '" + name + "' is " + have
                    + " in the graph, not what the manifest says: the graph does not belong to this export (re-export)");
            }
        };
        int64_t const L = m.blockSize - 1;
        std::vector<int64_t> const tkv{-1, m.targetKvHeads, -1, m.targetHeadDim};
        std::vector<int64_t> const dkv{-1, m.drafterKvHeads, -1, m.drafterHeadDim};
        need(mTarget, "input_ids", {-1, -1});
        need(mTarget, "logits", {-1, -1, m.vocabSize});
        need(mTarget, "context_features", {-1, -1, -1});
        if (mFeatureDim < 1)
        {
            throw Error(DFL2_ERR_CORRUPT, mTarget.file + ": context_features has no fixed feature size");
        }
        for (std::string const& n : targetKvNames(m, "past_key_values"))
        {
            need(mTarget, n, tkv);
        }
        for (std::string const& n : targetKvNames(m, "present"))
        {
            need(mTarget, n, tkv);
        }
        if (m.hasLinearLayers())
        {
            checkLinearInterface(need);
        }
        if (m.hasSlidingLayers())  // a sliding layer's ring in, its new rows out, and the ring's window positions
        {
            int32_t const R = m.slidingWindow.ringSlots;
            need(mTarget, kWINDOW_POSITIONS, {-1, R});
            for (std::string const& n : targetKvNames(m, "past_key_values", "sliding"))
            {
                need(mTarget, n, {-1, m.targetKvHeads, R, m.targetHeadDim});
            }
            for (std::string const& n : targetKvNames(m, "present", "sliding"))
            {
                need(mTarget, n, tkv);
            }
        }
        need(mContext, "context_features", {-1, -1, mFeatureDim});
        for (std::string const& n : kvNames(m.drafterLayers, "context"))
        {
            need(mContext, n, dkv);
            need(mBlock, n, dkv);
        }
        need(mBlock, "context_mask", {-1, -1});
        need(mBlock, "hidden", {-1, m.blockSize, -1});
        need(mHead, "hidden", {-1, m.blockSize, -1});
        if (mIndependent)
        {
            need(mHead, "logits", {-1, L, m.vocabSize});
            return;
        }
        need(mHead, "cand_ids", {-1, L, m.topK});
        need(mHead, "path_ids", {-1, L});
        need(mHead, "proposal_probs", {-1, L, -1});
    }

    //! The element types this backend exchanges with the graphs: logits and proposals fp32; the target's KV, the
    //! features, the drafter's context K/V and the hidden states fp32 or fp16, each the same on both sides of a
    //! graph boundary (the Python backend feeds one graph's outputs to the next as they are).
    void checkTypes()
    {
        auto typeOf = [](Graph const& g, std::string const& name) {
            auto const it = g.types.find(name);
            return it == g.types.end() ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : it->second;
        };
        auto refuse = [](Graph const& g, std::string const& name, char const* want) {
            return Error(DFL2_ERR_UNAVAILABLE, g.file + ": tensor '" + name + "' is not " + want
                + ", which libdflash2's ONNX Runtime backend needs there");
        };
        // the tensors `uses` have one element type, fp32 (or fp16 where halfToo) -> that type
        auto same = [&](std::vector<std::pair<Graph const*, std::string>> const& uses, bool halfToo) {
            ONNXTensorElementDataType const t = typeOf(*uses[0].first, uses[0].second);
            bool const ok = t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || (halfToo && t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
            for (auto const& [g, name] : uses)
            {
                if (!ok || typeOf(*g, name) != t)
                {
                    throw refuse(*g, name, halfToo ? "fp32 or fp16 like the tensors it meets" : "fp32");
                }
            }
            return t;
        };
        Manifest const& m = mManifest;
        // attention and sliding layers' K/V (buffers and rings), linear layers' windows and recurrent states
        std::vector<std::pair<Graph const*, std::string>> kv;
        std::vector<std::pair<Graph const*, std::string>> conv;
        std::vector<std::pair<Graph const*, std::string>> recurrent;
        for (char const* prefix : {"past", "present"})
        {
            std::vector<std::string> const names = targetStateNames(m, prefix);  // 2 per layer with state, in order
            size_t at = 0;
            for (int32_t i = 0; i < m.targetLayers; ++i)
            {
                if (!m.hasState(i))  // an mlp layer: no tensors
                {
                    continue;
                }
                std::string const& first = names[at++];
                std::string const& second = names[at++];
                if (m.isLinear(i))  // window, recurrent state
                {
                    conv.emplace_back(&mTarget, first);
                    recurrent.emplace_back(&mTarget, second);
                    continue;
                }
                kv.emplace_back(&mTarget, first);
                kv.emplace_back(&mTarget, second);
            }
        }
        mTargetKvType = kv.empty() ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : same(kv, true);
        if (!conv.empty())
        {
            mConvType = same(conv, true);
            same(recurrent, false);
        }
        mFeatureType = same({{&mTarget, "context_features"}, {&mContext, "context_features"}}, true);
        std::vector<std::pair<Graph const*, std::string>> ctx;
        for (std::string const& n : kvNames(m.drafterLayers, "context"))
        {
            ctx.emplace_back(&mContext, n);
            ctx.emplace_back(&mBlock, n);
        }
        mDrafterKvType = same(ctx, true);
        mHiddenType = same({{&mBlock, "hidden"}, {&mHead, "hidden"}}, true);
        same({{&mTarget, "logits"}}, false);
        same({{&mHead, mIndependent ? "logits" : "proposal_probs"}}, false);
    }

    //! a hybrid target's state tensors: per linear layer the window, recurrent state and their outputs, and state_rows
    template <typename Need>
    void checkLinearInterface(Need const& need) const
    {
        Manifest const& m = mManifest;
        LinearStateSpec const& s = m.linearState;
        need(mTarget, kSTATE_ROWS, {-1});
        for (int32_t i = 0; i < m.targetLayers; ++i)
        {
            if (m.isLinear(i))
            {
                std::string const n = std::to_string(i);
                need(mTarget, "past_conv." + n, {-1, s.convDim, s.window()});
                need(mTarget, "past_recurrent." + n, {-1, s.numHeads, s.keyDim, s.valueDim});
                need(mTarget, "present_conv." + n, {-1, s.convDim, -1});
                need(mTarget, "present_recurrent." + n, {-1, -1, s.numHeads, s.keyDim, s.valueDim});
            }
        }
    }

    Manifest mManifest;
    std::string mDir;
    //! the environment, released after the graphs' sessions (members are destroyed in reverse order)
    struct Env
    {
        ~Env()
        {
            if (env != nullptr)
            {
                api->ReleaseEnv(env);
            }
        }
        OrtApi const* api{nullptr};
        OrtEnv* env{nullptr};
    };

    OrtApi const* mApi{nullptr};
    Env mEnv;
    int32_t mThreads{0};
    bool mFused{false};
    std::string mOps;  //!< the custom-op library in use ("" none)
    bool mPanels{false};
    bool mRewritten{false};
    PanelSwaps mSwaps;  //!< the MatMuls the rewrites swapped for the op library's panel kernels
    bool mIndependent{false};
    ONNXTensorElementDataType mTargetKvType{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    ONNXTensorElementDataType mFeatureType{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    ONNXTensorElementDataType mDrafterKvType{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    ONNXTensorElementDataType mHiddenType{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    ONNXTensorElementDataType mConvType{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    int32_t mFeatureDim{0};
    Graph mTarget;
    Graph mContext;
    Graph mBlock;
    Graph mHead;
};

//! A linear or sliding target's state at one length (prefix_cache.SlotState): per linear layer its convolution window
//! and recurrent state, per ring its contents, and the rings' window positions and floor.
struct OrtTargetSnapshot : TargetSnapshot
{
    std::vector<std::vector<char>> windows;
    std::vector<std::vector<float>> recurrents;
    std::vector<std::vector<char>> rings;
    std::vector<int64_t> positions;
    int64_t floor{0};

    size_t nbytes() const override
    {
        size_t n = positions.size() * sizeof(int64_t);
        for (auto const& w : windows)
        {
            n += w.size();
        }
        for (auto const& r : recurrents)
        {
            n += r.size() * sizeof(float);
        }
        for (auto const& r : rings)
        {
            n += r.size();
        }
        return n;
    }
};

//! One request's caches over the model's sessions (OrtTargetRunner / OrtFusedTargetRunner + OrtDraftRunner).
class OrtRunners : public SizedRunners<Runners>
{
public:
    explicit OrtRunners(OrtModel const& model)
        : SizedRunners(RunnerSizes::of(model))
        , mM(model)
        , mApi(model.api())
        , mTkv(model.manifest().kvLayers(), model.manifest().targetKvHeads, model.manifest().targetHeadDim,
              model.manifest().kvCapacityStep, model.manifest().maxSeqLen, elementBytes(model.targetKvType()))
        , mDkv(model.manifest().drafterLayers, model.manifest().drafterKvHeads, model.manifest().drafterHeadDim,
              model.manifest().kvCapacityStep, model.manifest().maxSeqLen, elementBytes(model.drafterKvType()))
        , mFeatureBytes(elementBytes(model.featureType()))
        , mPastNames(targetKvNames(model.manifest(), "past_key_values"))
        , mPresentNames(targetKvNames(model.manifest(), "present"))
        , mContextNames(kvNames(model.manifest().drafterLayers, "context"))
    {
        if (mM.fused())
        {
            ortCheck(mApi, mApi->CreateIoBinding(mM.target().session, &mBinding), "CreateIoBinding");
        }
        if (!mM.manifest().kvOnly())
        {
            setUpStates();
        }
    }
    ~OrtRunners() override
    {
        mKvValues.clear();
        if (mBinding != nullptr)
        {
            mApi->ReleaseIoBinding(mBinding);
        }
    }
    int32_t cacheLength() const
    {
        return mTkv.length;
    }

    void targetReset() override
    {
        mTkv.length = 0;
        if (mLinear)
        {
            mLinear->reset();
        }
        if (mRing)
        {
            mRing->log.reset(0);
        }
        mFeatureRows = 0;
        mPending.clear();
        mPendingRows = 0;
    }

    //! ids [n] at positions length.. -> logits [n, V]; the features [n, F] stay here for drafterQueueContext
    void targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits) override
    {
        targetForwardRows(ids, n, false, logits);
    }
    void targetForwardLast(int32_t const* ids, int32_t n, std::vector<float>& logits) override
    {
        targetForwardRows(ids, n, true, logits);
    }

    //! targetForward; lastOnly: logits [1, V], the last row's alone (a prefill's, the batch's lastLogits): the
    //! rewritten fused graph's LM head computes that row alone (logits_index), the other graphs every row (the last
    //! kept). DFLASH2_PLANT_LOGITS_ROW (a negative control): the rewritten graph computes the row before the last.
    void targetForwardRows(int32_t const* ids, int32_t n, bool lastOnly, std::vector<float>& logits)
    {
        int32_t const V = mM.vocabSize;
        size_t const F = static_cast<size_t>(mM.fdim());
        mIds.resize(static_cast<size_t>(n));
        for (int32_t i = 0; i < n; ++i)
        {
            if (ids[i] < 0 || ids[i] >= V)
            {
                throw Error(DFL2_ERR_OUT_OF_RANGE, "token id " + std::to_string(ids[i]) + " out of range [0, "
                    + std::to_string(V) + ") in target input");
            }
            mIds[static_cast<size_t>(i)] = ids[i];
        }
        int32_t const len = mTkv.length;
        // rows whose logits the graph computes: the rewritten fused graph takes them (logits_index)
        bool const picks = mM.manifest().kvOnly() && mM.fused() && mM.rewritten();
        int32_t const R = lastOnly && picks ? 1 : n;
        logits.resize(static_cast<size_t>(R) * static_cast<size_t>(V));
        mFeatures.resize(static_cast<size_t>(n) * F * mFeatureBytes);
        mFeatureRows = 0;
        if (!mM.manifest().kvOnly())
        {
            stateTargetForward(n, logits.data());
            mFeatureRows = n;
            keepLastRow(lastOnly, n, logits);
            return;
        }
        mTkv.reserve(len + n);
        std::vector<int64_t> const idsShape{1, n};
        OrtTensor idsT(mApi, mIds.data(), mIds.size() * sizeof(int64_t), idsShape, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        OrtTensor logitsT(mApi, logits.data(), logits.size() * sizeof(float), {1, R, V}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        OrtTensor featT(mApi, mFeatures.data(), mFeatures.size(), {1, n, static_cast<int64_t>(F)}, mM.featureType());
        if (mM.fused())
        {
            // GroupQueryAttention over the shared buffers: the valid length of each call is seqlens_k + 1
            if (mBoundCapacity != mTkv.capacity)  // bound once per buffer generation
            {
                bindTargetKv();
                mBoundCapacity = mTkv.capacity;
            }
            mSeqlens = len + n - 1;
            mTotal = len + n;
            mPast = len;
            OrtTensor seqT(mApi, &mSeqlens, sizeof(int32_t), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
            OrtTensor totalT(mApi, &mTotal, sizeof(int32_t), {}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
            OrtTensor pastT;
            OrtTensor rowsT;
            if (mM.rewritten())  // DecodeAttention's cached length; the rows whose logits to compute (all, or the last)
            {
                static bool const plantedRow = std::getenv("DFLASH2_PLANT_LOGITS_ROW") != nullptr;
                mRowsIndex.resize(static_cast<size_t>(R));
                for (int32_t i = 0; i < R; ++i)
                {
                    mRowsIndex[static_cast<size_t>(i)] = n - R + i - (plantedRow && R == 1 && n > 1 ? 1 : 0);
                }
                pastT = OrtTensor(mApi, &mPast, sizeof(int32_t), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
                rowsT = OrtTensor(mApi, mRowsIndex.data(), mRowsIndex.size() * sizeof(int64_t), {1, R, 1},
                    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
                ortCheck(mApi, mApi->BindInput(mBinding, "past_seqlens", pastT.get()), "BindInput past_seqlens");
                ortCheck(mApi, mApi->BindInput(mBinding, "logits_index", rowsT.get()), "BindInput logits_index");
            }
            ortCheck(mApi, mApi->BindInput(mBinding, "input_ids", idsT.get()), "BindInput input_ids");
            ortCheck(mApi, mApi->BindInput(mBinding, "seqlens_k", seqT.get()), "BindInput seqlens_k");
            ortCheck(mApi, mApi->BindInput(mBinding, "total_sequence_length", totalT.get()), "BindInput");
            ortCheck(mApi, mApi->BindOutput(mBinding, "logits", logitsT.get()), "BindOutput logits");
            ortCheck(mApi, mApi->BindOutput(mBinding, "context_features", featT.get()), "BindOutput context_features");
            ortCheck(mApi, mApi->RunWithBinding(mM.target().session, nullptr, mBinding), mM.target().file);
        }
        else
        {
            standardTargetForward(idsT, logitsT, featT, len, n);
        }
        mTkv.length = len + n;
        mFeatureRows = n;
        keepLastRow(lastOnly && R == n, n, logits);
    }

    //! logits [n, V] -> [1, V], the last row's, when keep (a graph that computed every row)
    static void keepLastRow(bool keep, int32_t n, std::vector<float>& logits)
    {
        if (keep && n > 1)
        {
            size_t const V = logits.size() / static_cast<size_t>(n);
            std::copy(logits.end() - static_cast<long>(V), logits.end(), logits.begin());
            logits.resize(V);
        }
    }

    //! OrtTargetRunner.crop: the KV by its length; a hybrid target's linear state rolled back into the last call,
    //! a sliding target's rings the cut rows' slots
    void targetCrop(int32_t length) override
    {
        int32_t const keep = std::max(0, length);
        if (mLinear && keep < mTkv.length)
        {
            mLinear->crop(keep);
        }
        if (mRing && keep < mTkv.length)
        {
            mRing->log.crop(0, keep);
        }
        mTkv.length = std::min(mTkv.length, keep);
    }

    void drafterReset() override
    {
        mDkv.length = 0;
        mPending.clear();
        mPendingRows = 0;
    }

    void drafterQueueContext(int32_t rows) override
    {
        if (rows > mFeatureRows)
        {
            throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the last target forward made");
        }
        mPending.insert(mPending.end(), mFeatures.begin(),
            mFeatures.begin() + static_cast<long>(rows) * mM.fdim() * static_cast<long>(mFeatureBytes));
        mPendingRows += rows;
    }

    //! OrtDraftRunner.add_context: the pending features [m, F] of positions start.. -> the drafter's context K/V
    void drafterAddContext(int32_t start) override
    {
        int32_t const m = mPendingRows;
        if (start != mDkv.length)
        {
            throw Error(DFL2_ERR_INTERNAL, "draft context is at length " + std::to_string(mDkv.length)
                + ", got features for position " + std::to_string(start));
        }
        Manifest const& man = mM.manifest();
        std::vector<int64_t> pos(static_cast<size_t>(m));
        for (int32_t i = 0; i < m; ++i)
        {
            pos[static_cast<size_t>(i)] = start + i;
        }
        size_t const per = static_cast<size_t>(man.drafterKvHeads) * static_cast<size_t>(m) * mDkv.rowBytes();
        std::vector<std::vector<char>> rows(static_cast<size_t>(mDkv.count), std::vector<char>(per));
        OrtTensor featT(mApi, mPending.data(), mPending.size(), {1, m, mM.fdim()}, mM.featureType());
        OrtTensor posT(mApi, pos.data(), pos.size() * sizeof(int64_t), {1, m}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        std::vector<OrtTensor> outs;
        for (auto& r : rows)
        {
            outs.emplace_back(mApi, r.data(), r.size(), std::vector<int64_t>{1, man.drafterKvHeads, m, man.drafterHeadDim},
                mM.drafterKvType());
        }
        run(mM.context(), {"context_features", "position_ids"}, {featT.get(), posT.get()}, mContextNames, outs);
        mDkv.append(rows, m);
        mPending.clear();
        mPendingRows = 0;
    }

    // ---- prefix reuse (core/prefixCache.h): OrtTargetRunner.prefix_state / restore_prefix, OrtDraftRunner's
    // context_rows / restore_context, over the caches in place
    bool keepsPrefix() const override
    {
        return true;
    }
    int32_t targetLength() const override
    {
        return mTkv.length;
    }
    std::shared_ptr<TargetSnapshot const> targetSnapshot() override
    {
        if (!mLinear && !mRing)
        {
            return nullptr;
        }
        auto snap = std::make_shared<OrtTargetSnapshot>();
        for (size_t i = 0; mLinear && i < mLinear->layers.size(); ++i)
        {
            snap->windows.push_back(mLinear->layers[i].window);
            snap->recurrents.push_back(mLinear->layers[i].recurrent);
        }
        if (mRing)
        {
            snap->rings = mRing->arrays;
            std::tie(snap->positions, snap->floor) = mRing->log.snapshot(0);
        }
        return snap;
    }
    void targetRestore(int32_t length, TargetSnapshot const* state) override
    {
        if (length < 0 || length > mTkv.length || ((mLinear || mRing) && state == nullptr))
        {
            throw Error(DFL2_ERR_INTERNAL, "a prefix restore to length " + std::to_string(length) + " of a target at "
                + std::to_string(mTkv.length) + (state == nullptr ? " without its state" : ""));
        }
        mTkv.length = length;
        mFeatureRows = 0;
        if (state == nullptr)
        {
            return;
        }
        auto const& snap = dynamic_cast<OrtTargetSnapshot const&>(*state);
        // copied into the buffers the state inputs' values are made over (never reallocated)
        for (size_t i = 0; mLinear && i < mLinear->layers.size(); ++i)
        {
            HostLinearState::Layer& l = mLinear->layers[i];
            std::copy(snap.windows[i].begin(), snap.windows[i].end(), l.window.begin());
            std::copy(snap.recurrents[i].begin(), snap.recurrents[i].end(), l.recurrent.begin());
        }
        if (mLinear)
        {
            mLinear->log.reset(0);  // a new sequence: no call to roll back into
        }
        if (mRing)
        {
            for (size_t a = 0; a < mRing->arrays.size(); ++a)
            {
                std::copy(snap.rings[a].begin(), snap.rings[a].end(), mRing->arrays[a].begin());
            }
            mRing->log.restore(0, snap.positions, snap.floor);
        }
    }
    int32_t drafterLength() const override
    {
        return mDkv.length + mPendingRows;
    }
    void drafterRestore(int32_t length) override
    {
        restoreDrafterContext(length, mDkv.length, mPending, mPendingRows,
            static_cast<size_t>(mM.fdim()) * mFeatureBytes, [this](int32_t start) { drafterAddContext(start); });
        if (plantedPrefixDrafterZeroed())  // the planted bug: the target restored, the drafter's context garbage
        {
            size_t const rb = mDkv.rowBytes();
            for (auto& a : mDkv.arrays)
            {
                for (size_t h = 0; h < static_cast<size_t>(mDkv.heads); ++h)
                {
                    std::fill_n(a.begin() + static_cast<long>(h * static_cast<size_t>(mDkv.capacity) * rb),
                        static_cast<size_t>(length) * rb, 0);
                }
            }
        }
    }
    //! OrtTargetRunner.prefix_rows, OrtDraftRunner.context_rows + the queued features (drafter: its context too)
    std::shared_ptr<PrefixCopy const> prefixCopy(int32_t n, bool drafter) const override
    {
        auto c = std::make_shared<HostPrefixCopy>();
        c->n = std::min(n, mTkv.length);
        c->target = mTkv.rowsOf(c->n);
        if (drafter)
        {
            c->m = std::min(c->n, mDkv.length);
            c->drafter = mDkv.rowsOf(c->m);
            c->k = std::min(mPendingRows, c->n - c->m);
            size_t const rowBytes = static_cast<size_t>(mM.fdim()) * mFeatureBytes;
            c->features.assign(mPending.begin(), mPending.begin() + static_cast<long>(c->k * rowBytes));
        }
        return c;
    }
    //! OrtTargetRunner.restore_prefix + OrtDraftRunner.restore_context / add_context into reset caches
    void prefixRestore(PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter) override
    {
        auto const& c = dynamic_cast<HostPrefixCopy const&>(rows);
        mTkv.length = 0;
        mTkv.append(c.target, c.n);
        targetRestore(length, state);
        if (drafter)
        {
            mDkv.length = 0;
            mDkv.append(c.drafter, c.m);
            mPending = c.features;
            mPendingRows = c.k;
            drafterRestore(length);
        }
    }
    //! OrtDraftRunner.propose: block over the context, rows past the verified ones zeroed, the selector head
    void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out) override
    {
        Manifest const& man = mM.manifest();
        if (mDkv.length != pos)
        {
            throw Error(DFL2_ERR_INTERNAL, "draft context holds " + std::to_string(mDkv.length) + " positions, anchor is at "
                + std::to_string(pos));
        }
        mDkv.reserve(std::max(1, pos));
        if (mCtxCapacity != mDkv.capacity)  // the buffers grew (here or when context was added): new values over them
        {
            mCtxCapacity = mDkv.capacity;
            mCtxValues.clear();
            for (auto& a : mDkv.arrays)
            {
                mCtxValues.emplace_back(mApi, a.data(), a.size(), mDkv.shape(), mM.drafterKvType());
            }
        }
        int32_t const bs = man.blockSize;
        int32_t const L = bs - 1;
        int32_t const K = man.topK;
        auto const hiddenDims = mM.block().shapes.at("hidden");
        int64_t const H = hiddenDims[2] > 0 ? hiddenDims[2] : man.hiddenSize;
        int64_t anchorId = anchor;
        int64_t anchorPos = pos;
        std::vector<int64_t> mask = mDkv.validMask();
        size_t const hb = elementBytes(mM.hiddenType());
        mHidden.assign(static_cast<size_t>(bs) * static_cast<size_t>(H) * hb, 0);
        {
            OrtTensor a(mApi, &anchorId, sizeof(int64_t), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
            OrtTensor p(mApi, &anchorPos, sizeof(int64_t), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
            OrtTensor mk(mApi, mask.data(), mask.size() * sizeof(int64_t), {1, mDkv.capacity},
                ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
            std::vector<std::string> names{"anchor_ids", "anchor_position", "context_mask"};
            std::vector<OrtValue*> values{a.get(), p.get(), mk.get()};
            for (size_t i = 0; i < mContextNames.size(); ++i)
            {
                names.push_back(mContextNames[i]);
                values.push_back(mCtxValues[i].get());
            }
            std::vector<OrtTensor> outs;
            outs.emplace_back(mApi, mHidden.data(), mHidden.size(), std::vector<int64_t>{1, bs, H}, mM.hiddenType());
            run(mM.block(), names, values, {"hidden"}, outs);
        }
        // a final partial block: the path over the verified rows alone (zero bits: 0.0 in fp32 and fp16)
        std::fill(mHidden.begin() + static_cast<long>(static_cast<size_t>((1 + rows) * H) * hb), mHidden.end(), 0);
        OrtTensor h(mApi, mHidden.data(), mHidden.size(), {1, bs, H}, mM.hiddenType());
        if (mM.independent())  // no selector: each row's logits [L, V], then protocol.independent_draft
        {
            int32_t const V = mM.vocabSize;
            mHeadLogits.resize(static_cast<size_t>(L) * static_cast<size_t>(V));
            std::vector<OrtTensor> outs;
            outs.emplace_back(mApi, mHeadLogits.data(), mHeadLogits.size() * sizeof(float), std::vector<int64_t>{1, L, V},
                ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
            run(mM.head(), {"hidden"}, {h.get()}, {"logits"}, outs);
            independentDraft(mHeadLogits.data(), L, V, temperature, uniforms, K, out);
            return;
        }
        int32_t anchor32 = anchor;
        float temp = temperature;
        std::vector<float> u(static_cast<size_t>(L), 0.0F);
        if (uniforms != nullptr)
        {
            std::copy_n(uniforms, L, u.begin());
        }
        out.tokens.assign(static_cast<size_t>(L), 0);
        out.cand.assign(static_cast<size_t>(L) * static_cast<size_t>(K), 0);
        out.proposal.assign(static_cast<size_t>(L) * static_cast<size_t>(K), 0.0F);
        out.vocabProposal.clear();
        out.hasVocabProposal = false;
        OrtTensor a(mApi, &anchor32, sizeof(int32_t), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
        OrtTensor t(mApi, &temp, sizeof(float), {1}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        OrtTensor uT(mApi, u.data(), u.size() * sizeof(float), {1, L}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        std::vector<OrtTensor> outs;
        outs.emplace_back(mApi, out.cand.data(), out.cand.size() * sizeof(int32_t), std::vector<int64_t>{1, L, K},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
        outs.emplace_back(mApi, out.tokens.data(), out.tokens.size() * sizeof(int32_t), std::vector<int64_t>{1, L},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
        outs.emplace_back(mApi, out.proposal.data(), out.proposal.size() * sizeof(float), std::vector<int64_t>{1, L, K},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        run(mM.head(), {"hidden", "anchor_ids", "temperature", "uniforms"}, {h.get(), a.get(), t.get(), uT.get()},
            {"cand_ids", "path_ids", "proposal_probs"}, outs);
    }

private:
    //! A target with linear or sliding layers (OrtTargetRunner with LinearStates / WindowRing): the state buffers,
    //! the call's names in the graph's layer order (KV for attention and sliding layers, window and recurrent state
    //! for linear ones) and the state inputs' values over the fixed state buffers, made once.
    void setUpStates()
    {
        Manifest const& man = mM.manifest();
        mCallInNames = {"input_ids", "position_ids", "attention_mask"};
        if (man.hasSlidingLayers())
        {
            mRing = std::make_unique<HostRing>(man, mTkv.elem);
            int32_t const R = man.slidingWindow.ringSlots;
            for (auto& a : mRing->arrays)
            {
                mRingValues.emplace_back(mApi, a.data(), a.size(),
                    std::vector<int64_t>{1, man.targetKvHeads, R, man.targetHeadDim}, mM.targetKvType());
            }
            mRingRows.assign(mRing->arrays.size(), {});
            mWindowPositions = OrtTensor(mApi, const_cast<int64_t*>(mRing->log.positions(0)), static_cast<size_t>(R) * sizeof(int64_t),
                {1, R}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
            mCallInNames.push_back(kWINDOW_POSITIONS);
        }
        if (man.hasLinearLayers())
        {
            mLinear = std::make_unique<HostLinearState>(man, elementBytes(mM.convType()));
            mCallInNames.push_back(kSTATE_ROWS);
        }
        LinearStateSpec const& ls = man.linearState;
        for (size_t i = 0; mLinear && i < mLinear->layers.size(); ++i)
        {
            HostLinearState::Layer& l = mLinear->layers[i];
            mLinearValues.emplace_back(mApi, l.window.data(), l.window.size(),
                std::vector<int64_t>{1, ls.convDim, ls.window()}, mM.convType());
            mLinearValues.emplace_back(mApi, l.recurrent.data(), l.recurrent.size() * sizeof(float),
                std::vector<int64_t>{1, ls.numHeads, ls.keyDim, ls.valueDim}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        }
        mCallOutNames = {"logits", "context_features"};
        for (std::string const& n : targetStateNames(man, "past"))
        {
            mCallInNames.push_back(n);
        }
        for (std::string const& n : targetStateNames(man, "present"))
        {
            mCallOutNames.push_back(n);
        }
        mCallIn = cNames(mCallInNames);
        mCallOut = cNames(mCallOutNames);
        mCallInValues.assign(mCallIn.size(), nullptr);
        mCallOutValues.assign(mCallOut.size(), nullptr);
        mKvRows.assign(static_cast<size_t>(mTkv.count), {});
        mCallOutTensors.reserve(mCallOut.size());
    }

    //! OrtTargetRunner.forward of a target with linear or sliding layers: with linear layers one call of n <=
    //! max_rows_per_call rows asking every row's state (a verify, which a crop may roll back), else calls of
    //! max_rows_per_call rows asking their last row's only; without, one call
    void stateTargetForward(int32_t n, float* logits)
    {
        int32_t const step = mLinear ? mLinear->spec.maxRowsPerCall : n;
        bool const everyRow = n <= step;
        size_t const V = static_cast<size_t>(mM.vocabSize);
        size_t const F = static_cast<size_t>(mM.fdim());
        for (int32_t a = 0; a < n; a += step)
        {
            int32_t const S = std::min(step, n - a);
            stateTargetCall(a, S, everyRow, logits + static_cast<size_t>(a) * V,
                mFeatures.data() + static_cast<size_t>(a) * F * mFeatureBytes);
        }
    }

    //! a state call's host buffers for S rows at position `len`: the caches reserved (their values made again where
    //! they grew), positions, the rows whose linear state is kept (every row, or the last), the attention mask
    void prepareStateCall(int32_t len, int32_t S, bool everyRow)
    {
        mTkv.reserve(len + S);
        if (mPastCapacity != mTkv.capacity)  // the buffers grew: new values over them
        {
            mPastCapacity = mTkv.capacity;
            mPastValues.clear();
            for (auto& arr : mTkv.arrays)
            {
                mPastValues.emplace_back(mApi, arr.data(), arr.size(), mTkv.shape(), mM.targetKvType());
            }
        }
        int32_t const C = mTkv.capacity;
        int32_t const R = everyRow ? S : 1;
        mPos.resize(static_cast<size_t>(S));
        mStateRows.resize(static_cast<size_t>(R));
        for (int32_t i = 0; i < S; ++i)
        {
            mPos[static_cast<size_t>(i)] = len + i;
        }
        for (int32_t i = 0; i < R; ++i)
        {
            mStateRows[static_cast<size_t>(i)] = everyRow ? i : S - 1;
        }
        mMask.assign(static_cast<size_t>(C + S), 1);
        std::fill(mMask.begin() + len, mMask.begin() + C, 0);
    }

    //! every layer's state inputs (from index fixedIn) and outputs (from 2), in layer order: a linear layer's
    //! convolution window and recurrent state (R rows), a sliding layer's ring and its S new rows, an attention
    //! layer's past and its S new rows; an mlp layer has none
    void bindLayerStates(int32_t S, int32_t R, size_t fixedIn)
    {
        Manifest const& man = mM.manifest();
        LinearStateSpec const& ls = man.linearState;
        size_t const per = static_cast<size_t>(man.targetKvHeads) * static_cast<size_t>(S) * static_cast<size_t>(man.targetHeadDim);
        mCallOutTensors.clear();
        size_t kv = 0;
        size_t lin = 0;
        size_t ring = 0;
        size_t stateful = 0;
        for (int32_t i = 0; i < man.targetLayers; ++i)  // layer order: 2 inputs and 2 outputs per layer with state
        {
            if (!man.hasState(i))
            {
                continue;
            }
            size_t const at = fixedIn + 2 * stateful;
            size_t const out = 2 + 2 * stateful++;
            if (man.isLinear(i))
            {
                HostLinearState::Layer& l = mLinear->layers[lin];
                mCallInValues[at] = mLinearValues[2 * lin].get();
                mCallInValues[at + 1] = mLinearValues[2 * lin + 1].get();
                mCallOutTensors.emplace_back(mApi, l.inputs.data(), static_cast<size_t>(ls.convDim) * static_cast<size_t>(S) * l.convElem,
                    std::vector<int64_t>{1, ls.convDim, S}, mM.convType());
                mCallOutValues[out] = mCallOutTensors.back().get();
                mCallOutTensors.emplace_back(mApi, l.states.data(), static_cast<size_t>(R) * ls.recurrentElements() * sizeof(float),
                    std::vector<int64_t>{1, R, ls.numHeads, ls.keyDim, ls.valueDim}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
                mCallOutValues[out + 1] = mCallOutTensors.back().get();
                ++lin;
                continue;
            }
            if (man.isSliding(i))
            {
                for (size_t k = 0; k < 2; ++k, ++ring)
                {
                    mCallInValues[at + k] = mRingValues[ring].get();
                    mRingRows[ring].resize(per * mTkv.elem);
                    mCallOutTensors.emplace_back(mApi, mRingRows[ring].data(), per * mTkv.elem,
                        std::vector<int64_t>{1, man.targetKvHeads, S, man.targetHeadDim}, mM.targetKvType());
                    mCallOutValues[out + k] = mCallOutTensors.back().get();
                }
                continue;
            }
            for (size_t k = 0; k < 2; ++k, ++kv)
            {
                mCallInValues[at + k] = mPastValues[kv].get();
                mKvRows[kv].resize(per * mTkv.elem);
                mCallOutTensors.emplace_back(mApi, mKvRows[kv].data(), per * mTkv.elem,
                    std::vector<int64_t>{1, man.targetKvHeads, S, man.targetHeadDim}, mM.targetKvType());
                mCallOutValues[out + k] = mCallOutTensors.back().get();
            }
        }
    }

    //! OrtTargetRunner._call with linear or sliding layers: ids mIds[a..a+S-1] at positions length.., the KV buffers
    //! + validity mask, every sliding layer's ring + the window positions and every linear layer's state in; the
    //! new rows' K/V (appended to the buffers, written into the rings), the convolution inputs and the asked rows'
    //! recurrent states out (HostLinearState.called keeps the state after the rows)
    void stateTargetCall(int32_t a, int32_t S, bool everyRow, float* logits, char* feats)
    {
        Manifest const& man = mM.manifest();
        int32_t const len = mTkv.length;
        prepareStateCall(len, S, everyRow);
        int32_t const C = mTkv.capacity;
        int32_t const R = everyRow ? S : 1;
        int32_t const V = mM.vocabSize;
        int64_t const F = mM.fdim();
        OrtTensor const idsT(mApi, mIds.data() + a, static_cast<size_t>(S) * sizeof(int64_t), {1, S},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        OrtTensor const posT(mApi, mPos.data(), mPos.size() * sizeof(int64_t), {1, S}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        OrtTensor const maskT(mApi, mMask.data(), mMask.size() * sizeof(int64_t), {1, C + S},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        OrtTensor const rowsT(mApi, mStateRows.data(), mStateRows.size() * sizeof(int64_t), {R},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        size_t const fixedIn = mCallInNames.size() - 2 * static_cast<size_t>(man.stateLayers());
        OrtTensor const logitsT(mApi, logits, static_cast<size_t>(S) * static_cast<size_t>(V) * sizeof(float), {1, S, V},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        OrtTensor const featT(mApi, feats, static_cast<size_t>(S) * static_cast<size_t>(F) * mFeatureBytes, {1, S, F},
            mM.featureType());
        mCallInValues[0] = idsT.get();
        mCallInValues[1] = posT.get();
        mCallInValues[2] = maskT.get();
        size_t extra = 3;
        if (mRing)
        {
            mCallInValues[extra++] = mWindowPositions.get();
        }
        if (mLinear)
        {
            mCallInValues[extra++] = rowsT.get();
        }
        mCallOutValues[0] = logitsT.get();
        mCallOutValues[1] = featT.get();
        bindLayerStates(S, R, fixedIn);
        ortCheck(mApi, mApi->Run(mM.target().session, nullptr, mCallIn.data(), mCallInValues.data(), mCallIn.size(),
                           mCallOut.data(), mCallOut.size(), mCallOutValues.data()),
            mM.target().file);
        mTkv.append(mKvRows, S);
        if (mRing)
        {
            mRing->write(len, S, mRingRows);
        }
        if (mLinear)
        {
            mLinear->called(len, S, everyRow);
        }
    }

    //! the fused target's capacity buffers as its past AND present (one OrtValue each: GroupQueryAttention then
    //! writes the new rows in place)
    void bindTargetKv()
    {
        mKvValues.clear();
        for (size_t i = 0; i < mTkv.arrays.size(); ++i)
        {
            auto& a = mTkv.arrays[i];
            mKvValues.emplace_back(mApi, a.data(), a.size(), mTkv.shape(), mM.targetKvType());
            ortCheck(mApi, mApi->BindInput(mBinding, mPastNames[i].c_str(), mKvValues.back().get()), "BindInput past");
            ortCheck(mApi, mApi->BindOutput(mBinding, mPresentNames[i].c_str(), mKvValues.back().get()), "BindOutput present");
        }
    }

    //! OrtTargetRunner.forward: the whole buffers + a validity mask in, the new rows' K/V out (appended)
    void standardTargetForward(OrtTensor const& idsT, OrtTensor const& logitsT, OrtTensor const& featT, int32_t len, int32_t n)
    {
        Manifest const& man = mM.manifest();
        std::vector<int64_t> pos(static_cast<size_t>(n));
        for (int32_t i = 0; i < n; ++i)
        {
            pos[static_cast<size_t>(i)] = len + i;
        }
        std::vector<int64_t> mask(static_cast<size_t>(mTkv.capacity + n), 1);
        std::fill(mask.begin() + len, mask.begin() + mTkv.capacity, 0);
        OrtTensor posT(mApi, pos.data(), pos.size() * sizeof(int64_t), {1, n}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        OrtTensor maskT(mApi, mask.data(), mask.size() * sizeof(int64_t), {1, mTkv.capacity + n},
            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
        std::vector<std::string> names{"input_ids", "position_ids", "attention_mask"};
        std::vector<OrtValue*> values{idsT.get(), posT.get(), maskT.get()};
        std::vector<OrtTensor> past;
        for (size_t i = 0; i < mTkv.arrays.size(); ++i)
        {
            past.emplace_back(mApi, mTkv.arrays[i].data(), mTkv.arrays[i].size(), mTkv.shape(), mM.targetKvType());
            names.push_back(mPastNames[i]);
            values.push_back(past.back().get());
        }
        size_t const per = static_cast<size_t>(man.targetKvHeads) * static_cast<size_t>(n) * mTkv.rowBytes();
        std::vector<std::vector<char>> rows(mTkv.arrays.size(), std::vector<char>(per));
        std::vector<std::string> outNames{"logits", "context_features"};
        std::vector<OrtValue*> outValues{logitsT.get(), featT.get()};
        std::vector<OrtTensor> presents;
        for (size_t i = 0; i < rows.size(); ++i)
        {
            presents.emplace_back(mApi, rows[i].data(), rows[i].size(),
                std::vector<int64_t>{1, man.targetKvHeads, n, man.targetHeadDim}, mM.targetKvType());
            outNames.push_back(mPresentNames[i]);
            outValues.push_back(presents.back().get());
        }
        runValues(mM.target(), names, values, outNames, outValues);
        mTkv.length = len;
        mTkv.append(rows, n);  // the caller sets the length again (the same)
    }

    void run(Graph const& g, std::vector<std::string> const& inNames, std::vector<OrtValue*> const& in,
        std::vector<std::string> const& outNames, std::vector<OrtTensor>& out)
    {
        std::vector<OrtValue*> outValues;
        for (OrtTensor& t : out)
        {
            outValues.push_back(t.get());
        }
        runValues(g, inNames, in, outNames, outValues);
    }

    //! Session::Run with every output pre-allocated over this runner's buffers (ORT writes into them)
    void runValues(Graph const& g, std::vector<std::string> const& inNames, std::vector<OrtValue*> const& in,
        std::vector<std::string> const& outNames, std::vector<OrtValue*>& out)
    {
        std::vector<char const*> const ins = cNames(inNames);
        std::vector<char const*> const outs = cNames(outNames);
        std::vector<OrtValue const*> inValues(in.begin(), in.end());
        ortCheck(mApi, mApi->Run(g.session, nullptr, ins.data(), inValues.data(), ins.size(), outs.data(), outs.size(),
                           out.data()),
            g.file);
    }

    OrtModel const& mM;
    OrtApi const* mApi;
    HostKV mTkv;
    HostKV mDkv;
    size_t mFeatureBytes;  //!< bytes per feature (fp32, fp16)
    std::vector<std::string> mPastNames;
    std::vector<std::string> mPresentNames;
    std::vector<std::string> mContextNames;
    OrtIoBinding* mBinding{nullptr};
    std::vector<OrtTensor> mKvValues;   //!< over mTkv.arrays (bound as past and present)
    std::vector<OrtTensor> mCtxValues;  //!< over mDkv.arrays (the block's context inputs)
    int32_t mCtxCapacity{-1};           //!< the capacity mCtxValues were made for
    int32_t mBoundCapacity{-1};         //!< the capacity mKvValues were bound for
    std::vector<int64_t> mIds;
    int32_t mSeqlens{0};
    int32_t mTotal{0};
    int32_t mPast{0};
    std::vector<int64_t> mRowsIndex;
    std::vector<char> mFeatures;   //!< [rows, F] of the latest target forward (the graph's element type)
    int32_t mFeatureRows{0};
    std::vector<char> mPending;    //!< [rows, F] queued for the drafter
    int32_t mPendingRows{0};
    std::vector<char> mHidden;     //!< [bs, H] the block's output, the head's input (its element type)
    std::vector<float> mHeadLogits;  //!< [L, V] the independent head's output
    // a hybrid target (setUpLinear): its linear layers' state and one call's inputs and outputs, made once
    std::unique_ptr<HostLinearState> mLinear;
    std::vector<OrtTensor> mLinearValues;  //!< per linear layer: window, recurrent (the state inputs)
    // a sliding target: its rings, the values over them and the window positions, made once
    std::unique_ptr<HostRing> mRing;
    std::vector<OrtTensor> mRingValues;           //!< per sliding layer: key ring, value ring (the inputs)
    std::vector<std::vector<char>> mRingRows;     //!< per ring: the call's new rows [heads, S, dim]
    OrtTensor mWindowPositions;                   //!< over mRing's window positions
    std::vector<OrtTensor> mPastValues;    //!< over mTkv.arrays (the KV inputs)
    int32_t mPastCapacity{-1};             //!< the capacity mPastValues were made for
    std::vector<std::string> mCallInNames;
    std::vector<std::string> mCallOutNames;
    std::vector<char const*> mCallIn;
    std::vector<char const*> mCallOut;
    std::vector<OrtValue const*> mCallInValues;
    std::vector<OrtValue*> mCallOutValues;
    std::vector<OrtTensor> mCallOutTensors;     //!< one call's output values (over the buffers below and mLinear's)
    std::vector<std::vector<char>> mKvRows;     //!< per KV buffer: the call's new rows [heads, S, dim]
    std::vector<int64_t> mPos;
    std::vector<int64_t> mMask;
    std::vector<int64_t> mStateRows;
};

//! dfl2_batch over one OrtRunners per slot: each sequence's rows run as its single run's (batch 1 graphs).
class OrtBatchRunners : public SizedRunners<BatchRunners>
{
public:
    OrtBatchRunners(OrtModel const& model, int32_t slots)
        : SizedRunners(RunnerSizes::of(model))
    {
        for (int32_t i = 0; i < slots; ++i)
        {
            mSlots.push_back(std::make_unique<OrtRunners>(model));
        }
    }
    int32_t slots() const override
    {
        return static_cast<int32_t>(mSlots.size());
    }
    void targetReset(int32_t slot) override
    {
        at(slot).targetReset();
    }
    void targetRelease(int32_t slot) override
    {
        at(slot).targetReset();
    }
    void targetForward(std::vector<SlotRows> const& seqs, bool lastLogits, std::vector<float>& logits) override
    {
        logits.clear();
        for (SlotRows const& s : seqs)
        {
            OrtRunners& r = at(s.slot);
            if (r.cacheLength() != s.cacheLength)
            {
                throw Error(DFL2_ERR_INTERNAL, "batch slot " + std::to_string(s.slot) + " holds "
                    + std::to_string(r.cacheLength()) + " positions, the core says " + std::to_string(s.cacheLength));
            }
            r.targetForwardRows(s.ids.data(), static_cast<int32_t>(s.ids.size()), lastLogits, mRows);
            logits.insert(logits.end(), mRows.begin(), mRows.end());  // [n, V], or [1, V] with lastLogits
        }
    }
    void targetCrop(int32_t slot, int32_t length) override
    {
        at(slot).targetCrop(length);
    }
    void drafterReset(int32_t slot) override
    {
        at(slot).drafterReset();
    }
    void drafterQueueContext(int32_t slot, int32_t rows) override
    {
        at(slot).drafterQueueContext(rows);
    }
    void drafterAddContext(int32_t slot, int32_t start) override
    {
        at(slot).drafterAddContext(start);
    }
    void drafterPropose(int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
        float const* uniforms, Draft& out) override
    {
        at(slot).drafterPropose(anchor, pos, rows, temperature, uniforms, out);
    }
    bool keepsPrefix() const override
    {
        return true;
    }
    std::shared_ptr<TargetSnapshot const> targetSnapshot(int32_t slot) override
    {
        return at(slot).targetSnapshot();
    }
    std::shared_ptr<PrefixCopy const> prefixCopy(int32_t slot, int32_t n, bool drafter) override
    {
        return at(slot).prefixCopy(n, drafter);
    }
    void prefixRestore(
        int32_t slot, PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter) override
    {
        at(slot).prefixRestore(rows, length, state, drafter);
    }

private:
    OrtRunners& at(int32_t slot)
    {
        if (slot < 0 || slot >= static_cast<int32_t>(mSlots.size()))
        {
            throw Error(DFL2_ERR_INTERNAL, "batch slot " + std::to_string(slot) + " out of range");
        }
        return *mSlots[static_cast<size_t>(slot)];
    }

    std::vector<std::unique_ptr<OrtRunners>> mSlots;
    std::vector<float> mRows;
};

std::unique_ptr<Runners> OrtModel::newRunners()
{
    return std::make_unique<OrtRunners>(*this);
}

std::unique_ptr<BatchRunners> OrtModel::newBatchRunners(int32_t slots)
{
    return std::make_unique<OrtBatchRunners>(*this, slots);
}

} // namespace

std::unique_ptr<Model> loadOrtModel(Manifest const& manifest, std::string const& dir, Options const& options)
{
    return std::make_unique<OrtModel>(manifest, dir, options);
}

} // namespace dflash2
