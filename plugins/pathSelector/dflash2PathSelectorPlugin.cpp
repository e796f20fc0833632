/*
 * dflash2_trt — DFlash2PathSelector plugin, then its creator. See the header for
 * the I/O contract. Every TensorRT-facing method is noexcept and catches everything: exceptions
 * never cross the library boundary; errors are logged and reported as status.
 */
#include "dflash2PathSelectorPlugin.h"

#include "../common/dflash2PluginsCommon.h"
#include "pathSelectorKernel.cuh"

#include <cstdio>
#include <cstring>
#include <sstream>

namespace dflash2
{
namespace plugin
{

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorFormat;

namespace
{

constexpr char const* kFIELD_TOP_K = "top_k";
constexpr char const* kFIELD_RANK = "rank";
constexpr char const* kFIELD_MODE = "mode";
//! Set by the ONNX parser on every plugin node; the creator lookup already consumed them.
constexpr char const* kFIELD_PLUGIN_VERSION = "plugin_version";
constexpr char const* kFIELD_PLUGIN_NAMESPACE = "plugin_namespace";
//! Upper bound on rank: keeps index arithmetic far from overflow; real checkpoints use 256.
constexpr int32_t kMAX_RANK = 1 << 16;

char const* const kINPUT_NAMES[kNB_INPUTS] = {"cand_ids", "unary", "hidden_proj", "anchor_ids", "pred_codebook",
    "succ_codebook", "temperature", "uniforms"};

std::string prefixed(std::string const& message)
{
    return std::string(kPATH_SELECTOR_NAME) + ": " + message;
}

void reportError(std::string const& message) noexcept
{
    try
    {
        logError(prefixed(message).c_str());
    }
    catch (...)
    {
        logError("DFlash2PathSelector: error (message allocation failed)");
    }
}

void reportUnknownException() noexcept
{
    logError("DFlash2PathSelector: unexpected internal error");
}

char const* dataTypeName(DataType t) noexcept
{
    switch (t)
    {
    case DataType::kFLOAT: return "fp32";
    case DataType::kHALF: return "fp16";
    case DataType::kBF16: return "bf16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    default: return "unsupported";
    }
}

bool isCodebookType(DataType t) noexcept
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

selector::ElemType toElemType(DataType t) noexcept
{
    return t == DataType::kHALF ? selector::ElemType::kFLOAT16
                                : (t == DataType::kBF16 ? selector::ElemType::kBFLOAT16 : selector::ElemType::kFLOAT32);
}

//! The type input `pos` must have; codebook-typed inputs (2, 4, 5) report kFLOAT and are
//! checked separately.
DataType expectedFixedType(int32_t pos) noexcept
{
    switch (pos)
    {
    case kIN_CAND_IDS:
    case kIN_ANCHOR_IDS: return DataType::kINT32;
    default: return DataType::kFLOAT;
    }
}

bool isCodebookInput(int32_t pos) noexcept
{
    return pos == kIN_HIDDEN_PROJ || pos == kIN_PRED_CODEBOOK || pos == kIN_SUCC_CODEBOOK;
}

std::string dimsToString(Dims const& d)
{
    std::ostringstream s;
    s << '[';
    for (int32_t k = 0; k < d.nbDims; ++k)
    {
        s << (k ? ", " : "") << d.d[k];
    }
    s << ']';
    return s.str();
}

//! Scalar integer field value (kINT32 or kINT64, length 1).
bool readIntField(PluginField const& f, int64_t& value, std::string& error)
{
    if (f.data == nullptr || f.length != 1)
    {
        error = std::string("field '") + f.name + "' must be one integer";
        return false;
    }
    if (f.type == PluginFieldType::kINT32)
    {
        value = *static_cast<int32_t const*>(f.data);
        return true;
    }
    if (f.type == PluginFieldType::kINT64)
    {
        value = *static_cast<int64_t const*>(f.data);
        return true;
    }
    error = std::string("field '") + f.name + "' must be of type kINT32";
    return false;
}

} // namespace

char const* modeName(selector::Mode mode) noexcept
{
    return mode == selector::Mode::kVITERBI ? "viterbi" : "greedy";
}

bool parsePathSelectorFields(PluginFieldCollection const* fc, PathSelectorAttrs& attrs, std::string& error) noexcept
{
    try
    {
        if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr) || fc->nbFields < 0)
        {
            error = "missing plugin field collection";
            return false;
        }
        bool haveTopK = false;
        bool haveRank = false;
        int64_t topK = 0;
        int64_t rank = 0;
        selector::Mode mode = selector::Mode::kGREEDY;
        for (int32_t k = 0; k < fc->nbFields; ++k)
        {
            PluginField const& f = fc->fields[k];
            if (f.name == nullptr)
            {
                error = "plugin field without a name";
                return false;
            }
            if (std::strcmp(f.name, kFIELD_TOP_K) == 0)
            {
                if (!readIntField(f, topK, error))
                {
                    return false;
                }
                haveTopK = true;
            }
            else if (std::strcmp(f.name, kFIELD_RANK) == 0)
            {
                if (!readIntField(f, rank, error))
                {
                    return false;
                }
                haveRank = true;
            }
            else if (std::strcmp(f.name, kFIELD_MODE) == 0)
            {
                if (f.type != PluginFieldType::kCHAR || f.data == nullptr || f.length < 0)
                {
                    error = "field 'mode' must be a kCHAR string \"greedy\" or \"viterbi\"";
                    return false;
                }
                // the ONNX parser passes the string without a terminating NUL; callers may add one
                char const* text = static_cast<char const*>(f.data);
                std::string const value(text, strnlen(text, static_cast<size_t>(f.length)));
                if (value == "greedy")
                {
                    mode = selector::Mode::kGREEDY;
                }
                else if (value == "viterbi")
                {
                    mode = selector::Mode::kVITERBI;
                }
                else
                {
                    error = "mode must be \"greedy\" or \"viterbi\", got \"" + value + "\"";
                    return false;
                }
            }
            else if (std::strcmp(f.name, kFIELD_PLUGIN_VERSION) == 0 || std::strcmp(f.name, kFIELD_PLUGIN_NAMESPACE) == 0)
            {
                continue;
            }
            else
            {
                error = std::string("unknown field '") + f.name + "' (expected top_k, rank, mode)";
                return false;
            }
        }
        if (!haveTopK || !haveRank)
        {
            error = !haveTopK ? "field top_k is required" : "field rank is required";
            return false;
        }
        if (topK < 1 || topK > selector::kMAX_TOP_K)
        {
            error = "top_k must be in [1, " + std::to_string(selector::kMAX_TOP_K) + "], got " + std::to_string(topK);
            return false;
        }
        if (rank < 1 || rank > kMAX_RANK)
        {
            error = "rank must be in [1, " + std::to_string(kMAX_RANK) + "], got " + std::to_string(rank);
            return false;
        }
        attrs.topK = static_cast<int32_t>(topK);
        attrs.rank = static_cast<int32_t>(rank);
        attrs.mode = mode;
        return true;
    }
    catch (...)
    {
        error = "internal error while parsing fields";
        return false;
    }
}

