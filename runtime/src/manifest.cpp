//! \file manifest.cpp
#include "manifest.h"

#include "core/decoder.h"

#include <nlohmann/json.hpp>
#include <valijson/adapters/nlohmann_json_adapter.hpp>
#include <valijson/schema.hpp>
#include <valijson/schema_parser.hpp>
#include <valijson/validation_results.hpp>
#include <valijson/validator.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/stat.h>

#if DFLASH2_WITH_OPENSSL
#include <openssl/evp.h>
#endif

namespace dflash2
{

namespace
{

using Json = nlohmann::json;

//! The schema, parsed once (function-local statics are initialised thread-safely).
valijson::Schema const& manifestSchema()
{
    static valijson::Schema const* const kSchema = [] {
        static Json const doc = Json::parse(kManifestSchemaText);
        static valijson::Schema schema;
        valijson::SchemaParser parser(valijson::SchemaParser::kDraft7);
        valijson::adapters::NlohmannJsonAdapter adapter(doc);
        parser.populateSchema(adapter, schema);
        return &schema;
    }();
    return *kSchema;
}

//! First schema violation as "path: description", or "" when the document conforms.
std::string schemaViolation(Json const& j)
{
    valijson::Validator validator;
    valijson::ValidationResults results;
    valijson::adapters::NlohmannJsonAdapter target(j);
    if (validator.validate(manifestSchema(), target, &results))
    {
        return "";
    }
    // the deepest error names the offending field best
    valijson::ValidationResults::Error err;
    std::string best;
    size_t depth = 0;
    while (results.popError(err))
    {
        if (best.empty() || err.context.size() > depth)
        {
            std::string path;  // valijson's "<root>[files][g.onnx]" -> "files.g.onnx"
            for (std::string const& c : err.context)
            {
                if (c == "<root>")
                {
                    continue;
                }
                std::string const item = c.size() >= 2 && c.front() == '[' && c.back() == ']' ? c.substr(1, c.size() - 2) : c;
                path += (path.empty() ? "" : ".") + item;
            }
            best = (path.empty() ? std::string("the top level") : "'" + path + "'") + ": " + err.description;
            depth = err.context.size();
        }
    }
    return best;
}

constexpr char const* kRequiredGraphs[] = {"target", "drafter_context", "drafter_block", "drafter_head_independent"};

[[noreturn]] void corrupt(std::string const& source, std::string const& what)
{
    throw Error(DFL2_ERR_CORRUPT, source + ": " + what + " (corrupt manifest)");
}

//! The layer index of a per-layer tensor name: "{prefix}{i}.key|value" (kv) or "{prefix}{i}" (a linear layer's
//! state), else -1.
int64_t layerOf(std::string const& name, std::string const& prefix, bool kv)
{
    if (name.compare(0, prefix.size(), prefix) != 0)
    {
        return -1;
    }
    std::string const rest = name.substr(prefix.size());
    size_t const end = kv ? rest.find('.') : rest.size();
    if (end == 0 || end == std::string::npos || rest.find_first_not_of("0123456789") != (kv ? end : std::string::npos))
    {
        return -1;
    }
    if (kv && rest.substr(end) != ".key" && rest.substr(end) != ".value")
    {
        return -1;
    }
    return std::stoll(rest.substr(0, end));
}

//! manifest.graph_field_rules' rows: a tensor matching `prefix` (per layer: "{prefix}{i}..."; else the whole name)
//! has `want` at `dim` (negative: from the end) where its shape fixes that dim.
struct FieldRule
{
    char const* prefix; //!< "name." of a per-layer tensor, or a whole name
    bool perLayer;
    int dim;            //!< negative: from the end
    char const* field;
    int64_t want;
};

//! check_graph_fields' `layers`: per-layer tensors of one prefix and the layers that must have them
struct LayerSet
{
    char const* prefix;
    bool kv;                //!< "{i}.key|value" names
    std::set<int64_t> ids;  //!< the layers that have them
    std::string field;      //!< what says so
};

//! manifest.graph_field_rules (+ _linear_state_rules)
std::vector<FieldRule> graphFieldRules(Manifest const& m)
{
    int64_t const drafterHidden = m.hiddenSize; // the drafter's hidden size is the target's (checked above)
    LinearStateSpec const& ls = m.linearState;
    // $DFLASH2_PLANT_SWAP_STATE_DIMS=1: the tests' planted bug (tests/test_hybrid_export.py shows the edited-manifest
    // check catching it): the rules below take key_dim for value_dim and back; never set it otherwise
    char const* const swap = std::getenv("DFLASH2_PLANT_SWAP_STATE_DIMS");
    bool const swapped = swap != nullptr && std::string(swap) == "1";
    int64_t const keyDim = swapped ? ls.valueDim : ls.keyDim;
    int64_t const valueDim = swapped ? ls.keyDim : ls.valueDim;
    return {
        {"past_key_values.", true, 1, "target.num_key_value_heads", m.targetKvHeads},
        {"past_key_values.", true, 3, "target.head_dim", m.targetHeadDim},
        {"present.", true, 1, "target.num_key_value_heads", m.targetKvHeads},
        {"present.", true, 3, "target.head_dim", m.targetHeadDim},
        {"context.", true, 1, "drafter.num_key_value_heads", m.drafterKvHeads},
        {"context.", true, 3, "drafter.head_dim", m.drafterHeadDim},
        {"past_conv.", true, 1, "target.linear_state.conv_dim", ls.convDim},
        {"past_conv.", true, 2, "target.linear_state.conv_kernel - 1", ls.window()},
        {"present_conv.", true, 1, "target.linear_state.conv_dim", ls.convDim},
        {"past_recurrent.", true, 1, "target.linear_state.num_heads", ls.numHeads},
        {"past_recurrent.", true, 2, "target.linear_state.key_dim", keyDim},
        {"past_recurrent.", true, 3, "target.linear_state.value_dim", valueDim},
        {"present_recurrent.", true, 2, "target.linear_state.num_heads", ls.numHeads},
        {"present_recurrent.", true, 3, "target.linear_state.key_dim", keyDim},
        {"present_recurrent.", true, 4, "target.linear_state.value_dim", valueDim},
        {"context_features", false, -1, "target.hidden_size x len(target.layer_ids)",
            static_cast<int64_t>(m.hiddenSize) * static_cast<int64_t>(m.layerIds.size())},
        {"hidden", false, -1, "drafter.hidden_size", drafterHidden},
    };
}

//! check_graph_fields' `layers`: which layers have KV, linear-state and drafter-context tensors, and the field
//! that says so
std::vector<LayerSet> graphLayerSets(Manifest const& m)
{
    std::set<int64_t> kvIds;
    std::set<int64_t> linearIds;
    for (int32_t i = 0; i < m.targetLayers; ++i)
    {
        if (m.hasState(i))  // an mlp layer has no state tensors
        {
            (m.isLinear(i) ? linearIds : kvIds).insert(i);
        }
    }
    std::set<int64_t> drafterIds;
    for (int32_t i = 0; i < m.drafterLayers; ++i)
    {
        drafterIds.insert(i);
    }
    std::string const kvField = m.hasLinearLayers()
        ? "target.layer_kinds has " + std::to_string(kvIds.size()) + " attention layers"
        : "target.num_layers is " + std::to_string(m.targetLayers);
    std::string const linearField = "target.layer_kinds has " + std::to_string(linearIds.size()) + " linear layers";
    std::string const drafterField = "drafter.num_hidden_layers is " + std::to_string(m.drafterLayers);
    return {
        {"past_key_values.", true, kvIds, kvField},
        {"present.", true, kvIds, kvField},
        {"past_conv.", false, linearIds, linearField},
        {"past_recurrent.", false, linearIds, linearField},
        {"present_conv.", false, linearIds, linearField},
        {"present_recurrent.", false, linearIds, linearField},
        {"context.", true, drafterIds, drafterField},
    };
}

//! the layer of a per-layer tensor name of one of the sets' prefixes, else -1
int64_t layerIndex(std::vector<LayerSet> const& sets, std::string const& name, std::string const& prefix)
{
    for (LayerSet const& l : sets)
    {
        if (prefix == l.prefix)
        {
            return layerOf(name, prefix, l.kv);
        }
    }
    return -1;
}

//! One input or output of graph `key` (role `role`) against the rules; its layer noted in `seen` per prefix.
void checkTensor(Manifest const& m, std::vector<FieldRule> const& rules, std::vector<LayerSet> const& sets,
    std::string const& key, std::string const& role, Json const& tensor, std::map<std::string, std::set<int64_t>>& seen,
    std::string const& source)
{
    std::string const name = tensor["name"].get<std::string>();
    Json const& shape = tensor["shape"];
    auto const check = [&](int dim, char const* field, int64_t want) {
        int64_t const rank = static_cast<int64_t>(shape.size());
        int64_t const d = dim < 0 ? rank + dim : dim;
        if (d >= 0 && d < rank && shape[d].is_number_integer() && shape[d].get<int64_t>() != want)
        {
            corrupt(source, std::string(field) + " is " + std::to_string(want) + " but graph '" + key + "' has "
                    + name + " of " + std::to_string(shape[d].get<int64_t>()) + " at dim " + std::to_string(d));
        }
    };
    for (LayerSet const& l : sets)
    {
        int64_t const layer = layerIndex(sets, name, l.prefix);
        if (layer >= 0)
        {
            seen[l.prefix].insert(layer);
        }
    }
    for (FieldRule const& r : rules)
    {
        if (r.perLayer ? layerIndex(sets, name, r.prefix) >= 0 : name == r.prefix)
        {
            check(r.dim, r.field, r.want);
        }
    }
    if (name == "logits" && role == "target")
    {
        check(-1, "target.vocab_size", m.vocabSize);
    }
}

//! The fields the graphs' inputs and outputs also state agree with them (the rules of dflash2_trt/manifest.py
//! check_graph_fields): one past_key_values.{i} / present.{i} pair per KV layer of the target, one past_conv.{i} /
//! past_recurrent.{i} / present_conv.{i} / present_recurrent.{i} set per linear layer and context.{i} per drafter
//! layer, their heads (dim 1) and head size (dim 3), the linear layers' state sizes, the feature width, the
//! drafter's hidden size, the target's vocabulary. A symbolic dim states nothing.
void checkGraphFields(Manifest const& m, Json const& graphs, std::string const& source)
{
    std::vector<FieldRule> const rules = graphFieldRules(m);
    std::vector<LayerSet> const sets = graphLayerSets(m);
    for (auto const& [key, g] : graphs.items())
    {
        std::map<std::string, std::set<int64_t>> seen;
        std::string const role = g.contains("role") && g["role"].is_string() ? g["role"].get<std::string>() : "";
        for (char const* side : {"inputs", "outputs"})
        {
            if (!g.contains(side) || !g[side].is_array())
            {
                continue;
            }
            for (Json const& tensor : g[side])
            {
                if (!tensor.is_object() || !tensor.contains("name") || !tensor["name"].is_string()
                    || !tensor.contains("shape") || !tensor["shape"].is_array())
                {
                    continue; // the schema check above refuses a malformed entry
                }
                checkTensor(m, rules, sets, key, role, tensor, seen, source);
            }
        }
        for (LayerSet const& l : sets)
        {
            auto const it = seen.find(l.prefix);
            if (it != seen.end() && it->second != l.ids)
            {
                std::string const prefix = l.prefix;
                corrupt(source, l.field + " but graph '" + key + "' has " + prefix.substr(0, prefix.size() - 1)
                        + " tensors for " + std::to_string(it->second.size()) + " layers");
            }
        }
    }
}

Json const& member(Json const& obj, char const* key, std::string const& source, std::string const& where)
{
    if (!obj.is_object() || !obj.contains(key))
    {
        corrupt(source, "lacks the '" + where + key + "' entry");
    }
    return obj.at(key);
}

int32_t intMember(Json const& obj, char const* key, std::string const& source, std::string const& where,
    int64_t lo = 1, int64_t hi = INT32_MAX)
{
    Json const& v = member(obj, key, source, where);
    if (!v.is_number_integer())
    {
        corrupt(source, "'" + where + key + "' must be an integer");
    }
    int64_t const x = v.get<int64_t>();
    if (x < lo || x > hi)
    {
        corrupt(source, "'" + where + key + "' = " + std::to_string(x) + " is out of range [" + std::to_string(lo) + ", "
                + std::to_string(hi) + "]");
    }
    return static_cast<int32_t>(x);
}

std::string stringMember(Json const& obj, char const* key, std::string const& source, std::string const& where)
{
    Json const& v = member(obj, key, source, where);
    if (!v.is_string())
    {
        corrupt(source, "'" + where + key + "' must be a string");
    }
    return v.get<std::string>();
}

std::vector<int32_t> idList(Json const& v, std::string const& source, std::string const& what)
{
    if (!v.is_array())
    {
        corrupt(source, "'" + what + "' must be a list of integers");
    }
    std::vector<int32_t> out;
    for (Json const& e : v)
    {
        if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
        {
            corrupt(source, "'" + what + "' holds a non-id entry");
        }
        out.push_back(static_cast<int32_t>(e.get<int64_t>()));
    }
    return out;
}

bool isFile(std::string const& path)
{
    struct stat st{};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool isDir(std::string const& path)
{
    struct stat st{};
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// relative paths only: a manifest must not point outside its folder
void checkRelative(std::string const& rel, std::string const& source)
{
    if (rel.empty() || rel[0] == '/' || rel.find("..") != std::string::npos)
    {
        corrupt(source, "file path '" + rel + "' is not a plain relative path inside the export folder");
    }
}

#if DFLASH2_WITH_OPENSSL
std::string sha256File(std::string const& path)
{
    std::ifstream f(path, std::ios::binary);
    if (!f)
    {
        throw Error(DFL2_ERR_NOT_FOUND, path + " cannot be read");
    }
    EVP_MD_CTX* ctx = EVP_MD_CTX_new();
    if (ctx == nullptr || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1)
    {
        EVP_MD_CTX_free(ctx);
        throw Error(DFL2_ERR_INTERNAL, "OpenSSL sha256 unavailable");
    }
    std::vector<char> buf(1 << 20);
    while (f)
    {
        f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
        EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(f.gcount()));
    }
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx, md, &len);
    EVP_MD_CTX_free(ctx);
    static char const* kHex = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i)
    {
        out += kHex[md[i] >> 4];
        out += kHex[md[i] & 15];
    }
    return out;
}
#endif

//! target.layer_kinds, target.linear_state and target.sliding_window (manifest._check_layer_kinds): version 2 has
//! neither linear nor sliding layers (every layer a KV cache, whatever its kind); version 3 has linear (Gated
//! DeltaNet or Mamba-2) or sliding-window layers beside attention layers, and their state's spec; the fourth kind,
//! 'mlp' (a Nemotron-H MoE / MLP layer), has no state: no graph inputs or outputs, nothing to roll back.
void readLayerKinds(Manifest& m, Json const& t, std::string const& source)
{
    m.layerKinds.assign(static_cast<size_t>(m.targetLayers), "attention");
    if (t.contains("layer_kinds") && !t["layer_kinds"].empty())  // absent or []: every layer attention
    {
        Json const& kinds = t["layer_kinds"];
        if (!kinds.is_array() || kinds.size() != static_cast<size_t>(m.targetLayers))
        {
            corrupt(source, "'target.layer_kinds' must list one kind per layer (" + std::to_string(m.targetLayers) + ")");
        }
        for (size_t i = 0; i < kinds.size(); ++i)
        {
            m.layerKinds[i] = kinds[i].get<std::string>();  // a string of the schema's enum
        }
    }
    if (m.manifestVersion != DFL2_MANIFEST_STATE_VERSION)  // version 2: every layer a KV cache
    {
        std::replace(m.layerKinds.begin(), m.layerKinds.end(), std::string("sliding"), std::string("attention"));
    }
    bool const linear = std::count(m.layerKinds.begin(), m.layerKinds.end(), "linear") > 0;
    bool const sliding = std::count(m.layerKinds.begin(), m.layerKinds.end(), "sliding") > 0;
    if ((linear || sliding) != (m.manifestVersion == DFL2_MANIFEST_STATE_VERSION))
    {
        corrupt(source, "manifest_version is " + std::to_string(m.manifestVersion) + " but the target has "
                + (linear || sliding ? "" : "no ") + "linear or sliding layers (version " + std::to_string(DFL2_MANIFEST_STATE_VERSION)
                + " exactly when it has)");
    }
    if (linear != (t.contains("linear_state") && t["linear_state"].is_object()))
    {
        corrupt(source, "target.linear_state must be given exactly when the target has linear layers");
    }
    if (sliding != (t.contains("sliding_window") && t["sliding_window"].is_object()))
    {
        corrupt(source, "target.sliding_window must be given exactly when the target has sliding layers");
    }
    if ((linear || sliding) && m.kvLayers() == 0)
    {
        corrupt(source, "the target has no attention layer (the export's graphs need one)");
    }
    if (sliding)
    {
        Json const& sw = t["sliding_window"];
        std::string const where = "target.sliding_window.";
        m.slidingWindow.window = intMember(sw, "window", source, where);
        m.slidingWindow.ringSlots = intMember(sw, "ring_slots", source, where);
        if (m.slidingWindow.ringSlots < m.slidingWindow.window)
        {
            corrupt(source, "target.sliding_window needs window <= ring_slots");
        }
    }
    if (!linear)
    {
        return;
    }
    Json const& ls = t["linear_state"];
    std::string const where = "target.linear_state.";
    m.linearState.convDim = intMember(ls, "conv_dim", source, where);
    m.linearState.convKernel = intMember(ls, "conv_kernel", source, where, 2);
    m.linearState.numHeads = intMember(ls, "num_heads", source, where);
    m.linearState.keyDim = intMember(ls, "key_dim", source, where);
    m.linearState.valueDim = intMember(ls, "value_dim", source, where);
    m.linearState.maxRowsPerCall = intMember(ls, "max_rows_per_call", source, where);
}

} // namespace

