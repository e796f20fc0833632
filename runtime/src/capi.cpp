//! \file capi.cpp
//! The C boundary: every exported function is noexcept, catches everything and returns a dfl2_status (no
//! exception crosses the library boundary). Handles are thin structs around the C++ objects.
#include "dflash2/dflash2.h"

#include "core/batch.h"
#include "core/decoder.h"
#include "core/prefixCache.h"
#include "manifest.h"
#include "model.h"
#include "options.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

struct dfl2_status
{
    dfl2_code code;
    std::string message;
};

struct dfl2_options
{
    dflash2::Options opts;
};

struct dfl2_model
{
    std::unique_ptr<dflash2::Model> impl;
};

//! The request queue around the batched core: submit / cancel / results under `mutex` from any thread; the core
//! itself (decoder, runners) is touched only by the one thread holding `stepping`.
struct dfl2_batch
{
    struct Live
    {
        dfl2_done_fn onDone;
        void* user;
    };
    struct Ended
    {
        dflash2::Result result;
        dflash2::Stats stats;
        dfl2_code error;
        std::string message;
        std::vector<dfl2_logprob> logprobs;  //!< views of result.logprobs
    };

    dfl2_model* model{nullptr};
    int32_t maxBatch{0};
    std::unique_ptr<dflash2::BatchRunners> runners;
    std::unique_ptr<dflash2::SharedPrefixCache> prefix;  //!< the prefixes its slots share ("prefix_cache_bytes")
    std::unique_ptr<dflash2::BatchDecoder> decoder;
    std::mutex stepping;  //!< held by dfl2_batch_step / dfl2_batch_serve

    std::mutex mutex;     //!< guards everything below
    std::condition_variable wake;
    uint64_t nextId{1};
    std::vector<std::pair<uint64_t, dflash2::BatchRequest>> inbox;  //!< submitted, not yet in the core
    std::vector<uint64_t> cancels;
    std::map<uint64_t, Live> live;    //!< submitted, not ended
    std::map<uint64_t, Ended> ended;  //!< ended, not released
    dfl2_batch_info info{};
    bool stop{false};
};

struct dfl2_session
{
    dfl2_model* model{nullptr};
    std::unique_ptr<dflash2::Runners> runners;
    dflash2::GenerateConfig config;
    uint64_t seed{0};
    dfl2_uniform_fn uniformFn{nullptr};
    void* uniformUser{nullptr};
    dflash2::Result result;
    dflash2::Stats stats;
    std::vector<dfl2_logprob> logprobs;  //!< views of result.logprobs
    std::unique_ptr<dflash2::PrefixCache> prefix;  //!< what the runners keep of the last request ("prefix_cache_bytes")
};