// ---------------------------------------------------------------------------------------------
// PathSelectorPlugin
// ---------------------------------------------------------------------------------------------

PathSelectorPlugin::PathSelectorPlugin(PathSelectorAttrs const& attrs, std::string const& pluginNamespace)
    : mAttrs(attrs)
    , mNamespace(pluginNamespace)
    , mModeString(modeName(attrs.mode))
{
}

PathSelectorPlugin::PathSelectorPlugin(PathSelectorPlugin const& other)
    : nvinfer1::IPluginV3(other)
    , nvinfer1::IPluginV3OneCore(other)
    , nvinfer1::IPluginV3OneBuild(other)
    , nvinfer1::IPluginV3OneRuntime(other)
    , mAttrs(other.mAttrs)
    , mNamespace(other.mNamespace)
    , mModeString(other.mModeString)
{
    // mSerialFields points into the owner's members, so a copy rebuilds them on demand
}

nvinfer1::IPluginCapability* PathSelectorPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* PathSelectorPlugin::clone() noexcept
{
    try
    {
        return new PathSelectorPlugin(*this);
    }
    catch (...)
    {
        reportUnknownException();
        return nullptr;
    }
}

char const* PathSelectorPlugin::getPluginName() const noexcept
{
    return kPATH_SELECTOR_NAME;
}

