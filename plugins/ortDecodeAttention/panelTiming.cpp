//! \file panelTiming.cpp
//! Times the coded panel kernels alone on one thread (no ONNX Runtime): MATS random [576, 1536] weights that fit the
//! 4-bit code (GGUF Q4_1 blocks: SmolLM2's MLP shape), each kept as its code, y = x @ W over all of them for 1..8 rows.
//! 40 matrices (26 MB of codes) stream from memory as a decode step does; 1 stays in cache (the arithmetic alone).
//!   cmake --build build/ort_ops --target dflash2_panel_timing
//!   taskset -c 0 build/ort_ops/dflash2_panel_timing 40   # MATS -> best of 15 runs per row count, ms and GB/s
#include "panelCodes.h"
#include "panelMatMul.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv)
{
    int const mats = argc > 1 ? std::atoi(argv[1]) : 40;
    if (argc > 2 || mats < 1)
    {
        std::fprintf(stderr, "usage: %s [MATS >= 1]\n", argv[0]);
        return 1;
    }
    int64_t constexpr K = 576, N = 1536, W = dflash2::kPanelWidth, B = dflash2::kCodeBlock;
    std::mt19937 gen(1);
    std::uniform_int_distribution<int> level(0, 15);
    std::vector<dflash2::CodedPanels> coded;
    for (int m = 0; m < mats; ++m)
    {
        // packed [N/16][K][16]; per block of 32 k of a column: q in 0..15 (both ends present), scale and minimum
        // of 11 significant bits (fp16's, as GGUF keeps them)
        std::vector<float> packed(static_cast<size_t>(N * K));
        for (int64_t p = 0; p < N / W; ++p)
        {
            for (int64_t b = 0; b < K / B; ++b)
            {
                for (int64_t j = 0; j < W; ++j)
                {
                    float const s = std::ldexp(static_cast<float>(1024 + level(gen) * 60), -18);
                    float const lo = -std::ldexp(static_cast<float>(1024 + level(gen) * 60), -15);
                    for (int64_t k = 0; k < B; ++k)
                    {
                        float const q = static_cast<float>(k == 0 ? 0 : k == 1 ? 15 : level(gen));
                        packed[static_cast<size_t>((p * K + b * B + k) * W + j)] = std::fma(q, s, lo);
                    }
                }
            }
        }
        coded.push_back(dflash2::codePanels(packed.data(), K, N));
        if (coded.back().code != dflash2::PanelCode::Affine4)
        {
            std::fprintf(stderr, "the weights did not fit the 4-bit code\n");
            return 1;
        }
    }
    std::vector<float> x(static_cast<size_t>(8 * K), 0.5F);
    std::vector<float> y(static_cast<size_t>(8 * N));
    double const weights = static_cast<double>(K) * N * mats;
    for (int rows = 1; rows <= 8; ++rows)
    {
        double best = 1e30;
        for (int rep = 0; rep < 15; ++rep)
        {
            auto const t0 = std::chrono::steady_clock::now();
            for (auto const& c : coded)
            {
                dflash2::panelMatMulCoded(x.data(), rows, c, y.data(), 0, N / W);
            }
            auto const t1 = std::chrono::steady_clock::now();
            best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::printf("%d matrices, %d rows: %.2f ms (%.2f GB/s of codes, %.2f G multiply-adds/s)\n", mats, rows, best,
            weights * 0.75 / best / 1e6, weights * rows / best / 1e6);
    }
    return 0;
}
