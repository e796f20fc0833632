/*
 * dflash2_trt — GPU check of the DFlash2PathSelector kernel against its CPU twin.
 *
 *   gpuCheck [--quick] [--no-timing]
 *
 * 1. Correctness: random inputs over many sizes (B, L, K <= 16, r not a power of two, V), both
 *    modes, T = 0 and T > 0 with given uniforms, fp32/fp16/bf16, aligned and misaligned rows,
 *    exact ties; outputs poisoned (0xFF bytes: NaN / -1) before every launch. The kernel must
 *    reproduce the host twin: path ids exactly and proposals bit for bit (the shared math avoids
 *    every host/device difference); a tolerance of 1e-6 is reported separately.
 * 2. Timing: CUDA-graph replay of 100 back-to-back launches, B = 1, 8, 64, 256 at L = 15, K = 16,
 *    r = 256, V = 49152; prints microseconds per call (target: < 5 us at B = 1 on H100/H200).
 *
 * Exit: 0 pass, 1 mismatch or CUDA error, 77 no CUDA device (ctest reports a skip).
 */
#include "pathSelectorHost.h"
#include "pathSelectorKernel.cuh"

#include <cuda_runtime.h>

#include "dfl2Test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace sel = dflash2::selector;

namespace
{

//! fp32 -> fp16 / bf16 bits, round to nearest even (inputs here are finite and in range).
uint16_t toHalfBits(float f)
{
    uint32_t x = 0;
    std::memcpy(&x, &f, sizeof(x));
    uint32_t const sign = (x >> 16) & 0x8000u;
    int32_t const expo = static_cast<int32_t>((x >> 23) & 0xffu) - 127 + 15;
    uint32_t mant = x & 0x7fffffu;
    if (expo <= 0)
    {
        if (expo < -10)
        {
            return static_cast<uint16_t>(sign);
        }
        mant |= 0x800000u;
        uint32_t const shift = static_cast<uint32_t>(14 - expo);
        uint32_t half = mant >> shift;
        uint32_t const rem = mant & ((1u << shift) - 1u);
        uint32_t const mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u)))
        {
            ++half;
        }
        return static_cast<uint16_t>(sign | half);
    }
    uint32_t half = (static_cast<uint32_t>(expo) << 10) | (mant >> 13);
    uint32_t const rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
    {
        ++half;
    }
    return static_cast<uint16_t>(sign | half);
}

uint16_t toBf16Bits(float f)
{
    uint32_t x = 0;
    std::memcpy(&x, &f, sizeof(x));
    uint32_t const rounding = 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>((x + rounding) >> 16);
}

struct Case
{
    int32_t B;
    int32_t L;
    int32_t K;
    int32_t r;
    int32_t V;
    sel::Mode mode;
    sel::ElemType type;
    bool sampling;  //!< some sequences at T > 0
    bool ties;      //!< small-integer inputs with many exact ties
    bool misalign;  //!< shift the codebook/hidden bases by one element (scalar load path)
};

size_t elemSize(sel::ElemType t)
{
    return t == sel::ElemType::kFLOAT32 ? 4 : 2;
}

//! Host data of one case, with the typed copies of hidden/codebooks.
struct Inputs
{
    std::vector<int32_t> cand;   // [B, L, K]
    std::vector<float> unary;    // [B, L, K]
    std::vector<float> hidden;   // [B, L, r]
    std::vector<int32_t> anchor; // [B]
    std::vector<float> predCb;   // [V, r]
    std::vector<float> succCb;   // [V, r]
    std::vector<float> temperature; // [B]
    std::vector<float> uniforms; // [B, L]
};

std::vector<unsigned char> typed(std::vector<float> const& v, sel::ElemType t, int32_t padElems)
{
    size_t const es = elemSize(t);
    std::vector<unsigned char> out((v.size() + static_cast<size_t>(padElems)) * es, 0);
    for (size_t k = 0; k < v.size(); ++k)
    {
        unsigned char* dst = out.data() + (k + static_cast<size_t>(padElems)) * es;
        if (t == sel::ElemType::kFLOAT32)
        {
            std::memcpy(dst, &v[k], 4);
        }
        else
        {
            uint16_t const h = t == sel::ElemType::kFLOAT16 ? toHalfBits(v[k]) : toBf16Bits(v[k]);
            std::memcpy(dst, &h, 2);
        }
    }
    return out;
}