std::string headKey(std::string const& mode, bool plugin)
{
    return "drafter_head_" + mode + (plugin ? "_plugin" : "");
}

int32_t Manifest::layersOf(char const* kind) const
{
    return static_cast<int32_t>(std::count(layerKinds.begin(), layerKinds.end(), kind));
}

std::vector<std::string> targetKvNames(Manifest const& m, std::string const& prefix, std::string const& kind)
{
    std::vector<std::string> out;
    for (int32_t i = 0; i < m.targetLayers; ++i)
    {
        bool const sliding = m.isSliding(i);
        if (m.hasState(i) && !m.isLinear(i) && sliding == (kind == "sliding"))
        {
            out.push_back(prefix + "." + std::to_string(i) + ".key");
            out.push_back(prefix + "." + std::to_string(i) + ".value");
        }
    }
    return out;
}

std::vector<std::string> targetStateNames(Manifest const& m, std::string const& prefix)
{
    std::string const kv = prefix == "past" ? "past_key_values" : prefix;
    std::vector<std::string> out;
    for (int32_t i = 0; i < m.targetLayers; ++i)
    {
        std::string const n = std::to_string(i);
        if (!m.hasState(i))
        {
            continue;
        }
        if (m.isLinear(i))
        {
            out.push_back(prefix + "_conv." + n);
            out.push_back(prefix + "_recurrent." + n);
        }
        else
        {
            out.push_back(kv + "." + n + ".key");
            out.push_back(kv + "." + n + ".value");
        }
    }
    return out;
}

