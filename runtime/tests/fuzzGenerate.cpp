// libFuzzer target over the C API's generation entry points with caller-chosen inputs: a callbacks model whose
// sizes come from the input (vocabulary, block size, top-K, positions, feature width, default stop tokens, slots),
// then dfl2_session_generate and dfl2_batch_submit / step / cancel / get_result / release with fuzzed prompt ids
// (out of range, negative, too long, none), lengths and generation options (every key, any value: the typed
// setters and "key=value" text), the token callback cancelling at a fuzzed chunk and a target call failing at a
// fuzzed call. Any input must end in statuses: a crash, leak, overflow, undefined behaviour (ASan/UBSan), a
// token outside the vocabulary, more tokens than asked, or a batch that never drains fails the run.
#include "dflash2/dflash2.h"

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace
{

constexpr int32_t kMAX_SLOTS = 4;

//! The toy model: logits a hash of (token, position, id); features (token, position); a drafter proposing the
//! target's own argmax at some rows and another candidate at the others. Every callback checks what it is
//! handed against the library's contract, and can be told to fail at its Nth target call.
struct Toy
{
    int32_t vocab{2};
    int32_t features{0};
    int32_t topK{1};
    int32_t length[kMAX_SLOTS + 1]{};  //!< cached positions per slot (the last: the session's)
    int32_t failAt{0};                 //!< fail the Nth target call (0: never)
    int32_t calls{0};
};

float logit(int32_t tok, int32_t pos, int32_t v)
{
    uint32_t h = static_cast<uint32_t>(tok) * 2654435761u ^ static_cast<uint32_t>(pos % 5) * 40503u
        ^ static_cast<uint32_t>(v) * 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    return static_cast<float>(h % 8000u) / 1000.0f - 4.0f;
}

void check(bool ok, char const* what)
{
    if (!ok)
    {
        std::fprintf(stderr, "fuzzGenerate: %s\n", what);
        std::abort();
    }
}

int32_t forwardRows(Toy& t, int32_t slot, int32_t const* ids, int32_t n, float* logits, float* feats, bool lastOnly)
{
    if (t.failAt != 0 && ++t.calls == t.failAt)
    {
        return 7;
    }
    check(n >= 1, "a target call of no rows");
    for (int32_t i = 0; i < n; ++i)
    {
        check(ids[i] >= 0 && ids[i] < t.vocab, "a target call with an id outside the vocabulary");
        int32_t const pos = t.length[slot] + i;
        if (!lastOnly || i == n - 1)
        {
            float* row = lastOnly ? logits : logits + static_cast<size_t>(i) * t.vocab;
            for (int32_t v = 0; v < t.vocab; ++v)
            {
                row[v] = logit(ids[i], pos, v);
            }
        }
        for (int32_t f = 0; f < t.features; ++f)
        {
            feats[static_cast<size_t>(i) * t.features + f] = static_cast<float>(f == 0 ? ids[i] : pos);
        }
    }
    t.length[slot] += n;
    return 0;
}

int32_t propose(Toy& t, int32_t anchor, int32_t pos, int32_t rows, int32_t L, float temperature,
                float const* uniforms, int32_t* tokens, float* proposal, int32_t* cand)
{
    check(anchor >= 0 && anchor < t.vocab, "a draft anchor outside the vocabulary");
    check(rows >= 0 && rows <= L, "draft rows outside [0, L]");
    check(temperature <= 0.0f || uniforms != nullptr, "a sampling draft without uniforms");
    int32_t prev = anchor;
    for (int32_t r = 0; r < L; ++r)
    {
        for (int32_t k = 0; k < t.topK; ++k)
        {
            cand[r * t.topK + k] = (prev + 1 + k * 7 + pos + r) % t.vocab;  // distinct while K <= vocab / 7 ...
        }
        for (int32_t k = 1; k < t.topK; ++k)  // ... and made distinct where not: the first free id
        {
            for (int32_t j = 0; j < k; ++j)
            {
                if (cand[r * t.topK + j] == cand[r * t.topK + k])
                {
                    cand[r * t.topK + k] = (cand[r * t.topK + k] + 1) % t.vocab;
                    j = -1;
                }
            }
        }
        int32_t j = 0;
        if (temperature > 0.0f)
        {
            check(uniforms[r] >= 0.0f && uniforms[r] < 1.0f, "a draft uniform outside [0, 1)");
            j = static_cast<int32_t>(uniforms[r] * static_cast<float>(t.topK)) % t.topK;
        }
        for (int32_t k = 0; k < t.topK; ++k)
        {
            proposal[r * t.topK + k] = temperature > 0.0f ? 1.0f / static_cast<float>(t.topK) : (k == j ? 1.0f : 0.0f);
        }
        tokens[r] = cand[r * t.topK + j];
        prev = tokens[r];
    }
    return 0;
}

// -- the B = 1 callbacks (slot kMAX_SLOTS) ----------------------------------------------------------------
struct Model
{
    Toy toy;
    int32_t L{1};
};

int32_t targetReset(void* u)
{
    static_cast<Model*>(u)->toy.length[kMAX_SLOTS] = 0;
    return 0;
}

int32_t targetForward(void* u, int32_t const* ids, int32_t n, float* logits, float* feats)
{
    return forwardRows(static_cast<Model*>(u)->toy, kMAX_SLOTS, ids, n, logits, feats, false);
}

int32_t targetCrop(void* u, int32_t length)
{
    Toy& t = static_cast<Model*>(u)->toy;
    check(length >= 0 && length <= t.length[kMAX_SLOTS], "a crop past the cache");
    t.length[kMAX_SLOTS] = length;
    return 0;
}

int32_t drafterReset(void*)
{
    return 0;
}

int32_t addContext(void* u, float const* feats, int32_t m, int32_t start)
{
    (void) u;
    check(m >= 0 && start >= 0 && (m == 0 || feats != nullptr || static_cast<Model*>(u)->toy.features == 0),
          "a drafter context of negative size");
    return 0;
}

int32_t draft(void* u, int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms,
              int32_t* tokens, float* proposal, int32_t* cand, float*, int32_t*)
{
    Model* m = static_cast<Model*>(u);
    return propose(m->toy, anchor, pos, rows, m->L, temperature, uniforms, tokens, proposal, cand);
}

// -- the batched callbacks -----------------------------------------------------------------------------------
int32_t batchReset(void* u, int32_t slot)
{
    check(slot >= 0 && slot < kMAX_SLOTS, "a slot outside the batch");
    static_cast<Model*>(u)->toy.length[slot] = 0;
    return 0;
}

int32_t batchForward(void* u, int32_t nSeqs, int32_t const* slots, int32_t const* lengths, int32_t const* rows,
                     int32_t const* ids, int32_t lastLogits, float* logits, float* feats)
{
    Toy& t = static_cast<Model*>(u)->toy;
    check(nSeqs >= 1 && nSeqs <= kMAX_SLOTS, "a batch call of no or too many requests");
    size_t off = 0;
    for (int32_t i = 0; i < nSeqs; ++i)
    {
        check(slots[i] >= 0 && slots[i] < kMAX_SLOTS, "a slot outside the batch");
        check(lengths[i] == t.length[slots[i]], "a cache length that is not the slot's");
        float* out = lastLogits ? logits + static_cast<size_t>(i) * t.vocab : logits + off * t.vocab;
        int32_t const rc = forwardRows(t, slots[i], ids + off, rows[i], out, feats + off * t.features, lastLogits);
        if (rc != 0)
        {
            return rc;
        }
        off += static_cast<size_t>(rows[i]);
    }
    return 0;
}

int32_t batchCrop(void* u, int32_t slot, int32_t length)
{
    Toy& t = static_cast<Model*>(u)->toy;
    check(slot >= 0 && slot < kMAX_SLOTS && length >= 0 && length <= t.length[slot], "a crop past the slot's cache");
    t.length[slot] = length;
    return 0;
}

int32_t batchDrafterReset(void*, int32_t slot)
{
    check(slot >= 0 && slot < kMAX_SLOTS, "a slot outside the batch");
    return 0;
}

int32_t batchAddContext(void* u, int32_t slot, float const* feats, int32_t m, int32_t start)
{
    check(slot >= 0 && slot < kMAX_SLOTS, "a slot outside the batch");
    return addContext(u, feats, m, start);
}

int32_t batchDraft(void* u, int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
                   float const* uniforms, int32_t* tokens, float* proposal, int32_t* cand, float* vp, int32_t* used)
{
    check(slot >= 0 && slot < kMAX_SLOTS, "a slot outside the batch");
    return draft(u, anchor, pos, rows, temperature, uniforms, tokens, proposal, cand, vp, used);
}

// -- fuzzed inputs -------------------------------------------------------------------------------------------
void drop(dfl2_status* st)
{
    dfl2_status_free(st);
}

char const* const kKEYS[] = {"max_new_tokens", "temperature", "seed", "speculative", "measure_oracle", "eos_ids",
    "proposer", "ngram_rows", "guard", "max_batch", "adaptive", "prior_tau", "prior_weight", "tau_window",
    "probe_after", "fixed_costs", "draft_mode", "backend", "no_such_key"};

double fuzzDouble(FuzzedDataProvider& in)
{
    switch (in.ConsumeIntegralInRange<int>(0, 5))
    {
    case 0: return NAN;
    case 1: return in.ConsumeBool() ? INFINITY : -INFINITY;
    case 2: return in.ConsumeFloatingPoint<double>();
    default: return in.ConsumeFloatingPointInRange<double>(-1.0, 3.0);
    }
}

//! Options with fuzzed keys and values through every setter; the statuses are the library's to give.
dfl2_options* fuzzOptions(FuzzedDataProvider& in)
{
    dfl2_options* o = nullptr;
    drop(dfl2_options_create(&o));
    int const n = in.ConsumeIntegralInRange<int>(0, 6);
    for (int i = 0; i < n; ++i)
    {
        char const* key = kKEYS[in.ConsumeIntegralInRange<size_t>(0, sizeof(kKEYS) / sizeof(kKEYS[0]) - 1)];
        switch (in.ConsumeIntegralInRange<int>(0, 5))
        {
        case 0: drop(dfl2_options_set_int(o, key, in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-3, 300)
                                                                    : in.ConsumeIntegral<int64_t>())); break;
        case 1: drop(dfl2_options_set_double(o, key, fuzzDouble(in))); break;
        case 2: drop(dfl2_options_set_bool(o, key, in.ConsumeIntegral<int>())); break;
        case 3: drop(dfl2_options_set_string(o, key, in.ConsumeRandomLengthString(16).c_str())); break;
        case 4:
        {
            std::vector<int32_t> ids(in.ConsumeIntegralInRange<size_t>(0, 4));
            for (int32_t& v : ids)
            {
                v = in.ConsumeIntegralInRange<int32_t>(-2, 70);
            }
            drop(dfl2_options_set_int_array(o, key, ids.empty() ? nullptr : ids.data(), ids.size()));
            break;
        }
        default: drop(dfl2_options_parse(o, (std::string(key) + "=" + in.ConsumeRandomLengthString(12)).c_str()));
        }
    }
    return o;
}

