/* The C API from C99: every error path returns a status with the right code and a message (never a crash),
 * and end-to-end runs of a toy model behind dfl2_callbacks: speculative == autoregressive tokens (greedy),
 * drafts accepted and rejected, streaming == result, cancellation, EOS, partial blocks, stats, sampling.
 *
 * usage: capiC SCRATCH_DIR   (manifest fixtures are written there)
 *
 * The toy target is a Markov chain over V tokens whose logits depend on (token, position) only, so cropping
 * its cache is exact; the toy drafter follows the target's greedy chain but is wrong at every third
 * position, so cycles accept some drafts and reject others. */
#include "dflash2/dflash2.h"

#include "dfl2Test.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define V 32
#define F 2
#define BS 5
#define L (BS - 1)
#define K 4
#define MAXPOS 96

/* Expect a status with `code` and a non-empty message containing `needle` (may be NULL); frees it. */
static void expectStatus(dfl2_status* st, dfl2_code code, const char* needle, int line)
{
    const char* msg = dfl2_status_message(st);
    if (dfl2_status_code(st) != code || msg == NULL || msg[0] == '\0' || (needle && !strstr(msg, needle))) {
        fprintf(stderr, "line %d: expected code %d containing '%s', got code %d: %s\n", line, (int) code,
                needle ? needle : "", (int) dfl2_status_code(st), msg ? msg : "(null)");
        ++*dfl2TestCounter();
    }
    dfl2_status_free(st);
}
#define EXPECT(st, code, needle) expectStatus((st), (code), (needle), __LINE__)
#define OK(st) expectStatus((st), DFL2_OK, NULL, __LINE__)

/* ---- toy model ---------------------------------------------------------------------------------------- */

typedef struct Toy {
    int32_t targetLength;  /* cached positions */
    int32_t draftLength;   /* draft context positions */
    int failForwardAt;     /* fail the Nth target_forward (0 = never) */
    int forwards;
    int badDraftToken;     /* propose an out-of-range token */
    int addContextRows;    /* rows handed to the drafter in total */
    int32_t lastRows;      /* rows the latest drafter_propose was told would be verified */
    int inside;            /* callbacks running now (> 1: two sessions overlapped) */
    int overlaps;
    int yieldInside;       /* yield the CPU inside target_forward (widens the window an overlap would need) */
} Toy;

static float toyLogit(int32_t tok, int32_t pos, int32_t v)
{
    /* deterministic, no ties in practice: a mixing hash of (tok, pos, v) mapped to [-4, 4) */
    uint32_t h = (uint32_t) tok * 2654435761u ^ (uint32_t) (pos % 7) * 40503u ^ (uint32_t) v * 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    return (float) (h % 8000u) / 1000.0f - 4.0f;
}

static int32_t toyArgmax(int32_t tok, int32_t pos)
{
    int32_t best = 0;
    for (int32_t v = 1; v < V; ++v) {
        if (toyLogit(tok, pos, v) > toyLogit(tok, pos, best)) best = v;
    }
    return best;
}

static int32_t toyTargetReset(void* u)
{
    ((Toy*) u)->targetLength = 0;
    return 0;
}

static int32_t toyTargetForward(void* u, const int32_t* ids, int32_t n, float* logits, float* features)
{
    Toy* t = (Toy*) u;
    if (t->failForwardAt && ++t->forwards == t->failForwardAt) return 7;
    t->overlaps += t->inside++ > 0;
    if (t->yieldInside) sched_yield();
    for (int32_t i = 0; i < n; ++i) {
        int32_t pos = t->targetLength + i;
        for (int32_t v = 0; v < V; ++v) logits[i * V + v] = toyLogit(ids[i], pos, v);
        features[i * F + 0] = (float) ids[i];
        features[i * F + 1] = (float) pos;
    }
    t->targetLength += n;
    --t->inside;
    return 0;
}

static int32_t toyTargetCrop(void* u, int32_t length)
{
    Toy* t = (Toy*) u;
    if (length < t->targetLength) t->targetLength = length;
    return 0;
}

static int32_t toyDrafterReset(void* u)
{
    ((Toy*) u)->draftLength = 0;
    return 0;
}

