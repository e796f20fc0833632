//! \file model.h
//! What a dfl2_model is inside: a backend that hands out one Runners per session.
#pragma once

#include "core/batch.h"
#include "core/decoder.h"
#include "manifest.h"
#include "options.h"

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dflash2
{

class Model
{
public:
    virtual ~Model() = default;
    //! One request's runners (a session holds one for its lifetime).
    virtual std::unique_ptr<Runners> newRunners() = 0;
    //! `slots` (1..maxBatch) sequences decoded together (dfl2_batch). Backends without a batched path refuse.
    virtual std::unique_ptr<BatchRunners> newBatchRunners(int32_t slots)
    {
        (void) slots;
        throw Error(DFL2_ERR_UNAVAILABLE,
            "the " + backend + " backend has no batched decoding; it needs a callbacks model with batched callbacks "
            "(dfl2_callbacks.max_batch >= 1) or TensorRT engines");
    }
    //! Non-null when sessions (and batches) must not run concurrently (callbacks share the caller's state).
    virtual std::mutex* generateLock()
    {
        return nullptr;
    }

    std::string backend;
    std::string note;  //!< which backend and library run the model, and why (dfl2_model_get_note)
    int32_t vocabSize{0};
    int32_t blockSize{0};
    int32_t topK{0};
    int32_t maxPositions{0};
    int32_t maxBatch{0};  //!< slots of the batched backend (0: none; TensorRT: the target engine's batch, >= 1)
    std::vector<int32_t> eosIds;
};

//! The sizes a runner interface answers (Runners and BatchRunners alike): a model's, or a callbacks struct's.
struct RunnerSizes
{
    int32_t vocabSize{0};
    int32_t blockSize{0};
    int32_t topK{0};
    int32_t maxPositions{0};

    static RunnerSizes of(Model const& m)
    {
        return {m.vocabSize, m.blockSize, m.topK, m.maxPositions};
    }
};

//! A runner interface (Base: Runners or BatchRunners) answering its sizes from a copy taken at construction (a
//! model's sizes never change after load): the one definition of the size getters every backend's runners share.
template <typename Base>
class SizedRunners : public Base
{
public:
    explicit SizedRunners(RunnerSizes const& sizes)
        : mSizes(sizes)
    {
    }
    int32_t vocabSize() const override
    {
        return mSizes.vocabSize;
    }
    int32_t blockSize() const override
    {
        return mSizes.blockSize;
    }
    int32_t topK() const override
    {
        return mSizes.topK;
    }
    int32_t maxPositions() const override
    {
        return mSizes.maxPositions;
    }

private:
    RunnerSizes mSizes;
};

//! dfl2_callbacks -> Model (validates the struct; copies its first struct_size bytes: fields a caller's older,
//! smaller struct lacks are absent, i.e. zero).
std::unique_ptr<Model> createCallbackModel(dfl2_callbacks const* callbacks);

//! The smallest struct_size accepted: the struct as API version 1.0 defined it (through drafter_propose).
constexpr size_t kCALLBACKS_V1_SIZE = offsetof(dfl2_callbacks, drafter_propose) + sizeof(void (*)());

//! The TensorRT backend (backends/trtBackend.cpp when built with DFLASH2_RUNTIME_TENSORRT, else a stub
//! that reports DFL2_ERR_UNAVAILABLE).
std::unique_ptr<Model> loadTensorRTModel(Manifest const& manifest, std::string const& dir, Options const& options);

//! The ONNX Runtime backend (backends/ortBackend.cpp when built with DFLASH2_RUNTIME_ORT, else a stub that reports
//! DFL2_ERR_UNAVAILABLE). libonnxruntime is opened at run time (backends/ortApi.h).
std::unique_ptr<Model> loadOrtModel(Manifest const& manifest, std::string const& dir, Options const& options);

} // namespace dflash2