namespace
{

//! the document is JSON, a dflash2 manifest, of a version this library reads -> the parsed document
Json readDocument(std::string const& text, std::string const& source)
{
    Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded())
    {
        throw Error(DFL2_ERR_CORRUPT, source + " is not valid JSON (corrupt manifest)");
    }
    if (!j.is_object() || !j.contains("format") || !j["format"].is_string() || j["format"] != kManifestFormat)
    {
        throw Error(DFL2_ERR_VERSION_MISMATCH, source + " is not a " + std::string(kManifestFormat) + " manifest");
    }
    Json const& ver = j.contains("manifest_version") ? j["manifest_version"] : Json();
    if (!ver.is_number_integer()
        || (ver.get<int64_t>() != DFL2_MANIFEST_VERSION && ver.get<int64_t>() != DFL2_MANIFEST_STATE_VERSION))
    {
        std::string const written = j.contains("project_version") && j["project_version"].is_string()
            ? j["project_version"].get<std::string>()
            : "?";
        throw Error(DFL2_ERR_VERSION_MISMATCH,
            source + " has manifest_version " + ver.dump() + " (written by dflash2-trt " + written
                + "); this library reads versions " + std::to_string(DFL2_MANIFEST_VERSION) + " and "
                + std::to_string(DFL2_MANIFEST_STATE_VERSION) + ": re-export with a matching dflash2 export");
    }
    // the whole document against dflash2_trt/manifest.schema.json (compiled in), then the typed reads
    std::string const violation = schemaViolation(j);
    if (!violation.empty())
    {
        corrupt(source, "does not match the manifest schema at " + violation);
    }
    return j;
}