static int32_t toyAddContext(void* u, const float* features, int32_t m, int32_t start)
{
    Toy* t = (Toy*) u;
    if (start != t->draftLength) return 3; /* context must arrive in order, like the real drafters */
    for (int32_t i = 0; i < m; ++i) {
        if ((int32_t) features[i * F + 1] != start + i) return 4; /* the features of the right positions */
    }
    t->draftLength += m;
    t->addContextRows += m;
    return 0;
}

static int32_t toyPropose(void* u, int32_t anchor, int32_t pos, int32_t rows, float temperature, const float* uniforms,
                          int32_t* tokens, float* proposal, int32_t* cand, float* vocabProposal, int32_t* used)
{
    Toy* t = (Toy*) u;
    (void) vocabProposal;
    (void) used;
    if (pos != t->draftLength) return 5;
    if (rows < 0 || rows > L) return 6;
    t->lastRows = rows;
    int32_t prev = anchor;
    for (int32_t r = 0; r < L; ++r) {
        int32_t p = pos + r; /* the row predicts the token at p + 1 from prev at p */
        /* candidates: the target's top-K at this step (selection sort; lowest id first among ties) */
        float row[V];
        int taken[V] = {0};
        for (int32_t v = 0; v < V; ++v) row[v] = toyLogit(prev, p, v);
        for (int32_t k = 0; k < K; ++k) {
            int32_t best = -1;
            for (int32_t v = 0; v < V; ++v) {
                if (!taken[v] && (best < 0 || row[v] > row[best])) best = v;
            }
            taken[best] = 1;
            cand[r * K + k] = best;
        }
        int32_t j = (p % 3 == 2) ? 1 : 0; /* wrong at every third position: the second candidate */
        if (temperature > 0) {
            /* sample over the K candidates with the row's uniform */
            double w[K], s = 0.0, c = 0.0;
            for (int32_t k = 0; k < K; ++k) s += (w[k] = exp((double) row[cand[r * K + k]] / temperature));
            j = K - 1;
            for (int32_t k = 0; k < K; ++k) {
                c += w[k] / s;
                if (c > uniforms[r]) { j = k; break; }
            }
            for (int32_t k = 0; k < K; ++k) proposal[r * K + k] = (float) (w[k] / s);
        } else {
            for (int32_t k = 0; k < K; ++k) proposal[r * K + k] = k == j ? 1.0f : 0.0f;
        }
        tokens[r] = t->badDraftToken ? V + 5 : cand[r * K + j];
        prev = tokens[r];
    }
    return 0;
}

static dfl2_callbacks toyCallbacks(Toy* toy)
{
    static const int32_t eos[1] = {0};
    dfl2_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.struct_size = sizeof cb;
    cb.user_data = toy;
    cb.vocab_size = V;
    cb.feature_dim = F;
    cb.block_size = BS;
    cb.top_k = K;
    cb.max_positions = MAXPOS;
    cb.eos_ids = eos;
    cb.n_eos_ids = 0; /* no default stop token: tests set eos_ids explicitly */
    cb.target_reset = toyTargetReset;
    cb.target_forward = toyTargetForward;
    cb.target_crop = toyTargetCrop;
    cb.drafter_reset = toyDrafterReset;
    cb.drafter_add_context = toyAddContext;
    cb.drafter_propose = toyPropose;
    return cb;
}

/* ---- helpers ------------------------------------------------------------------------------------------ */

typedef struct Stream {
    int32_t tokens[MAXPOS];
    size_t n;
    int chunks;
    int cancelAfter; /* cancel after this many chunks (0 = never) */
} Stream;

static int32_t onTokens(void* u, const int32_t* tokens, size_t n)
{
    Stream* s = (Stream*) u;
    for (size_t i = 0; i < n; ++i) s->tokens[s->n++] = tokens[i];
    ++s->chunks;
    return s->cancelAfter && s->chunks >= s->cancelAfter;
}