Inputs makeInputs(Case const& c, std::mt19937& rng)
{
    Inputs in;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int32_t> small(-2, 2);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    size_t const blk = static_cast<size_t>(c.B) * c.L * c.K;
    in.cand.resize(blk);
    in.unary.resize(blk);
    std::uniform_int_distribution<int32_t> token(0, c.V - 1);
    for (int32_t row = 0; row < c.B * c.L; ++row)
    {
        std::vector<float> u(static_cast<size_t>(c.K));
        for (int32_t j = 0; j < c.K; ++j)
        {
            in.cand[static_cast<size_t>(row) * c.K + j] = token(rng);
            u[static_cast<size_t>(j)] = c.ties ? static_cast<float>(small(rng)) : 2.0f * normal(rng);
        }
        std::sort(u.begin(), u.end(), [](float a, float b) { return a > b; });
        for (int32_t j = 0; j < c.K; ++j)
        {
            in.unary[static_cast<size_t>(row) * c.K + j] = u[static_cast<size_t>(j)];
        }
    }
    float const scale = 1.0f / std::sqrt(static_cast<float>(c.r));
    auto fill = [&](std::vector<float>& v, size_t n, float s) {
        v.resize(n);
        for (auto& x : v)
        {
            x = c.ties ? static_cast<float>(small(rng)) * 0.5f : s * normal(rng);
        }
    };
    fill(in.hidden, static_cast<size_t>(c.B) * c.L * c.r, 1.0f);
    fill(in.predCb, static_cast<size_t>(c.V) * c.r, scale);
    fill(in.succCb, static_cast<size_t>(c.V) * c.r, 1.0f);
    if (c.type != sel::ElemType::kFLOAT32)
    {
        // the twin gets exactly the rounded values the kernel reads
        for (auto* v : {&in.hidden, &in.predCb, &in.succCb})
        {
            for (auto& x : *v)
            {
                uint16_t const h = c.type == sel::ElemType::kFLOAT16 ? toHalfBits(x) : toBf16Bits(x);
                x = c.type == sel::ElemType::kFLOAT16 ? sel::toFloat(sel::Fp16Bits{h}) : sel::toFloat(sel::Bf16Bits{h});
            }
        }
    }
    in.anchor.resize(static_cast<size_t>(c.B));
    in.temperature.resize(static_cast<size_t>(c.B));
    for (int32_t b = 0; b < c.B; ++b)
    {
        in.anchor[static_cast<size_t>(b)] = token(rng);
        in.temperature[static_cast<size_t>(b)] = c.sampling && (b % 3 != 2) ? 0.25f + 2.0f * unit(rng) : 0.0f;
    }
    in.uniforms.resize(static_cast<size_t>(c.B) * c.L);
    for (auto& x : in.uniforms)
    {
        x = unit(rng) * 0.999999f;
    }
    return in;
}

//! Device copies of one case; the typed buffers may start one element past an aligned base.
struct DeviceInputs
{
    void* cand = nullptr;
    void* unary = nullptr;
    void* hiddenBase = nullptr;
    void* predBase = nullptr;
    void* succBase = nullptr;
    void* anchor = nullptr;
    void* temperature = nullptr;
    void* uniforms = nullptr;
    void* pathIds = nullptr;
    void* proposals = nullptr;
    size_t pad = 0;

    ~DeviceInputs()
    {
        for (void* p : {cand, unary, hiddenBase, predBase, succBase, anchor, temperature, uniforms, pathIds, proposals})
        {
            cudaFree(p);
        }
    }
};