//! the top-level fields: versions, dtype, max_seq_len, kv_capacity_step
void readTopLevel(Manifest& m, Json const& j, std::string const& source)
{
    m.manifestVersion = j["manifest_version"].get<int64_t>();
    if (j.contains("project_version") && j["project_version"].is_string())
    {
        m.projectVersion = j["project_version"].get<std::string>();
    }
    m.dtype = stringMember(j, "dtype", source, "");
    m.maxSeqLen = intMember(j, "max_seq_len", source, "", 2);
    if (j.contains("kv_capacity_step"))
    {
        m.kvCapacityStep = intMember(j, "kv_capacity_step", source, "");
    }
}

//! "target": sizes, EOS ids, the drafter's feature layers, the layer kinds (readLayerKinds)
void readTarget(Manifest& m, Json const& t, std::string const& source)
{
    m.vocabSize = intMember(t, "vocab_size", source, "target.");
    m.targetLayers = intMember(t, "num_layers", source, "target.");
    m.hiddenSize = intMember(t, "hidden_size", source, "target.");
    m.targetKvHeads = intMember(t, "num_key_value_heads", source, "target.");
    m.targetHeadDim = intMember(t, "head_dim", source, "target.");
    m.eosTokenIds = t.contains("eos_token_ids") ? idList(t["eos_token_ids"], source, "target.eos_token_ids")
                                                : std::vector<int32_t>{};
    m.layerIds = t.contains("layer_ids") ? idList(t["layer_ids"], source, "target.layer_ids") : std::vector<int32_t>{};
    readLayerKinds(m, t, source);
}