/* Generate with options given as "key=value" strings; returns the session (caller frees). */
static dfl2_session* run(dfl2_model* model, const char** opts, const int32_t* prompt, size_t n, Stream* stream,
                         dfl2_code want)
{
    dfl2_options* o = NULL;
    dfl2_session* s = NULL;
    OK(dfl2_options_create(&o));
    for (; opts && *opts; ++opts) OK(dfl2_options_parse(o, *opts));
    OK(dfl2_session_create(model, o, &s));
    dfl2_options_free(o);
    dfl2_status* st = dfl2_session_generate(s, prompt, n, stream ? onTokens : NULL, stream);
    if (dfl2_status_code(st) != want) {
        fprintf(stderr, "generate: expected %d, got %d: %s\n", (int) want, (int) dfl2_status_code(st),
                dfl2_status_message(st));
        ++*dfl2TestCounter();
    }
    dfl2_status_free(st);
    return s;
}

static int writeFile(const char* dir, const char* name, const char* text)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    fputs(text, f);
    fclose(f);
    return 1;
}

static void makeDir(const char* path)
{
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "cannot create %s\n", path);
        exit(2);
    }
}

/* sha256 of the empty file */
#define EMPTY_SHA "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

static void manifestText(char* out, size_t cap, const char* format, int version, const char* extraFile,
                         const char* sha, int dropTarget, const char* dtype)
{
    snprintf(out, cap,
             "{\"format\": \"%s\", \"manifest_version\": %d, \"project_version\": \"9.9\", \"opset\": 17,"
             " \"dtype\": \"%s\", \"max_seq_len\": 96, \"kv_capacity_step\": 32,"
             " %s"
             " \"drafter\": {\"vocab_size\": 32, \"hidden_size\": 8, \"num_hidden_layers\": 1,"
             "   \"num_key_value_heads\": 1, \"num_attention_heads\": 2,"
             "   \"dflash_config\": {\"block_size\": 5, \"selector_top_k\": 4}},"
             " \"plugin\": {\"op_type\": \"DFlash2PathSelector\", \"domain\": \"trt.plugins\","
             "   \"plugin_version\": \"1\", \"plugin_namespace\": \"\"},"
             " \"graphs\": {\"target\": {\"file\": \"g.onnx\", \"role\": \"target\"},"
             "   \"drafter_context\": {\"file\": \"g.onnx\", \"role\": \"drafter_context\"},"
             "   \"drafter_block\": {\"file\": \"g.onnx\", \"role\": \"drafter_block\"},"
             "   \"drafter_head_independent\": {\"file\": \"%s\", \"role\": \"drafter_head\"}},"
             " \"tokenizer\": {\"files\": [], \"chat_template\": false},"
             " \"files\": {\"g.onnx\": \"%s\"}}",
             format, version, dtype,
             dropTarget ? "" : "\"target\": {\"model_type\": \"toy\", \"vocab_size\": 32, \"num_layers\": 2,"
                               " \"hidden_size\": 8, \"num_key_value_heads\": 1, \"head_dim\": 4,"
                               " \"max_positions\": 96, \"eos_token_ids\": [0], \"layer_ids\": [0]},",
             extraFile, sha);
}

/* ---- tests -------------------------------------------------------------------------------------------- */