namespace
{

using dflash2::Error;

// returned when even a status cannot be allocated; dfl2_status_free leaves it alone
dfl2_status gOutOfMemory{DFL2_ERR_OUT_OF_MEMORY, std::string()};

dfl2_status* makeStatus(dfl2_code code, std::string const& message) noexcept
{
    try
    {
        return new dfl2_status{code, message};
    }
    catch (...)
    {
        return &gOutOfMemory;
    }
}

template <typename F>
dfl2_status* guarded(F&& f) noexcept
{
    try
    {
        f();
        return nullptr;
    }
    catch (...)
    {
        auto const [code, message] = dflash2::errorOfCurrentException();
        return makeStatus(code, message);
    }
}

void need(void const* p, char const* what)
{
    if (p == nullptr)
    {
        throw Error(DFL2_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
    }
}

std::string keyOf(char const* key)
{
    need(key, "option key");
    return key;
}

class CallbackUniforms : public dflash2::UniformSource
{
public:
    CallbackUniforms(dfl2_uniform_fn fn, void* user)
        : mFn(fn)
        , mUser(user)
    {
    }
    void draw(dfl2_uniform_use use, double* out, size_t n) override
    {
        int32_t const rc = mFn(mUser, use, out, n);
        if (rc != 0)
        {
            throw Error(DFL2_ERR_CALLBACK, "uniform source returned " + std::to_string(rc));
        }
        for (size_t i = 0; i < n; ++i)
        {
            if (!(out[i] >= 0.0 && out[i] < 1.0))
            {
                throw Error(DFL2_ERR_CALLBACK, "uniform source gave a value outside [0, 1)");
            }
        }
    }

private:
    dfl2_uniform_fn mFn;
    void* mUser;
};

dflash2::Options const& optionsOrDefault(dfl2_options const* options)
{
    static dflash2::Options const kEmpty;
    return options != nullptr ? options->opts : kEmpty;
}

std::unique_ptr<dflash2::UniformSource> uniformSource(dfl2_uniform_fn fn, void* user, uint64_t seed)
{
    if (fn != nullptr)
    {
        return std::make_unique<CallbackUniforms>(fn, user);
    }
    return std::make_unique<dflash2::SplitMixUniforms>(seed);
}

dflash2::TokenSink tokenSink(dfl2_token_fn fn, void* user)
{
    if (fn == nullptr)
    {
        return {};
    }
    return [fn, user](int32_t const* t, size_t k) { return fn(user, t, k) == 0; };
}

void fillStats(dflash2::Result const& r, dflash2::Stats const& s, dfl2_stats* out)
{
    out->tau = s.tau;
    out->oracle_tau = s.oracleTau;
    out->cycles = s.cycles;
    out->n_tokens = static_cast<int32_t>(r.tokens.size());
    out->n_positions = static_cast<int32_t>(s.cumulative.size());
    out->finish_reason = r.finish;
    out->per_position_cumulative = s.cumulative.data();
    out->per_position_conditional = s.conditional.data();
    out->accepted = r.accepted.data();
    out->proposed = r.proposed.data();
    out->oracle_accepted = r.oracleAccepted.empty() ? nullptr : r.oracleAccepted.data();
    out->elapsed_s = r.elapsedS;
    out->cached_tokens = r.cachedTokens;
}

//! dfl2_logprob views of a result's logprobs (valid as long as the result is not changed)
std::vector<dfl2_logprob> logprobViews(dflash2::Result const& r)
{
    std::vector<dfl2_logprob> out;
    out.reserve(r.logprobs.size());
    for (dflash2::TokenLogprob const& t : r.logprobs)
    {
        out.push_back(dfl2_logprob{t.token, t.logprob, static_cast<int32_t>(t.topIds.size()),
            t.topIds.empty() ? nullptr : t.topIds.data(), t.topLogprobs.empty() ? nullptr : t.topLogprobs.data()});
    }
    return out;
}

std::unique_lock<std::mutex> modelLock(dfl2_model* model)
{
    std::mutex* lock = model->impl->generateLock();
    return lock != nullptr ? std::unique_lock<std::mutex>(*lock) : std::unique_lock<std::mutex>();
}

// One step of a batch (the caller holds batch->stepping): the inbox and cancels into the core, the core's step
// under the model's lock, the ended requests into `ended` and their on_done called without any lock.
void batchStep(dfl2_batch& b)
{
    std::vector<std::pair<uint64_t, dflash2::BatchRequest>> inbox;
    std::vector<uint64_t> cancels;
    {
        std::lock_guard<std::mutex> g(b.mutex);
        inbox.swap(b.inbox);
        cancels.swap(b.cancels);
    }
    dflash2::BatchDecoder& d = *b.decoder;
    std::vector<dflash2::BatchFinished> failed;
    {
        auto const lock = modelLock(b.model);
        for (auto& [id, req] : inbox)
        {
            try
            {
                d.submit(id, std::move(req));  // checked at dfl2_batch_submit already
            }
            catch (...)
            {
                auto [code, message] = dflash2::errorOfCurrentException();
                dflash2::BatchFinished f{id, {}, code, std::move(message)};
                f.result.finish = DFL2_FINISH_ERROR;
                failed.push_back(std::move(f));
            }
        }
        for (uint64_t id : cancels)
        {
            d.cancel(id);
        }
        d.step();
    }
    std::vector<dflash2::BatchFinished> done = d.takeFinished();
    for (dflash2::BatchFinished& f : failed)
    {
        done.push_back(std::move(f));
    }
    std::vector<std::pair<dfl2_batch::Live, dfl2_finish_reason>> notify;
    {
        std::lock_guard<std::mutex> g(b.mutex);
        for (dflash2::BatchFinished& f : done)
        {
            auto it = b.live.find(f.id);
            notify.emplace_back(it->second, f.result.finish);
            b.live.erase(it);
            dflash2::Stats st = dflash2::resultStats(f.result);
            dfl2_batch::Ended& e = b.ended[f.id] = dfl2_batch::Ended{std::move(f.result), std::move(st), f.error,
                f.message, {}};
            e.logprobs = logprobViews(e.result);
        }
        dflash2::BatchCounters const& c = d.counters();
        b.info.active = d.activeCount();
        b.info.queued = d.queuedCount();
        b.info.largest_step = c.largestForward;
        b.info.largest_plain = c.largestPlain;
        b.info.steps = c.steps;
        b.info.drafting_steps = c.draftingSteps;
        b.info.cycles = c.cycles;
        b.info.prefill_calls = c.prefillCalls;
        b.info.prefill_rows = c.prefillRows;
        dflash2::PrefixCacheStats const& p = b.prefix->stats();
        b.info.prefix_hits = p.hits;
        b.info.cached_tokens = p.hitTokens;
        b.info.prefix_cache_bytes = p.nbytes;
        b.info.prefix_entries = p.entries;
        b.info.prefix_evictions = p.evictions;
    }
    for (size_t i = 0; i < done.size(); ++i)
    {
        auto const& [live, reason] = notify[i];
        if (live.onDone != nullptr)
        {
            dfl2_status const error{done[i].error, done[i].message};
            live.onDone(live.user, done[i].id, reason, done[i].error != DFL2_OK ? &error : nullptr);
        }
    }
}

std::unique_lock<std::mutex> stepLock(dfl2_batch* batch)
{
    std::unique_lock<std::mutex> lock(batch->stepping, std::try_to_lock);
    if (!lock.owns_lock())
    {
        throw Error(DFL2_ERR_INVALID_ARGUMENT,
            "this batch is already being stepped (by dfl2_batch_step / dfl2_batch_serve on another thread, or a "
            "callback of this batch)");
    }
    return lock;
}

// ended or pending request -> its result, else a clear error
dfl2_batch::Ended& endedRequest(dfl2_batch& b, uint64_t id)
{
    auto it = b.ended.find(id);
    if (it != b.ended.end())
    {
        return it->second;
    }
    if (b.live.count(id) != 0)
    {
        throw Error(DFL2_ERR_INVALID_ARGUMENT, "request " + std::to_string(id) + " has not ended");
    }
    throw Error(DFL2_ERR_INVALID_ARGUMENT,
        "no result for request " + std::to_string(id) + " (never submitted to this batch, or released)");
}

} // namespace

extern "C" {

uint32_t dfl2_api_version(void)
{
    return DFL2_API_VERSION;
}

dfl2_code dfl2_status_code(dfl2_status const* status)
{
    return status == nullptr ? DFL2_OK : status->code;
}

char const* dfl2_status_message(dfl2_status const* status)
{
    if (status == &gOutOfMemory)
    {
        return "out of memory";
    }
    return status == nullptr ? "ok" : status->message.c_str();
}

void dfl2_status_free(dfl2_status* status)
{
    if (status != &gOutOfMemory)
    {
        delete status;
    }
}

dfl2_status* dfl2_options_create(dfl2_options** out)
{
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        *out = new dfl2_options();
    });
}

