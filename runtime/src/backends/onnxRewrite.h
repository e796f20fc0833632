//! \file onnxRewrite.h
//! The graph rewrites the Python ONNX Runtime backend makes at load when the project's custom-op library
//! (libdflash2_ort_ops.so) is in use — dflash2_trt/runtime/ort/decode_attention.py's rewrite() and _swap_matmuls(),
//! the same nodes in the same order — done here on the protobuf wire format (no protobuf or onnx library: a model
//! is a list of fields; only the messages a rewrite touches are parsed, the rest is copied byte for byte):
//!
//!   rewriteTarget   target_ort.onnx: each GroupQueryAttention -> dflash2.DecodeAttention (+ the graph input
//!                   past_seqlens [batch] int32), the LM head's input gathered by logits_index [batch, rows, 1] int64,
//!                   and with `panels` every MatMul by a constant fp32 weight [K, N] (N % 16 == 0) ->
//!                   dflash2.PanelMatMul over the weight reshaped [K, N/16, 16] and transposed to [N/16, K, 16]
//!   swapMatMuls     a drafter graph's MatMuls as above (prepare_panels)
//!
//! Both return the serialized model, or "" where Python's returns None (the graph cannot take the op, nothing to
//! swap). The int4 MatMulNBits swap (PanelMatMulQ4) is not made here: such a graph keeps ORT's MatMulNBits.
#pragma once

#include <string>

namespace dflash2
{

std::string rewriteTarget(std::string const& model, bool panels);
std::string swapMatMuls(std::string const& model);

} // namespace dflash2