//! "drafter" (its HF config): fits the target; layers, heads, block size (a verify fits one linear-state call),
//! selector top K
void readDrafter(Manifest& m, Json const& d, std::string const& source)
{
    if (intMember(d, "vocab_size", source, "drafter.") != m.vocabSize
        || intMember(d, "hidden_size", source, "drafter.") != m.hiddenSize)
    {
        corrupt(source, "the drafter's vocab_size / hidden_size do not fit the target's");
    }
    m.drafterLayers = intMember(d, "num_hidden_layers", source, "drafter.");
    m.drafterKvHeads = intMember(d, "num_key_value_heads", source, "drafter.");
    if (d.contains("head_dim") && !d["head_dim"].is_null())
    {
        m.drafterHeadDim = intMember(d, "head_dim", source, "drafter.");
    }
    else
    {
        m.drafterHeadDim = m.hiddenSize / intMember(d, "num_attention_heads", source, "drafter.");
    }
    // DFlash 2 keeps block_size / selector_top_k in dflash_config; DFlash v1 may keep block_size at top level
    Json const* dc = d.contains("dflash_config") && d["dflash_config"].is_object() ? &d["dflash_config"] : &d;
    if (dc->contains("block_size"))
    {
        m.blockSize = intMember(*dc, "block_size", source, "drafter.dflash_config.", 2, 4096);
    }
    else
    {
        m.blockSize = intMember(d, "block_size", source, "drafter.", 2, 4096);
    }
    if (m.hasLinearLayers() && m.linearState.maxRowsPerCall < m.blockSize)
    {
        corrupt(source, "target.linear_state.max_rows_per_call is " + std::to_string(m.linearState.maxRowsPerCall)
                + " but the drafter's block size is " + std::to_string(m.blockSize)
                + ": a verify would not be one graph call, and could not be rolled back");
    }
    if (dc->contains("selector_top_k"))
    {
        m.topK = intMember(*dc, "selector_top_k", source, "drafter.dflash_config.", 1, m.vocabSize);
    }
    m.topK = std::min(m.topK, m.vocabSize);
}