void dfl2_options_free(dfl2_options* options)
{
    delete options;
}

dfl2_status* dfl2_options_set_int(dfl2_options* options, char const* key, int64_t value)
{
    return guarded([&] {
        need(options, "options");
        options->opts.set(keyOf(key), value);
    });
}

dfl2_status* dfl2_options_set_double(dfl2_options* options, char const* key, double value)
{
    return guarded([&] {
        need(options, "options");
        options->opts.set(keyOf(key), value);
    });
}

dfl2_status* dfl2_options_set_bool(dfl2_options* options, char const* key, int value)
{
    return guarded([&] {
        need(options, "options");
        options->opts.set(keyOf(key), value != 0);
    });
}

dfl2_status* dfl2_options_set_string(dfl2_options* options, char const* key, char const* value)
{
    return guarded([&] {
        need(options, "options");
        need(value, "option value");
        options->opts.set(keyOf(key), std::string(value));
    });
}

dfl2_status* dfl2_options_set_int_array(dfl2_options* options, char const* key, int32_t const* values, size_t n)
{
    return guarded([&] {
        need(options, "options");
        if (n > 0)
        {
            need(values, "option values");
        }
        options->opts.set(keyOf(key), n > 0 ? std::vector<int32_t>(values, values + n) : std::vector<int32_t>{});
    });
}