char const* PathSelectorPlugin::getPluginVersion() const noexcept
{
    return kPATH_SELECTOR_VERSION;
}

char const* PathSelectorPlugin::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

int32_t PathSelectorPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t PathSelectorPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || outputTypes == nullptr || inputTypes == nullptr)
        {
            reportError("expects 8 inputs and 2 outputs, got " + std::to_string(nbInputs) + " inputs and "
                + std::to_string(nbOutputs) + " outputs");
            return -1;
        }
        for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
        {
            bool const ok = isCodebookInput(pos) ? inputTypes[pos] == inputTypes[kIN_PRED_CODEBOOK]
                        && isCodebookType(inputTypes[pos])
                                                 : inputTypes[pos] == expectedFixedType(pos);
            if (!ok)
            {
                reportError(std::string("input ") + std::to_string(pos) + " (" + kINPUT_NAMES[pos] + ") has type "
                    + dataTypeName(inputTypes[pos]) + "; expected "
                    + (isCodebookInput(pos) ? "fp32/fp16/bf16, the same for hidden_proj and both codebooks"
                                            : dataTypeName(expectedFixedType(pos))));
                return -1;
            }
        }
        outputTypes[kOUT_PATH_IDS] = DataType::kINT32;
        outputTypes[kOUT_PROPOSAL_PROBS] = DataType::kFLOAT;
        return 0;
    }
    catch (...)
    {
        reportUnknownException();
        return -1;
    }
}

int32_t PathSelectorPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    try
    {
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || nbShapeInputs != 0 || inputs == nullptr
            || outputs == nullptr)
        {
            reportError("expects 8 inputs, 0 shape inputs and 2 outputs");
            return -1;
        }
        static int32_t const kRANKS[kNB_INPUTS] = {3, 3, 3, 1, 2, 2, 1, 2};
        for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
        {
            if (inputs[pos].nbDims != kRANKS[pos])
            {
                reportError(std::string("input ") + kINPUT_NAMES[pos] + " must have rank " + std::to_string(kRANKS[pos])
                    + ", got " + std::to_string(inputs[pos].nbDims));
                return -1;
            }
        }
        nvinfer1::DimsExprs const& cand = inputs[kIN_CAND_IDS]; // [B, L, K]
        // L and K must be build-time constants (static block length; K is the top_k attribute)
        if (!cand.d[1]->isConstant() || !cand.d[2]->isConstant())
        {
            reportError("cand_ids [B, L, K] needs static L and K");
            return -1;
        }
        if (cand.d[2]->getConstantValue() != mAttrs.topK)
        {
            reportError("cand_ids K = " + std::to_string(cand.d[2]->getConstantValue()) + " differs from top_k = "
                + std::to_string(mAttrs.topK));
            return -1;
        }
        nvinfer1::DimsExprs const& hidden = inputs[kIN_HIDDEN_PROJ]; // [B, L, r]
        if (hidden.d[2]->isConstant() && hidden.d[2]->getConstantValue() != mAttrs.rank)
        {
            reportError("hidden_proj r = " + std::to_string(hidden.d[2]->getConstantValue()) + " differs from rank = "
                + std::to_string(mAttrs.rank));
            return -1;
        }
        outputs[kOUT_PATH_IDS].nbDims = 2; // [B, L]
        outputs[kOUT_PATH_IDS].d[0] = cand.d[0];
        outputs[kOUT_PATH_IDS].d[1] = cand.d[1];
        outputs[kOUT_PROPOSAL_PROBS].nbDims = 3; // [B, L, K]
        outputs[kOUT_PROPOSAL_PROBS].d[0] = cand.d[0];
        outputs[kOUT_PROPOSAL_PROBS].d[1] = cand.d[1];
        outputs[kOUT_PROPOSAL_PROBS].d[2] = cand.d[2];
        return 0;
    }
    catch (...)
    {
        reportUnknownException();
        return -1;
    }
}