template <typename T>
void upload(void*& dst, T const* src, size_t bytes)
{
    CUDA_OK(cudaMalloc(&dst, bytes > 0 ? bytes : 1));
    CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

sel::SelectorLaunchParams launchParams(Case const& c, DeviceInputs const& d)
{
    sel::SelectorLaunchParams p{};
    size_t const pad = d.pad * elemSize(c.type);
    p.candIds = static_cast<int32_t const*>(d.cand);
    p.unary = static_cast<float const*>(d.unary);
    p.hiddenProj = static_cast<unsigned char const*>(d.hiddenBase) + pad;
    p.anchorIds = static_cast<int32_t const*>(d.anchor);
    p.predCodebook = static_cast<unsigned char const*>(d.predBase) + pad;
    p.succCodebook = static_cast<unsigned char const*>(d.succBase) + pad;
    p.temperature = static_cast<float const*>(d.temperature);
    p.uniforms = static_cast<float const*>(d.uniforms);
    p.pathIds = static_cast<int32_t*>(d.pathIds);
    p.proposals = static_cast<float*>(d.proposals);
    p.batch = c.B;
    p.rows = c.L;
    p.topK = c.K;
    p.rank = c.r;
    p.vocab = c.V;
    p.elemType = c.type;
    p.mode = c.mode;
    return p;
}

void uploadCase(Case const& c, Inputs const& in, DeviceInputs& d)
{
    d.pad = c.misalign ? 1 : 0;
    int32_t const pad = static_cast<int32_t>(d.pad);
    upload(d.cand, in.cand.data(), in.cand.size() * 4);
    upload(d.unary, in.unary.data(), in.unary.size() * 4);
    std::vector<unsigned char> const h = typed(in.hidden, c.type, pad);
    std::vector<unsigned char> const a = typed(in.predCb, c.type, pad);
    std::vector<unsigned char> const b = typed(in.succCb, c.type, pad);
    upload(d.hiddenBase, h.data(), h.size());
    upload(d.predBase, a.data(), a.size());
    upload(d.succBase, b.data(), b.size());
    upload(d.anchor, in.anchor.data(), in.anchor.size() * 4);
    upload(d.temperature, in.temperature.data(), in.temperature.size() * 4);
    upload(d.uniforms, in.uniforms.data(), in.uniforms.size() * 4);
    CUDA_OK(cudaMalloc(&d.pathIds, static_cast<size_t>(c.B) * c.L * 4 + 4));
    CUDA_OK(cudaMalloc(&d.proposals, static_cast<size_t>(c.B) * c.L * c.K * 4 + 4));
}

char const* typeName(sel::ElemType t)
{
    return t == sel::ElemType::kFLOAT32 ? "fp32" : (t == sel::ElemType::kFLOAT16 ? "fp16" : "bf16");
}

//! Run one case on both sides; returns false on mismatch.
bool checkCase(Case const& c, std::mt19937& rng, int32_t& bitwiseEqual)
{
    Inputs const in = makeInputs(c, rng);
    DeviceInputs d;
    uploadCase(c, in, d);
    size_t const nIds = static_cast<size_t>(c.B) * c.L;
    size_t const nProps = nIds * c.K;
    CUDA_OK(cudaMemset(d.pathIds, 0xff, nIds * 4 + 4)); // poison: -1 ids, NaN probabilities
    CUDA_OK(cudaMemset(d.proposals, 0xff, nProps * 4 + 4));
    cudaError_t const launch = sel::launchPathSelector(launchParams(c, d), nullptr);
    if (launch != cudaSuccess)
    {
        std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(launch));
        return false;
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<int32_t> ids(nIds + 1);
    std::vector<float> props(nProps + 1);
    CUDA_OK(cudaMemcpy(ids.data(), d.pathIds, (nIds + 1) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(props.data(), d.proposals, (nProps + 1) * 4, cudaMemcpyDeviceToHost));

    std::vector<int32_t> hostIds(nIds);
    std::vector<float> hostProps(nProps);
    std::vector<unsigned char> const h = typed(in.hidden, c.type, 0);
    std::vector<unsigned char> const a = typed(in.predCb, c.type, 0);
    std::vector<unsigned char> const b = typed(in.succCb, c.type, 0);
    int32_t const status = dfl2SelectPathsHost(in.cand.data(), in.unary.data(), h.data(), in.anchor.data(), a.data(),
        b.data(), in.temperature.data(), in.uniforms.data(), c.B, c.L, c.K, c.r, c.V, static_cast<int32_t>(c.type),
        static_cast<int32_t>(c.mode), hostIds.data(), hostProps.data(), nullptr);
    if (status != DFL2_SELECTOR_OK)
    {
        std::fprintf(stderr, "host twin refused the case\n");
        return false;
    }
    int32_t idMismatch = 0;
    double maxDiff = 0.0;
    bool bitwise = true;
    for (size_t k = 0; k < nIds; ++k)
    {
        idMismatch += ids[k] != hostIds[k];
    }
    for (size_t k = 0; k < nProps; ++k)
    {
        double const diff = std::fabs(static_cast<double>(props[k]) - hostProps[k]);
        maxDiff = std::isnan(props[k]) ? INFINITY : std::fmax(maxDiff, diff);
        bitwise = bitwise && std::memcmp(&props[k], &hostProps[k], 4) == 0;
    }
    bool const guardOk = ids[nIds] == -1 && std::isnan(props[nProps]); // nothing written past the end
    bitwiseEqual += bitwise ? 1 : 0;
    bool const ok = idMismatch == 0 && maxDiff <= 1.0e-6 && guardOk;
    if (!ok)
    {
        std::fprintf(stderr,
            "MISMATCH B=%d L=%d K=%d r=%d V=%d mode=%s type=%s sampling=%d ties=%d misalign=%d: %d id(s) differ, "
            "max |dq| = %g, guard %s\n",
            c.B, c.L, c.K, c.r, c.V, c.mode == sel::Mode::kVITERBI ? "viterbi" : "greedy", typeName(c.type),
            c.sampling, c.ties, c.misalign, idMismatch, maxDiff, guardOk ? "ok" : "overwritten");
    }
    return ok;
}

//! Microseconds per call from CUDA-graph replay of `kCalls` launches.
float timeCase(Case const& c, std::mt19937& rng)
{
    constexpr int32_t kCalls = 100;
    constexpr int32_t kReplays = 20;
    Inputs const in = makeInputs(c, rng);
    DeviceInputs d;
    uploadCase(c, in, d);
    sel::SelectorLaunchParams const p = launchParams(c, d);
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_OK(sel::launchPathSelector(p, stream)); // warm-up, eager
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int32_t k = 0; k < kCalls; ++k)
    {
        CUDA_OK(sel::launchPathSelector(p, stream));
    }
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaEvent_t start = nullptr;
    cudaEvent_t stop = nullptr;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreate(&stop));
    CUDA_OK(cudaEventRecord(start, stream));
    for (int32_t k = 0; k < kReplays; ++k)
    {
        CUDA_OK(cudaGraphLaunch(exec, stream));
    }
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    CUDA_OK(cudaEventDestroy(start));
    CUDA_OK(cudaEventDestroy(stop));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
    return 1000.0f * ms / static_cast<float>(kCalls * kReplays);
}

} // namespace