dfl2_status* dfl2_options_parse(dfl2_options* options, char const* key_equals_value)
{
    return guarded([&] {
        need(options, "options");
        need(key_equals_value, "option text");
        options->opts.parse(key_equals_value);
    });
}

dfl2_status* dfl2_manifest_check(char const* export_dir, dfl2_options const* options)
{
    return guarded([&] {
        need(export_dir, "export_dir");
        dflash2::loadManifest(export_dir, optionsOrDefault(options).getBool("verify_checksums", true));
    });
}

dfl2_status* dfl2_model_load(char const* export_dir, dfl2_options const* options, dfl2_model** out)
{
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        need(export_dir, "export_dir");
        dflash2::Options const& o = optionsOrDefault(options);
        dflash2::Manifest const m = dflash2::loadManifest(export_dir, o.getBool("verify_checksums", true));
        // "auto": TensorRT where it loads, else ONNX Runtime (the note says why); "tensorrt" / "trt", "ort": that one
        std::string const backend = o.getString("backend", "auto");
        auto model = std::make_unique<dfl2_model>();
        if (backend == "ort")
        {
            model->impl = dflash2::loadOrtModel(m, export_dir, o);
            model->impl->note = "using " + model->impl->note;
        }
        else if (backend != "auto")
        {
            model->impl = dflash2::loadTensorRTModel(m, export_dir, o);
            model->impl->note = "using TensorRT";
        }
        else
        {
            try
            {
                model->impl = dflash2::loadTensorRTModel(m, export_dir, o);
                model->impl->note = "using TensorRT";
            }
            catch (dflash2::Error const& e)
            {
                if (e.code() != DFL2_ERR_UNAVAILABLE)
                {
                    throw;
                }
                std::string const why = e.what();
                model->impl = dflash2::loadOrtModel(m, export_dir, o);
                model->impl->note = "TensorRT not available (" + why + "), using " + model->impl->note;
            }
        }
        *out = model.release();
    });
}

dfl2_status* dfl2_model_create_callbacks(dfl2_callbacks const* callbacks, dfl2_options const* options, dfl2_model** out)
{
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        need(callbacks, "callbacks");
        (void) options;  // no model option applies to caller-run engines
        auto model = std::make_unique<dfl2_model>();
        model->impl = dflash2::createCallbackModel(callbacks);
        model->impl->note = "callbacks: the caller runs every model";
        *out = model.release();
    });
}

dfl2_status* dfl2_model_get_note(dfl2_model const* model, char const** note)
{
    return guarded([&] {
        need(model, "model");
        need(note, "note");
        *note = model->impl->note.c_str();
    });
}

void dfl2_model_free(dfl2_model* model)
{
    delete model;
}

dfl2_status* dfl2_model_get_info(dfl2_model const* model, dfl2_model_info* out)
{
    return guarded([&] {
        need(model, "model");
        need(out, "out");
        dflash2::Model const& m = *model->impl;
        out->vocab_size = m.vocabSize;
        out->block_size = m.blockSize;
        out->top_k = m.topK;
        out->max_positions = m.maxPositions;
        out->backend = m.backend.c_str();
    });
}

