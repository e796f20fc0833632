//! \file panelMatMul.h
//! Y[M, N] = X[M, K] @ W[K, N] in fp32 for the few rows of a decode step or a verify, with W stored in panels of
//! 16 columns ([N/16][K][16]: the graph's Reshape [K, N/16, 16] + Transpose [1, 0, 2] of the [K, N] weight,
//! folded by ONNX Runtime when the session loads). Each panel is read from memory once for all rows (rows are
//! taken in register blocks of up to 6 while the panel streams through), so a k-row call reads the weights as a
//! 1-row call does: verify rows cost their arithmetic, not another pass over the weights.
//! Every output element is one sequential fused multiply-add chain over k = 0..K-1, whatever the number of rows
//! and the row's place among them: a row of a k-row call equals the same row computed alone, bit for bit.
#pragma once

#include <cstdint>

namespace dflash2
{

constexpr int64_t kPanelWidth = 16; //!< columns per panel

//! Whether this CPU runs the AVX-512 kernel (the one that also beats a packed GEMM on many rows: a prefill).
bool panelMatMulWide();

//! Panels [panelBegin, panelEnd) of Y = X @ W: x [rows, K] (row stride K), packed [N/16][K][16], y [rows, N].
void panelMatMul(float const* x, int64_t rows, int64_t K, float const* packed, int64_t N, float* y,
    int64_t panelBegin, int64_t panelEnd);

} // namespace dflash2
