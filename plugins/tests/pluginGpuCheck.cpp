/*
 * dflash2_trt — GPU check of libdflash2_plugins.so driven the way TensorRT drives it, without
 * TensorRT (for GPU machines where TensorRT cannot be installed; plugins/tests/gpu_check.sh).
 *
 *   pluginGpuCheck <libdflash2_plugins.so>
 *
 * 1. dlopen the library, take its creators from getCreators and find DFlash2PathSelector / "1" / ""
 *    as the registry look-up does;
 * 2. create the plugin as the ONNX parser does: the node's attributes as a PluginFieldCollection
 *    (top_k, rank: kINT32; mode: kCHAR, the string's bytes without a NUL), phase kBUILD; then, as
 *    engine deserialisation does, recreate it from getFieldsToSerialize() in phase kRUNTIME and
 *    attachToContext() it;
 * 3. onShapeChange + enqueue on a non-blocking stream, eagerly, and under thread-local stream
 *    capture with the graph replayed over fresh inputs written into the same buffers; outputs are
 *    poisoned (0xFF) before every run and must equal the CPU twin (dfl2SelectPathsHost) bit for
 *    bit: both modes, T = 0 and T > 0 with given uniforms, tied scores, fp32 / fp16 / bf16.
 *
 * What this does NOT exercise: TensorRT itself (registry, parser, builder, engine, its enqueue
 * around the plugin). Exit: 0 pass, 1 mismatch or error, 77 no CUDA device.
 */
#include "pathSelectorHost.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include "dfl2Test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

struct PluginDeleter
{
    void operator()(IPluginV3* p) const
    {
        delete p;
    }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

//! Bits of a value exactly representable in fp16 and bf16 (k / 64, |k| < 256: <= 8 significant bits).
uint16_t exactBits(float x, DataType t)
{
    uint32_t u = 0;
    std::memcpy(&u, &x, sizeof(u));
    if (t == DataType::kBF16)
    {
        return static_cast<uint16_t>(u >> 16);
    }
    if (x == 0.0f)
    {
        return static_cast<uint16_t>((u >> 16) & 0x8000u);
    }
    uint32_t const sign = (u >> 16) & 0x8000u;
    uint32_t const expo = ((u >> 23) & 0xffu) - 127u + 15u;
    return static_cast<uint16_t>(sign | (expo << 10) | ((u & 0x7fffffu) >> 13));
}

struct Case
{
    int32_t B, L, K, r, V;
    char const* mode;
    bool sampling;
    bool ties;
    DataType type;
};

struct Host
{
    std::vector<int32_t> cand, anchor;
    std::vector<float> unary, temperature, uniforms;
    std::vector<unsigned char> hidden, pred, succ; // typed
};

size_t elemSize(DataType t)
{
    return t == DataType::kFLOAT ? 4 : 2;
}

std::vector<unsigned char> typedValues(size_t n, DataType t, std::mt19937& rng, bool ties)
{
    std::uniform_int_distribution<int32_t> k(ties ? -2 : -255, ties ? 2 : 255);
    std::vector<unsigned char> out(n * elemSize(t));
    for (size_t i = 0; i < n; ++i)
    {
        float const x = static_cast<float>(k(rng)) / (ties ? 2.0f : 64.0f);
        if (t == DataType::kFLOAT)
        {
            std::memcpy(out.data() + 4 * i, &x, 4);
        }
        else
        {
            uint16_t const b = exactBits(x, t);
            std::memcpy(out.data() + 2 * i, &b, 2);
        }
    }
    return out;
}

Host makeHost(Case const& c, std::mt19937& rng)
{
    Host h;
    std::uniform_int_distribution<int32_t> token(0, c.V - 1);
    std::uniform_int_distribution<int32_t> small(-2, 2);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::uniform_real_distribution<float> unit(0.0f, 0.999999f);
    size_t const blk = static_cast<size_t>(c.B) * c.L * c.K;
    h.cand.resize(blk);
    h.unary.resize(blk);
    for (int32_t row = 0; row < c.B * c.L; ++row)
    {
        std::vector<float> u(static_cast<size_t>(c.K));
        for (int32_t j = 0; j < c.K; ++j)
        {
            h.cand[static_cast<size_t>(row) * c.K + j] = token(rng);
            u[static_cast<size_t>(j)] = c.ties ? static_cast<float>(small(rng)) : normal(rng);
        }
        std::sort(u.begin(), u.end(), [](float a, float b) { return a > b; }); // top-K arrive sorted
        std::copy(u.begin(), u.end(), h.unary.begin() + static_cast<std::ptrdiff_t>(row) * c.K);
    }
    h.hidden = typedValues(static_cast<size_t>(c.B) * c.L * c.r, c.type, rng, c.ties);
    h.pred = typedValues(static_cast<size_t>(c.V) * c.r, c.type, rng, c.ties);
    h.succ = typedValues(static_cast<size_t>(c.V) * c.r, c.type, rng, c.ties);
    h.anchor.resize(static_cast<size_t>(c.B));
    h.temperature.resize(static_cast<size_t>(c.B));
    for (int32_t b = 0; b < c.B; ++b)
    {
        h.anchor[static_cast<size_t>(b)] = token(rng);
        h.temperature[static_cast<size_t>(b)] = c.sampling ? 0.25f + 1.5f * unit(rng) : 0.0f;
    }
    h.uniforms.resize(static_cast<size_t>(c.B) * c.L);
    for (auto& x : h.uniforms)
    {
        x = unit(rng);
    }
    return h;
}

//! Device buffers of one case (fixed addresses: the captured graph reads and writes these).
struct Device
{
    void* in[8] = {};
    void* out[2] = {};
    size_t inBytes[8] = {};
    size_t outBytes[2] = {};

