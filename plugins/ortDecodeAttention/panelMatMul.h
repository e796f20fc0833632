//! \file panelMatMul.h
//! Y[M, N] = X[M, K] @ W[K, N] in fp32 for the few rows of a decode step or a verify, with W stored in panels of
//! 16 columns ([N/16][K][16]: the graph's Reshape [K, N/16, 16] + Transpose [1, 0, 2] of the [K, N] weight,
//! folded by ONNX Runtime when the session loads). Each panel is read from memory once for all rows (rows are
//! taken in register blocks of up to 6 while the panel streams through), so a k-row call reads the weights as a
//! 1-row call does: verify rows cost their arithmetic, not another pass over the weights.
//! Every output element is one sequential fused multiply-add chain over k = 0..K-1, whatever the number of rows
//! and the row's place among them: a row of a k-row call equals the same row computed alone, bit for bit.
//!
//! The int4 variant (panelMatMulQ4) does the same over ONNX Runtime's MatMulNBits weights (4 bits, symmetric: value
//! (q - 8) x scale, one fp32 scale per column per block of B consecutive k), in panels of 16 columns:
//!   packed [N/16][K/2][16] uint8: byte [p][i][j] = column 16p + j, low nibble k = 2i, high nibble k = 2i + 1
//!                                 (MatMulNBits' B [N, K/B, B/2] reshaped to [N/16, 16, K/2], transposed [0, 2, 1])
//!   scales [N/16][K/B][16] fp32   (its scales [N, K/B] reshaped to [N/16, 16, K/B], transposed [0, 2, 1])
//! Output element (m, n) = sum over blocks b of s[n, b] x t_b, t_b = sum over k in b of x[m, k] (q[k, n] - 8): per
//! block one fused multiply-add chain over its k, then one into the running sum; again the same for a row alone.
//! A panel's bytes are unpacked once for all rows, so k rows read 4-bit weights once, as one row does.
#pragma once

#include <cstdint>

namespace dflash2
{

constexpr int64_t kPanelWidth = 16; //!< columns per panel

//! Whether this CPU runs the AVX-512 kernel (the one that also beats a packed GEMM on many rows: a prefill);
//! DFLASH2_ORT_PANELS_AVX512=0 in the environment: the AVX2 / portable kernels (the same numbers) even where it has.
//! DecodeAttention takes its x86-64-v4 build by the same answer (decodeAttention.cpp).
bool panelMatMulWide();

//! Panels [panelBegin, panelEnd) of Y = X @ W: x [rows, K] (row stride K), packed [N/16][K][16], y [rows, N].
void panelMatMul(float const* x, int64_t rows, int64_t K, float const* packed, int64_t N, float* y,
    int64_t panelBegin, int64_t panelEnd);

//! Panels [panelBegin, panelEnd) of the int4 Y = X @ W (layout above): x [rows, K], packed [N/16][K/2][16] uint8,
//! scales [N/16][K/blockSize][16], y [rows, N]. K is a multiple of blockSize, blockSize a multiple of 2.
void panelMatMulQ4(float const* x, int64_t rows, int64_t K, uint8_t const* packed, float const* scales,
    int64_t blockSize, int64_t N, float* y, int64_t panelBegin, int64_t panelEnd);

} // namespace dflash2
