/*
 * dflash2_trt — host test of libdflash2_plugins.so with no TensorRT library present.
 *
 * dlopens the plugin library (path in argv[1]), takes the creators from getCreators, creates the
 * plugin from fields, and checks: output count/types, format support, shape inference (with a
 * fake expression builder), configure/onShapeChange validation, clone, field serialization
 * round-trip, refusal of invalid fields with a clear message, and that enqueue reports bad
 * arguments instead of crashing. Only TensorRT *headers* are used; every call goes through the
 * virtual interfaces, so this links and runs without libnvinfer.
 *
 *   testPluginHost <libdflash2_plugins.so>                   run the checks (exit 0 = pass)
 *   testPluginHost <libdflash2_plugins.so> --print-contract  print the contract as observed (JSON)
 */
#include <NvInferRuntime.h>

#include "dfl2Test.h"

#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
using AllCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t*);
using SetLoggerFinderFn = void (*)(ILoggerFinder*);
using LastErrorFn = char const* (*) ();
using StaticallyRegisteredFn = int32_t (*)();

using dfl2Test::symbol;

//! Collects what the library logs through the TensorRT logger interface.
class RecordingLogger : public ILogger
{
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kWARNING)
        {
            messages.emplace_back(msg != nullptr ? msg : "");
        }
    }
    std::vector<std::string> messages;
};

class LoggerFinder : public ILoggerFinder
{
public:
    explicit LoggerFinder(ILogger* logger)
        : mLogger(logger)
    {
    }
    ILogger* findLogger() override
    {
        return mLogger;
    }
    ~LoggerFinder() override = default;

private:
    ILogger* mLogger;
};

//! A dimension expression without TensorRT: constant or symbolic.
class FakeExprImpl : public apiv::VDimensionExpr
{
public:
    FakeExprImpl(bool constant, int64_t value)
        : mConstant(constant)
        , mValue(value)
    {
    }
    bool isConstant() const override
    {
        return mConstant;
    }
    int64_t getConstantValue() const override
    {
        return mConstant ? mValue : INT64_MIN;
    }
    bool isSizeTensor() const override
    {
        return false;
    }

private:
    bool mConstant;
    int64_t mValue;
};

class FakeExpr : public IDimensionExpr
{
public:
    FakeExpr(bool constant, int64_t value)
        : mOwned(constant, value)
    {
        mImpl = &mOwned;
    }
    ~FakeExpr() noexcept override = default;

private:
    FakeExprImpl mOwned;
};

class FakeBuilder : public IExprBuilder
{
public:
    FakeBuilder()
    {
        mImpl = nullptr; // the plugin must not need to build new expressions
    }
    ~FakeBuilder() noexcept override = default;
};

//! Input dims of a well-formed call; batch -1 = dynamic.
struct Shapes
{
    int64_t B = -1;
    int64_t L = 15;
    int64_t K = 16;
    int64_t r = 256;
    int64_t V = 1000;
};

std::vector<Dims> inputDims(Shapes const& s)
{
    auto make = [](std::initializer_list<int64_t> v) {
        Dims d{};
        d.nbDims = static_cast<int32_t>(v.size());
        int32_t k = 0;
        for (int64_t x : v)
        {
            d.d[k++] = x;
        }
        return d;
    };
    return {make({s.B, s.L, s.K}), make({s.B, s.L, s.K}), make({s.B, s.L, s.r}), make({s.B}), make({s.V, s.r}),
        make({s.V, s.r}), make({s.B}), make({s.B, s.L})};
}

