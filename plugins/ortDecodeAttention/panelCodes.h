//! \file panelCodes.h
//! Exact codes for dflash2.PanelMatMul's fp32 weight panels. An fp32 weight often holds values that came from a
//! narrower format: a model converted from a GGUF file (4-bit blocks with an fp16 scale and minimum, 8-bit blocks
//! with an fp16 scale), an fp16 or bf16 checkpoint. When the op's kernel is created it looks for a code that reproduces
//! every weight of its panels bit for bit; where one does, the kernel keeps the code and reads it instead of the fp32
//! panels (4-bit: 0.75 bytes a weight with its fp32 block scale and minimum, 8-bit: 1.125, fp16 / bf16: 2; fp32: 4). Each
//! weight is rebuilt in a register as its exact fp32 value, then multiplied in the fp32 kernel's fused multiply-add
//! chain (one per output element over k = 0..K-1): the output equals the fp32 kernel's, bit for bit, for any rows.
//! Codes, per block of kCodeBlock consecutive k of one column (the weight's input dimension, as GGUF blocks):
//!   Affine4 (GGUF Q4_1): w = fma(q, s, m), q in 0..15, s >= 0 and m fp32 per block
//!     codes [N/16][K/2][16] uint8 (byte [p][i][j]: column 16p + j, low nibble k = 2i, high nibble k = 2i + 1),
//!     scales and offsets [N/16][K/32][16] fp32
//!   Scaled8 (GGUF Q8_0): w = q x s, q in -127..127: codes [N/16][K][16] int8, scales [N/16][K/32][16]
//!   F16: w is an fp16 value: codes [N/16][K][16] uint16 (its fp16 bits; fp16 -> fp32 is exact)
//!   Bf16: w's lower 16 bits are zero: codes [N/16][K][16] uint16 (the upper 16 bits)
//! A weight no code reproduces exactly (any trained fp32 weight) keeps the fp32 kernel; looking costs little there:
//! the first block that fits no code ends the search.
#pragma once

#include <cstdint>
#include <vector>

namespace dflash2
{

constexpr int64_t kCodeBlock = 32; //!< k per scale (GGUF's block)
//! Calls of more rows (a prompt) take the fp32 kernel (the same numbers): there arithmetic, not bytes, sets the
//! time, and rebuilding the weights for every 8 rows costs more than reading fp32 panels once per 12.
constexpr int64_t kCodedMaxRows = 64;

enum class PanelCode : int32_t
{
    None = 0,
    Affine4 = 1,
    Scaled8 = 2,
    Bf16 = 3,
    F16 = 4,
};
constexpr int32_t kPanelCodes = 5; //!< PanelCode values (None included)

struct CodedPanels
{
    PanelCode code{PanelCode::None};
    int64_t K{0};
    int64_t N{0};
    std::vector<uint8_t> codes;  //!< layout per code above (Scaled8: int8 bytes, F16 / Bf16: uint16 pairs)
    std::vector<float> scales;   //!< Affine4, Scaled8
    std::vector<float> offsets;  //!< Affine4
};

//! The narrowest code (Affine4, then Scaled8, then F16, then Bf16) that reproduces every weight of packed [N/16][K][16]
//! exactly; code None (nothing kept) where none does.
CodedPanels codePanels(float const* packed, int64_t K, int64_t N);

//! Weight matrices this process's kernels (PanelMatMul, DrafterLayer) keep by code: one more of `code`; how many of
//! `code` (0 None .. 4 F16; -1 for another value), read by the library's dflash2OrtPanelCodes.
void countPanelCode(PanelCode code);
int64_t panelCodeCount(int32_t code);

//! Panels [panelBegin, panelEnd) of Y = X @ W from W's code: x [rows, K], y [rows, N]; the fp32 panelMatMul's
//! numbers. coded.code is not None.
void panelMatMulCoded(float const* x, int64_t rows, CodedPanels const& coded, float* y, int64_t panelBegin,
    int64_t panelEnd);

} // namespace dflash2
