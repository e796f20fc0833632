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

// drafter_propose / batch_drafter_propose into a Draft: `call` gets (vocab buffer or nullptr, &used) -> rc
template <typename Call>
void propose(dfl2_callbacks const& cb, float temperature, Draft& out, char const* what, Call&& call)
{
    size_t const L = static_cast<size_t>(cb.block_size - 1);
    size_t const K = static_cast<size_t>(cb.top_k);
    size_t const V = static_cast<size_t>(cb.vocab_size);
    out.tokens.assign(L, -1);
    out.proposal.assign(L * K, 0.0F);
    out.cand.assign(L * K, -1);
    // the [L, V] buffer is only offered (and sized) when sampling: greedy acceptance never reads it
    out.vocabProposal.assign(temperature > 0 ? L * V : 0, 0.0F);
    int32_t used = 0;
    check(call(temperature > 0 ? out.vocabProposal.data() : nullptr, &used), what);
    out.hasVocabProposal = temperature > 0 && used != 0;
}

//! What both callbacks runners (Base: Runners for sessions, BatchRunners for batches) answer from the caller's
//! struct: its sizes. Holds the runner's copy of dfl2_callbacks (the model's, eos pointer dropped).
template <typename Base>
class CallbackShapes : public SizedRunners<Base>
{
public:
    explicit CallbackShapes(dfl2_callbacks const& cb)
        : SizedRunners<Base>(RunnerSizes{cb.vocab_size, cb.block_size, cb.top_k, cb.max_positions})
        , mCb(cb)
    {
    }

protected:
    dfl2_callbacks mCb;
};

class CallbackRunners : public CallbackShapes<Runners>
{
public:
    explicit CallbackRunners(dfl2_callbacks const& cb)
        : CallbackShapes(cb)
    {
    }
    void targetReset() override
    {
        check(mCb.target_reset(mCb.user_data), "target_reset");
        mFeatureRows = 0;
        mPending.clear();
        mPendingRows = 0;
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
        mPending.clear();
        mPendingRows = 0;
        check(mCb.drafter_reset(mCb.user_data), "drafter_reset");
    }
    void drafterQueueContext(int32_t rows) override
    {
        if (rows > mFeatureRows)
        {
            throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the last target forward made");
        }
        mPending.insert(mPending.end(), mFeatures.begin(), mFeatures.begin() + static_cast<long>(rows) * mCb.feature_dim);
        mPendingRows += rows;
    }
    void drafterAddContext(int32_t start) override
    {
        int32_t const m = mPendingRows;
        std::vector<float> const features = std::move(mPending);
        mPending.clear();
        mPendingRows = 0;
        check(mCb.drafter_add_context(mCb.user_data, features.data(), m, start), "drafter_add_context");
    }
    void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out) override
    {
        propose(mCb, temperature, out, "drafter_propose", [&](float* vocab, int32_t* used) {
            return mCb.drafter_propose(mCb.user_data, anchor, pos, rows, temperature, uniforms, out.tokens.data(),
                out.proposal.data(), out.cand.data(), vocab, used);
        });
    }

private:
    std::vector<float> mFeatures;  //!< [rows, F] of the latest target forward
    int32_t mFeatureRows{0};
    std::vector<float> mPending;   //!< [rows, F] queued for the drafter
    int32_t mPendingRows{0};
};