    explicit Device(Case const& c)
    {
        size_t const e = elemSize(c.type);
        size_t const blk = static_cast<size_t>(c.B) * c.L * c.K;
        size_t const sizes[8] = {blk * 4, blk * 4, static_cast<size_t>(c.B) * c.L * c.r * e,
            static_cast<size_t>(c.B) * 4, static_cast<size_t>(c.V) * c.r * e, static_cast<size_t>(c.V) * c.r * e,
            static_cast<size_t>(c.B) * 4, static_cast<size_t>(c.B) * c.L * 4};
        for (int k = 0; k < 8; ++k)
        {
            inBytes[k] = sizes[k];
            CUDA_OK(cudaMalloc(&in[k], sizes[k]));
        }
        outBytes[0] = static_cast<size_t>(c.B) * c.L * 4;
        outBytes[1] = blk * 4;
        for (int k = 0; k < 2; ++k)
        {
            CUDA_OK(cudaMalloc(&out[k], outBytes[k] + 4)); // + a guard word that must stay poisoned
        }
    }
    ~Device()
    {
        for (void* p : in)
        {
            cudaFree(p);
        }
        for (void* p : out)
        {
            cudaFree(p);
        }
    }
    Device(Device const&) = delete;
    Device& operator=(Device const&) = delete;

