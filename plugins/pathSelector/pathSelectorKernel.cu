/*
 * dflash2_trt — DFlash2PathSelector CUDA kernel. Kernels first, then launchers.
 *
 * One block per sequence (grid = B, 512 threads):
 *   1. cache the clamped candidate ids of the sequence in shared memory;
 *   2. build the [L, K, K] lattice in parallel: a task is (t, j, part); an 8-lane group owns
 *      (t, j) and each lane one of the kDOT_PARTS partial sums of the rank-r dot product for all
 *      K predecessors i at once (g*b is loaded and multiplied once per element, a 16-wide register
 *      tile over i), then a 3-level xor-shuffle butterfly combines the parts — exactly
 *      combineParts() of the shared math, so the lattice equals the CPU twin bit for bit;
 *   3. warp 0 walks the lattice with the shared walk code (WarpLanes executor) and writes
 *      path_ids [B, L] and proposal_probs [B, L, K].
 * fp32 accumulation throughout; no workspace, no allocation, no synchronisation with the host.
 */
#include "pathSelectorKernel.cuh"

#include <cuda_runtime.h>

namespace dflash2
{
namespace selector
{
namespace
{

constexpr int32_t kWARP = 32;
constexpr unsigned kFULL_MASK = 0xffffffffu;

//! Walk executor for the device: warp 0's lane k handles k, k + 32, ...; the barrier is
//! __syncwarp(), which also orders the shared-memory traffic of the lanes.
struct WarpLanes
{
    int32_t lane;

    template <typename F>
    DFL2_HD void forEach(int32_t n, F&& f) const
    {
#if defined(__CUDA_ARCH__)
        for (int32_t k = lane; k < n; k += kWARP)
        {
            f(k);
        }
        __syncwarp();
#else
        SerialLanes{}.forEach(n, f); // never used on the host; keeps the template host-compilable
#endif
    }

    template <typename F>
    DFL2_HD void single(F&& f) const
    {
#if defined(__CUDA_ARCH__)
        if (lane == 0)
        {
            f();
        }
        __syncwarp();
#else
        f();
#endif
    }
};

//! Shared-memory carve-up of one block (all members 4-byte types, so no padding is needed).
struct SmemLayout
{
    size_t lattice;   //!< [L, K, K] fp32
    size_t messages;  //!< [L, K] fp32
    size_t proposals; //!< [L, K] fp32
    size_t back;      //!< [L, K] int32
    size_t candIds;   //!< [L, K] int32, clamped to [0, V)
    size_t pathIdx;   //!< [L] int32
    size_t scratch;   //!< WalkScratch
    size_t total;

    DFL2_HD SmemLayout(int32_t L, int32_t K)
    {
        size_t const lk = static_cast<size_t>(L) * K * 4;
        lattice = 0;
        messages = lattice + lk * K;
        proposals = messages + lk;
        back = proposals + lk;
        candIds = back + lk;
        pathIdx = candIds + lk;
        scratch = pathIdx + static_cast<size_t>(L) * 4;
        total = scratch + sizeof(WalkScratch);
    }
};

//! Four consecutive elements as fp32; p must be aligned to 4 elements.
__device__ __forceinline__ void load4(float const* p, float (&v)[4])
{
    float4 const x = __ldg(reinterpret_cast<float4 const*>(p));
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
}

__device__ __forceinline__ void load4(Fp16Bits const* p, float (&v)[4])
{
    uint2 const x = __ldg(reinterpret_cast<uint2 const*>(p));
    v[0] = toFloat(Fp16Bits{static_cast<uint16_t>(x.x & 0xffffu)});
    v[1] = toFloat(Fp16Bits{static_cast<uint16_t>(x.x >> 16)});
    v[2] = toFloat(Fp16Bits{static_cast<uint16_t>(x.y & 0xffffu)});
    v[3] = toFloat(Fp16Bits{static_cast<uint16_t>(x.y >> 16)});
}

__device__ __forceinline__ void load4(Bf16Bits const* p, float (&v)[4])
{
    uint2 const x = __ldg(reinterpret_cast<uint2 const*>(p));
    v[0] = toFloat(Bf16Bits{static_cast<uint16_t>(x.x & 0xffffu)});
    v[1] = toFloat(Bf16Bits{static_cast<uint16_t>(x.x >> 16)});
    v[2] = toFloat(Bf16Bits{static_cast<uint16_t>(x.y & 0xffffu)});
    v[3] = toFloat(Bf16Bits{static_cast<uint16_t>(x.y >> 16)});
}

template <typename T>
__device__ __forceinline__ float loadOne(T const* p)
{
    return toFloat(*p);
}

template <>
__device__ __forceinline__ float loadOne<float>(float const* p)
{
    return __ldg(p);
}

template <typename T>
__global__ void __launch_bounds__(kTHREADS) pathSelectorKernel(SelectorLaunchParams p)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int32_t const L = p.rows;
    int32_t const K = p.topK;
    int32_t const r = p.rank;
    int32_t const b = blockIdx.x;
    SmemLayout const layout(L, K);
    float* lattice = reinterpret_cast<float*>(smem + layout.lattice);     // [L, K, K]
    int32_t* candS = reinterpret_cast<int32_t*>(smem + layout.candIds);   // [L, K]
    int64_t const lk = static_cast<int64_t>(b) * L * K;
    int32_t const* candG = p.candIds + lk;                                  // [L, K]
    float const* unaryG = p.unary + lk;                                     // [L, K]
    T const* hidden = static_cast<T const*>(p.hiddenProj) + static_cast<int64_t>(b) * L * r; // [L, r]
    T const* predCb = static_cast<T const*>(p.predCodebook);                // [V, r]
    T const* succCb = static_cast<T const*>(p.succCodebook);                // [V, r]
    int32_t const anchor = clampId(p.anchorIds[b], p.vocab);