std::vector<int32_t> fuzzPrompt(FuzzedDataProvider& in, int32_t vocab, int32_t positions)
{
    size_t const n = in.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(positions) + 2);
    std::vector<int32_t> ids(n);
    int const kind = in.ConsumeIntegralInRange<int>(0, 7);  // mostly valid ids, so generation runs
    for (int32_t& v : ids)
    {
        v = kind == 0 ? in.ConsumeIntegral<int32_t>() : in.ConsumeIntegralInRange<int32_t>(0, vocab - 1);
    }
    if (kind == 1 && n > 0)  // one id just outside the vocabulary, at either end
    {
        ids[in.ConsumeIntegralInRange<size_t>(0, n - 1)] = in.ConsumeBool() ? vocab : -1;
    }
    return ids;
}

struct Sink
{
    int32_t vocab;
    size_t n{0};
    int chunks{0};
    int cancelAt{0};  //!< cancel after this many chunks (0: never)
};

int32_t onTokens(void* u, int32_t const* tokens, size_t n)
{
    Sink* s = static_cast<Sink*>(u);
    check(n >= 1, "an empty chunk");
    for (size_t i = 0; i < n; ++i)
    {
        check(tokens[i] >= 0 && tokens[i] < s->vocab, "a generated token outside the vocabulary");
    }
    s->n += n;
    return ++s->chunks == s->cancelAt ? 1 : 0;
}

