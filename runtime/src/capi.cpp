//! \file capi.cpp
//! The C boundary: every exported function is noexcept, catches everything and returns a dfl2_status
//! (STYLE rule 11). Handles are thin structs around the C++ objects.
#include "dflash2/dflash2.h"

#include "core/decoder.h"
#include "manifest.h"
#include "model.h"
#include "options.h"

#include <cstring>
#include <memory>
#include <new>
#include <string>

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
    catch (Error const& e)
    {
        return makeStatus(e.code(), e.what());
    }
    catch (std::bad_alloc const&)
    {
        return makeStatus(DFL2_ERR_OUT_OF_MEMORY, "out of memory");
    }
    catch (std::exception const& e)
    {
        return makeStatus(DFL2_ERR_INTERNAL, std::string("internal error: ") + e.what());
    }
    catch (...)
    {
        return makeStatus(DFL2_ERR_INTERNAL, "internal error");
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
        // "auto" and "tensorrt" both mean TensorRT today: it is the one file-loading backend compiled in
        // (ONNX Runtime runs behind the callbacks; see NOTES in runtime/README.md)
        auto model = std::make_unique<dfl2_model>();
        model->impl = dflash2::loadTensorRTModel(m, export_dir, o);
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
        *out = model.release();
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
        s->seed = static_cast<uint64_t>(o.getInt("seed", 0));
        s->runners = model->impl->newRunners();
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
        std::vector<int32_t> const ids(prompt, prompt + n);
        dflash2::SplitMixUniforms builtin(session->seed);
        CallbackUniforms fromCaller(session->uniformFn, session->uniformUser);
        dflash2::UniformSource& uniforms = session->uniformFn != nullptr
            ? static_cast<dflash2::UniformSource&>(fromCaller)
            : static_cast<dflash2::UniformSource&>(builtin);
        dflash2::TokenSink sink;
        if (on_tokens != nullptr)
        {
            sink = [&](int32_t const* t, size_t k) { return on_tokens(user_data, t, k) == 0; };
        }
        std::mutex* lock = session->model->impl->generateLock();
        std::unique_lock<std::mutex> guard;
        if (lock != nullptr)
        {
            guard = std::unique_lock<std::mutex>(*lock);
        }
        dflash2::Runners& r = *session->runners;
        session->result = session->config.speculative
            ? dflash2::speculativeGenerate(r, ids, session->config, uniforms, sink)
            : dflash2::targetGenerate(r, ids, session->config, uniforms, sink);
        session->stats = dflash2::resultStats(session->result);
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
        dflash2::Result const& r = session->result;
        dflash2::Stats const& s = session->stats;
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
    });
}

} // extern "C"