std::vector<DataType> inputTypes(DataType codebook)
{
    return {DataType::kINT32, DataType::kFLOAT, codebook, DataType::kINT32, codebook, codebook, DataType::kFLOAT,
        DataType::kFLOAT};
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(Shapes const& s, DataType codebook)
{
    std::vector<Dims> const dims = inputDims(s);
    std::vector<DataType> const types = inputTypes(codebook);
    std::vector<DynamicPluginTensorDesc> d(10);
    for (size_t k = 0; k < 8; ++k)
    {
        d[k].desc.dims = dims[k];
        d[k].desc.type = types[k];
        d[k].desc.format = TensorFormat::kLINEAR;
        d[k].min = dims[k];
        d[k].max = dims[k];
        d[k].opt = dims[k];
    }
    d[8].desc.dims = Dims{};
    d[8].desc.type = DataType::kINT32;
    d[8].desc.format = TensorFormat::kLINEAR;
    d[9].desc.type = DataType::kFLOAT;
    d[9].desc.format = TensorFormat::kLINEAR;
    return d;
}

struct Fields
{
    std::vector<PluginField> list;
    PluginFieldCollection fc{};
    PluginFieldCollection const* get()
    {
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

struct PluginDeleter
{
    void operator()(IPluginV3* p) const
    {
        delete p;
    }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

char const* typeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    default: return "other";
    }
}

char const* dataTypeName(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    case DataType::kBOOL: return "bool";
    default: return "other";
    }
}

IPluginV3* createFrom(IPluginCreatorV3One* creator, int32_t topK, int32_t rank, char const* mode, size_t modeLen,
    TensorRTPhase phase = TensorRTPhase::kBUILD)
{
    Fields f;
    f.list.emplace_back("top_k", &topK, PluginFieldType::kINT32, 1);
    f.list.emplace_back("rank", &rank, PluginFieldType::kINT32, 1);
    if (mode != nullptr)
    {
        f.list.emplace_back("mode", mode, PluginFieldType::kCHAR, static_cast<int32_t>(modeLen));
    }
    return creator->createPlugin("selector", f.get(), phase);
}

//! Print the contract the library exposes: creator identity and fields, outputs, and the
//! types each I/O position accepts (probed through supportsFormatCombination).
int printContract(IPluginCreatorV3One* creator)
{
    std::printf("{\"name\": \"%s\", \"version\": \"%s\", \"namespace\": \"%s\", \"fields\": [",
        creator->getPluginName(), creator->getPluginVersion(), creator->getPluginNamespace());
    PluginFieldCollection const* fields = creator->getFieldNames();
    for (int32_t k = 0; k < fields->nbFields; ++k)
    {
        std::printf("%s{\"name\": \"%s\", \"type\": \"%s\"}", k ? ", " : "", fields->fields[k].name,
            typeName(fields->fields[k].type));
    }
    char const mode[] = "greedy";
    PluginPtr plugin(createFrom(creator, 16, 256, mode, sizeof(mode) - 1));
    if (!plugin)
    {
        std::fprintf(stderr, "cannot create the plugin\n");
        return 1;
    }
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    int32_t nbInputs = -1;
    for (int32_t n = 0; n <= 16; ++n)
    {
        std::vector<DataType> in(static_cast<size_t>(n), DataType::kFLOAT);
        std::vector<DataType> base = inputTypes(DataType::kFLOAT);
        for (int32_t k = 0; k < n && k < 8; ++k)
        {
            in[static_cast<size_t>(k)] = base[static_cast<size_t>(k)];
        }
        DataType out[2];
        if (build->getOutputDataTypes(out, 2, in.data(), n) == 0)
        {
            nbInputs = n;
        }
    }
    std::printf("], \"nb_inputs\": %d, \"nb_outputs\": %d, \"io_types\": [", nbInputs, build->getNbOutputs());
    DataType const candidates[] = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT32,
        DataType::kINT64, DataType::kINT8, DataType::kBOOL};
    int32_t const nbIo = nbInputs + build->getNbOutputs();
    for (int32_t pos = 0; pos < nbIo; ++pos)
    {
        std::printf("%s[", pos ? ", " : "");
        bool first = true;
        for (DataType t : candidates)
        {
            // the other positions hold a valid combination whose codebook type is t; the later
            // codebook positions count only types that hidden_proj (position 2) accepts as well
            std::vector<DynamicPluginTensorDesc> d = dynamicDescs(Shapes{}, t);
            bool const laterCodebook = pos == 4 || pos == 5;
            bool const hiddenOk = build->supportsFormatCombination(2, d.data(), nbInputs, build->getNbOutputs());
            d[static_cast<size_t>(pos)].desc.type = t;
            if ((!laterCodebook || hiddenOk)
                && build->supportsFormatCombination(pos, d.data(), nbInputs, build->getNbOutputs()))
            {
                std::printf("%s\"%s\"", first ? "" : ", ", dataTypeName(t));
                first = false;
            }
        }
        std::printf("]");
    }
    std::printf("]}\n");
    return 0;
}