dfl2_status* dfl2_session_create(dfl2_model* model, dfl2_options const* options, dfl2_session** out)
{
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        need(model, "model");
        dflash2::Options const& o = optionsOrDefault(options);
        auto s = std::make_unique<dfl2_session>();
        s->model = model;
        s->config = dflash2::generateConfig(o, model->impl->eosIds);
        for (auto const& [t, b] : s->config.sampling.logitBias)
        {
            if (t >= model->impl->vocabSize)
            {
                throw Error(DFL2_ERR_OPTION_VALUE, "option 'logit_bias': token id " + std::to_string(t)
                    + " out of range [0, " + std::to_string(model->impl->vocabSize) + ")");
            }
        }
        s->seed = static_cast<uint64_t>(o.getInt("seed", 0));
        s->runners = model->impl->newRunners();
        s->prefix = std::make_unique<dflash2::PrefixCache>(o.getInt("prefix_cache_bytes", dflash2::kPREFIX_BUDGET_BYTES));
        *out = s.release();
    });
}

void dfl2_session_free(dfl2_session* session)
{
    delete session;
}

dfl2_status* dfl2_session_set_uniform_source(dfl2_session* session, dfl2_uniform_fn fn, void* user_data)
{
    return guarded([&] {
        need(session, "session");
        session->uniformFn = fn;
        session->uniformUser = user_data;
    });
}

dfl2_status* dfl2_session_generate(
    dfl2_session* session, int32_t const* prompt, size_t n, dfl2_token_fn on_tokens, void* user_data)
{
    return guarded([&] {
        need(session, "session");
        if (n > 0)
        {
            need(prompt, "prompt");
        }
        session->result = dflash2::Result{};
        session->stats = dflash2::Stats{};
        session->logprobs.clear();
        std::vector<int32_t> const ids(prompt, prompt + n);
        auto const uniforms = uniformSource(session->uniformFn, session->uniformUser, session->seed);
        dflash2::TokenSink const sink = tokenSink(on_tokens, user_data);
        auto const guard = modelLock(session->model);
        dflash2::Runners& r = *session->runners;
        try
        {
            session->result = session->config.speculative
                ? dflash2::speculativeGenerate(r, ids, session->config, *uniforms, sink, session->prefix.get())
                : dflash2::targetGenerate(r, ids, session->config, *uniforms, sink, session->prefix.get());
        }
        catch (...)
        {
            session->prefix->clear();  // the caches' content is unknown: the next request starts empty
            throw;
        }
        session->stats = dflash2::resultStats(session->result);
        session->logprobs = logprobViews(session->result);
    });
}

dfl2_status* dfl2_session_get_logprobs(dfl2_session const* session, dfl2_logprob const** logprobs, size_t* n)
{
    return guarded([&] {
        need(session, "session");
        need(logprobs, "logprobs");
        need(n, "n");
        *logprobs = session->logprobs.empty() ? nullptr : session->logprobs.data();
        *n = session->logprobs.size();
    });
}

dfl2_status* dfl2_session_get_tokens(dfl2_session const* session, int32_t const** tokens, size_t* n)
{
    return guarded([&] {
        need(session, "session");
        need(tokens, "tokens");
        need(n, "n");
        *tokens = session->result.tokens.data();
        *n = session->result.tokens.size();
    });
}

dfl2_status* dfl2_session_get_stats(dfl2_session const* session, dfl2_stats* out)
{
    return guarded([&] {
        need(session, "session");
        need(out, "out");
        fillStats(session->result, session->stats, out);
    });
}

dfl2_status* dfl2_session_get_proposers(dfl2_session const* session, int32_t const** proposers, size_t* n)
{
    return guarded([&] {
        need(session, "session");
        need(proposers, "proposers");
        need(n, "n");
        *proposers = session->result.proposers.data();
        *n = session->result.proposers.size();
    });
}