bool PathSelectorPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0
        || pos >= kNB_INPUTS + kNB_OUTPUTS)
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case kIN_HIDDEN_PROJ: return isCodebookType(desc.type);
    // TensorRT asks positions in order, so inOut[kIN_HIDDEN_PROJ] is already fixed here
    case kIN_PRED_CODEBOOK:
    case kIN_SUCC_CODEBOOK: return desc.type == inOut[kIN_HIDDEN_PROJ].desc.type;
    case kNB_INPUTS + kOUT_PATH_IDS: return desc.type == DataType::kINT32;
    case kNB_INPUTS + kOUT_PROPOSAL_PROBS: return desc.type == DataType::kFLOAT;
    default: return desc.type == expectedFixedType(pos);
    }
}

bool PathSelectorPlugin::validateIo(
    Dims const* dims, DataType const* types, int32_t nbInputs, std::string& error) const
{
    if (nbInputs != kNB_INPUTS)
    {
        error = "expects 8 inputs, got " + std::to_string(nbInputs);
        return false;
    }
    for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
    {
        bool const ok = isCodebookInput(pos)
            ? types[pos] == types[kIN_PRED_CODEBOOK] && isCodebookType(types[pos])
            : types[pos] == expectedFixedType(pos);
        if (!ok)
        {
            error = std::string("input ") + kINPUT_NAMES[pos] + " has unsupported type " + dataTypeName(types[pos]);
            return false;
        }
    }
    Dims const& cand = dims[kIN_CAND_IDS]; // [B, L, K]
    Dims const& unary = dims[kIN_UNARY];   // [B, L, K]
    Dims const& hidden = dims[kIN_HIDDEN_PROJ]; // [B, L, r]
    Dims const& anchor = dims[kIN_ANCHOR_IDS]; // [B]
    Dims const& predCb = dims[kIN_PRED_CODEBOOK]; // [V, r]
    Dims const& succCb = dims[kIN_SUCC_CODEBOOK]; // [V, r]
    Dims const& temperature = dims[kIN_TEMPERATURE]; // [B]
    Dims const& uniforms = dims[kIN_UNIFORMS]; // [B, L]
    if (cand.nbDims != 3 || unary.nbDims != 3 || hidden.nbDims != 3 || anchor.nbDims != 1 || predCb.nbDims != 2
        || succCb.nbDims != 2 || temperature.nbDims != 1 || uniforms.nbDims != 2)
    {
        error = "input ranks must be cand_ids 3, unary 3, hidden_proj 3, anchor_ids 1, codebooks 2, temperature 1, "
                "uniforms 2";
        return false;
    }
    int64_t const L = cand.d[1];
    int64_t const K = cand.d[2];
    if (L < 1 || K < 1)
    {
        error = "cand_ids " + dimsToString(cand) + " needs static L >= 1 and K >= 1";
        return false;
    }
    if (K != mAttrs.topK)
    {
        error = "cand_ids K = " + std::to_string(K) + " differs from top_k = " + std::to_string(mAttrs.topK);
        return false;
    }
    auto sameDim = [](int64_t a, int64_t b) { return a < 0 || b < 0 || a == b; }; // -1: dynamic
    int64_t const B = cand.d[0];
    if (!sameDim(unary.d[0], B) || unary.d[1] != L || unary.d[2] != K)
    {
        error = "unary " + dimsToString(unary) + " must match cand_ids " + dimsToString(cand);
        return false;
    }
    if (!sameDim(hidden.d[0], B) || hidden.d[1] != L || hidden.d[2] != mAttrs.rank)
    {
        error = "hidden_proj " + dimsToString(hidden) + " must be [B, L, rank] with L = " + std::to_string(L)
            + ", rank = " + std::to_string(mAttrs.rank);
        return false;
    }
    if (!sameDim(anchor.d[0], B) || !sameDim(temperature.d[0], B))
    {
        error = "anchor_ids " + dimsToString(anchor) + " and temperature " + dimsToString(temperature)
            + " must be [B]";
        return false;
    }
    if (!sameDim(uniforms.d[0], B) || uniforms.d[1] != L)
    {
        error = "uniforms " + dimsToString(uniforms) + " must be [B, L] with L = " + std::to_string(L);
        return false;
    }
    if (predCb.d[0] < 1 || predCb.d[1] != mAttrs.rank || succCb.d[0] != predCb.d[0] || succCb.d[1] != mAttrs.rank
        || predCb.d[0] > INT32_MAX)
    {
        error = "codebooks pred " + dimsToString(predCb) + " / succ " + dimsToString(succCb)
            + " must both be [V, rank] with static V, rank = " + std::to_string(mAttrs.rank);
        return false;
    }
    size_t const smem = selector::pathSelectorSharedBytes(static_cast<int32_t>(L), static_cast<int32_t>(K));
    if (L > 4096 || smem > selector::kDEFAULT_SMEM_LIMIT)
    {
        error = "L = " + std::to_string(L) + " with K = " + std::to_string(K) + " needs " + std::to_string(smem)
            + " bytes of shared memory per sequence; the limit is " + std::to_string(selector::kDEFAULT_SMEM_LIMIT);
        return false;
    }
    return true;
}