void checkRefused(IPluginCreatorV3One* creator, LastErrorFn lastError, Fields& f, char const* expectInMessage)
{
    IPluginV3* p = creator->createPlugin("bad", f.get(), TensorRTPhase::kBUILD);
    CHECK(p == nullptr);
    delete p;
    std::string const message = lastError();
    if (message.find(expectInMessage) == std::string::npos)
    {
        std::fprintf(stderr, "expected '%s' in the error message, got '%s'\n", expectInMessage, message.c_str());
        ++*dfl2TestCounter();
    }
}

void testRefusals(IPluginCreatorV3One* creator, LastErrorFn lastError)
{
    int32_t const k0 = 0;
    int32_t const k17 = 17;
    int32_t const k16 = 16;
    int32_t const r0 = 0;
    int32_t const r256 = 256;
    float const f16 = 16.0f;
    char const beam[] = "beam";
    {
        Fields f;
        f.list.emplace_back("top_k", &k0, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "top_k must be in [1, 16], got 0");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &k17, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "top_k must be in [1, 16], got 17");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &k16, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "rank is required");
    }
    {
        Fields f;
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "top_k is required");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &k16, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r0, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "rank must be in");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &k16, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        f.list.emplace_back("mode", beam, PluginFieldType::kCHAR, 4);
        checkRefused(creator, lastError, f, "mode must be \"greedy\" or \"viterbi\", got \"beam\"");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &f16, PluginFieldType::kFLOAT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        checkRefused(creator, lastError, f, "field 'top_k' must be of type kINT32");
    }
    {
        Fields f;
        f.list.emplace_back("top_k", &k16, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        f.list.emplace_back("temperature", &f16, PluginFieldType::kFLOAT32, 1);
        checkRefused(creator, lastError, f, "unknown field 'temperature'");
    }
    {
        CHECK(creator->createPlugin("bad", nullptr, TensorRTPhase::kBUILD) == nullptr);
    }
    {
        // the ONNX parser's bookkeeping attributes are accepted and ignored
        char const version[] = "1";
        char const ns[] = "";
        Fields f;
        f.list.emplace_back("top_k", &k16, PluginFieldType::kINT32, 1);
        f.list.emplace_back("rank", &r256, PluginFieldType::kINT32, 1);
        f.list.emplace_back("plugin_version", version, PluginFieldType::kCHAR, 1);
        f.list.emplace_back("plugin_namespace", ns, PluginFieldType::kCHAR, 0);
        PluginPtr p(creator->createPlugin("ok", f.get(), TensorRTPhase::kBUILD));
        CHECK(p != nullptr);
    }
}

//! Serialized fields of a plugin as (top_k, rank, mode).
void readSerialized(IPluginV3* plugin, int32_t& topK, int32_t& rank, std::string& mode)
{
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* fc = runtime->getFieldsToSerialize();
    CHECK(fc != nullptr && fc->nbFields == 3);
    topK = -1;
    rank = -1;
    mode.clear();
    for (int32_t k = 0; fc != nullptr && k < fc->nbFields; ++k)
    {
        PluginField const& f = fc->fields[k];
        if (std::strcmp(f.name, "top_k") == 0 && f.type == PluginFieldType::kINT32)
        {
            topK = *static_cast<int32_t const*>(f.data);
        }
        else if (std::strcmp(f.name, "rank") == 0 && f.type == PluginFieldType::kINT32)
        {
            rank = *static_cast<int32_t const*>(f.data);
        }
        else if (std::strcmp(f.name, "mode") == 0 && f.type == PluginFieldType::kCHAR)
        {
            char const* s = static_cast<char const*>(f.data);
            mode.assign(s, strnlen(s, static_cast<size_t>(f.length)));
        }
    }
}