    for (int32_t k = threadIdx.x; k < L * K; k += blockDim.x)
    {
        candS[k] = clampId(candG[k], p.vocab);
    }
    __syncthreads();

    // Vector loads need every row start aligned to 4 elements: r % 4 == 0 and aligned bases.
    size_t const vecBytes = 4 * sizeof(T);
    bool const vecOk = (r % 4 == 0) && (reinterpret_cast<uintptr_t>(hidden) % vecBytes == 0)
        && (reinterpret_cast<uintptr_t>(predCb) % vecBytes == 0)
        && (reinterpret_cast<uintptr_t>(succCb) % vecBytes == 0);

    int32_t const lane = static_cast<int32_t>(threadIdx.x) % kWARP;
    int32_t const warp = static_cast<int32_t>(threadIdx.x) / kWARP;
    int32_t const nWarps = static_cast<int32_t>(blockDim.x) / kWARP;
    int32_t const nTasks = L * K * kDOT_PARTS; // (t, j, part), part fastest; a multiple of 8
    for (int32_t base = warp * kWARP; base < nTasks; base += nWarps * kWARP)
    {
        // Whole warps iterate together so the shuffles below are convergent; an 8-lane group is
        // either entirely valid or entirely padding because nTasks is a multiple of 8.
        int32_t const task = base + lane;
        bool const valid = task < nTasks;
        int32_t const part = task % kDOT_PARTS;
        int32_t const tj = valid ? task / kDOT_PARTS : 0;
        int32_t const t = tj / K;
        int32_t const j = tj % K;
        int32_t const nI = !valid ? 0 : (t == 0 ? 1 : K); // row 0: the anchor is the only predecessor

        T const* g = hidden + static_cast<int64_t>(t) * r;                   // [r]
        T const* bRow = succCb + static_cast<int64_t>(candS[t * K + j]) * r; // [r]
        T const* aRows[kMAX_TOP_K];                                          // K x [r]
#pragma unroll
        for (int32_t i = 0; i < kMAX_TOP_K; ++i)
        {
            int32_t const pred = t == 0 ? anchor : candS[(t - 1) * K + (i < K ? i : 0)];
            aRows[i] = predCb + static_cast<int64_t>(pred) * r;
        }

        float acc[kMAX_TOP_K];
#pragma unroll
        for (int32_t i = 0; i < kMAX_TOP_K; ++i)
        {
            acc[i] = 0.0f;
        }
        for (int32_t c0 = part * kDOT_CHUNK; c0 < r && nI > 0; c0 += kDOT_STRIDE)
        {
            if (vecOk && c0 + kDOT_CHUNK <= r)
            {
                float gv[4];
                float bv[4];
                load4(g + c0, gv);
                load4(bRow + c0, bv);
                float gb[4];
#pragma unroll
                for (int32_t k = 0; k < 4; ++k)
                {
                    gb[k] = gbProduct(gv[k], bv[k]);
                }
#pragma unroll
                for (int32_t i = 0; i < kMAX_TOP_K; ++i)
                {
                    if (i < nI)
                    {
                        float av[4];
                        load4(aRows[i] + c0, av);
#pragma unroll
                        for (int32_t k = 0; k < 4; ++k)
                        {
                            acc[i] = dotTermGb(acc[i], av[k], gb[k]);
                        }
                    }
                }
            }
            else
            {
                for (int32_t k = 0; k < kDOT_CHUNK && c0 + k < r; ++k)
                {
                    float const gb = gbProduct(loadOne(g + c0 + k), loadOne(bRow + c0 + k));
#pragma unroll
                    for (int32_t i = 0; i < kMAX_TOP_K; ++i)
                    {
                        if (i < nI)
                        {
                            acc[i] = dotTermGb(acc[i], loadOne(aRows[i] + c0 + k), gb);
                        }
                    }
                }
            }
        }
        // combineParts() as a butterfly: after offsets 1, 2, 4 every lane of the group holds
        // ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)).
#pragma unroll
        for (int32_t i = 0; i < kMAX_TOP_K; ++i)
        {
#pragma unroll
            for (int32_t offset = 1; offset < kDOT_PARTS; offset <<= 1)
            {
                acc[i] = acc[i] + __shfl_xor_sync(kFULL_MASK, acc[i], offset);
            }
        }
        if (part == 0)
        {
            float const u = valid ? unaryG[t * K + j] : 0.0f;
#pragma unroll
            for (int32_t i = 0; i < kMAX_TOP_K; ++i)
            {
                if (i < nI)
                {
                    lattice[(t * K + i) * K + j] = latticeEntry(u, acc[i]);
                }
            }
        }
    }
    __syncthreads();

