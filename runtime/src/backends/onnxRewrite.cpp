//! \file onnxRewrite.cpp
//! ONNX graph rewrites on the protobuf wire format; see onnxRewrite.h. Field numbers are onnx.proto3's.
#include "onnxRewrite.h"

#include "core/decoder.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dflash2
{

namespace
{

// ---- wire format -----------------------------------------------------------------------------------------

struct Field
{
    uint32_t num{0};
    uint32_t wire{0};     //!< 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32
    uint64_t value{0};    //!< varint / fixed
    std::string bytes;    //!< length-delimited payload
};

using Message = std::vector<Field>;

[[noreturn]] void corrupt(char const* what)
{
    throw Error(DFL2_ERR_CORRUPT, std::string("ONNX graph is not readable protobuf: ") + what);
}

uint64_t readVarint(std::string const& s, size_t& i)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7)
    {
        if (i >= s.size())
        {
            corrupt("truncated varint");
        }
        uint8_t const b = static_cast<uint8_t>(s[i++]);
        v |= static_cast<uint64_t>(b & 0x7F) << shift;
        if ((b & 0x80) == 0)
        {
            return v;
        }
    }
    corrupt("varint too long");
}

Message parse(std::string const& s)
{
    Message m;
    size_t i = 0;
    while (i < s.size())
    {
        uint64_t const tag = readVarint(s, i);
        Field f;
        f.num = static_cast<uint32_t>(tag >> 3);
        f.wire = static_cast<uint32_t>(tag & 7);
        if (f.wire == 0)
        {
            f.value = readVarint(s, i);
        }
        else if (f.wire == 1 || f.wire == 5)
        {
            size_t const n = f.wire == 1 ? 8 : 4;
            if (i + n > s.size())
            {
                corrupt("truncated fixed field");
            }
            std::memcpy(&f.value, s.data() + i, n);  // little endian (x86-64, aarch64)
            i += n;
        }
        else if (f.wire == 2)
        {
            uint64_t const n = readVarint(s, i);
            if (n > s.size() - i)
            {
                corrupt("truncated length-delimited field");
            }
            f.bytes = s.substr(i, static_cast<size_t>(n));
            i += static_cast<size_t>(n);
        }
        else
        {
            corrupt("unsupported wire type");
        }
        m.push_back(std::move(f));
    }
    return m;
}