static void testStatusAndOptions(void)
{
    CHECK(dfl2_api_version() == DFL2_API_VERSION);
    CHECK(dfl2_status_code(NULL) == DFL2_OK && strcmp(dfl2_status_message(NULL), "ok") == 0);
    dfl2_status_free(NULL);
    dfl2_options_free(NULL);
    dfl2_model_free(NULL);
    dfl2_session_free(NULL);

    EXPECT(dfl2_options_create(NULL), DFL2_ERR_INVALID_ARGUMENT, "NULL");
    dfl2_options* o = NULL;
    OK(dfl2_options_create(&o));
    CHECK(o != NULL);
    EXPECT(dfl2_options_set_int(NULL, "seed", 1), DFL2_ERR_INVALID_ARGUMENT, "options");
    EXPECT(dfl2_options_set_int(o, NULL, 1), DFL2_ERR_INVALID_ARGUMENT, "key");
    EXPECT(dfl2_options_set_int(o, "no_such_key", 1), DFL2_ERR_UNKNOWN_OPTION, "no_such_key");
    EXPECT(dfl2_options_set_double(o, "max_new_tokens", 1.0), DFL2_ERR_OPTION_TYPE, "int");
    EXPECT(dfl2_options_set_int(o, "temperature", 1), DFL2_ERR_OPTION_TYPE, "double");
    EXPECT(dfl2_options_set_string(o, "speculative", "yes"), DFL2_ERR_OPTION_TYPE, "bool");
    EXPECT(dfl2_options_set_bool(o, "eos_ids", 1), DFL2_ERR_OPTION_TYPE, "int[]");
    EXPECT(dfl2_options_set_string(o, "draft_mode", NULL), DFL2_ERR_INVALID_ARGUMENT, "value");
    EXPECT(dfl2_options_set_int_array(o, "eos_ids", NULL, 2), DFL2_ERR_INVALID_ARGUMENT, "values");
    EXPECT(dfl2_options_set_int(o, "max_new_tokens", 0), DFL2_ERR_OPTION_VALUE, ">= 1");
    EXPECT(dfl2_options_set_double(o, "temperature", -0.5), DFL2_ERR_OPTION_VALUE, ">= 0");
    EXPECT(dfl2_options_set_double(o, "temperature", NAN), DFL2_ERR_OPTION_VALUE, "finite");
    EXPECT(dfl2_options_set_string(o, "draft_mode", "beam"), DFL2_ERR_OPTION_VALUE, "greedy|viterbi|independent");
    EXPECT(dfl2_options_set_string(o, "backend", "onnxruntime"), DFL2_ERR_OPTION_VALUE, "auto|tensorrt");
    EXPECT(dfl2_options_set_int(o, "device", -1), DFL2_ERR_OPTION_VALUE, "device");
    EXPECT(dfl2_options_parse(o, "max_new_tokens"), DFL2_ERR_INVALID_ARGUMENT, "key=value");
    EXPECT(dfl2_options_parse(o, "max_new_tokens=12x"), DFL2_ERR_OPTION_TYPE, "12x");
    EXPECT(dfl2_options_parse(o, "max_new_tokens=99999999999999999999999"), DFL2_ERR_OPTION_TYPE, "int");
    EXPECT(dfl2_options_parse(o, "temperature=warm"), DFL2_ERR_OPTION_TYPE, "number");
    EXPECT(dfl2_options_parse(o, "speculative=maybe"), DFL2_ERR_OPTION_TYPE, "true|false");
    EXPECT(dfl2_options_parse(o, "eos_ids=1,,2"), DFL2_ERR_OPTION_TYPE, "int");
    EXPECT(dfl2_options_parse(o, "eos_ids=1,2,"), DFL2_ERR_OPTION_TYPE, "comma");
    EXPECT(dfl2_options_parse(o, "eos_ids=99999999999"), DFL2_ERR_OPTION_VALUE, "int32");
    EXPECT(dfl2_options_parse(o, "=1"), DFL2_ERR_UNKNOWN_OPTION, "unknown");
    EXPECT(dfl2_options_parse(NULL, "seed=1"), DFL2_ERR_INVALID_ARGUMENT, "options");
    EXPECT(dfl2_options_parse(o, NULL), DFL2_ERR_INVALID_ARGUMENT, "text");
    OK(dfl2_options_parse(o, "eos_ids="));
    OK(dfl2_options_parse(o, "eos_ids=3,4"));
    OK(dfl2_options_parse(o, "temperature=0.75"));
    OK(dfl2_options_parse(o, "draft_mode=viterbi"));
    OK(dfl2_options_set_bool(o, "measure_oracle", 1));
    OK(dfl2_options_set_int_array(o, "eos_ids", NULL, 0));
    dfl2_options_free(o);
}