    if (warp != 0)
    {
        return;
    }
    WalkArgs w{};
    w.lattice = lattice;
    w.messages = reinterpret_cast<float*>(smem + layout.messages);   // [L, K]
    w.back = reinterpret_cast<int32_t*>(smem + layout.back);         // [L, K]
    w.pathIdx = reinterpret_cast<int32_t*>(smem + layout.pathIdx);   // [L]
    w.proposals = reinterpret_cast<float*>(smem + layout.proposals); // [L, K]
    w.uniforms = p.uniforms + static_cast<int64_t>(b) * L;           // [L]
    w.temperature = p.temperature[b];
    w.rows = L;
    w.topK = K;
    WalkScratch& scratch = *reinterpret_cast<WalkScratch*>(smem + layout.scratch);
    WarpLanes const lanes{lane};
    walk(lanes, p.mode, w, scratch);

    for (int32_t k = lane; k < L * K; k += kWARP)
    {
        p.proposals[lk + k] = w.proposals[k];
    }
    for (int32_t t = lane; t < L; t += kWARP)
    {
        p.pathIds[static_cast<int64_t>(b) * L + t] = candG[t * K + w.pathIdx[t]];
    }
}

} // namespace

size_t pathSelectorSharedBytes(int32_t rows, int32_t topK) noexcept
{
    return SmemLayout(rows, topK).total;
}

cudaError_t launchPathSelector(SelectorLaunchParams const& p, cudaStream_t stream) noexcept
{
    if (p.batch < 0 || p.rows < 1 || p.topK < 1 || p.topK > kMAX_TOP_K || p.rank < 1 || p.vocab < 1)
    {
        return cudaErrorInvalidValue;
    }
    size_t const smemBytes = pathSelectorSharedBytes(p.rows, p.topK);
    if (smemBytes > kDEFAULT_SMEM_LIMIT)
    {
        return cudaErrorInvalidValue;
    }
    if (p.batch == 0)
    {
        return cudaSuccess;
    }
    if (p.candIds == nullptr || p.unary == nullptr || p.hiddenProj == nullptr || p.anchorIds == nullptr
        || p.predCodebook == nullptr || p.succCodebook == nullptr || p.temperature == nullptr
        || p.uniforms == nullptr || p.pathIds == nullptr || p.proposals == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    dim3 const grid(static_cast<unsigned>(p.batch));
    dim3 const block(kTHREADS);
    switch (p.elemType)
    {
    case ElemType::kFLOAT32: pathSelectorKernel<float><<<grid, block, smemBytes, stream>>>(p); break;
    case ElemType::kFLOAT16: pathSelectorKernel<Fp16Bits><<<grid, block, smemBytes, stream>>>(p); break;
    case ElemType::kBFLOAT16: pathSelectorKernel<Bf16Bits><<<grid, block, smemBytes, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

} // namespace selector
} // namespace dflash2