void putVarint(std::string& out, uint64_t v)
{
    while (v >= 0x80)
    {
        out.push_back(static_cast<char>((v & 0x7F) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}

std::string serialize(Message const& m)
{
    std::string out;
    for (Field const& f : m)
    {
        putVarint(out, (static_cast<uint64_t>(f.num) << 3) | f.wire);
        if (f.wire == 0)
        {
            putVarint(out, f.value);
        }
        else if (f.wire == 1 || f.wire == 5)
        {
            char b[8];
            std::memcpy(b, &f.value, 8);
            out.append(b, f.wire == 1 ? 8 : 4);
        }
        else
        {
            putVarint(out, f.bytes.size());
            out += f.bytes;
        }
    }
    return out;
}

Field bytesField(uint32_t num, std::string b)
{
    Field f;
    f.num = num;
    f.wire = 2;
    f.bytes = std::move(b);
    return f;
}

Field varintField(uint32_t num, uint64_t v)
{
    Field f;
    f.num = num;
    f.wire = 0;
    f.value = v;
    return f;
}

std::string stringOf(Message const& m, uint32_t num)
{
    for (Field const& f : m)
    {
        if (f.num == num && f.wire == 2)
        {
            return f.bytes;
        }
    }
    return "";
}

std::vector<std::string> stringsOf(Message const& m, uint32_t num)
{
    std::vector<std::string> out;
    for (Field const& f : m)
    {
        if (f.num == num && f.wire == 2)
        {
            out.push_back(f.bytes);
        }
    }
    return out;
}

//! repeated int64 (packed or not)
std::vector<int64_t> intsOf(Message const& m, uint32_t num)
{
    std::vector<int64_t> out;
    for (Field const& f : m)
    {
        if (f.num != num)
        {
            continue;
        }
        if (f.wire == 0)
        {
            out.push_back(static_cast<int64_t>(f.value));
        }
        else if (f.wire == 2)
        {
            size_t i = 0;
            while (i < f.bytes.size())
            {
                out.push_back(static_cast<int64_t>(readVarint(f.bytes, i)));
            }
        }
    }
    return out;
}

// ---- onnx messages -----------------------------------------------------------------------------------------

// ModelProto
constexpr uint32_t kMODEL_GRAPH = 7;
constexpr uint32_t kMODEL_OPSET = 8;
// GraphProto
constexpr uint32_t kGRAPH_NODE = 1;
constexpr uint32_t kGRAPH_INITIALIZER = 5;
constexpr uint32_t kGRAPH_INPUT = 11;
constexpr uint32_t kGRAPH_OUTPUT = 12;
// NodeProto
constexpr uint32_t kNODE_INPUT = 1;
constexpr uint32_t kNODE_OUTPUT = 2;
constexpr uint32_t kNODE_NAME = 3;
constexpr uint32_t kNODE_OP_TYPE = 4;
constexpr uint32_t kNODE_ATTRIBUTE = 5;
constexpr uint32_t kNODE_DOMAIN = 7;
// AttributeProto
constexpr uint32_t kATTR_NAME = 1;
constexpr uint32_t kATTR_F = 2;
constexpr uint32_t kATTR_I = 3;
constexpr uint32_t kATTR_INTS = 8;
constexpr uint32_t kATTR_TYPE = 20;
// TensorProto
constexpr uint32_t kTENSOR_DIMS = 1;
constexpr uint32_t kTENSOR_TYPE = 2;
constexpr uint32_t kTENSOR_NAME = 8;
constexpr uint32_t kTENSOR_RAW = 9;
// ValueInfoProto / TypeProto / TypeProto.Tensor / TensorShapeProto / Dimension
constexpr uint32_t kVALUE_NAME = 1;
constexpr uint32_t kVALUE_TYPE = 2;
constexpr uint32_t kTYPE_TENSOR = 1;
constexpr uint32_t kTENSOR_ELEM = 1;
constexpr uint32_t kTENSOR_SHAPE = 2;
constexpr uint32_t kSHAPE_DIM = 1;
constexpr uint32_t kDIM_VALUE = 1;
constexpr uint32_t kDIM_PARAM = 2;

constexpr int64_t kFLOAT = 1;
constexpr int64_t kUINT8 = 2;
constexpr int64_t kINT32 = 6;
constexpr int64_t kINT64 = 7;
constexpr int64_t kPANEL_WIDTH = 16;  // plugins/ortDecodeAttention/panelMatMul.h
constexpr char const* kOP_DOMAIN = "dflash2";

struct Attr
{
    bool present{false};
    int64_t i{0};
    float f{0.0F};
};

std::map<std::string, Attr> attributesOf(Message const& node)
{
    std::map<std::string, Attr> out;
    for (Field const& f : node)
    {
        if (f.num != kNODE_ATTRIBUTE || f.wire != 2)
        {
            continue;
        }
        Message const a = parse(f.bytes);
        Attr v;
        v.present = true;
        for (Field const& x : a)
        {
            if (x.num == kATTR_I && x.wire == 0)
            {
                v.i = static_cast<int64_t>(x.value);
            }
            else if (x.num == kATTR_F && x.wire == 5)
            {
                uint32_t bits = static_cast<uint32_t>(x.value);
                std::memcpy(&v.f, &bits, 4);
            }
        }
        out[stringOf(a, kATTR_NAME)] = v;
    }
    return out;
}

Field intAttribute(std::string const& name, int64_t v)
{
    Message a{bytesField(kATTR_NAME, name), varintField(kATTR_I, static_cast<uint64_t>(v)), varintField(kATTR_TYPE, 2)};
    return bytesField(kNODE_ATTRIBUTE, serialize(a));
}

Field floatAttribute(std::string const& name, float v)
{
    Field f;
    f.num = kATTR_F;
    f.wire = 5;
    uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    f.value = bits;
    Message a{bytesField(kATTR_NAME, name), f, varintField(kATTR_TYPE, 1)};
    return bytesField(kNODE_ATTRIBUTE, serialize(a));
}

Field intsAttribute(std::string const& name, std::vector<int64_t> const& v)
{
    Message a{bytesField(kATTR_NAME, name)};
    for (int64_t x : v)
    {
        a.push_back(varintField(kATTR_INTS, static_cast<uint64_t>(x)));
    }
    a.push_back(varintField(kATTR_TYPE, 7));
    return bytesField(kNODE_ATTRIBUTE, serialize(a));
}

Message makeNode(std::string const& op, std::vector<std::string> const& in, std::vector<std::string> const& out,
    std::string const& name, std::string const& domain, std::vector<Field> const& attrs = {})
{
    Message n;
    for (std::string const& s : in)
    {
        n.push_back(bytesField(kNODE_INPUT, s));
    }
    for (std::string const& s : out)
    {
        n.push_back(bytesField(kNODE_OUTPUT, s));
    }
    n.push_back(bytesField(kNODE_NAME, name));
    n.push_back(bytesField(kNODE_OP_TYPE, op));
    for (Field const& a : attrs)
    {
        n.push_back(a);
    }
    if (!domain.empty())
    {
        n.push_back(bytesField(kNODE_DOMAIN, domain));
    }
    return n;
}

//! a graph input [dims...] of an element type
Field valueInfo(std::string const& name, int64_t elem, std::vector<std::string> const& dims)
{
    Message shape;
    for (std::string const& d : dims)  // a number is a fixed size (dim_value), a name a symbolic one (dim_param)
    {
        bool const number = !d.empty() && d.find_first_not_of("0123456789") == std::string::npos;
        Field const dim = number ? varintField(kDIM_VALUE, std::stoull(d)) : bytesField(kDIM_PARAM, d);
        shape.push_back(bytesField(kSHAPE_DIM, serialize(Message{dim})));
    }
    Message tensor{varintField(kTENSOR_ELEM, static_cast<uint64_t>(elem)), bytesField(kTENSOR_SHAPE, serialize(shape))};
    Message type{bytesField(kTYPE_TENSOR, serialize(tensor))};
    return bytesField(kGRAPH_INPUT, serialize(Message{bytesField(kVALUE_NAME, name), bytesField(kVALUE_TYPE, serialize(type))}));
}

//! numpy_helper.from_array(np.array(shape, int64), name)
Field int64Initializer(std::string const& name, std::vector<int64_t> const& values)
{
    std::string raw(values.size() * 8, '\0');
    std::memcpy(raw.data(), values.data(), raw.size());
    Message t{varintField(kTENSOR_DIMS, values.size()), varintField(kTENSOR_TYPE, kINT64), bytesField(kTENSOR_NAME, name),
        bytesField(kTENSOR_RAW, raw)};
    return bytesField(kGRAPH_INITIALIZER, serialize(t));
}

struct Graph
{
    Message model;
    size_t graphIndex{0};
    Message graph;
    std::vector<Message> nodes;  //!< in order; the graph's node fields are rebuilt from these
};

Graph open(std::string const& bytes)
{
    Graph g;
    g.model = parse(bytes);
    bool found = false;
    for (size_t i = 0; i < g.model.size(); ++i)
    {
        if (g.model[i].num == kMODEL_GRAPH && g.model[i].wire == 2)
        {
            g.graphIndex = i;
            found = true;
        }
    }
    if (!found)
    {
        corrupt("no graph");
    }
    Message all = parse(g.model[g.graphIndex].bytes);
    for (Field& f : all)
    {
        if (f.num == kGRAPH_NODE && f.wire == 2)
        {
            g.nodes.push_back(parse(f.bytes));
        }
        else
        {
            g.graph.push_back(std::move(f));
        }
    }
    return g;
}

//! the model with its graph's nodes first (as onnx serializes a GraphProto: node is field 1) and opset dflash2 1
std::string close(Graph& g)
{
    Message graph;
    for (Message const& n : g.nodes)
    {
        graph.push_back(bytesField(kGRAPH_NODE, serialize(n)));
    }
    graph.insert(graph.end(), g.graph.begin(), g.graph.end());
    g.model[g.graphIndex].bytes = serialize(graph);
    Message opset{bytesField(1, kOP_DOMAIN), varintField(2, 1)};
    g.model.push_back(bytesField(kMODEL_OPSET, serialize(opset)));
    return serialize(g.model);
}

std::string opType(Message const& n)
{
    return stringOf(n, kNODE_OP_TYPE);
}

void setStrings(Message& n, uint32_t num, std::vector<std::string> const& values)
{
    Message out;
    bool placed = false;
    for (Field& f : n)
    {
        if (f.num == num)
        {
            if (!placed)
            {
                for (std::string const& v : values)
                {
                    out.push_back(bytesField(num, v));
                }
                placed = true;
            }
            continue;
        }
        out.push_back(std::move(f));
    }
    if (!placed)
    {
        for (std::string const& v : values)
        {
            out.push_back(bytesField(num, v));
        }
    }
    n = std::move(out);
}

struct Initializer
{
    std::vector<int64_t> dims;
    int64_t type{0};
};

std::map<std::string, Initializer> initializers(Graph const& g)
{
    std::map<std::string, Initializer> out;
    for (Field const& f : g.graph)
    {
        if (f.num == kGRAPH_INITIALIZER && f.wire == 2)
        {
            Message const t = parse(f.bytes);
            Initializer i;
            i.dims = intsOf(t, kTENSOR_DIMS);
            for (Field const& x : t)
            {
                if (x.num == kTENSOR_TYPE && x.wire == 0)
                {
                    i.type = static_cast<int64_t>(x.value);
                }
            }
            out[stringOf(t, kTENSOR_NAME)] = i;
        }
    }
    return out;
}

//! decode_attention._q4_shape: (K, N, block size) of a MatMulNBits node that PanelMatMulQ4 computes as specified
//! (com.microsoft, 4 bits, accuracy level 0, no zero points / g_idx / bias, constant uint8 weights [N, K/block,
//! block/2] and fp32 scales of N * K/block values, N % 16 == 0) -> else nothing
std::optional<std::array<int64_t, 3>> q4Shape(Message const& node, std::map<std::string, Initializer> const& inits)
{
    std::vector<std::string> const in = stringsOf(node, kNODE_INPUT);
    if (opType(node) != "MatMulNBits" || stringOf(node, kNODE_DOMAIN) != "com.microsoft" || in.size() < 3)
    {
        return std::nullopt;
    }
    for (size_t i = 3; i < in.size(); ++i)
    {
        if (!in[i].empty())
        {
            return std::nullopt;
        }
    }
    std::map<std::string, Attr> const a = attributesOf(node);
    auto const get = [&](char const* k, int64_t otherwise) {
        auto const it = a.find(k);
        return it == a.end() ? otherwise : it->second.i;
    };
    int64_t const K = get("K", 0);
    int64_t const N = get("N", 0);
    int64_t const block = get("block_size", 0);
    auto const b = inits.find(in[1]);
    auto const s = inits.find(in[2]);
    if (get("bits", 4) != 4 || get("accuracy_level", 0) != 0 || b == inits.end() || s == inits.end()
        || b->second.type != kUINT8 || s->second.type != kFLOAT || block < 2 || block % 2 != 0 || K % block != 0
        || N % kPANEL_WIDTH != 0 || b->second.dims != std::vector<int64_t>{N, K / block, block / 2})
    {
        return std::nullopt;
    }
    int64_t scales = 1;
    for (int64_t d : s->second.dims)
    {
        scales *= d;
    }
    if (scales != N * (K / block))
    {
        return std::nullopt;
    }
    return std::array<int64_t, 3>{K, N, block};
}

//! _swap_matmuls over the graph -> the number swapped: every MatMul by a constant fp32 [K, N] (N % 16 == 0) ->
//! PanelMatMul, every exact int4 MatMulNBits (q4Shape) -> PanelMatMulQ4 over its packed weights and scales in
//! panels of 16 columns; each counted into `swaps` when given
int swapInGraph(Graph& g, PanelSwaps* swaps)
{
    std::map<std::string, Initializer> const inits = initializers(g);
    std::vector<Message> nodes;
    int swapped = 0;
    // constant `src` reshaped to `shape`, transposed by `perm` (nodes ONNX Runtime folds at load) -> `name`
    auto const panels = [&](std::string const& name, std::string const& src, std::vector<int64_t> const& shape,
                            std::vector<int64_t> const& perm) {
        g.graph.push_back(int64Initializer(name + "_shape", shape));
        nodes.push_back(makeNode("Reshape", {src, name + "_shape"}, {name + "_reshaped"}, name + "/reshape", ""));
        nodes.push_back(makeNode("Transpose", {name + "_reshaped"}, {name}, name + "/transpose", "",
            {intsAttribute("perm", perm)}));
        return name;
    };
    for (Message& node : g.nodes)
    {
        std::string name = stringOf(node, kNODE_NAME);
        if (name.empty())
        {
            name = "matmul_" + std::to_string(swapped);
        }
        std::vector<std::string> const in = stringsOf(node, kNODE_INPUT);
        auto const w = opType(node) == "MatMul" && in.size() == 2 ? inits.find(in[1]) : inits.end();
        if (w != inits.end() && w->second.dims.size() == 2 && w->second.type == kFLOAT
            && w->second.dims[1] % kPANEL_WIDTH == 0)
        {
            int64_t const K = w->second.dims[0];
            int64_t const N = w->second.dims[1];
            std::string const packed = panels(name + "/panels", in[1], {K, N / kPANEL_WIDTH, kPANEL_WIDTH}, {1, 0, 2});
            nodes.push_back(makeNode("PanelMatMul", {in[0], packed}, stringsOf(node, kNODE_OUTPUT), name, kOP_DOMAIN));
            if (swaps != nullptr)
            {
                ++swaps->fp32;
            }
        }
        else if (std::optional<std::array<int64_t, 3>> const q4 = q4Shape(node, inits))
        {
            auto const [K, N, block] = *q4;
            // [N, ...] -> [N/16, 16, cols] -> [N/16, cols, 16]
            std::string const packed = panels(name + "/q4_panels", in[1], {N / kPANEL_WIDTH, kPANEL_WIDTH, K / 2}, {0, 2, 1});
            std::string const scales
                = panels(name + "/q4_scales", in[2], {N / kPANEL_WIDTH, kPANEL_WIDTH, K / block}, {0, 2, 1});
            nodes.push_back(
                makeNode("PanelMatMulQ4", {in[0], packed, scales}, stringsOf(node, kNODE_OUTPUT), name, kOP_DOMAIN));
            if (swaps != nullptr)
            {
                ++swaps->int4;
            }
        }
        else
        {
            nodes.push_back(std::move(node));
            continue;
        }
        ++swapped;
    }
    g.nodes = std::move(nodes);
    return swapped;
}

} // namespace

namespace
{

// decode_attention.rewrite's first check: the first past_key_values input is fp32 (DecodeAttention's caches)
bool pastKvIsFloat(Graph const& g)
{
    bool kvFloat = false;
    bool kvSeen = false;
    for (Field const& f : g.graph)
    {
        if (f.num != kGRAPH_INPUT || f.wire != 2)
        {
            continue;
        }
        Message const v = parse(f.bytes);
        if (stringOf(v, kVALUE_NAME).rfind("past_key_values", 0) != 0 || kvSeen)
        {
            continue;
        }
        kvSeen = true;
        Message const type = parse(stringOf(v, kVALUE_TYPE));
        Message const tensor = parse(stringOf(type, kTYPE_TENSOR));
        for (Field const& x : tensor)
        {
            kvFloat = kvFloat || (x.num == kTENSOR_ELEM && x.wire == 0 && static_cast<int64_t>(x.value) == kFLOAT);
        }
    }
    return kvSeen && kvFloat;
}

// every GroupQueryAttention node -> dflash2.DecodeAttention (packed qkv, past K/V, then past_seqlens) -> how many;
// -1: a node DecodeAttention does not implement (a variant, or unpacked q/k/v), nothing to use
int swapAttention(Graph& g)
{
    int swapped = 0;
    for (Message& node : g.nodes)
    {
        if (opType(node) != "GroupQueryAttention")
        {
            continue;
        }
        std::map<std::string, Attr> const a = attributesOf(node);
        auto const get = [&](char const* k) { auto const it = a.find(k); return it == a.end() ? Attr{} : it->second; };
        Attr const window = get("local_window_size");
        if (get("do_rotary").i != 1 || get("rotary_interleaved").i != 0 || (window.present && window.i != -1 && window.i != 0)
            || get("softcap").f != 0.0F)
        {
            return -1;  // a variant DecodeAttention does not implement
        }
        std::vector<std::string> const ins = stringsOf(node, kNODE_INPUT);
        // qkv (packed; key/value inputs empty), past_key, past_value, seqlens_k, total_sequence_length, cos, sin
        if (ins.size() < 9 || !ins[1].empty() || !ins[2].empty())
        {
            return -1;
        }
        std::vector<std::string> in{ins[0]};
        in.insert(in.end(), ins.begin() + 3, ins.begin() + 9);
        in.push_back("past_seqlens");
        setStrings(node, kNODE_INPUT, in);
        Message out;
        for (Field& f : node)
        {
            if (f.num != kNODE_ATTRIBUTE && f.num != kNODE_OP_TYPE && f.num != kNODE_DOMAIN)
            {
                out.push_back(std::move(f));
            }
        }
        Message n = makeNode("DecodeAttention", stringsOf(out, kNODE_INPUT), stringsOf(out, kNODE_OUTPUT),
            stringOf(out, kNODE_NAME), kOP_DOMAIN,
            {intAttribute("num_heads", get("num_heads").i), intAttribute("kv_num_heads", get("kv_num_heads").i),
                floatAttribute("scale", get("scale").f)});
        node = std::move(n);
        ++swapped;
    }
    return swapped;
}

// the logits output's row dim (dim 1) named logits_rows: the rewritten graph computes the rows logits_index asks
void nameLogitRows(Graph& g)
{
    for (Field& f : g.graph)
    {
        if (f.num != kGRAPH_OUTPUT || f.wire != 2)
        {
            continue;
        }
        Message v = parse(f.bytes);
        if (stringOf(v, kVALUE_NAME) != "logits")
        {
            continue;
        }
        for (Field& vt : v)
        {
            if (vt.num != kVALUE_TYPE)
            {
                continue;
            }
            Message type = parse(vt.bytes);
            for (Field& tt : type)
            {
                if (tt.num != kTYPE_TENSOR)
                {
                    continue;
                }
                Message tensor = parse(tt.bytes);
                for (Field& sh : tensor)
                {
                    if (sh.num != kTENSOR_SHAPE)
                    {
                        continue;
                    }
                    Message shape = parse(sh.bytes);
                    int d = 0;
                    for (Field& dim : shape)
                    {
                        if (dim.num == kSHAPE_DIM && d++ == 1)
                        {
                            dim.bytes = serialize(Message{bytesField(kDIM_PARAM, "logits_rows")});
                        }
                    }
                    sh.bytes = serialize(shape);
                }
                tt.bytes = serialize(tensor);
            }
            vt.bytes = serialize(type);
        }
        f.bytes = serialize(v);
    }
}

// the LM head (the one node making "logits") computes only the rows logits_index asks: hidden [B, S, H] -> GatherND
// -> [B, R, H] -> the head -> logits [B, R, V]; false where no single node makes logits
bool gatherLogitRows(Graph& g)
{
    size_t head = g.nodes.size();
    int heads = 0;
    for (size_t i = 0; i < g.nodes.size(); ++i)
    {
        std::vector<std::string> const o = stringsOf(g.nodes[i], kNODE_OUTPUT);
        if (o.size() == 1 && o[0] == "logits")
        {
            head = i;
            ++heads;
        }
    }
    if (heads != 1)
    {
        return false;
    }
    // hidden [B, S, H] -> its rows logits_index [B, R, 1] -> [B, R, H] -> the LM head -> logits [B, R, V]
    std::vector<std::string> headIn = stringsOf(g.nodes[head], kNODE_INPUT);
    Message gather = makeNode("GatherND", {headIn[0], "logits_index"}, {"lm_head/rows"}, "lm_head/gather_rows", "",
        {intAttribute("batch_dims", 1)});
    headIn[0] = "lm_head/rows";
    setStrings(g.nodes[head], kNODE_INPUT, headIn);
    g.nodes.insert(g.nodes.begin() + static_cast<long>(head), gather);
    nameLogitRows(g);
    return true;
}

} // namespace

// decode_attention.rewrite
std::string rewriteTarget(std::string const& model, bool panels, PanelSwaps* swaps)
{
    Graph g = open(model);
    if (!pastKvIsFloat(g) || swapAttention(g) <= 0 || !gatherLogitRows(g))
    {
        return "";
    }
    g.graph.push_back(valueInfo("past_seqlens", kINT32, {"batch"}));
    g.graph.push_back(valueInfo("logits_index", kINT64, {"batch", "logits_rows", "1"}));
    if (panels)
    {
        swapInGraph(g, swaps);
    }
    return close(g);
}

std::string swapMatMuls(std::string const& model, PanelSwaps* swaps)
{
    Graph g = open(model);
    if (swapInGraph(g, swaps) == 0)
    {
        return "";
    }
    return close(g);
}

} // namespace dflash2