void checkTokens(int32_t const* tokens, size_t n, int32_t vocab)
{
    for (size_t i = 0; i < n; ++i)
    {
        check(tokens[i] >= 0 && tokens[i] < vocab, "a result token outside the vocabulary");
    }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size)
{
    FuzzedDataProvider in(data, size);
    Model model;
    model.toy.vocab = in.ConsumeIntegralInRange<int32_t>(1, 40);
    model.toy.features = in.ConsumeIntegralInRange<int32_t>(0, 3);
    int32_t const blockSize = in.ConsumeIntegralInRange<int32_t>(1, 8);
    model.L = blockSize > 1 ? blockSize - 1 : 1;
    model.toy.topK = in.ConsumeIntegralInRange<int32_t>(0, 6);
    int32_t const positions = in.ConsumeIntegralInRange<int32_t>(0, 48);
    std::vector<int32_t> eos(in.ConsumeIntegralInRange<size_t>(0, 3));
    for (int32_t& v : eos)
    {
        v = in.ConsumeIntegralInRange<int32_t>(-1, model.toy.vocab);
    }
    model.toy.failAt = in.ConsumeIntegralInRange<int>(0, 3) == 0 ? in.ConsumeIntegralInRange<int32_t>(1, 12) : 0;

    dfl2_callbacks cb{};
    cb.struct_size = sizeof cb;
    cb.user_data = &model;
    cb.vocab_size = model.toy.vocab;
    cb.feature_dim = model.toy.features;
    cb.block_size = blockSize;
    cb.top_k = model.toy.topK;
    cb.max_positions = positions;
    cb.eos_ids = eos.empty() ? nullptr : eos.data();
    cb.n_eos_ids = eos.size();
    cb.target_reset = targetReset;
    cb.target_forward = targetForward;
    cb.target_crop = targetCrop;
    cb.drafter_reset = drafterReset;
    cb.drafter_add_context = addContext;
    cb.drafter_propose = draft;
    cb.max_batch = in.ConsumeIntegralInRange<int32_t>(0, kMAX_SLOTS);
    cb.batch_target_reset = batchReset;
    cb.batch_target_forward = batchForward;
    cb.batch_target_crop = batchCrop;
    cb.batch_drafter_reset = batchDrafterReset;
    cb.batch_drafter_add_context = batchAddContext;
    cb.batch_drafter_propose = batchDraft;

    dfl2_model* m = nullptr;
    dfl2_status* st = dfl2_model_create_callbacks(&cb, nullptr, &m);
    if (st != nullptr)
    {
        check(m == nullptr, "a failed create left a model");
        drop(st);
        return 0;
    }
    dfl2_model_info info{};
    drop(dfl2_model_get_info(m, &info));

    if (in.ConsumeBool())  // one session, a few prompts
    {
        dfl2_options* o = fuzzOptions(in);
        dfl2_session* s = nullptr;
        st = dfl2_session_create(m, o, &s);
        dfl2_options_free(o);
        if (st == nullptr)
        {
            for (int r = in.ConsumeIntegralInRange<int>(1, 3); r > 0 && in.remaining_bytes() > 0; --r)
            {
                std::vector<int32_t> const prompt = fuzzPrompt(in, info.vocab_size, info.max_positions);
                Sink sink{info.vocab_size};
                sink.cancelAt = in.ConsumeIntegralInRange<int>(0, 3);
                model.toy.calls = 0;
                drop(dfl2_session_generate(s, prompt.empty() && in.ConsumeBool() ? nullptr : prompt.data(),
                                           prompt.size(), in.ConsumeBool() ? onTokens : nullptr, &sink));
                int32_t const* tokens = nullptr;
                size_t n = 0;
                if (dfl2_status* t = dfl2_session_get_tokens(s, &tokens, &n); t == nullptr)
                {
                    checkTokens(tokens, n, info.vocab_size);
                }
                else
                {
                    drop(t);
                }
                dfl2_stats stats{};
                drop(dfl2_session_get_stats(s, &stats));
            }
            dfl2_session_free(s);
        }
        else
        {
            check(s == nullptr, "a failed create left a session");
            drop(st);
        }
    }
    else  // a batch: requests submitted, stepped, cancelled, read, released
    {
        dfl2_options* o = fuzzOptions(in);
        dfl2_batch* b = nullptr;
        st = dfl2_batch_create(m, o, &b);
        dfl2_options_free(o);
        if (st == nullptr)
        {
            std::vector<uint64_t> ids;
            std::vector<Sink> sinks(6, Sink{info.vocab_size});
            std::vector<std::vector<int32_t>> prompts(6);
            for (size_t r = 0; r < sinks.size() && in.remaining_bytes() > 0; ++r)
            {
                prompts[r] = fuzzPrompt(in, info.vocab_size, info.max_positions);
                sinks[r].cancelAt = in.ConsumeIntegralInRange<int>(0, 3);
                dfl2_options* ro = fuzzOptions(in);
                dfl2_request q{};
                q.struct_size = sizeof q;
                q.prompt = prompts[r].empty() && in.ConsumeBool() ? nullptr : prompts[r].data();
                q.n_prompt = prompts[r].size();
                q.options = in.ConsumeBool() ? ro : nullptr;
                q.on_tokens = in.ConsumeBool() ? onTokens : nullptr;
                q.user_data = &sinks[r];
                uint64_t id = 0;
                if (dfl2_status* t = dfl2_batch_submit(b, &q, &id); t == nullptr)
                {
                    check(id >= 1, "a request id of 0");
                    ids.push_back(id);
                }
                else
                {
                    drop(t);
                }
                dfl2_options_free(ro);
            }
            size_t pending = 1;
            for (int step = 0; pending > 0; ++step)
            {
                check(step < 4000, "a batch that does not drain");
                if (!ids.empty() && in.ConsumeIntegralInRange<int>(0, 15) == 0)
                {
                    drop(dfl2_batch_cancel(b, ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)]));
                }
                if (dfl2_status* t = dfl2_batch_step(b, &pending); t != nullptr)
                {
                    drop(t);
                    break;
                }
            }
            drop(dfl2_batch_cancel(b, in.ConsumeIntegral<uint64_t>()));  // ids it never gave
            for (uint64_t id : ids)
            {
                int32_t const* tokens = nullptr;
                size_t n = 0;
                dfl2_stats stats{};
                int32_t plain = 0;
                if (dfl2_status* t = dfl2_batch_get_result(b, id, &tokens, &n, &stats, &plain); t == nullptr)
                {
                    checkTokens(tokens, n, info.vocab_size);
                }
                else
                {
                    drop(t);
                }
                drop(dfl2_batch_release(b, id));
            }
            dfl2_batch_free(b);
        }
        else
        {
            check(b == nullptr, "a failed create left a batch");
            drop(st);
        }
    }
    dfl2_model_free(m);
    return 0;
}