void testPlugin(IPluginCreatorV3One* creator, LastErrorFn lastError, RecordingLogger& logger)
{
    char const viterbi[] = "viterbi"; // passed without the NUL, as the ONNX parser does
    PluginPtr plugin(createFrom(creator, 16, 256, viterbi, sizeof(viterbi) - 1));
    CHECK(plugin != nullptr);
    if (!plugin)
    {
        return;
    }
    CHECK(std::strcmp(plugin->getInterfaceInfo().kind, "PLUGIN") == 0);
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    CHECK(core != nullptr && build != nullptr && runtime != nullptr);
    CHECK(std::strcmp(core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0);
    CHECK(std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0);
    CHECK(std::strcmp(runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0);
    CHECK(std::strcmp(core->getPluginName(), "DFlash2PathSelector") == 0);
    CHECK(std::strcmp(core->getPluginVersion(), "1") == 0);
    CHECK(std::strcmp(core->getPluginNamespace(), "") == 0);

    // outputs: path_ids int32, proposal_probs fp32, for every codebook type
    CHECK(build->getNbOutputs() == 2);
    for (DataType cb : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        std::vector<DataType> in = inputTypes(cb);
        DataType out[2] = {DataType::kBOOL, DataType::kBOOL};
        CHECK(build->getOutputDataTypes(out, 2, in.data(), 8) == 0);
        CHECK(out[0] == DataType::kINT32 && out[1] == DataType::kFLOAT);
    }
    {
        std::vector<DataType> in = inputTypes(DataType::kHALF);
        in[5] = DataType::kFLOAT; // successor codebook differs from the predecessor codebook
        DataType out[2];
        size_t const before = logger.messages.size();
        CHECK(build->getOutputDataTypes(out, 2, in.data(), 8) != 0);
        CHECK(logger.messages.size() == before + 1);
        CHECK(std::string(lastError()).find("succ_codebook") != std::string::npos);
        in = inputTypes(DataType::kFLOAT);
        in[0] = DataType::kINT64;
        CHECK(build->getOutputDataTypes(out, 2, in.data(), 8) != 0);
        CHECK(build->getOutputDataTypes(out, 2, in.data(), 7) != 0);
    }

    // format support
    {
        std::vector<DynamicPluginTensorDesc> d = dynamicDescs(Shapes{}, DataType::kHALF);
        for (int32_t pos = 0; pos < 10; ++pos)
        {
            CHECK(build->supportsFormatCombination(pos, d.data(), 8, 2));
        }
        d[5].desc.type = DataType::kFLOAT;
        CHECK(!build->supportsFormatCombination(5, d.data(), 8, 2));
        d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        d[1].desc.format = TensorFormat::kHWC;
        CHECK(!build->supportsFormatCombination(1, d.data(), 8, 2));
        d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        d[0].desc.type = DataType::kINT64;
        CHECK(!build->supportsFormatCombination(0, d.data(), 8, 2));
        d = dynamicDescs(Shapes{}, DataType::kINT8);
        CHECK(!build->supportsFormatCombination(2, d.data(), 8, 2));
        d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        d[9].desc.type = DataType::kHALF;
        CHECK(!build->supportsFormatCombination(9, d.data(), 8, 2));
        CHECK(!build->supportsFormatCombination(10, d.data(), 8, 2));
        CHECK(!build->supportsFormatCombination(0, d.data(), 7, 2));
    }

    // shape inference with fake expressions: [B, L, K] -> [B, L], [B, L, K]
    {
        FakeExpr batch(false, 0);
        FakeExpr L(true, 15);
        FakeExpr K(true, 16);
        FakeExpr K8(true, 8);
        FakeExpr r(true, 256);
        FakeExpr V(true, 1000);
        FakeExpr dynL(false, 0);
        FakeBuilder builder;
        auto exprs = [&](IDimensionExpr const* rowDim, IDimensionExpr const* kDim) {
            std::vector<DimsExprs> in(8);
            auto set = [](DimsExprs& e, std::initializer_list<IDimensionExpr const*> d) {
                e.nbDims = static_cast<int32_t>(d.size());
                int32_t k = 0;
                for (auto* x : d)
                {
                    e.d[k++] = x;
                }
            };
            set(in[0], {&batch, rowDim, kDim});
            set(in[1], {&batch, rowDim, kDim});
            set(in[2], {&batch, rowDim, &r});
            set(in[3], {&batch});
            set(in[4], {&V, &r});
            set(in[5], {&V, &r});
            set(in[6], {&batch});
            set(in[7], {&batch, rowDim});
            return in;
        };
        std::vector<DimsExprs> in = exprs(&L, &K);
        DimsExprs out[2];
        CHECK(build->getOutputShapes(in.data(), 8, nullptr, 0, out, 2, builder) == 0);
        CHECK(out[0].nbDims == 2 && out[0].d[0] == &batch && out[0].d[1] == &L);
        CHECK(out[1].nbDims == 3 && out[1].d[0] == &batch && out[1].d[1] == &L && out[1].d[2] == &K);
        in = exprs(&L, &K8);
        CHECK(build->getOutputShapes(in.data(), 8, nullptr, 0, out, 2, builder) != 0);
        CHECK(std::string(lastError()).find("top_k") != std::string::npos);
        in = exprs(&dynL, &K);
        CHECK(build->getOutputShapes(in.data(), 8, nullptr, 0, out, 2, builder) != 0);
        CHECK(std::string(lastError()).find("static L") != std::string::npos);
        in = exprs(&L, &K);
        in[3].nbDims = 2;
        CHECK(build->getOutputShapes(in.data(), 8, nullptr, 0, out, 2, builder) != 0);
    }

    // configurePlugin: dynamic batch accepted, wrong shapes refused with a message
    {
        std::vector<DynamicPluginTensorDesc> d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) == 0);
        Shapes bad;
        bad.K = 8;
        d = dynamicDescs(bad, DataType::kFLOAT);
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        CHECK(std::string(lastError()).find("differs from top_k = 16") != std::string::npos);
        bad = Shapes{};
        bad.r = 128;
        d = dynamicDescs(bad, DataType::kFLOAT);
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        bad = Shapes{};
        bad.L = -1;
        d = dynamicDescs(bad, DataType::kFLOAT);
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        CHECK(std::string(lastError()).find("static L") != std::string::npos);
        bad = Shapes{};
        bad.L = 64; // 64 x 16 x 16 fp32 lattice exceeds the shared-memory budget
        d = dynamicDescs(bad, DataType::kFLOAT);
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        CHECK(std::string(lastError()).find("shared memory") != std::string::npos);
        d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        d[4].desc.dims.d[0] = 999; // pred and succ codebooks disagree on V
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        d = dynamicDescs(Shapes{}, DataType::kFLOAT);
        d[7].desc.dims.d[1] = 14; // uniforms [B, L - 1]
        CHECK(build->configurePlugin(d.data(), 8, d.data() + 8, 2) != 0);
        CHECK(build->getWorkspaceSize(d.data(), 8, d.data() + 8, 2) == 0);
    }

    // onShapeChange with concrete shapes; enqueue refuses null tensors without touching CUDA
    {
        Shapes s;
        s.B = 4;
        std::vector<DynamicPluginTensorDesc> d = dynamicDescs(s, DataType::kBF16);
        std::vector<PluginTensorDesc> in(8);
        std::vector<PluginTensorDesc> out(2);
        for (size_t k = 0; k < 8; ++k)
        {
            in[k] = d[k].desc;
        }
        out[0] = d[8].desc;
        out[1] = d[9].desc;
        CHECK(runtime->onShapeChange(in.data(), 8, out.data(), 2) == 0);
        std::vector<void const*> inPtrs(8, nullptr);
        std::vector<void*> outPtrs(2, nullptr);
        CHECK(runtime->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), nullptr, nullptr) != 0);
        in[3].dims.d[0] = 3; // anchor batch disagrees
        CHECK(runtime->onShapeChange(in.data(), 8, out.data(), 2) != 0);
    }

    // serialization round-trip through the creator (runtime phase), clone, attachToContext
    {
        int32_t topK = 0;
        int32_t rank = 0;
        std::string mode;
        readSerialized(plugin.get(), topK, rank, mode);
        CHECK(topK == 16 && rank == 256 && mode == "viterbi");
        PluginFieldCollection const* fc = runtime->getFieldsToSerialize();
        PluginPtr restored(creator->createPlugin("restored", fc, TensorRTPhase::kRUNTIME));
        CHECK(restored != nullptr);
        if (restored)
        {
            readSerialized(restored.get(), topK, rank, mode);
            CHECK(topK == 16 && rank == 256 && mode == "viterbi");
        }
        PluginPtr cloned(plugin->clone());
        CHECK(cloned != nullptr);
        if (cloned)
        {
            plugin.reset(); // the clone must not depend on the original's storage
            readSerialized(cloned.get(), topK, rank, mode);
            CHECK(topK == 16 && rank == 256 && mode == "viterbi");
            auto* rt = static_cast<IPluginV3OneRuntime*>(cloned->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
            PluginPtr attached(rt->attachToContext(nullptr));
            CHECK(attached != nullptr);
        }
    }

    // mode defaults to greedy; a NUL-terminated mode string is accepted too
    {
        PluginPtr p(createFrom(creator, 4, 3, nullptr, 0));
        CHECK(p != nullptr);
        char const greedy[] = "greedy";
        PluginPtr q(createFrom(creator, 1, 7, greedy, sizeof(greedy)));
        CHECK(q != nullptr);
        if (p && q)
        {
            int32_t topK = 0;
            int32_t rank = 0;
            std::string mode;
            readSerialized(p.get(), topK, rank, mode);
            CHECK(topK == 4 && rank == 3 && mode == "greedy");
            readSerialized(q.get(), topK, rank, mode);
            CHECK(topK == 1 && rank == 7 && mode == "greedy");
        }
    }
}

} // namespace