//! "files": relative paths -> sha256 strings
void readFiles(Manifest& m, Json const& files, std::string const& source)
{
    if (!files.is_object())
    {
        corrupt(source, "'files' must map paths to sha256 strings");
    }
    for (auto const& [rel, digest] : files.items())
    {
        checkRelative(rel, source);
        if (!digest.is_string())
        {
            corrupt(source, "the checksum of '" + rel + "' is not a string");
        }
        m.files[rel] = digest.get<std::string>();
    }
}

//! "graphs": each entry's file (with a checksum), role, selector, mode; every required graph present
void readGraphs(Manifest& m, Json const& graphs, std::string const& source)
{
    if (!graphs.is_object())
    {
        corrupt(source, "'graphs' must be an object");
    }
    for (auto const& [key, g] : graphs.items())
    {
        GraphEntry e;
        e.file = stringMember(g, "file", source, "graphs." + key + ".");
        e.role = g.contains("role") && g["role"].is_string() ? g["role"].get<std::string>() : "";
        e.selector = g.contains("selector") && g["selector"].is_string() ? g["selector"].get<std::string>() : "";
        e.mode = g.contains("mode") && g["mode"].is_string() ? g["mode"].get<std::string>() : "";
        if (m.files.count(e.file) == 0)
        {
            corrupt(source, "graph file " + e.file + " has no checksum");
        }
        m.graphs[key] = e;
    }
    for (char const* g : kRequiredGraphs)
    {
        if (m.graphs.count(g) == 0)
        {
            corrupt(source, std::string("lists no '") + g + "' graph");
        }
    }
}