dfl2_status* dfl2_batch_create(dfl2_model* model, dfl2_options const* options, dfl2_batch** out)
{
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        need(model, "model");
        dflash2::Options const& o = optionsOrDefault(options);
        dflash2::Model& m = *model->impl;
        int64_t const want = o.getInt("max_batch", 0);
        if (want > m.maxBatch && m.maxBatch > 0)
        {
            throw Error(DFL2_ERR_OPTION_VALUE,
                "option 'max_batch' " + std::to_string(want) + " exceeds the model's " + std::to_string(m.maxBatch));
        }
        int32_t const slots = want > 0 ? static_cast<int32_t>(want) : m.maxBatch;
        auto b = std::make_unique<dfl2_batch>();
        b->model = model;
        b->runners = m.newBatchRunners(slots);
        dflash2::SpeculationRule rule;
        rule.adaptive = o.getBool("adaptive", true);
        rule.priorTau = o.getDouble("prior_tau", 1.5);
        rule.priorWeight = o.getDouble("prior_weight", 2.0);
        rule.window = static_cast<int32_t>(std::min<int64_t>(o.getInt("tau_window", 32), INT32_MAX));
        rule.probeAfter = static_cast<int32_t>(std::min<int64_t>(o.getInt("probe_after", 64), INT32_MAX));
        std::vector<double> const fixed = dflash2::parseFixedCosts(o.getString("fixed_costs", ""));
        if (!fixed.empty())
        {
            rule.costs = fixed.size() == 6
                ? std::make_unique<dflash2::FixedCosts>(fixed[0], fixed[1], fixed[2], fixed[3], fixed[4], fixed[5])
                : std::make_unique<dflash2::FixedCosts>(fixed[0], fixed[1], fixed[2], fixed[3]);
        }
        b->maxBatch = slots;
        b->info.max_batch = slots;
        auto const chunk = static_cast<int32_t>(o.getInt("prefill_chunk", dflash2::kPREFILL_CHUNK));
        b->prefix = std::make_unique<dflash2::SharedPrefixCache>(
            o.getInt("prefix_cache_bytes", dflash2::kPREFIX_BUDGET_BYTES));
        double const share = o.getDouble("prefill_share", dflash2::kPREFILL_SHARE);
        b->decoder = std::make_unique<dflash2::BatchDecoder>(
            *b->runners, std::move(rule), chunk, share, b->prefix.get());
        *out = b.release();
    });
}

void dfl2_batch_free(dfl2_batch* batch)
{
    delete batch;
}

dfl2_status* dfl2_batch_submit(dfl2_batch* batch, dfl2_request const* request, uint64_t* request_id)
{
    return guarded([&] {
        need(request_id, "request_id");
        *request_id = 0;
        need(batch, "batch");
        need(request, "request");
        dfl2_request r{};
        uint32_t size = 0;
        std::memcpy(&size, request, sizeof(size));
        if (size < sizeof(dfl2_request))
        {
            throw Error(DFL2_ERR_INVALID_ARGUMENT,
                "dfl2_request: struct_size " + std::to_string(size) + " < " + std::to_string(sizeof(dfl2_request))
                    + " (set it to sizeof(dfl2_request))");
        }
        std::memcpy(&r, request, sizeof(r));
        if (r.n_prompt > 0)
        {
            need(r.prompt, "request prompt");
        }
        dflash2::Options const& o = optionsOrDefault(r.options);
        dflash2::Model const& m = *batch->model->impl;
        dflash2::BatchRequest req;
        req.prompt.assign(r.prompt, r.prompt + r.n_prompt);
        req.config = dflash2::generateConfig(o, m.eosIds);
        req.uniforms = uniformSource(r.uniforms, r.uniforms_user_data, static_cast<uint64_t>(o.getInt("seed", 0)));
        req.sink = tokenSink(r.on_tokens, r.user_data);
        dflash2::checkBatchRequest(req, m.vocabSize, m.maxPositions);
        std::lock_guard<std::mutex> g(batch->mutex);
        uint64_t const id = batch->nextId++;
        batch->live[id] = dfl2_batch::Live{r.on_done, r.user_data};
        batch->inbox.emplace_back(id, std::move(req));
        batch->wake.notify_all();
        *request_id = id;
    });
}

dfl2_status* dfl2_batch_cancel(dfl2_batch* batch, uint64_t request_id)
{
    return guarded([&] {
        need(batch, "batch");
        std::lock_guard<std::mutex> g(batch->mutex);
        if (request_id == 0 || request_id >= batch->nextId)
        {
            throw Error(DFL2_ERR_INVALID_ARGUMENT, "no request " + std::to_string(request_id) + " in this batch");
        }
        if (batch->live.count(request_id) != 0)
        {
            batch->cancels.push_back(request_id);
            batch->wake.notify_all();
        }
    });
}