int main(int argc, char** argv)
{
    if (argc < 2)
    {
        std::fprintf(stderr, "usage: %s <libdflash2_plugins.so> [--print-contract]\n", argv[0]);
        return 2;
    }
    // RTLD_NOW: every symbol the library needs must resolve now, without any TensorRT library
    void* handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    auto getCreators = symbol<GetCreatorsFn>(handle, "getCreators");
    auto allCreators = symbol<AllCreatorsFn>(handle, "dfl2PluginsAllCreators");
    auto setFinder = symbol<SetLoggerFinderFn>(handle, "setLoggerFinder");
    auto lastError = symbol<LastErrorFn>(handle, "dfl2PluginsLastError");
    auto staticallyRegistered = symbol<StaticallyRegisteredFn>(handle, "dfl2PluginsStaticallyRegistered");
    if (!getCreators || !allCreators || !setFinder || !lastError || !staticallyRegistered)
    {
        std::fprintf(stderr, "missing exported entry points\n");
        return 1;
    }
    CHECK(dlsym(handle, "getPluginRegistry") == nullptr); // TensorRT itself is not pulled in

    // no TensorRT in the process: no static registration, so getCreators lists the creator
    CHECK(staticallyRegistered() == 0);
    int32_t nbCreators = -1;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    CHECK(creators != nullptr && nbCreators == 1);
    int32_t nbAll = -1;
    CHECK(allCreators(&nbAll) == creators && nbAll == 1);
    if (creators == nullptr || nbCreators != 1)
    {
        return 1;
    }
    CHECK(std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
    CHECK(creators[0]->getInterfaceInfo().major == 1);
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);

    if (argc > 2 && std::strcmp(argv[2], "--print-contract") == 0)
    {
        return printContract(creator) != 0 || dfl2TestFailures() != 0 ? 1 : 0;
    }

    // without a logger finder errors go to stderr; install one and check they arrive there
    RecordingLogger logger;
    LoggerFinder finder(&logger);
    setFinder(&finder);

    CHECK(std::strcmp(creator->getPluginName(), "DFlash2PathSelector") == 0);
    CHECK(std::strcmp(creator->getPluginVersion(), "1") == 0);
    CHECK(std::strcmp(creator->getPluginNamespace(), "") == 0);
    PluginFieldCollection const* fields = creator->getFieldNames();
    CHECK(fields != nullptr && fields->nbFields == 3);

    testPlugin(creator, lastError, logger);
    testRefusals(creator, lastError);
    CHECK(!logger.messages.empty());
    CHECK(logger.messages.back().rfind("DFlash2PathSelector: ", 0) == 0);

    return dfl2TestReport("testPluginHost");
}
