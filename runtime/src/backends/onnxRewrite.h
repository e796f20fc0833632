//! \file onnxRewrite.h
//! The graph rewrites the Python ONNX Runtime backend makes at load when the project's custom-op library
//! (libdflash2_ort_ops.so) is in use — dflash2_trt/runtime/ort/decode_attention.py's rewrite() and _swap_matmuls(),
//! the same nodes in the same order — done here on the protobuf wire format (no protobuf or onnx library: a model
//! is a list of fields; only the messages a rewrite touches are parsed, the rest is copied byte for byte):
//!
//!   rewriteTarget   target_ort.onnx: each GroupQueryAttention -> dflash2.DecodeAttention (+ the graph input
//!                   past_seqlens [batch] int32), the LM head's input gathered by logits_index [batch, rows, 1] int64,
//!                   and with `panels` every MatMul by a constant fp32 weight [K, N] (N % 16 == 0) ->
//!                   dflash2.PanelMatMul over the weight reshaped [K, N/16, 16] and transposed to [N/16, K, 16], and
//!                   every exact int4 MatMulNBits (4 bits, accuracy level 0, symmetric, N % 16 == 0: an --quantize
//!                   int4 graph) -> dflash2.PanelMatMulQ4 over its packed weights [N, K/2] and scales [N, K/block]
//!                   reshaped [N/16, 16, cols] and transposed to [N/16, cols, 16]
//!   swapMatMuls     a drafter graph's MatMuls as above (prepare_panels)
//!
//! Both return the serialized model, or "" where Python's returns None (the graph cannot take the op, nothing to
//! swap), and add the nodes they swapped to `swaps` when given.
#pragma once

#include <cstdint>
#include <string>

namespace dflash2
{

//! The MatMul nodes a rewrite swapped: for PanelMatMul (fp32 weights) and for PanelMatMulQ4 (int4 weights)
struct PanelSwaps
{
    int32_t fp32{0};
    int32_t int4{0};
};

std::string rewriteTarget(std::string const& model, bool panels, PanelSwaps* swaps = nullptr);
std::string swapMatMuls(std::string const& model, PanelSwaps* swaps = nullptr);

} // namespace dflash2