static void testManifestErrors(const char* scratch)
{
    char dir[1024], text[4096];
    dfl2_model* m = (dfl2_model*) (void*) &m; /* must be reset to NULL on failure */
    dfl2_options* noSums = NULL;
    OK(dfl2_options_create(&noSums));
    OK(dfl2_options_set_bool(noSums, "verify_checksums", 0));

    EXPECT(dfl2_model_load(NULL, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "export_dir");
    CHECK(m == NULL);
    EXPECT(dfl2_model_load(scratch, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    snprintf(dir, sizeof dir, "%s/absent", scratch);
    EXPECT(dfl2_model_load(dir, NULL, &m), DFL2_ERR_NOT_FOUND, "not found");
    EXPECT(dfl2_manifest_check(dir, NULL), DFL2_ERR_NOT_FOUND, "not found");

    snprintf(dir, sizeof dir, "%s/empty", scratch);
    makeDir(dir);
    EXPECT(dfl2_model_load(dir, NULL, &m), DFL2_ERR_NOT_FOUND, "manifest.json");

    snprintf(dir, sizeof dir, "%s/corrupt", scratch);
    makeDir(dir);
    writeFile(dir, "manifest.json", "{\"format\": \"dflash2-trt-export\", \"manifest_version\": 1, \"block");
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_CORRUPT, "not valid JSON");
    writeFile(dir, "manifest.json", "[1, 2, 3]");
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_VERSION_MISMATCH, "not a dflash2-trt-export");

    snprintf(dir, sizeof dir, "%s/format", scratch);
    makeDir(dir);
    writeFile(dir, "g.onnx", "");
    manifestText(text, sizeof text, "some-other-format", 1, "g.onnx", EMPTY_SHA, 0, "fp32");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_VERSION_MISMATCH, "not a dflash2-trt-export");
    manifestText(text, sizeof text, "dflash2-trt-export", 1, "g.onnx", EMPTY_SHA, 0, "fp32");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_VERSION_MISMATCH, "manifest_version 1");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "g.onnx", EMPTY_SHA, 0, "fp64");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_CORRUPT, "schema at 'dtype'");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "g.onnx", "not-a-sha256", 0, "fp32");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_CORRUPT, "schema at 'files.g.onnx'");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "g.onnx", EMPTY_SHA, 1, "fp32");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_CORRUPT, "'target'");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "missing.onnx", EMPTY_SHA, 0, "fp32");
    writeFile(dir, "manifest.json", text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_CORRUPT, "missing.onnx has no checksum");

    snprintf(dir, sizeof dir, "%s/valid", scratch);
    makeDir(dir);
    writeFile(dir, "g.onnx", "");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "g.onnx", EMPTY_SHA, 0, "fp32");
    writeFile(dir, "manifest.json", text);
    OK(dfl2_manifest_check(dir, noSums));
#if DFL2_TEST_HAVE_OPENSSL
    OK(dfl2_manifest_check(dir, NULL));
#else
    EXPECT(dfl2_manifest_check(dir, NULL), DFL2_ERR_UNAVAILABLE, "OpenSSL");
#endif
    /* a valid folder, but no backend can run it here (CPU build / no GPU with TensorRT) */
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_UNAVAILABLE, "TensorRT");
    CHECK(m == NULL);

    snprintf(dir, sizeof dir, "%s/tampered", scratch);
    makeDir(dir);
    writeFile(dir, "g.onnx", "changed after export");
    manifestText(text, sizeof text, "dflash2-trt-export", 2, "g.onnx", EMPTY_SHA, 0, "fp32");
    writeFile(dir, "manifest.json", text);
#if DFL2_TEST_HAVE_OPENSSL
    EXPECT(dfl2_model_load(dir, NULL, &m), DFL2_ERR_CORRUPT, "checksum mismatch");
#endif
    snprintf(text, sizeof text, "%s/g.onnx", dir);
    remove(text);
    EXPECT(dfl2_model_load(dir, noSums, &m), DFL2_ERR_NOT_FOUND, "is missing");
    dfl2_options_free(noSums);
}