//! one optimisation profile of an engine plan: its name and dims {name: [min, opt, max]}
ProfileEntry readProfile(Json const& pr, std::string const& where, std::string const& source)
{
    ProfileEntry prof;
    prof.name = stringMember(pr, "name", source, where + "profiles[].");
    Json const& dims = member(pr, "dims", source, where + "profiles[].");
    if (!dims.is_object())
    {
        corrupt(source, "'" + where + "profiles[].dims' must be an object");
    }
    for (auto const& [dim, range] : dims.items())
    {
        if (!range.is_array() || range.size() != 3)
        {
            corrupt(source, "'" + where + "profiles[].dims." + dim + "' must be [min, opt, max]");
        }
        std::vector<int64_t> r;
        for (Json const& x : range)
        {
            if (!x.is_number_integer() || x.get<int64_t>() < 0)
            {
                corrupt(source, "'" + where + "profiles[].dims." + dim + "' holds a non-size");
            }
            r.push_back(x.get<int64_t>());
        }
        prof.dims[dim] = r;
    }
    return prof;
}

//! "engines.plans": each plan's file and profiles
void readPlans(Manifest& m, Json const& e, std::string const& source)
{
    Json const& plans = member(e, "plans", source, "engines.");
    if (!plans.is_object())
    {
        corrupt(source, "'engines.plans' must be an object");
    }
    for (auto const& [key, p] : plans.items())
    {
        PlanEntry pe;
        std::string const where = "engines.plans." + key + ".";
        pe.file = stringMember(p, "file", source, where);
        checkRelative(pe.file, source);
        Json const& profiles = member(p, "profiles", source, where);
        if (!profiles.is_array())
        {
            corrupt(source, "'" + where + "profiles' must be a list");
        }
        for (Json const& pr : profiles)
        {
            pe.profiles.push_back(readProfile(pr, where, source));
        }
        m.engines.plans[key] = pe;
    }
}