//! The batched callbacks: per slot the latest target features and the context queued for the slot's drafter.
class CallbackBatchRunners : public CallbackShapes<BatchRunners>
{
public:
    CallbackBatchRunners(dfl2_callbacks const& cb, int32_t slots)
        : CallbackShapes(cb)
        , mSlots(slots)
        , mFeatures(static_cast<size_t>(slots))
        , mFeatureRows(static_cast<size_t>(slots), 0)
        , mPending(static_cast<size_t>(slots))
        , mPendingRows(static_cast<size_t>(slots), 0)
    {
    }
    int32_t slots() const override
    {
        return mSlots;
    }
    void targetReset(int32_t slot) override
    {
        forget(slot);
        check(mCb.batch_target_reset(mCb.user_data, slot), "batch_target_reset");
    }
    void targetRelease(int32_t slot) override
    {
        forget(slot);
        if (mCb.batch_target_release != nullptr)
        {
            check(mCb.batch_target_release(mCb.user_data, slot), "batch_target_release");
        }
    }
    void targetForward(std::vector<SlotRows> const& seqs, bool lastLogits, std::vector<float>& logits) override
    {
        size_t const F = static_cast<size_t>(mCb.feature_dim);
        std::vector<int32_t> slots;
        std::vector<int32_t> lengths;
        std::vector<int32_t> rows;
        std::vector<int32_t> ids;
        for (SlotRows const& s : seqs)
        {
            slots.push_back(s.slot);
            lengths.push_back(s.cacheLength);
            rows.push_back(static_cast<int32_t>(s.ids.size()));
            ids.insert(ids.end(), s.ids.begin(), s.ids.end());
            mFeatureRows[static_cast<size_t>(s.slot)] = 0;
        }
        logits.assign((lastLogits ? seqs.size() : ids.size()) * static_cast<size_t>(mCb.vocab_size), 0.0F);
        std::vector<float> features(ids.size() * F, 0.0F);
        check(mCb.batch_target_forward(mCb.user_data, static_cast<int32_t>(seqs.size()), slots.data(), lengths.data(),
                  rows.data(), ids.data(), lastLogits ? 1 : 0, logits.data(), features.data()),
            "batch_target_forward");
        size_t row = 0;
        for (SlotRows const& s : seqs)
        {
            size_t const b = static_cast<size_t>(s.slot);
            mFeatures[b].assign(features.begin() + static_cast<long>(row * F),
                features.begin() + static_cast<long>((row + s.ids.size()) * F));
            mFeatureRows[b] = static_cast<int32_t>(s.ids.size());
            row += s.ids.size();
        }
    }
    void targetCrop(int32_t slot, int32_t length) override
    {
        check(mCb.batch_target_crop(mCb.user_data, slot, length), "batch_target_crop");
    }
    void drafterReset(int32_t slot) override
    {
        mPending[static_cast<size_t>(slot)].clear();
        mPendingRows[static_cast<size_t>(slot)] = 0;
        check(mCb.batch_drafter_reset(mCb.user_data, slot), "batch_drafter_reset");
    }
    void drafterQueueContext(int32_t slot, int32_t rows) override
    {
        size_t const b = static_cast<size_t>(slot);
        if (rows > mFeatureRows[b])
        {
            throw Error(DFL2_ERR_INTERNAL, "drafter context asks for more rows than the slot's last target forward made");
        }
        auto const first = mFeatures[b].begin();
        mPending[b].insert(mPending[b].end(), first, first + static_cast<long>(rows) * mCb.feature_dim);
        mPendingRows[b] += rows;
    }
    void drafterAddContext(int32_t slot, int32_t start) override
    {
        size_t const b = static_cast<size_t>(slot);
        int32_t const m = mPendingRows[b];
        std::vector<float> const features = std::move(mPending[b]);
        mPending[b].clear();
        mPendingRows[b] = 0;
        check(mCb.batch_drafter_add_context(mCb.user_data, slot, features.data(), m, start), "batch_drafter_add_context");
    }
    void drafterPropose(int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
        float const* uniforms, Draft& out) override
    {
        propose(mCb, temperature, out, "batch_drafter_propose", [&](float* vocab, int32_t* used) {
            return mCb.batch_drafter_propose(mCb.user_data, slot, anchor, pos, rows, temperature, uniforms,
                out.tokens.data(), out.proposal.data(), out.cand.data(), vocab, used);
        });
    }

private:
    void forget(int32_t slot)
    {
        size_t const b = static_cast<size_t>(slot);
        mFeatureRows[b] = 0;
        mPending[b].clear();
        mPendingRows[b] = 0;
    }

    int32_t mSlots;
    std::vector<std::vector<float>> mFeatures;  //!< per slot: [rows, F] of its latest target forward
    std::vector<int32_t> mFeatureRows;
    std::vector<std::vector<float>> mPending;   //!< per slot: [rows, F] queued for its drafter
    std::vector<int32_t> mPendingRows;
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
    std::unique_ptr<BatchRunners> newBatchRunners(int32_t slots) override
    {
        if (mCb.max_batch < 1)
        {
            throw Error(DFL2_ERR_UNAVAILABLE, "this callbacks model has no batched callbacks (dfl2_callbacks.max_batch = 0)");
        }
        return std::make_unique<CallbackBatchRunners>(mCb, slots);
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
    if (cb.max_batch < 0)
    {
        bad("max_batch must be >= 0 (0: no batched callbacks), got " + std::to_string(cb.max_batch));
    }
    if (cb.max_batch > 0
        && (cb.batch_target_reset == nullptr || cb.batch_target_forward == nullptr || cb.batch_target_crop == nullptr
            || cb.batch_drafter_reset == nullptr || cb.batch_drafter_add_context == nullptr
            || cb.batch_drafter_propose == nullptr))
    {
        bad("max_batch > 0 needs every batch_* function pointer (batch_target_release may be NULL)");
    }
    auto m = std::make_unique<CallbackModel>(cb);
    m->backend = "callbacks";
    m->vocabSize = cb.vocab_size;
    m->blockSize = cb.block_size;
    m->topK = cb.top_k;
    m->maxPositions = cb.max_positions;
    m->maxBatch = cb.max_batch;
    m->eosIds.assign(cb.eos_ids, cb.eos_ids + cb.n_eos_ids);
    return m;
}

} // namespace dflash2
