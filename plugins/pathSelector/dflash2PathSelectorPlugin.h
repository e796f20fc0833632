/*
 * dflash2_trt — DFlash2PathSelector TensorRT plugin (IPluginV3: OneCore/OneBuild/OneRuntime) and
 * its IPluginCreatorV3One creator. The contract (name, version, I/O, attributes) is written in
 * dflash2PathSelector.yaml; tests/test_plugin_selector.py pins the yaml, the ONNX op schema
 * (dflash2_trt/export/selector_contract.py) and the creator's field list together.
 *
 * I/O (B dynamic; L, K, r, V static):
 *   in  0 cand_ids       int32 [B, L, K]   top-k candidate ids, sorted by descending unary
 *   in  1 unary          fp32  [B, L, K]   top-k logits
 *   in  2 hidden_proj    T     [B, L, r]   hidden_projection(h)
 *   in  3 anchor_ids     int32 [B]
 *   in  4 pred_codebook  T     [V, r]      A (initializer)
 *   in  5 succ_codebook  T     [V, r]      B (initializer)
 *   in  6 temperature    fp32  [B]         <= 0: argmax decoding for that sequence
 *   in  7 uniforms       fp32  [B, L]      in [0, 1), one per row, used when temperature > 0
 *   out 0 path_ids       int32 [B, L]
 *   out 1 proposal_probs fp32  [B, L, K]   (one-hot at temperature <= 0)
 *   T in {fp32, fp16, bf16}. Attributes: top_k (int32, 1..16, == K), rank (int32, == r),
 *   mode (string "greedy" | "viterbi", default "greedy").
 *
 * Thread safety: a plugin object is used by one builder/execution context at a time (TensorRT
 * clones it per context); the creator is stateless apart from its namespace and may be shared.
 * enqueue() uses no workspace, allocates nothing and never synchronises, so it is capturable into
 * CUDA graphs; a captured graph depends on the tensor addresses TensorRT bound at capture time.
 */
#ifndef DFLASH2_PATH_SELECTOR_PLUGIN_H
#define DFLASH2_PATH_SELECTOR_PLUGIN_H

#include "pathSelectorMath.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dflash2
{
namespace plugin
{

constexpr char const* kPATH_SELECTOR_NAME = "DFlash2PathSelector";
constexpr char const* kPATH_SELECTOR_VERSION = "1";

//! Input positions.
enum PathSelectorInput : int32_t
{
    kIN_CAND_IDS = 0,
    kIN_UNARY = 1,
    kIN_HIDDEN_PROJ = 2,
    kIN_ANCHOR_IDS = 3,
    kIN_PRED_CODEBOOK = 4,
    kIN_SUCC_CODEBOOK = 5,
    kIN_TEMPERATURE = 6,
    kIN_UNIFORMS = 7,
    kNB_INPUTS = 8,
};

//! Output positions.
enum PathSelectorOutput : int32_t
{
    kOUT_PATH_IDS = 0,
    kOUT_PROPOSAL_PROBS = 1,
    kNB_OUTPUTS = 2,
};

//! Validated attributes.
struct PathSelectorAttrs
{
    int32_t topK{0};
    int32_t rank{0};
    selector::Mode mode{selector::Mode::kGREEDY};
};

//! "greedy" / "viterbi".
char const* modeName(selector::Mode mode) noexcept;

//! Parse and validate creator fields; on failure returns false and sets `error`.
//! Accepts top_k/rank as kINT32 (or kINT64) scalars and mode as kCHAR (with or without NUL);
//! ignores the ONNX-parser bookkeeping fields plugin_version / plugin_namespace.
bool parsePathSelectorFields(
    nvinfer1::PluginFieldCollection const* fc, PathSelectorAttrs& attrs, std::string& error) noexcept;

class PathSelectorPlugin : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime
{
public:
    PathSelectorPlugin(PathSelectorAttrs const& attrs, std::string const& pluginNamespace);
    PathSelectorPlugin(PathSelectorPlugin const& other);
    PathSelectorPlugin& operator=(PathSelectorPlugin const&) = delete;
    ~PathSelectorPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    PathSelectorAttrs const& attrs() const noexcept
    {
        return mAttrs;
    }

private:
    //! Check dims/types of all inputs (dims may hold -1 for the dynamic batch at build time).
    bool validateIo(nvinfer1::Dims const* dims, nvinfer1::DataType const* types, int32_t nbInputs,
        std::string& error) const;

    PathSelectorAttrs mAttrs;
    std::string mNamespace;
    std::string mModeString;                           //!< backing store of the serialized "mode" field
    std::vector<nvinfer1::PluginField> mSerialFields;  //!< [3] top_k, rank, mode
    nvinfer1::PluginFieldCollection mSerialCollection{};
};

class PathSelectorCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    PathSelectorCreator();
    ~PathSelectorCreator() override = default;

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    //! Namespace given to created plugins (default ""). Not thread-safe against createPlugin().
    void setPluginNamespace(char const* pluginNamespace) noexcept;

private:
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields; //!< [3] top_k, rank, mode (names and types only)
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace plugin
} // namespace dflash2

#endif // DFLASH2_PATH_SELECTOR_PLUGIN_H