dfl2_status* dfl2_batch_step(dfl2_batch* batch, size_t* pending)
{
    return guarded([&] {
        need(batch, "batch");
        auto const lock = stepLock(batch);
        batchStep(*batch);
        if (pending != nullptr)
        {
            std::lock_guard<std::mutex> g(batch->mutex);
            *pending = batch->live.size();
        }
    });
}

dfl2_status* dfl2_batch_serve(dfl2_batch* batch)
{
    return guarded([&] {
        need(batch, "batch");
        auto const lock = stepLock(batch);
        for (;;)
        {
            {
                std::unique_lock<std::mutex> g(batch->mutex);
                batch->wake.wait(g, [&] { return batch->stop || !batch->live.empty(); });
                if (batch->stop)
                {
                    batch->stop = false;
                    return;
                }
            }
            batchStep(*batch);
        }
    });
}

dfl2_status* dfl2_batch_stop(dfl2_batch* batch)
{
    return guarded([&] {
        need(batch, "batch");
        std::lock_guard<std::mutex> g(batch->mutex);
        batch->stop = true;
        batch->wake.notify_all();
    });
}

dfl2_status* dfl2_batch_get_result(dfl2_batch* batch, uint64_t request_id, int32_t const** tokens, size_t* n,
    dfl2_stats* stats, int32_t* plain_steps)
{
    return guarded([&] {
        need(batch, "batch");
        need(tokens, "tokens");
        need(n, "n");
        std::lock_guard<std::mutex> g(batch->mutex);
        dfl2_batch::Ended const& e = endedRequest(*batch, request_id);
        *tokens = e.result.tokens.data();
        *n = e.result.tokens.size();
        if (stats != nullptr)
        {
            fillStats(e.result, e.stats, stats);
        }
        if (plain_steps != nullptr)
        {
            *plain_steps = e.result.plainSteps;
        }
        if (e.error != DFL2_OK)
        {
            throw Error(e.error, e.message);
        }
    });
}

dfl2_status* dfl2_batch_get_proposers(dfl2_batch* batch, uint64_t request_id, int32_t const** proposers, size_t* n)
{
    return guarded([&] {
        need(batch, "batch");
        need(proposers, "proposers");
        need(n, "n");
        std::lock_guard<std::mutex> g(batch->mutex);
        dfl2_batch::Ended const& e = endedRequest(*batch, request_id);
        *proposers = e.result.proposers.data();
        *n = e.result.proposers.size();
        if (e.error != DFL2_OK)
        {
            throw Error(e.error, e.message);
        }
    });
}

dfl2_status* dfl2_batch_get_logprobs(dfl2_batch* batch, uint64_t request_id, dfl2_logprob const** logprobs, size_t* n)
{
    return guarded([&] {
        need(batch, "batch");
        need(logprobs, "logprobs");
        need(n, "n");
        std::lock_guard<std::mutex> g(batch->mutex);
        dfl2_batch::Ended const& e = endedRequest(*batch, request_id);
        *logprobs = e.logprobs.empty() ? nullptr : e.logprobs.data();
        *n = e.logprobs.size();
        if (e.error != DFL2_OK)
        {
            throw Error(e.error, e.message);
        }
    });
}

dfl2_status* dfl2_batch_release(dfl2_batch* batch, uint64_t request_id)
{
    return guarded([&] {
        need(batch, "batch");
        std::lock_guard<std::mutex> g(batch->mutex);
        endedRequest(*batch, request_id);
        batch->ended.erase(request_id);
    });
}

dfl2_status* dfl2_batch_get_info(dfl2_batch* batch, dfl2_batch_info* out)
{
    return guarded([&] {
        need(batch, "batch");
        need(out, "out");
        std::lock_guard<std::mutex> g(batch->mutex);
        *out = batch->info;
        out->queued += static_cast<int32_t>(batch->inbox.size());
    });
}

} // extern "C"
