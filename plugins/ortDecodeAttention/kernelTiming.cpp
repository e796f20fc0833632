//! \file kernelTiming.cpp
//! Times the DecodeAttention kernel alone on one thread (no ONNX Runtime): 30 layers of SmolLM2-135M's attention
//! (9 query heads, 3 key/value heads, d = 64), each layer its own capacity buffer of 2048 slots, random inputs.
//!   cmake --build build/ort_ops --target dflash2_attention_timing
//!   taskset -c 0 build/ort_ops/dflash2_attention_timing 2032 4   # past, rows -> best of 30 runs, ms
//! The time is the thread's CPU time (CLOCK_THREAD_CPUTIME_ID): on a shared machine the time slices other processes
//! take are not counted, what they do to the caches is.
//!   build/ort_ops/dflash2_attention_timing 1800 200 2   # + THREADS: the op's parallel loop on THREADS threads
//! With THREADS, each work item of the op's cut (decodeAttentionCut, as ortCustomOp.cpp makes it for one sequence)
//! and of the cut by heads alone (groups of 3 in parts of 2 + 1: the op's items before rows were cut) is timed alone
//! (CPU time, best of 30, all layers), and the loop's wall time on THREADS idle cores is computed from those times:
//! items in the op's order (costliest first), each taken by the first thread free, as ONNX Runtime's loop takes
//! them. The two cuts' outputs are compared bit for bit.
#include "decodeAttention.h"

#include <algorithm>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace
{

double cpuMs()
{
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return 1e3 * static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_nsec);
}

//! The loop's wall time on `threads` idle cores from each item's own CPU time: items in order, each to the first
//! thread free.
double makespan(std::vector<double> const& ms, int64_t threads)
{
    std::vector<double> freeAt(static_cast<size_t>(threads), 0.);
    for (double t : ms)
    {
        *std::min_element(freeAt.begin(), freeAt.end()) += t;
    }
    return *std::max_element(freeAt.begin(), freeAt.end());
}

int loop(dflash2::DecodeAttentionShape const& s, int64_t threads, std::vector<float> const& qkv,
    std::vector<float> const& cosTable, std::vector<float> const& sinTable, std::vector<float> const& keys,
    std::vector<float> const& values, std::vector<float>& scratch)
{
    int64_t constexpr kLayers = 30;
    int64_t const group = s.numHeads / s.kvHeads;
    std::vector<dflash2::QueryRange> cut;
    dflash2::decodeAttentionCut(s, dflash2::decodeAttentionPieces(s.kvHeads), cut);
    std::vector<dflash2::QueryRange> byHeads; // parts of ceil(group * kvHeads / 8) heads
    int64_t const part = std::max<int64_t>(1, (group * s.kvHeads + 7) / 8);
    for (int64_t kv = 0; kv < s.kvHeads; ++kv)
    {
        for (int64_t h = kv * group; h < (kv + 1) * group; h += part)
        {
            int64_t const e = std::min((kv + 1) * group, h + part);
            byHeads.push_back({h * s.rows, e * s.rows, (e - h) * s.rows});
        }
    }
    for (auto* items : {&cut, &byHeads})
    {
        std::stable_sort(items->begin(), items->end(), [](auto const& x, auto const& y) { return x.cost > y.cost; });
    }
    std::vector<float> outs[2];
    double spans[2][2] = {};
    int which = 0;
    for (auto* items : {&cut, &byHeads})
    {
        std::vector<double> best(items->size(), 1e30);
        std::vector<float> out(static_cast<size_t>(s.rows * s.numHeads * s.headDim));
        for (int rep = 0; rep < 30; ++rep)
        {
            for (size_t i = 0; i < items->size(); ++i)
            {
                double const t0 = cpuMs();
                for (int64_t layer = 0; layer < kLayers; ++layer)
                {
                    size_t const at = static_cast<size_t>(layer * s.kvHeads * s.capacity * s.headDim);
                    dflash2::decodeAttentionQueries(s, qkv.data(), cosTable.data(), sinTable.data(), keys.data() + at,
                        values.data() + at, out.data(), (*items)[i].begin, (*items)[i].end, scratch.data());
                }
                best[i] = std::min(best[i], cpuMs() - t0);
            }
        }
        double sum = 0.;
        for (double t : best)
        {
            sum += t;
        }
        spans[which][0] = makespan(best, threads);
        spans[which][1] = sum;
        outs[which++] = out;
    }
    std::printf("past %lld rows %lld, %lld threads: cut by rows %zu items %.2f ms (sum %.2f), by heads %zu items %.2f ms "
                "(sum %.2f); outputs bit-equal: %s\n",
        static_cast<long long>(s.past), static_cast<long long>(s.rows), static_cast<long long>(threads), cut.size(),
        spans[0][0], spans[0][1], byHeads.size(), spans[1][0], spans[1][1], std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)) == 0 ? "yes" : "NO");
    return std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)) == 0 ? 0 : 2;
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 3 && argc != 4)
    {
        std::fprintf(stderr, "usage: %s PAST ROWS [THREADS]  (PAST + ROWS <= 2048)\n", argv[0]);
        return 1;
    }
    int64_t const threads = argc == 4 ? std::atoll(argv[3]) : 0;
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
    if (threads > 0)
    {
        return loop(s, threads, qkv, cosTable, sinTable, keys, values, scratch);
    }
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
