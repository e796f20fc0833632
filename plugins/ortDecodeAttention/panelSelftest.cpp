//! \file panelSelftest.cpp
//! The panel kernels' numbers on this machine, for a comparison across instruction sets and architectures (no ONNX
//! Runtime): fixed pseudo-random weights that fit each exact code (and plain fp32 ones), packed in panels of 16
//! columns, times x for 1..13 and 70 rows, through panelMatMul (fp32 panels), panelMatMulQ4 (int4 panels) and
//! codePanels + panelMatMulCoded. Writes one binary file: per case its name, the code found, x, the weights and y.
//! Every output element is a fused multiply-add chain in a fixed order, so x86-64 (AVX-512, AVX2) and aarch64 (NEON)
//! builds write the same bytes; tests/test_ort_panel_matmul.py runs it natively and under qemu-aarch64.
//!   cmake --build <dir> --target dflash2_panel_selftest && <dir>/dflash2_panel_selftest OUT.bin
#include "panelCodes.h"
#include "panelMatMul.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace
{

uint64_t gState = 0x9E3779B97F4A7C15ULL;

//! splitmix64: the same integers on every platform (no library distribution)
uint64_t next()
{
    uint64_t z = (gState += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

int64_t below(int64_t n)
{
    return static_cast<int64_t>(next() % static_cast<uint64_t>(n));
}

//! a float of 12 significant bits in about [-2, 2): exact in fp32, fp16 and bf16-free of rounding ambiguity
float value()
{
    return std::ldexp(static_cast<float>(below(4096) - 2048), -10);
}

//! weights [K][N] (row-major) fitting `code`: "affine4" (q s + m per block of 32 k of a column), "scaled8" (q s),
//! "fp16" (11 significant bits, normal range), "bf16" (8 significant bits, beyond fp16's range), "none" (24 bits)
std::vector<float> weights(std::string const& code, int64_t K, int64_t N)
{
    std::vector<float> w(static_cast<size_t>(K * N));
    for (int64_t b = 0; b < K / 32; ++b)
    {
        for (int64_t n = 0; n < N; ++n)
        {
            float const s = std::ldexp(static_cast<float>(1024 + below(1024)), -18);
            float const m = -std::ldexp(static_cast<float>(1024 + below(1024)), -15);
            for (int64_t k = 32 * b; k < 32 * b + 32; ++k)
            {
                float& v = w[static_cast<size_t>(k * N + n)];
                int64_t const i = k - 32 * b;
                if (code == "affine4")
                {
                    v = std::fma(static_cast<float>(i == 0 ? 0 : i == 1 ? 15 : below(16)), s, m);
                }
                else if (code == "scaled8")
                {
                    v = static_cast<float>(i == 0 ? 127 : below(255) - 127) * s;
                }
                else if (code == "fp16")
                {
                    v = std::ldexp(static_cast<float>(below(2048) - 1024), -12);
                }
                else if (code == "bf16")
                {
                    v = std::ldexp(static_cast<float>(128 + below(128)) * (below(2) ? 1.F : -1.F), 20);
                }
                else
                {
                    v = std::ldexp(static_cast<float>(below(1 << 24)) - static_cast<float>(1 << 23), -24);
                }
            }
        }
    }
    return w;
}

//! [K][N] -> panels [N/16][K][16]
std::vector<float> panels(std::vector<float> const& w, int64_t K, int64_t N)
{
    int64_t constexpr W = dflash2::kPanelWidth;
    std::vector<float> p(w.size());
    for (int64_t k = 0; k < K; ++k)
    {
        for (int64_t n = 0; n < N; ++n)
        {
            p[static_cast<size_t>(((n / W) * K + k) * W + n % W)] = w[static_cast<size_t>(k * N + n)];
        }
    }
    return p;
}

void put(FILE* f, void const* data, size_t bytes)
{
    std::fwrite(&bytes, sizeof bytes, 1, f);
    std::fwrite(data, 1, bytes, f);
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s OUT.bin\n", argv[0]);
        return 1;
    }
    FILE* f = std::fopen(argv[1], "wb");
    if (f == nullptr)
    {
        std::fprintf(stderr, "cannot write %s\n", argv[1]);
        return 1;
    }
    int64_t constexpr K = 96, N = 48;
    int64_t const rowCounts[] = {1, 2, 3, 4, 5, 8, 9, 13, 70};
    for (char const* code : {"none", "affine4", "scaled8", "fp16", "bf16"})
    {
        std::vector<float> const w = weights(code, K, N);
        std::vector<float> const packed = panels(w, K, N);
        dflash2::CodedPanels const coded = dflash2::codePanels(packed.data(), K, N);
        for (int64_t rows : rowCounts)
        {
            std::vector<float> x(static_cast<size_t>(rows * K));
            for (float& v : x)
            {
                v = value();
            }
            std::vector<float> y(static_cast<size_t>(rows * N));
            if (coded.code == dflash2::PanelCode::None || rows > dflash2::kCodedMaxRows)
            {
                dflash2::panelMatMul(x.data(), rows, K, packed.data(), N, y.data(), 0, N / dflash2::kPanelWidth);
            }
            else
            {
                dflash2::panelMatMulCoded(x.data(), rows, coded, y.data(), 0, N / dflash2::kPanelWidth);
            }
            std::string const name = std::string(code) + "/" + std::to_string(rows);
            int32_t const found = static_cast<int32_t>(coded.code);
            put(f, name.data(), name.size());
            put(f, &found, sizeof found);
            put(f, x.data(), x.size() * sizeof(float));
            put(f, w.data(), w.size() * sizeof(float));
            put(f, y.data(), y.size() * sizeof(float));
        }
    }
    // int4 panels (MatMulNBits' symmetric 4 bits, blocks of 32): packed [N/16][K/2][16], scales [N/16][K/32][16]
    std::vector<uint8_t> q4(static_cast<size_t>(N * K / 2));
    for (uint8_t& b : q4)
    {
        b = static_cast<uint8_t>(below(256));
    }
    std::vector<float> s4(static_cast<size_t>(N * K / 32));
    for (float& v : s4)
    {
        v = std::ldexp(static_cast<float>(1024 + below(1024)), -16);
    }
    for (int64_t rows : rowCounts)
    {
        std::vector<float> x(static_cast<size_t>(rows * K));
        for (float& v : x)
        {
            v = value();
        }
        std::vector<float> y(static_cast<size_t>(rows * N));
        dflash2::panelMatMulQ4(x.data(), rows, K, q4.data(), s4.data(), 32, N, y.data(), 0, N / dflash2::kPanelWidth);
        std::string const name = "q4/" + std::to_string(rows);
        int32_t const found = -1;
        put(f, name.data(), name.size());
        put(f, &found, sizeof found);
        put(f, x.data(), x.size() * sizeof(float));
        put(f, q4.data(), q4.size());
        put(f, y.data(), y.size() * sizeof(float));
    }
    return std::fclose(f) == 0 ? 0 : 1;
}
