//! \file manifest.h
//! manifest.json of an export folder, read for the C API — the ONE module that knows its layout (the layout
//! is documented in dflash2_trt/manifest.py; when it changes, only this file changes).
//!
//! parseManifest checks the "format" string and "manifest_version" (DFL2_MANIFEST_VERSION, or
//! DFL2_MANIFEST_STATE_VERSION for a target with "linear" or "sliding" layers beside "attention" ones) first, then the
//! whole document against the JSON Schema dflash2_trt/manifest.schema.json (compiled into the library at build
//! time; validated with valijson), then reads the typed fields and checks consistency (drafter vocab/hidden ==
//! target's, graph files listed with checksums, relative paths only). loadManifest adds the folder: listed
//! files must exist and, with verifyChecksums, match their sha256 (OpenSSL; a build without it reports
//! DFL2_ERR_UNAVAILABLE for verification). Errors: dflash2::Error with DFL2_ERR_NOT_FOUND / CORRUPT /
//! VERSION_MISMATCH and a message naming the entry.
#pragma once

#include "core/linearState.h"
#include "core/windowRing.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dflash2
{

constexpr char const* kManifestFormat = "dflash2-trt-export";
constexpr char const* kManifestFile = "manifest.json";
//! dflash2_trt/manifest.schema.json, embedded by CMake (manifestSchema.cpp.in)
extern char const* const kManifestSchemaText;

struct GraphEntry
{
    std::string file;
    std::string role;
    std::string selector;  //!< "decomposed" | "plugin" | "" (null)
    std::string mode;
};

struct ProfileEntry
{
    std::string name;                                   //!< "prefill" | "step"
    std::map<std::string, std::vector<int64_t>> dims;   //!< dim name -> [min, opt, max]
};

struct PlanEntry
{
    std::string file;  //!< relative to the export folder ("engines-<id>/target.plan")
    std::vector<ProfileEntry> profiles;
};

struct EnginesEntry
{
    bool present{false};
    std::string dir;
    std::string tensorrtVersion;   //!< e.g. "10.3.0.30"
    std::string gpuName;
    std::string computeCapability; //!< e.g. "8.7"
    std::string pluginFile;    //!< "" when the engines need no plugin
    std::string pluginSha256;
    int32_t prefillRows{0};
    std::map<std::string, PlanEntry> plans;  //!< graph key -> plan
};

struct Manifest
{
    int64_t manifestVersion{0};
    std::string projectVersion;
    std::string dtype;
    int32_t blockSize{0};
    int32_t maxSeqLen{0};
    int32_t kvCapacityStep{256};
    // target
    int32_t vocabSize{0};
    int32_t targetLayers{0};
    int32_t hiddenSize{0};
    int32_t targetKvHeads{0};
    int32_t targetHeadDim{0};
    std::vector<int32_t> eosTokenIds;
    std::vector<int32_t> layerIds;
    std::vector<std::string> layerKinds;  //!< one per target layer: "attention" | "linear" | "sliding" | "mlp" (version 2: as written)
    LinearStateSpec linearState;          //!< the linear layers' state (version 3; zero without linear layers)
    SlidingWindowSpec slidingWindow;      //!< the sliding layers' window and ring (version 3; zero without sliding layers)
    // drafter
    int32_t drafterLayers{0};
    int32_t drafterKvHeads{0};
    int32_t drafterHeadDim{0};
    int32_t topK{16};
    std::map<std::string, GraphEntry> graphs;
    std::map<std::string, std::string> files;  //!< relative path -> sha256
    EnginesEntry engines;

    //! a linear (Gated DeltaNet) layer: its state is conv / recurrent, not a KV cache
    bool isLinear(int32_t layer) const
    {
        return static_cast<size_t>(layer) < layerKinds.size() && layerKinds[static_cast<size_t>(layer)] == "linear";
    }
    bool hasLinearLayers() const
    {
        return linearState.convDim > 0;
    }
    //! a layer with state: every kind but "mlp" (a Nemotron-H MoE / MLP layer, which has no graph inputs/outputs)
    bool hasState(int32_t layer) const
    {
        return static_cast<size_t>(layer) < layerKinds.size() && layerKinds[static_cast<size_t>(layer)] != "mlp";
    }
    //! the layers with state tensors (2 inputs and 2 outputs each in the target graph)
    int32_t stateLayers() const
    {
        return targetLayers - layersOf("mlp");
    }
    //! a sliding-window layer: its K/V live in a ring of slidingWindow.ringSlots slots, not a capacity buffer
    bool isSliding(int32_t layer) const
    {
        return static_cast<size_t>(layer) < layerKinds.size() && layerKinds[static_cast<size_t>(layer)] == "sliding";
    }
    bool hasSlidingLayers() const
    {
        return slidingWindow.ringSlots > 0;
    }
    //! every layer full attention: the target's state is a KV cache of positions alone (a crop rolls it back)
    bool kvOnly() const
    {
        return !hasLinearLayers() && !hasSlidingLayers();
    }
    //! the layers of one kind ("attention" | "linear" | "sliding" | "mlp")
    int32_t layersOf(char const* kind) const;
    //! the layers with a KV capacity buffer: full attention (every layer of a version 2 export)
    int32_t kvLayers() const
    {
        return layersOf("attention");
    }
};

//! The target graph's per-layer state tensors, 2 per layer with state in layer order (manifest.target_state_names;
//! an "mlp" layer has none):
//! "past": past_key_values.{i}.key / .value of a KV layer, past_conv.{i} / past_recurrent.{i} of a linear layer;
//! "present": present.{i}.key / .value, present_conv.{i} / present_recurrent.{i}.
std::vector<std::string> targetStateNames(Manifest const& m, std::string const& prefix);
//! The KV tensors of the target's layers of one kind, 2 per layer in layer order: "{prefix}.{i}.key" / ".value"
//! (prefix "past_key_values" or "present"); kind "attention": the full-attention layers (every layer of a version 2
//! export; their capacity buffers), "sliding": the sliding-window layers (their rings).
std::vector<std::string> targetKvNames(Manifest const& m, std::string const& prefix, std::string const& kind = "attention");

//! Target inputs of version 3 exports (dflash2_trt.manifest): [B, ringSlots] the position each ring slot of a
//! sliding-window target holds (-1: none); [R] the rows whose linear-layer state a hybrid target's call returns.
constexpr char const* kWINDOW_POSITIONS = "window_positions";
constexpr char const* kSTATE_ROWS = "state_rows";
//! The engines' profile dim of a sliding layer's ring (dflash2_trt.export.engines.RING_SLOTS): fixed at
//! target.sliding_window.ring_slots in every profile.
constexpr char const* kRING_SLOTS = "ring_slots";

//! Parse and check manifest text; `source` names it in messages.
Manifest parseManifest(std::string const& text, std::string const& source);
//! Read DIR/manifest.json, parse it, check the listed files (and their checksums).
Manifest loadManifest(std::string const& dir, bool verifyChecksums);
//! The graph key of a drafter head ("drafter_head_greedy", "..._plugin").
std::string headKey(std::string const& mode, bool plugin);

} // namespace dflash2