static void testCallbackErrors(void)
{
    Toy toy;
    memset(&toy, 0, sizeof toy);
    toy.yieldInside = 1;
    dfl2_callbacks cb = toyCallbacks(&toy);
    dfl2_model* m = NULL;
    EXPECT(dfl2_model_create_callbacks(NULL, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "callbacks");
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    cb.struct_size = 8;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "struct_size");
    cb = toyCallbacks(&toy);
    cb.target_forward = NULL;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "function pointer");
    cb = toyCallbacks(&toy);
    cb.block_size = 1;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "block_size");
    cb = toyCallbacks(&toy);
    cb.top_k = V + 1;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "top_k");
    cb = toyCallbacks(&toy);
    cb.eos_ids = NULL;
    cb.n_eos_ids = 2;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "eos_ids");
    CHECK(m == NULL);

    cb = toyCallbacks(&toy);
    OK(dfl2_model_create_callbacks(&cb, NULL, &m));
    dfl2_model_info info;
    EXPECT(dfl2_model_get_info(NULL, &info), DFL2_ERR_INVALID_ARGUMENT, "model");
    EXPECT(dfl2_model_get_info(m, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    OK(dfl2_model_get_info(m, &info));
    CHECK(info.vocab_size == V && info.block_size == BS && info.top_k == K && info.max_positions == MAXPOS);
    CHECK(strcmp(info.backend, "callbacks") == 0);

    dfl2_session* s = NULL;
    EXPECT(dfl2_session_create(NULL, NULL, &s), DFL2_ERR_INVALID_ARGUMENT, "model");
    EXPECT(dfl2_session_create(m, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    OK(dfl2_session_create(m, NULL, &s));
    const int32_t good[3] = {1, 2, 3}, bad[2] = {4, V}, negative[1] = {-1};
    int32_t longPrompt[MAXPOS];
    for (int i = 0; i < MAXPOS; ++i) longPrompt[i] = 1;
    EXPECT(dfl2_session_generate(NULL, good, 3, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "session");
    EXPECT(dfl2_session_generate(s, NULL, 3, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "prompt");
    EXPECT(dfl2_session_generate(s, good, 0, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "empty prompt");
    EXPECT(dfl2_session_generate(s, bad, 2, NULL, NULL), DFL2_ERR_OUT_OF_RANGE, "32 out of range [0, 32)");
    EXPECT(dfl2_session_generate(s, negative, 1, NULL, NULL), DFL2_ERR_OUT_OF_RANGE, "-1");
    EXPECT(dfl2_session_generate(s, longPrompt, MAXPOS, NULL, NULL), DFL2_ERR_TOO_LONG, "does not fit");
    OK(dfl2_session_generate(s, longPrompt, MAXPOS - 1, NULL, NULL)); /* exactly fits: one token */
    const int32_t* toks = NULL;
    size_t n = 99;
    OK(dfl2_session_get_tokens(s, &toks, &n));
    CHECK(n == 1);
    EXPECT(dfl2_session_get_tokens(NULL, &toks, &n), DFL2_ERR_INVALID_ARGUMENT, "session");
    EXPECT(dfl2_session_get_tokens(s, NULL, &n), DFL2_ERR_INVALID_ARGUMENT, "tokens");
    dfl2_stats st;
    EXPECT(dfl2_session_get_stats(s, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    EXPECT(dfl2_session_set_uniform_source(NULL, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "session");

    toy.failForwardAt = 2; /* the first verify pass fails */
    toy.forwards = 0;
    EXPECT(dfl2_session_generate(s, good, 3, NULL, NULL), DFL2_ERR_CALLBACK, "target_forward returned 7");
    toy.failForwardAt = 0;
    toy.badDraftToken = 1;
    EXPECT(dfl2_session_generate(s, good, 3, NULL, NULL), DFL2_ERR_OUT_OF_RANGE, "drafter proposed token id 37");
    toy.badDraftToken = 0;
    OK(dfl2_session_generate(s, good, 3, NULL, NULL)); /* the session recovers: generate resets it */
    OK(dfl2_session_get_stats(s, &st));
    CHECK(st.n_tokens == 64 && st.finish_reason == DFL2_FINISH_LENGTH);
    dfl2_session_free(s);
    dfl2_model_free(m);
}

static int32_t badUniforms(void* u, dfl2_uniform_use use, double* out, size_t n)
{
    (void) u;
    (void) use;
    for (size_t i = 0; i < n; ++i) out[i] = 1.5;
    return 0;
}

static void testGeneration(void)
{
    Toy toy;
    memset(&toy, 0, sizeof toy);
    toy.yieldInside = 1;
    dfl2_callbacks cb = toyCallbacks(&toy);
    dfl2_model* m = NULL;
    OK(dfl2_model_create_callbacks(&cb, NULL, &m));
    const int32_t prompt[4] = {3, 9, 27, 17};
    const char* ar[] = {"speculative=false", "max_new_tokens=40", NULL};
    const char* spec[] = {"max_new_tokens=40", "measure_oracle=true", NULL};
    Stream stream;
    memset(&stream, 0, sizeof stream);

    /* greedy: speculative decoding gives exactly the target's own tokens */
    dfl2_session* a = run(m, ar, prompt, 4, NULL, DFL2_OK);
    dfl2_session* s = run(m, spec, prompt, 4, &stream, DFL2_OK);
    const int32_t *ta = NULL, *ts = NULL;
    size_t na = 0, ns = 0;
    OK(dfl2_session_get_tokens(a, &ta, &na));
    OK(dfl2_session_get_tokens(s, &ts, &ns));
    CHECK(na == 40 && ns == 40 && memcmp(ta, ts, 40 * sizeof(int32_t)) == 0);
    /* the AR chain is the toy's argmax chain */
    int32_t prev = prompt[3];
    for (size_t i = 0; i < na; ++i) {
        CHECK(ta[i] == toyArgmax(prev, 3 + (int32_t) i));
        prev = ta[i];
    }
    /* streamed chunks concatenate to the result */
    CHECK(stream.n == ns && memcmp(stream.tokens, ts, ns * sizeof(int32_t)) == 0);
    dfl2_stats st;
    OK(dfl2_session_get_stats(s, &st));
    int accepted = 0, rejected = 0, drafted = 0;
    double tau = 0.0;
    for (int c = 0; c < st.cycles; ++c) {
        accepted += st.accepted[c];
        drafted += st.proposed[c];
        rejected += st.accepted[c] < st.proposed[c];
        tau += st.accepted[c] + 1;
        CHECK(st.oracle_accepted[c] >= st.accepted[c]); /* the oracle bound holds */
    }
    CHECK(stream.chunks == st.cycles + 1);
    CHECK(accepted > 0 && rejected > 0); /* both paths of the acceptance rule were taken */
    CHECK(fabs(st.tau - tau / st.cycles) < 1e-12 && st.tau > 1.0);
    CHECK(st.n_positions == L && st.per_position_cumulative[0] >= st.per_position_cumulative[L - 1]);
    CHECK(st.oracle_tau >= st.tau);
    /* 1 + accepted drafts + bonus per cycle = tokens; the last block was partial (40 - 1 is not a multiple) */
    CHECK(1 + accepted + st.cycles == 40);
    CHECK(drafted > 0 && st.proposed[st.cycles - 1] <= L);
    CHECK(toy.lastRows == st.proposed[st.cycles - 1]); /* the drafter was told the verified rows */
    CHECK(st.finish_reason == DFL2_FINISH_LENGTH);
    /* every committed position went to the drafter exactly once: prompt + generated - the last anchor */
    CHECK(toy.draftLength == 4 + 40 - 1 || toy.draftLength == 4 + 40);
    dfl2_session_free(s);

    /* EOS: stop at the 10th AR token (it is the last token; later ones are cut from the chunk) */
    char eosOpt[64];
    snprintf(eosOpt, sizeof eosOpt, "eos_ids=%d", (int) ta[9]);
    int32_t firstEos = 0;
    while (ta[firstEos] != ta[9]) ++firstEos;
    const char* eos[] = {"max_new_tokens=40", eosOpt, NULL};
    memset(&stream, 0, sizeof stream);
    s = run(m, eos, prompt, 4, &stream, DFL2_OK);
    OK(dfl2_session_get_tokens(s, &ts, &ns));
    OK(dfl2_session_get_stats(s, &st));
    CHECK(ns == (size_t) firstEos + 1 && memcmp(ts, ta, ns * sizeof(int32_t)) == 0);
    CHECK(st.finish_reason == DFL2_FINISH_EOS && stream.n == ns);
    dfl2_session_free(s);

    /* cancellation after the second chunk */
    memset(&stream, 0, sizeof stream);
    stream.cancelAfter = 2;
    s = run(m, spec, prompt, 4, &stream, DFL2_OK);
    OK(dfl2_session_get_tokens(s, &ts, &ns));
    OK(dfl2_session_get_stats(s, &st));
    CHECK(st.finish_reason == DFL2_FINISH_CANCELLED && stream.chunks == 2 && ns == stream.n && ns < 40);
    CHECK(memcmp(ts, ta, ns * sizeof(int32_t)) == 0);
    dfl2_session_free(s);

    /* capacity: max_positions limits the length (the prompt leaves MAXPOS - 4 positions) */
    const char* big[] = {"max_new_tokens=1000", NULL};
    s = run(m, big, prompt, 4, NULL, DFL2_OK);
    OK(dfl2_session_get_stats(s, &st));
    CHECK(st.n_tokens == MAXPOS - 4 && st.finish_reason == DFL2_FINISH_LENGTH);
    dfl2_session_free(s);

    /* sampling with the built-in generator: reproducible for a seed, different across seeds */
    const char* t1[] = {"temperature=0.9", "seed=5", "max_new_tokens=30", NULL};
    const char* t2[] = {"temperature=0.9", "seed=6", "max_new_tokens=30", NULL};
    dfl2_session* s1 = run(m, t1, prompt, 4, NULL, DFL2_OK);
    dfl2_session* s1b = run(m, t1, prompt, 4, NULL, DFL2_OK);
    dfl2_session* s2 = run(m, t2, prompt, 4, NULL, DFL2_OK);
    const int32_t *u1, *u1b, *u2;
    size_t n1, n1b, n2;
    OK(dfl2_session_get_tokens(s1, &u1, &n1));
    OK(dfl2_session_get_tokens(s1b, &u1b, &n1b));
    OK(dfl2_session_get_tokens(s2, &u2, &n2));
    CHECK(n1 == 30 && n1b == 30 && n2 == 30);
    CHECK(memcmp(u1, u1b, 30 * sizeof(int32_t)) == 0 && memcmp(u1, u2, 30 * sizeof(int32_t)) != 0);
    OK(dfl2_session_set_uniform_source(s1, badUniforms, NULL));
    EXPECT(dfl2_session_generate(s1, prompt, 4, NULL, NULL), DFL2_ERR_CALLBACK, "outside [0, 1)");
    dfl2_session_free(s1);
    dfl2_session_free(s1b);
    dfl2_session_free(s2);
    dfl2_session_free(a);
    dfl2_model_free(m);
}

/* Sessions of one model on several threads: generate calls take turns (the model's lock), so the shared toy
 * state is never used by two at once, and every thread gets the single-threaded result. */
typedef struct Job {
    dfl2_model* model;
    const int32_t* prompt;
    Stream out;
} Job;

static void* generateJob(void* arg)
{
    Job* job = (Job*) arg;
    static const char* opts[] = {"max_new_tokens=30", NULL};
    for (int rep = 0; rep < 3; ++rep) {
        job->out.n = 0;
        dfl2_session_free(run(job->model, opts, job->prompt, 3, &job->out, DFL2_OK));
    }
    return NULL;
}

static void testConcurrentSessions(void)
{
    enum { kTHREADS = 4 };
    Toy toy;
    memset(&toy, 0, sizeof toy);
    toy.yieldInside = 1;
    dfl2_callbacks cb = toyCallbacks(&toy);
    dfl2_model* m = NULL;
    OK(dfl2_model_create_callbacks(&cb, NULL, &m));
    static const int32_t prompt[3] = {3, 9, 4};
    Job ref = {m, prompt, {{0}, 0, 0, 0}};
    generateJob(&ref);
    CHECK(ref.out.n == 30);
    Job jobs[kTHREADS];
    pthread_t threads[kTHREADS];
    for (int i = 0; i < kTHREADS; ++i) {
        jobs[i] = ref;
        jobs[i].out.n = 0;
        CHECK(pthread_create(&threads[i], NULL, generateJob, &jobs[i]) == 0);
    }
    for (int i = 0; i < kTHREADS; ++i) {
        pthread_join(threads[i], NULL);
        CHECK(jobs[i].out.n == ref.out.n && memcmp(jobs[i].out.tokens, ref.out.tokens, ref.out.n * sizeof(int32_t)) == 0);
    }
    CHECK(toy.overlaps == 0);
    dfl2_model_free(m);
}

int main(int argc, char** argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]);
        return 2;
    }
    makeDir(argv[1]);
    testStatusAndOptions();
    testManifestErrors(argv[1]);
    testCallbackErrors();
    testGeneration();
    testConcurrentSessions();
    return dfl2TestReport("capiC");
}