int32_t PathSelectorPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            reportError("expects 8 inputs and 2 outputs");
            return -1;
        }
        Dims dims[kNB_INPUTS];
        DataType types[kNB_INPUTS];
        for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
        {
            dims[pos] = in[pos].desc.dims;
            types[pos] = in[pos].desc.type;
        }
        std::string error;
        if (!validateIo(dims, types, nbInputs, error))
        {
            reportError(error);
            return -1;
        }
        return 0;
    }
    catch (...)
    {
        reportUnknownException();
        return -1;
    }
}

size_t PathSelectorPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/,
    int32_t /*nbInputs*/, nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0; // lattice and walk state live in shared memory
}

int32_t PathSelectorPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            reportError("expects 8 inputs and 2 outputs");
            return -1;
        }
        Dims dims[kNB_INPUTS];
        DataType types[kNB_INPUTS];
        for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
        {
            dims[pos] = in[pos].dims;
            types[pos] = in[pos].type;
        }
        std::string error;
        if (!validateIo(dims, types, nbInputs, error))
        {
            reportError(error);
            return -1;
        }
        if (dims[kIN_CAND_IDS].d[0] < 0)
        {
            reportError("runtime batch dimension is unknown");
            return -1;
        }
        return 0;
    }
    catch (...)
    {
        reportUnknownException();
        return -1;
    }
}

