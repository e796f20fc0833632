//! \file callbackBackend.cpp
//! "Bring your own engines": Runners over the caller's dfl2_callbacks. The library owns every buffer it
//! passes; the features of the latest target forward stay here until the loop hands rows to the drafter.
#include "../model.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace dflash2
{

namespace
{

void check(int32_t rc, char const* what)
{
    if (rc != 0)
    {
        throw Error(DFL2_ERR_CALLBACK, std::string("callback ") + what + " returned " + std::to_string(rc));
    }
}

class CallbackRunners : public Runners
{
public:
    explicit CallbackRunners(dfl2_callbacks const& cb)
        : mCb(cb)
    {
    }
    int32_t vocabSize() const override
    {
        return mCb.vocab_size;
    }
    int32_t blockSize() const override
    {
        return mCb.block_size;
    }
    int32_t topK() const override
    {
        return mCb.top_k;
    }
    int32_t maxPositions() const override
    {
        return mCb.max_positions;
    }
    void targetReset() override
    {
        check(mCb.target_reset(mCb.user_data), "target_reset");
        mFeatureRows = 0;
    }
    void targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits) override
    {
        size_t const F = static_cast<size_t>(mCb.feature_dim);
        logits.assign(static_cast<size_t>(n) * static_cast<size_t>(mCb.vocab_size), 0.0F);
        mFeatures.assign(static_cast<size_t>(n) * F, 0.0F);
        mFeatureRows = 0;
        check(mCb.target_forward(mCb.user_data, ids, n, logits.data(), mFeatures.data()), "target_forward");
        mFeatureRows = n;
    }
    void targetCrop(int32_t length) override
    {
        check(mCb.target_crop(mCb.user_data, length), "target_crop");
    }
    void drafterReset() override
    {
        check(mCb.drafter_reset(mCb.user_data), "drafter_reset");
    }
    void drafterAddContext(int32_t rows, int32_t start) override
    {
        if (rows > mFeatureRows)
        {
            throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the last target forward made");
        }
        check(mCb.drafter_add_context(mCb.user_data, mFeatures.data(), rows, start), "drafter_add_context");
    }
    void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out) override
    {
        size_t const L = static_cast<size_t>(mCb.block_size - 1);
        size_t const K = static_cast<size_t>(mCb.top_k);
        size_t const V = static_cast<size_t>(mCb.vocab_size);
        out.tokens.assign(L, -1);
        out.proposal.assign(L * K, 0.0F);
        out.cand.assign(L * K, -1);
        // the [L, V] buffer is only offered (and sized) when sampling: greedy acceptance never reads it
        out.vocabProposal.assign(temperature > 0 ? L * V : 0, 0.0F);
        int32_t used = 0;
        check(mCb.drafter_propose(mCb.user_data, anchor, pos, rows, temperature, uniforms, out.tokens.data(),
                  out.proposal.data(), out.cand.data(), temperature > 0 ? out.vocabProposal.data() : nullptr, &used),
            "drafter_propose");
        out.hasVocabProposal = temperature > 0 && used != 0;
    }

private:
    dfl2_callbacks mCb;
    std::vector<float> mFeatures;  //!< [rows, F] of the latest target forward
    int32_t mFeatureRows{0};
};

class CallbackModel : public Model
{
public:
    explicit CallbackModel(dfl2_callbacks const& cb)
        : mCb(cb)
    {
        mCb.eos_ids = nullptr;  // the caller's array is copied into eosIds; never read through mCb
        mCb.n_eos_ids = 0;
    }
    std::unique_ptr<Runners> newRunners() override
    {
        return std::make_unique<CallbackRunners>(mCb);
    }
    std::mutex* generateLock() override
    {
        return &mLock;
    }

private:
    dfl2_callbacks mCb;
    std::mutex mLock;
};

} // namespace

std::unique_ptr<Model> createCallbackModel(dfl2_callbacks const* caller)
{
    auto bad = [](std::string const& why) { throw Error(DFL2_ERR_INVALID_ARGUMENT, "dfl2_callbacks: " + why); };
    uint32_t size = 0; // read first, alone: the caller's struct may be smaller than this library's
    std::memcpy(&size, caller, sizeof(size));
    if (size < kCALLBACKS_V1_SIZE)
    {
        bad("struct_size " + std::to_string(size) + " < " + std::to_string(kCALLBACKS_V1_SIZE)
            + ", the size of the first version (set it to sizeof(dfl2_callbacks))");
    }
    dfl2_callbacks cb{}; // fields past the caller's struct_size stay zero (absent)
    std::memcpy(&cb, caller, std::min<size_t>(size, sizeof(cb)));
    if (cb.vocab_size < 1 || cb.block_size < 2 || cb.top_k < 1 || cb.top_k > cb.vocab_size || cb.feature_dim < 0
        || cb.max_positions < 2)
    {
        bad("needs vocab_size >= 1, block_size >= 2, 1 <= top_k <= vocab_size, feature_dim >= 0, max_positions >= 2");
    }
    if (cb.target_reset == nullptr || cb.target_forward == nullptr || cb.target_crop == nullptr
        || cb.drafter_reset == nullptr || cb.drafter_add_context == nullptr || cb.drafter_propose == nullptr)
    {
        bad("every function pointer must be set");
    }
    if (cb.n_eos_ids > 0 && cb.eos_ids == nullptr)
    {
        bad("eos_ids is NULL but n_eos_ids > 0");
    }
    auto m = std::make_unique<CallbackModel>(cb);
    m->backend = "callbacks";
    m->vocabSize = cb.vocab_size;
    m->blockSize = cb.block_size;
    m->topK = cb.top_k;
    m->maxPositions = cb.max_positions;
    m->eosIds.assign(cb.eos_ids, cb.eos_ids + cb.n_eos_ids);
    return m;
}

} // namespace dflash2