    void upload(Host const& h, cudaStream_t s)
    {
        void const* src[8] = {h.cand.data(), h.unary.data(), h.hidden.data(), h.anchor.data(), h.pred.data(),
            h.succ.data(), h.temperature.data(), h.uniforms.data()};
        for (int k = 0; k < 8; ++k)
        {
            CUDA_OK(cudaMemcpyAsync(in[k], src[k], inBytes[k], cudaMemcpyHostToDevice, s));
        }
        for (int k = 0; k < 2; ++k)
        {
            CUDA_OK(cudaMemsetAsync(out[k], 0xff, outBytes[k] + 4, s)); // poison: -1 ids, NaN probabilities
        }
    }
};

void descs(Case const& c, std::vector<PluginTensorDesc>& in, std::vector<PluginTensorDesc>& out)
{
    auto make = [](std::initializer_list<int64_t> v, DataType t) {
        PluginTensorDesc d{};
        d.dims.nbDims = static_cast<int32_t>(v.size());
        int32_t k = 0;
        for (int64_t x : v)
        {
            d.dims.d[k++] = x;
        }
        d.type = t;
        d.format = TensorFormat::kLINEAR;
        d.scale = 1.0f;
        return d;
    };
    in = {make({c.B, c.L, c.K}, DataType::kINT32), make({c.B, c.L, c.K}, DataType::kFLOAT),
        make({c.B, c.L, c.r}, c.type), make({c.B}, DataType::kINT32), make({c.V, c.r}, c.type),
        make({c.V, c.r}, c.type), make({c.B}, DataType::kFLOAT), make({c.B, c.L}, DataType::kFLOAT)};
    out = {make({c.B, c.L}, DataType::kINT32), make({c.B, c.L, c.K}, DataType::kFLOAT)};
}

//! Download the outputs and compare with the twin on `h`; prints and returns false on mismatch.
bool compare(Case const& c, Host const& h, Device const& d, char const* how)
{
    size_t const nIds = static_cast<size_t>(c.B) * c.L;
    size_t const nProps = nIds * c.K;
    std::vector<int32_t> ids(nIds + 1);
    std::vector<float> props(nProps + 1);
    CUDA_OK(cudaMemcpy(ids.data(), d.out[0], (nIds + 1) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(props.data(), d.out[1], (nProps + 1) * 4, cudaMemcpyDeviceToHost));
    std::vector<int32_t> twinIds(nIds);
    std::vector<float> twinProps(nProps);
    int32_t const elem = c.type == DataType::kFLOAT ? DFL2_ELEM_FLOAT32
                                                    : (c.type == DataType::kHALF ? DFL2_ELEM_FLOAT16 : DFL2_ELEM_BFLOAT16);
    int32_t const mode = std::strcmp(c.mode, "viterbi") == 0 ? DFL2_MODE_VITERBI : DFL2_MODE_GREEDY;
    if (dfl2SelectPathsHost(h.cand.data(), h.unary.data(), h.hidden.data(), h.anchor.data(), h.pred.data(),
            h.succ.data(), h.temperature.data(), h.uniforms.data(), c.B, c.L, c.K, c.r, c.V, elem, mode,
            twinIds.data(), twinProps.data(), nullptr)
        != DFL2_SELECTOR_OK)
    {
        std::fprintf(stderr, "the CPU twin refused the case\n");
        return false;
    }
    bool const same = std::memcmp(ids.data(), twinIds.data(), nIds * 4) == 0
        && std::memcmp(props.data(), twinProps.data(), nProps * 4) == 0;
    bool const guard = ids[nIds] == -1 && std::isnan(props[nProps]);
    if (!same || !guard)
    {
        std::fprintf(stderr, "MISMATCH (%s) B=%d mode=%s sampling=%d ties=%d type=%d: %s\n", how, c.B, c.mode,
            c.sampling, c.ties, static_cast<int>(c.type), same ? "wrote past the outputs" : "differs from the twin");
    }
    return same && guard;
}

//! The ONNX parser's way: attributes -> fields -> createPlugin(kBUILD); then the engine's way:
//! serialised fields -> createPlugin(kRUNTIME) -> attachToContext.
PluginPtr createLikeTensorRT(IPluginCreatorV3One* creator, Case const& c)
{
    int32_t topK = c.K;
    int32_t rank = c.r;
    std::string const mode = c.mode;
    PluginField fields[3] = {PluginField("top_k", &topK, PluginFieldType::kINT32, 1),
        PluginField("rank", &rank, PluginFieldType::kINT32, 1),
        PluginField("mode", mode.data(), PluginFieldType::kCHAR, static_cast<int32_t>(mode.size()))};
    PluginFieldCollection fc{3, fields};
    PluginPtr built(creator->createPlugin("DFlash2PathSelector_0", &fc, TensorRTPhase::kBUILD));
    if (!built)
    {
        return nullptr;
    }
    auto* rt = static_cast<IPluginV3OneRuntime*>(built->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginPtr runtime(creator->createPlugin("DFlash2PathSelector_0", rt->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    if (!runtime)
    {
        return nullptr;
    }
    auto* rt2 = static_cast<IPluginV3OneRuntime*>(runtime->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    return PluginPtr(rt2->attachToContext(nullptr));
}

//! Eager enqueue, then capture + 3 replays over fresh inputs; false on any mismatch.
bool runCase(IPluginCreatorV3One* creator, Case const& c, std::mt19937& rng, cudaStream_t s)
{
    PluginPtr plugin = createLikeTensorRT(creator, c);
    if (!plugin)
    {
        std::fprintf(stderr, "createPlugin failed\n");
        return false;
    }
    auto* rt = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    std::vector<PluginTensorDesc> in;
    std::vector<PluginTensorDesc> out;
    descs(c, in, out);
    if (rt->onShapeChange(in.data(), 8, out.data(), 2) != 0)
    {
        std::fprintf(stderr, "onShapeChange refused the case\n");
        return false;
    }
    Device d(c);
    Host h = makeHost(c, rng);
    d.upload(h, s);
    if (rt->enqueue(in.data(), out.data(), const_cast<void const* const*>(d.in), d.out, nullptr, s) != 0)
    {
        std::fprintf(stderr, "enqueue failed\n");
        return false;
    }
    CUDA_OK(cudaStreamSynchronize(s));
    bool ok = compare(c, h, d, "eager");

    cudaGraph_t graph{};
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    int32_t const status = rt->enqueue(in.data(), out.data(), const_cast<void const* const*>(d.in), d.out, nullptr, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    if (status != 0)
    {
        std::fprintf(stderr, "enqueue under capture failed\n");
        cudaGraphDestroy(graph);
        return false;
    }
    cudaGraphExec_t exec{};
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3 && ok; ++rep)
    {
        h = makeHost(c, rng); // new values, same buffers: what the runtime's replays do
        d.upload(h, s);
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        ok = compare(c, h, d, "graph replay");
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    return ok;
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s <libdflash2_plugins.so>\n", argv[0]);
        return 2;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    {
        std::printf("pluginGpuCheck: no CUDA device, skipped\n");
        return 77;
    }
    void* handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
    auto getCreators = dfl2Test::symbol<GetCreatorsFn>(handle, "getCreators");
    int32_t nb = 0;
    IPluginCreatorInterface* const* list = getCreators != nullptr ? getCreators(nb) : nullptr;
    IPluginCreatorV3One* creator = nullptr;
    for (int32_t k = 0; list != nullptr && k < nb; ++k) // the registry's look-up: name, version, namespace
    {
        if (std::strcmp(list[k]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
        {
            continue;
        }
        auto* cr = static_cast<IPluginCreatorV3One*>(list[k]);
        if (std::strcmp(cr->getPluginName(), "DFlash2PathSelector") == 0 && std::strcmp(cr->getPluginVersion(), "1") == 0
            && std::strcmp(cr->getPluginNamespace(), "") == 0)
        {
            creator = cr;
        }
    }
    if (creator == nullptr)
    {
        std::fprintf(stderr, "DFlash2PathSelector/1 creator not found among %d creator(s)\n", nb);
        return 1;
    }
    cudaStream_t s{};
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::mt19937 rng(20251130u);
    int32_t passed = 0;
    int32_t total = 0;
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        for (char const* mode : {"greedy", "viterbi"})
        {
            for (int variant = 0; variant < 3; ++variant) // T = 0, T > 0 (given uniforms), ties at T = 0
            {
                for (int32_t B : {1, 3})
                {
                    Case const c{B, 15, 16, 256, 1000, mode, variant == 1, variant == 2, t};
                    ++total;
                    passed += runCase(creator, c, rng, s) ? 1 : 0;
                }
            }
        }
    }
    CUDA_OK(cudaStreamDestroy(s));
    std::printf("pluginGpuCheck: %d/%d cases equal to the CPU twin (eager enqueue + graph replay x3)\n", passed, total);
    return passed == total ? 0 : 1;
}
