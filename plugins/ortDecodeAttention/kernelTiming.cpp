//! \file kernelTiming.cpp
//! Times the DecodeAttention kernel alone on one thread (no ONNX Runtime): 30 layers of SmolLM2-135M's attention
//! (9 query heads, 3 key/value heads, d = 64), each layer its own capacity buffer of 2048 slots, random inputs.
//!   cmake --build build/ort_ops --target dflash2_attention_timing
//!   taskset -c 0 build/ort_ops/dflash2_attention_timing 2032 4   # past, rows -> best of 30 runs, ms
//! The time is the thread's CPU time (CLOCK_THREAD_CPUTIME_ID): on a shared machine the time slices other processes
//! take are not counted, what they do to the caches is.
#include "decodeAttention.h"

#include <algorithm>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s PAST ROWS  (PAST + ROWS <= 2048)\n", argv[0]);
        return 1;
    }
    int64_t const past = std::atoll(argv[1]);
    int64_t const rows = std::atoll(argv[2]);
    int64_t constexpr kLayers = 30, kCapacity = 2048, kHeads = 9, kKv = 3, kD = 64;
    if (past < 0 || rows < 1 || past + rows > kCapacity)
    {
        std::fprintf(stderr, "PAST + ROWS must be in [1, %lld]\n", static_cast<long long>(kCapacity));
        return 1;
    }
    dflash2::DecodeAttentionShape const s{rows, past, kCapacity, kHeads, kKv, kD, kCapacity, 0.F};
    std::mt19937 gen(1);
    std::normal_distribution<float> normal(0.F, 1.F);
    std::vector<float> qkv(static_cast<size_t>(rows * (kHeads + 2 * kKv) * kD));
    std::vector<float> cosTable(static_cast<size_t>(kCapacity * kD / 2));
    std::vector<float> sinTable(cosTable.size());
    std::vector<float> keys(static_cast<size_t>(kLayers * kKv * kCapacity * kD));
    std::vector<float> values(keys.size());
    std::vector<float> out(static_cast<size_t>(rows * kHeads * kD));
    for (auto* v : {&qkv, &cosTable, &sinTable, &keys, &values})
    {
        for (float& x : *v)
        {
            x = normal(gen);
        }
    }
    std::vector<float> scratch(static_cast<size_t>(dflash2::decodeAttentionScratch(s)));
    double best = 1e30;
    for (int rep = 0; rep < 30; ++rep)
    {
        timespec t0{};
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        for (int64_t layer = 0; layer < kLayers; ++layer)
        {
            size_t const at = static_cast<size_t>(layer * kKv * kCapacity * kD);
            dflash2::decodeAttentionHeads(s, qkv.data(), cosTable.data(), sinTable.data(), keys.data() + at,
                values.data() + at, out.data(), 0, kHeads, scratch.data());
        }
        timespec t1{};
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        best = std::min(best, 1e3 * static_cast<double>(t1.tv_sec - t0.tv_sec) + 1e-6 * static_cast<double>(t1.tv_nsec - t0.tv_nsec));
    }
    std::printf("past %lld rows %lld: %.2f ms (30 layers, 1 thread, CPU time, best of 30)\n", static_cast<long long>(past),
        static_cast<long long>(rows), best);
    return 0;
}