//! "engines" (TensorRT, optional): folder, versions, GPU, plugin, prefill rows, plans
void readEngines(Manifest& m, Json const& e, std::string const& source)
{
    m.engines.present = true;
    m.engines.dir = stringMember(e, "dir", source, "engines.");
    checkRelative(m.engines.dir, source);
    if (e.contains("tensorrt_version") && e["tensorrt_version"].is_string())
    {
        m.engines.tensorrtVersion = e["tensorrt_version"].get<std::string>();
    }
    if (e.contains("gpu") && e["gpu"].is_object())
    {
        Json const& g = e["gpu"];
        m.engines.gpuName = g.contains("name") && g["name"].is_string() ? g["name"].get<std::string>() : "";
        m.engines.computeCapability = g.contains("compute_capability") && g["compute_capability"].is_string()
            ? g["compute_capability"].get<std::string>()
            : "";
    }
    if (e.contains("plugin") && e["plugin"].is_object())
    {
        m.engines.pluginFile = stringMember(e["plugin"], "file", source, "engines.plugin.");
        if (e["plugin"].contains("sha256") && e["plugin"]["sha256"].is_string())
        {
            m.engines.pluginSha256 = e["plugin"]["sha256"].get<std::string>();
        }
    }
    if (e.contains("prefill_rows"))
    {
        m.engines.prefillRows = intMember(e, "prefill_rows", source, "engines.");
    }
    readPlans(m, e, source);
}

} // namespace

// manifest.parse_manifest, section by section (the document, the top level, target, drafter, files, graphs, the
// graphs' fields against the sizes, engines): the first violation found is the one reported
Manifest parseManifest(std::string const& text, std::string const& source)
{
    Json const j = readDocument(text, source);
    Manifest m;
    readTopLevel(m, j, source);
    Json const& t = member(j, "target", source, "");
    readTarget(m, t, source);
    readDrafter(m, member(j, "drafter", source, ""), source);
    readFiles(m, member(j, "files", source, ""), source);
    Json const& graphs = member(j, "graphs", source, "");
    readGraphs(m, graphs, source);
    int32_t const maxPositions = intMember(t, "max_positions", source, "target.");
    if (m.maxSeqLen > maxPositions)
    {
        corrupt(source, "max_seq_len is " + std::to_string(m.maxSeqLen) + " but the target's max_positions is "
                + std::to_string(maxPositions));
    }
    checkGraphFields(m, graphs, source);
    if (j.contains("engines") && !j["engines"].is_null())
    {
        readEngines(m, j["engines"], source);
    }
    return m;
}

Manifest loadManifest(std::string const& dir, bool verifyChecksums)
{
    if (!isDir(dir))
    {
        throw Error(DFL2_ERR_NOT_FOUND, "model folder not found: " + dir);
    }
    std::string const path = dir + "/" + kManifestFile;
    if (!isFile(path))
    {
        throw Error(DFL2_ERR_NOT_FOUND,
            dir + " has no " + kManifestFile + ": not a dflash2-export folder (run dflash2-export)");
    }
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    Manifest m = parseManifest(ss.str(), path);
    for (auto const& [rel, digest] : m.files)
    {
        if (!isFile(dir + "/" + rel))
        {
            throw Error(DFL2_ERR_NOT_FOUND, dir + "/" + rel + " is missing (listed in the manifest)");
        }
    }
    if (verifyChecksums)
    {
#if DFLASH2_WITH_OPENSSL
        for (auto const& [rel, digest] : m.files)
        {
            if (sha256File(dir + "/" + rel) != digest)
            {
                throw Error(DFL2_ERR_CORRUPT, "checksum mismatch for " + dir + "/" + rel
                        + ": the file was changed or corrupted after export (re-export the model)");
            }
        }
#else
        throw Error(DFL2_ERR_UNAVAILABLE,
            "this libdflash2 was built without OpenSSL and cannot verify checksums; set verify_checksums=false");
#endif
    }
    return m;
}

} // namespace dflash2