int main(int argc, char** argv)
{
    bool quick = false;
    bool timing = true;
    for (int k = 1; k < argc; ++k)
    {
        quick = quick || std::strcmp(argv[k], "--quick") == 0;
        timing = timing && std::strcmp(argv[k], "--no-timing") != 0;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    {
        std::printf("gpuCheck: no CUDA device; nothing run\n");
        return 77;
    }
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    std::printf("gpuCheck: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);

    std::mt19937 rng(20240607u);
    std::vector<Case> cases;
    int32_t const Bs[] = {1, 3, 17, 64};
    int32_t const Ls[] = {1, 2, 5, 15, 31};
    int32_t const Ks[] = {1, 3, 8, 16};
    int32_t const rs[] = {1, 7, 64, 100, 256};
    sel::ElemType const types[] = {sel::ElemType::kFLOAT32, sel::ElemType::kFLOAT16, sel::ElemType::kBFLOAT16};
    int32_t n = 0;
    for (int32_t B : Bs)
    {
        for (int32_t L : Ls)
        {
            for (int32_t K : Ks)
            {
                for (int32_t r : rs)
                {
                    ++n;
                    if (quick && n % 7 != 0)
                    {
                        continue;
                    }
                    for (int32_t variant = 0; variant < 4; ++variant)
                    {
                        Case c{};
                        c.B = B;
                        c.L = L;
                        c.K = K;
                        c.r = r;
                        c.V = K + 37 + (n % 5) * 101;
                        c.mode = variant % 2 == 0 ? sel::Mode::kGREEDY : sel::Mode::kVITERBI;
                        c.type = types[(n + variant) % 3];
                        c.sampling = variant >= 2;
                        c.ties = n % 4 == 1;
                        c.misalign = n % 5 == 2;
                        cases.push_back(c);
                    }
                }
            }
        }
    }
    int32_t failures = 0;
    int32_t bitwise = 0;
    for (Case const& c : cases)
    {
        failures += checkCase(c, rng, bitwise) ? 0 : 1;
    }
    std::printf("correctness: %zu cases, %d mismatching, %d bitwise identical to the CPU twin\n", cases.size(),
        failures, bitwise);

    if (timing)
    {
        std::printf("\ntiming (CUDA graph of 100 launches, L=15 K=16 r=256 V=49152), microseconds per call\n");
        std::printf("%-6s %-8s %-5s %-6s %10s\n", "B", "mode", "T", "type", "us/call");
        int32_t const tBs[] = {1, 8, 64, 256};
        for (sel::ElemType type : {sel::ElemType::kFLOAT16, sel::ElemType::kFLOAT32})
        {
            for (sel::Mode mode : {sel::Mode::kGREEDY, sel::Mode::kVITERBI})
            {
                for (bool sampling : {false, true})
                {
                    for (int32_t B : tBs)
                    {
                        Case c{B, 15, 16, 256, 49152, mode, type, sampling, false, false};
                        float const us = timeCase(c, rng);
                        std::printf("%-6d %-8s %-5s %-6s %10.2f\n", B, mode == sel::Mode::kVITERBI ? "viterbi" : "greedy",
                            sampling ? ">0" : "0", typeName(type), us);
                    }
                }
            }
        }
    }
    return failures == 0 ? 0 : 1;
}