int32_t PathSelectorPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    // Hot path: no allocation, no synchronisation; shapes were validated in onShapeChange().
    if (inputDesc == nullptr || inputs == nullptr || outputs == nullptr)
    {
        logError("DFlash2PathSelector: enqueue called without tensors");
        return -1;
    }
    selector::SelectorLaunchParams p{};
    p.candIds = static_cast<int32_t const*>(inputs[kIN_CAND_IDS]);
    p.unary = static_cast<float const*>(inputs[kIN_UNARY]);
    p.hiddenProj = inputs[kIN_HIDDEN_PROJ];
    p.anchorIds = static_cast<int32_t const*>(inputs[kIN_ANCHOR_IDS]);
    p.predCodebook = inputs[kIN_PRED_CODEBOOK];
    p.succCodebook = inputs[kIN_SUCC_CODEBOOK];
    p.temperature = static_cast<float const*>(inputs[kIN_TEMPERATURE]);
    p.uniforms = static_cast<float const*>(inputs[kIN_UNIFORMS]);
    p.pathIds = static_cast<int32_t*>(outputs[kOUT_PATH_IDS]);
    p.proposals = static_cast<float*>(outputs[kOUT_PROPOSAL_PROBS]);
    p.batch = static_cast<int32_t>(inputDesc[kIN_CAND_IDS].dims.d[0]);
    p.rows = static_cast<int32_t>(inputDesc[kIN_CAND_IDS].dims.d[1]);
    p.topK = static_cast<int32_t>(inputDesc[kIN_CAND_IDS].dims.d[2]);
    p.rank = static_cast<int32_t>(inputDesc[kIN_HIDDEN_PROJ].dims.d[2]);
    p.vocab = static_cast<int32_t>(inputDesc[kIN_PRED_CODEBOOK].dims.d[0]);
    p.elemType = toElemType(inputDesc[kIN_HIDDEN_PROJ].type);
    p.mode = mAttrs.mode;
    cudaError_t const status = selector::launchPathSelector(p, stream);
    if (status != cudaSuccess)
    {
        char message[256];
        std::snprintf(message, sizeof(message), "DFlash2PathSelector: kernel launch failed: %s",
            cudaGetErrorString(status));
        logError(message);
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* PathSelectorPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* PathSelectorPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mModeString = modeName(mAttrs.mode);
        mSerialFields.clear();
        mSerialFields.emplace_back(kFIELD_TOP_K, &mAttrs.topK, PluginFieldType::kINT32, 1);
        mSerialFields.emplace_back(kFIELD_RANK, &mAttrs.rank, PluginFieldType::kINT32, 1);
        // length includes the NUL so C consumers may read it as a C string
        mSerialFields.emplace_back(
            kFIELD_MODE, mModeString.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(mModeString.size() + 1));
        mSerialCollection.nbFields = static_cast<int32_t>(mSerialFields.size());
        mSerialCollection.fields = mSerialFields.data();
        return &mSerialCollection;
    }
    catch (...)
    {
        reportUnknownException();
        return nullptr;
    }
}

// ---------------------------------------------------------------------------------------------
// PathSelectorCreator
// ---------------------------------------------------------------------------------------------

PathSelectorCreator::PathSelectorCreator()
{
    mFields.emplace_back(kFIELD_TOP_K, nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back(kFIELD_RANK, nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back(kFIELD_MODE, nullptr, PluginFieldType::kCHAR, 0);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

nvinfer1::IPluginV3* PathSelectorCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    try
    {
        PathSelectorAttrs attrs;
        std::string error;
        if (!parsePathSelectorFields(fc, attrs, error))
        {
            reportError(error);
            return nullptr;
        }
        return new PathSelectorPlugin(attrs, mNamespace);
    }
    catch (...)
    {
        reportUnknownException();
        return nullptr;
    }
}

PluginFieldCollection const* PathSelectorCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* PathSelectorCreator::getPluginName() const noexcept
{
    return kPATH_SELECTOR_NAME;
}

char const* PathSelectorCreator::getPluginVersion() const noexcept
{
    return kPATH_SELECTOR_VERSION;
}

char const* PathSelectorCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

void PathSelectorCreator::setPluginNamespace(char const* pluginNamespace) noexcept
{
    try
    {
        mNamespace = pluginNamespace != nullptr ? pluginNamespace : "";
    }
    catch (...)
    {
        reportUnknownException();
    }
}

} // namespace plugin
} // namespace dflash2
