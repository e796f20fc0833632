/* The C API from C99: every error path returns a status with the right code and a message (never a crash),
 * and end-to-end runs of a toy model behind dfl2_callbacks: speculative == autoregressive tokens (greedy),
 * drafts accepted and rejected, streaming == result, cancellation, EOS, partial blocks, stats, sampling; and
 * batched decoding (dfl2_batch) behind the batch_* callbacks: every request == its own session output, joins,
 * cancels, T > 0 beside T = 0, the rule's drafted and plain steps, per-request failures, a served queue.
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
    int waitGate;    /* the first chunk waits until openGate (another thread's cancel has been issued) */
} Stream;

static pthread_mutex_t gateLock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gateCond = PTHREAD_COND_INITIALIZER;
static int gateOpen;

static void openGate(void)
{
    pthread_mutex_lock(&gateLock);
    gateOpen = 1;
    pthread_cond_broadcast(&gateCond);
    pthread_mutex_unlock(&gateLock);
}

static int32_t onTokens(void* u, const int32_t* tokens, size_t n)
{
    Stream* s = (Stream*) u;
    for (size_t i = 0; i < n; ++i) s->tokens[s->n++] = tokens[i];
    ++s->chunks;
    if (s->waitGate) {
        pthread_mutex_lock(&gateLock);
        while (!gateOpen) pthread_cond_wait(&gateCond, &gateLock);
        pthread_mutex_unlock(&gateLock);
        s->waitGate = 0;
    }
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
    EXPECT(dfl2_options_set_string(o, "proposer", "lookahead"), DFL2_ERR_OPTION_VALUE, "dflash2|ngram|auto");
    EXPECT(dfl2_options_parse(o, "ngram_rows=-1"), DFL2_ERR_OPTION_VALUE, ">= 0");
    EXPECT(dfl2_options_set_double(o, "ngram_rows", 2.0), DFL2_ERR_OPTION_TYPE, "int");
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
    /* a valid folder, but TensorRT cannot run it here (CPU build / no GPU with TensorRT) */
    dfl2_options* trtOnly = NULL;
    OK(dfl2_options_create(&trtOnly));
    OK(dfl2_options_set_bool(trtOnly, "verify_checksums", 0));
    OK(dfl2_options_set_string(trtOnly, "backend", "tensorrt"));
    EXPECT(dfl2_model_load(dir, trtOnly, &m), DFL2_ERR_UNAVAILABLE, "TensorRT");
    CHECK(m == NULL);
    /* ONNX Runtime absent (a library path that does not exist): one status naming it */
    OK(dfl2_options_set_string(trtOnly, "backend", "ort"));
    OK(dfl2_options_set_string(trtOnly, "ort_library", "/nonexistent/libonnxruntime.so.1.99"));
    EXPECT(dfl2_model_load(dir, trtOnly, &m), DFL2_ERR_UNAVAILABLE, "ONNX Runtime");
    CHECK(m == NULL);
    dfl2_options_free(trtOnly);

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
    const int32_t* who = NULL;
    OK(dfl2_session_get_proposers(s, &who, &n)); /* one per cycle, each a dfl2_proposer */
    CHECK(n == (size_t) st.cycles);
    for (size_t i = 0; i < n; ++i)
    {
        CHECK(who[i] == DFL2_PROPOSER_DFLASH2 || who[i] == DFL2_PROPOSER_NGRAM);
    }
    EXPECT(dfl2_session_get_proposers(NULL, &who, &n), DFL2_ERR_INVALID_ARGUMENT, "session");
    EXPECT(dfl2_session_get_proposers(s, NULL, &n), DFL2_ERR_INVALID_ARGUMENT, "proposers");
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
    Job ref = {m, prompt, {{0}, 0, 0, 0, 0}};
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

/* ---- batched decoding (dfl2_batch) -------------------------------------------------------------------------
 * The batched toy: one Toy per slot behind the batch_* callbacks. batch_target_forward checks that every request's
 * cache_length is its slot's own count (ragged caches) and records how the library batched the rows. */

#define MAXB 4

typedef struct BatchToy {
    Toy slot[MAXB];
    int active[MAXB];      /* between batch_target_reset and batch_target_release */
    int resets, releases;
    int forwards;          /* batch_target_forward calls */
    int badCalls;          /* a cache length or slot the toy did not expect */
    int largestCall;       /* most requests in one call */
    int mixedCalls;        /* calls with plain (1 row) and verify (> 1 row) requests together */
    int failProposeSlot;   /* batch_drafter_propose of this slot + 1 fails (0: never) */
    int failForwardAt;     /* the Nth batch_target_forward fails (0: never) */
} BatchToy;

static int32_t btReset(void* u, int32_t slot)
{
    BatchToy* b = (BatchToy*) u;
    if (slot < 0 || slot >= MAXB || b->active[slot]) ++b->badCalls;
    b->active[slot] = 1;
    ++b->resets;
    return toyTargetReset(&b->slot[slot]);
}

static int32_t btRelease(void* u, int32_t slot)
{
    BatchToy* b = (BatchToy*) u;
    if (!b->active[slot]) ++b->badCalls;
    b->active[slot] = 0;
    ++b->releases;
    return 0;
}

static int32_t btForward(void* u, int32_t nSeqs, const int32_t* slots, const int32_t* lengths, const int32_t* rows,
                         const int32_t* ids, int32_t lastLogits, float* logits, float* features)
{
    BatchToy* b = (BatchToy*) u;
    if (b->failForwardAt && ++b->forwards == b->failForwardAt) return 9;
    if (!b->failForwardAt) ++b->forwards;
    int ones = 0, many = 0;
    size_t off = 0;
    static float all[MAXPOS * V]; /* one request's logits, when only its last row is asked for */
    for (int32_t i = 0; i < nSeqs; ++i) {
        Toy* t = &b->slot[slots[i]];
        if (!b->active[slots[i]] || lengths[i] != t->targetLength || rows[i] < 1 || rows[i] > MAXPOS) {
            ++b->badCalls;
            return 8;
        }
        float* out = lastLogits ? all : logits + off * V;
        int32_t rc = toyTargetForward(t, ids + off, rows[i], out, features + off * F);
        if (rc != 0) return rc;
        if (lastLogits) memcpy(logits + (size_t) i * V, all + (size_t) (rows[i] - 1) * V, V * sizeof(float));
        off += (size_t) rows[i];
        ones += rows[i] == 1;
        many += rows[i] > 1;
    }
    if (nSeqs > b->largestCall) b->largestCall = nSeqs;
    b->mixedCalls += ones > 0 && many > 0;
    return 0;
}

static int32_t btCrop(void* u, int32_t slot, int32_t length)
{
    return toyTargetCrop(&((BatchToy*) u)->slot[slot], length);
}

static int32_t btDrafterReset(void* u, int32_t slot)
{
    return toyDrafterReset(&((BatchToy*) u)->slot[slot]);
}

static int32_t btAddContext(void* u, int32_t slot, const float* features, int32_t m, int32_t start)
{
    return toyAddContext(&((BatchToy*) u)->slot[slot], features, m, start);
}

static int32_t btPropose(void* u, int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
                         const float* uniforms, int32_t* tokens, float* proposal, int32_t* cand, float* vocabProposal,
                         int32_t* used)
{
    BatchToy* b = (BatchToy*) u;
    if (b->failProposeSlot == slot + 1) return 6;
    return toyPropose(&b->slot[slot], anchor, pos, rows, temperature, uniforms, tokens, proposal, cand, vocabProposal,
                      used);
}

/* The toy's B = 1 callbacks (on slot 0's state: sessions of this model are not used beside its batches here)
 * plus the batched ones. */
static dfl2_callbacks batchToyCallbacks(BatchToy* b, int32_t maxBatch)
{
    dfl2_callbacks cb = toyCallbacks(&b->slot[0]);
    cb.user_data = b; /* b->slot[0] is its first member: the B = 1 callbacks read it as a Toy */
    cb.max_batch = maxBatch;
    cb.batch_target_reset = btReset;
    cb.batch_target_release = btRelease;
    cb.batch_target_forward = btForward;
    cb.batch_target_crop = btCrop;
    cb.batch_drafter_reset = btDrafterReset;
    cb.batch_drafter_add_context = btAddContext;
    cb.batch_drafter_propose = btPropose;
    return cb;
}

/* One request's stream and end, as a server would keep them. */
typedef struct Req {
    Stream stream;            /* first: on_tokens reads the user data as a Stream */
    int done;                 /* on_done calls */
    dfl2_finish_reason reason;
    dfl2_code error;
    uint64_t id;              /* from dfl2_batch_submit */
    uint64_t doneId;          /* from on_done */
    pthread_mutex_t* lock;    /* guards done/reason/error when on_done runs on a serving thread (may be NULL) */
    pthread_cond_t* cond;
} Req;

static void onDone(void* u, uint64_t id, dfl2_finish_reason reason, const dfl2_status* error)
{
    Req* r = (Req*) u;
    if (r->lock) pthread_mutex_lock(r->lock);
    r->done += 1;
    r->reason = reason;
    r->error = dfl2_status_code(error);
    r->doneId = id;
    if (r->cond) pthread_cond_broadcast(r->cond);
    if (r->lock) pthread_mutex_unlock(r->lock);
}

static dfl2_options* optionsOf(const char** opts)
{
    dfl2_options* o = NULL;
    OK(dfl2_options_create(&o));
    for (; opts && *opts; ++opts) OK(dfl2_options_parse(o, *opts));
    return o;
}

static dfl2_batch* makeBatch(dfl2_model* m, const char** opts)
{
    dfl2_options* o = optionsOf(opts);
    dfl2_batch* b = NULL;
    OK(dfl2_batch_create(m, o, &b));
    dfl2_options_free(o);
    return b;
}

static uint64_t submit(dfl2_batch* b, const int32_t* prompt, size_t n, const char** opts, Req* r)
{
    dfl2_options* o = optionsOf(opts);
    dfl2_request q;
    memset(&q, 0, sizeof q);
    q.struct_size = sizeof q;
    q.prompt = prompt;
    q.n_prompt = n;
    q.options = o;
    q.on_tokens = onTokens;
    q.on_done = onDone;
    q.user_data = r;
    uint64_t id = 0;
    OK(dfl2_batch_submit(b, &q, &id));
    dfl2_options_free(o); /* copied by submit */
    r->id = id;
    return id;
}

static size_t stepUntilIdle(dfl2_batch* b)
{
    size_t pending = 1, steps = 0;
    while (pending && steps < 10000) {
        OK(dfl2_batch_step(b, &pending));
        ++steps;
    }
    return steps;
}

/* A single session's tokens for the same request (the B = 1 reference). */
static size_t sessionTokens(dfl2_model* m, const char** opts, const int32_t* prompt, size_t n, int32_t* out)
{
    dfl2_session* s = run(m, opts, prompt, n, NULL, DFL2_OK);
    const int32_t* t = NULL;
    size_t k = 0;
    OK(dfl2_session_get_tokens(s, &t, &k));
    memcpy(out, t, k * sizeof(int32_t));
    dfl2_session_free(s);
    return k;
}

/* Its result equals `want` [k] (tokens and the stream), ended with `reason`. */
static void expectResult(dfl2_batch* b, const Req* r, const int32_t* want, size_t k, dfl2_finish_reason reason, int line)
{
    const int32_t* t = NULL;
    size_t n = 0;
    dfl2_stats st;
    int32_t plain = -1;
    dfl2_status* status = dfl2_batch_get_result(b, r->id, &t, &n, &st, &plain);
    int ok = status == NULL && n == k && memcmp(t, want, k * sizeof(int32_t)) == 0 && r->stream.n == n &&
             memcmp(r->stream.tokens, t, n * sizeof(int32_t)) == 0 && r->done == 1 && r->doneId == r->id && r->reason == reason &&
             st.finish_reason == reason && st.n_tokens == (int32_t) n;
    int committed = 1 + plain; /* the first token, one per plain step, accepted + bonus per cycle (no EOS cut) */
    for (int c = 0; c < st.cycles; ++c) committed += st.accepted[c] + 1;
    if (reason != DFL2_FINISH_EOS) ok = ok && committed == (int) n;
    if (!ok) {
        fprintf(stderr, "line %d: request %llu: %s; %zu tokens (want %zu), streamed %zu, done %d, reason %d (want %d), "
                "plain %d + cycles %d -> %d\n", line, (unsigned long long) r->id, dfl2_status_message(status), n, k,
                r->stream.n, r->done, (int) r->reason, (int) reason, plain, st.cycles, committed);
        ++*dfl2TestCounter();
    }
    dfl2_status_free(status);
}
#define EXPECT_RESULT(b, r, want, k, reason) expectResult((b), (r), (want), (k), (reason), __LINE__)

/* A batch test's two models over the toy: `ref` (the B = 1 callbacks: reference sessions) and `m` (the batched toy
 * with maxBatch slots). Static in each test (the toys are large). */
typedef struct BatchFixture {
    Toy toy;
    BatchToy bt;
    dfl2_model* ref;
    dfl2_model* m;
} BatchFixture;

static void fixtureOpen(BatchFixture* f, int32_t maxBatch)
{
    memset(f, 0, sizeof *f);
    dfl2_callbacks plainCb = toyCallbacks(&f->toy);
    OK(dfl2_model_create_callbacks(&plainCb, NULL, &f->ref));
    dfl2_callbacks cb = batchToyCallbacks(&f->bt, maxBatch);
    OK(dfl2_model_create_callbacks(&cb, NULL, &f->m));
}

static void fixtureClose(BatchFixture* f)
{
    dfl2_model_free(f->m);
    dfl2_model_free(f->ref);
}

/* A request whose result must be its own session's tokens: the reference is the same prompt and options on a
 * session of the B = 1 model with "speculative=false" last, so only greedy or plain sampling requests (whose
 * tokens do not depend on drafting) are checked this way. */
typedef struct Checked {
    Req req;
    int32_t want[MAXPOS];
    size_t nWant;
} Checked;

static void submitChecked(BatchFixture* f, dfl2_batch* b, const int32_t* prompt, size_t n, const char** opts,
                          Checked* c)
{
    const char* plain[16];
    size_t k = 0;
    for (; opts && opts[k]; ++k) plain[k] = opts[k];
    plain[k++] = "speculative=false";
    plain[k] = NULL;
    memset(c, 0, sizeof *c);
    c->nWant = sessionTokens(f->ref, plain, prompt, n, c->want);
    submit(b, prompt, n, opts, &c->req);
}

#define EXPECT_SESSION(b, c, reason) expectResult((b), &(c)->req, (c)->want, (c)->nWant, (reason), __LINE__)

/* Step until idle, then every one of c[n] ran to its length with its session's tokens. */
static void serveChecked(dfl2_batch* b, Checked* c, int n, int line)
{
    stepUntilIdle(b);
    for (int i = 0; i < n; ++i) expectResult(b, &c[i].req, c[i].want, c[i].nWant, DFL2_FINISH_LENGTH, line);
}
#define SERVE_CHECKED(b, c, n) serveChecked((b), (c), (n), __LINE__)

static void testBatchErrors(void)
{
    Toy toy;
    memset(&toy, 0, sizeof toy);
    dfl2_callbacks plainCb = toyCallbacks(&toy);
    dfl2_model* single = NULL;
    OK(dfl2_model_create_callbacks(&plainCb, NULL, &single));
    dfl2_batch* b = (dfl2_batch*) (void*) &b;
    EXPECT(dfl2_batch_create(single, NULL, &b), DFL2_ERR_UNAVAILABLE, "no batched callbacks");
    CHECK(b == NULL);
    EXPECT(dfl2_batch_create(NULL, NULL, &b), DFL2_ERR_INVALID_ARGUMENT, "model");
    EXPECT(dfl2_batch_create(single, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    dfl2_model_free(single);

    static BatchToy bt;
    memset(&bt, 0, sizeof bt);
    dfl2_callbacks cb = batchToyCallbacks(&bt, 2);
    dfl2_model* m = NULL;
    cb.batch_target_forward = NULL;
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "batch_* function pointer");
    cb = batchToyCallbacks(&bt, -1);
    EXPECT(dfl2_model_create_callbacks(&cb, NULL, &m), DFL2_ERR_INVALID_ARGUMENT, "max_batch");
    cb = batchToyCallbacks(&bt, 2);
    cb.batch_target_release = NULL; /* optional */
    OK(dfl2_model_create_callbacks(&cb, NULL, &m));
    dfl2_model_free(m);
    cb = batchToyCallbacks(&bt, 2);
    OK(dfl2_model_create_callbacks(&cb, NULL, &m));

    const char* tooMany[] = {"max_batch=3", NULL};
    dfl2_options* o = optionsOf(tooMany);
    EXPECT(dfl2_batch_create(m, o, &b), DFL2_ERR_OPTION_VALUE, "exceeds the model's 2");
    dfl2_options_free(o);
    OK(dfl2_options_create(&o));
    EXPECT(dfl2_options_parse(o, "fixed_costs=1,2,3"), DFL2_ERR_OPTION_VALUE, "4 or 6 numbers");
    EXPECT(dfl2_options_parse(o, "fixed_costs=1,2,3,-4"), DFL2_ERR_OPTION_VALUE, "4 or 6 numbers");
    EXPECT(dfl2_options_parse(o, "fixed_costs=1,2,3,4,"), DFL2_ERR_OPTION_VALUE, "4 or 6 numbers");
    EXPECT(dfl2_options_parse(o, "fixed_costs=1,2,3,4,5"), DFL2_ERR_OPTION_VALUE, "4 or 6 numbers");
    EXPECT(dfl2_options_parse(o, "prefill_share=-1"), DFL2_ERR_OPTION_VALUE, ">= 0");
    EXPECT(dfl2_options_parse(o, "prior_weight=0"), DFL2_ERR_OPTION_VALUE, "> 0");
    EXPECT(dfl2_options_parse(o, "prior_tau=-1"), DFL2_ERR_OPTION_VALUE, ">= 0");
    EXPECT(dfl2_options_parse(o, "tau_window=0"), DFL2_ERR_OPTION_VALUE, ">= 1");
    EXPECT(dfl2_options_parse(o, "probe_after=0"), DFL2_ERR_OPTION_VALUE, ">= 1");
    EXPECT(dfl2_options_parse(o, "max_batch=-1"), DFL2_ERR_OPTION_VALUE, ">= 0");
    OK(dfl2_options_parse(o, "fixed_costs=1,0.05,0.5,1.4"));
    OK(dfl2_options_parse(o, "fixed_costs=1,0.05,0.5,1.4,0.01,0.004"));
    OK(dfl2_options_parse(o, "prefill_share=0"));
    OK(dfl2_options_parse(o, "fixed_costs="));
    dfl2_options_free(o);

    b = makeBatch(m, NULL);
    dfl2_batch_info info;
    OK(dfl2_batch_get_info(b, &info));
    CHECK(info.max_batch == 2 && info.active == 0 && info.queued == 0 && info.steps == 0);
    const int32_t good[3] = {1, 2, 3}, bad[2] = {4, V};
    int32_t longPrompt[MAXPOS];
    for (int i = 0; i < MAXPOS; ++i) longPrompt[i] = 1;
    Req r;
    memset(&r, 0, sizeof r);
    dfl2_request q;
    memset(&q, 0, sizeof q);
    q.struct_size = sizeof q;
    q.prompt = good;
    q.n_prompt = 3;
    uint64_t id = 99;
    EXPECT(dfl2_batch_submit(NULL, &q, &id), DFL2_ERR_INVALID_ARGUMENT, "batch");
    CHECK(id == 0);
    EXPECT(dfl2_batch_submit(b, NULL, &id), DFL2_ERR_INVALID_ARGUMENT, "request");
    EXPECT(dfl2_batch_submit(b, &q, NULL), DFL2_ERR_INVALID_ARGUMENT, "request_id");
    q.struct_size = 8;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_INVALID_ARGUMENT, "struct_size");
    q.struct_size = sizeof q;
    q.prompt = bad;
    q.n_prompt = 2;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_OUT_OF_RANGE, "32 out of range [0, 32)");
    q.prompt = longPrompt;
    q.n_prompt = MAXPOS;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_TOO_LONG, "does not fit");
    q.prompt = NULL;
    q.n_prompt = 3;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_INVALID_ARGUMENT, "prompt");
    q.n_prompt = 0;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_INVALID_ARGUMENT, "empty prompt");
    const char* oracle[] = {"measure_oracle=true", NULL};
    o = optionsOf(oracle);
    q.prompt = good;
    q.n_prompt = 3;
    q.options = o;
    EXPECT(dfl2_batch_submit(b, &q, &id), DFL2_ERR_OPTION_VALUE, "measure_oracle");
    dfl2_options_free(o);
    EXPECT(dfl2_batch_cancel(b, 1), DFL2_ERR_INVALID_ARGUMENT, "no request 1"); /* nothing was accepted */

    const char* opts[] = {"max_new_tokens=6", NULL};
    uint64_t first = submit(b, good, 3, opts, &r);
    CHECK(first == 1);
    OK(dfl2_batch_get_info(b, &info));
    CHECK(info.queued == 1);
    const int32_t* t = NULL;
    size_t n = 0;
    EXPECT(dfl2_batch_get_result(b, first, &t, &n, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "has not ended");
    EXPECT(dfl2_batch_get_proposers(b, first, &t, &n), DFL2_ERR_INVALID_ARGUMENT, "has not ended");
    EXPECT(dfl2_batch_release(b, first), DFL2_ERR_INVALID_ARGUMENT, "has not ended");
    EXPECT(dfl2_batch_get_result(b, first, NULL, &n, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "tokens");
    EXPECT(dfl2_batch_step(NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "batch");
    stepUntilIdle(b);
    OK(dfl2_batch_get_result(b, first, &t, &n, NULL, NULL));
    CHECK(n == 6 && r.done == 1 && r.reason == DFL2_FINISH_LENGTH);
    const int32_t* who = NULL;
    OK(dfl2_batch_get_proposers(b, first, &who, &n));
    EXPECT(dfl2_batch_get_proposers(b, first, NULL, &n), DFL2_ERR_INVALID_ARGUMENT, "proposers");
    EXPECT(dfl2_batch_get_proposers(b, 77, &who, &n), DFL2_ERR_INVALID_ARGUMENT, "never submitted");
    OK(dfl2_batch_cancel(b, first)); /* ended: nothing happens */
    OK(dfl2_batch_release(b, first));
    EXPECT(dfl2_batch_release(b, first), DFL2_ERR_INVALID_ARGUMENT, "released");
    EXPECT(dfl2_batch_get_result(b, 77, &t, &n, NULL, NULL), DFL2_ERR_INVALID_ARGUMENT, "never submitted");
    EXPECT(dfl2_batch_get_info(b, NULL), DFL2_ERR_INVALID_ARGUMENT, "out");
    CHECK(bt.badCalls == 0 && bt.resets == 1 && bt.releases == 1);
    dfl2_batch_free(b);
    dfl2_batch_free(NULL);

    /* freed with requests active and queued (and one submitted after the last step): dropped, no on_done, nothing
     * leaked (the ASan build checks) */
    b = makeBatch(m, NULL);
    static Req left[3];
    memset(left, 0, sizeof left);
    const char* longer[] = {"max_new_tokens=40", NULL};
    for (int i = 0; i < 2; ++i) submit(b, good, 3, longer, &left[i]);
    size_t pending = 0;
    OK(dfl2_batch_step(b, &pending));
    submit(b, good, 3, longer, &left[2]);
    OK(dfl2_batch_get_info(b, &info));
    CHECK(pending == 2 && info.active == 2 && info.queued == 1 && left[0].stream.n >= 1);
    dfl2_batch_free(b);
    CHECK(left[0].done == 0 && left[1].done == 0 && left[2].done == 0);
    dfl2_model_free(m);
}

/* Greedy: every request's tokens == its own B = 1 output; requests of different lengths join when slots free and
 * mid-way; a cancel frees its slot for a queued request; the rule drafts alone and goes plain under load. */
static void testBatchGreedy(void)
{
    static BatchFixture fx;
    fixtureOpen(&fx, 3);
    enum { kN = 6 };
    static const int32_t prompts[kN][8] = {{3, 9, 27, 17}, {5, 1, 8, 30, 2, 7, 11}, {12}, {4, 4, 19, 23, 6},
                                           {31, 2, 9}, {7, 14, 21, 28, 3, 10, 17, 24}};
    static const size_t lens[kN] = {4, 7, 1, 5, 3, 8};
    static const char* maxNew[kN] = {"max_new_tokens=40", "max_new_tokens=12", "max_new_tokens=33",
                                     "max_new_tokens=25", "max_new_tokens=30", "max_new_tokens=80"};

    /* 1. the adaptive rule with fixed costs (plain(n) = 1 + 0.05 n, draft 0.5, verify 1.4, prior 4): two or more
     *    requests decode in batched plain steps, a request alone drafts (4 / (1.05 + 1.9) > 1 / 1.05) */
    const char* adaptive[] = {"fixed_costs=1,0.05,0.5,1.4", "prior_tau=4", NULL};
    dfl2_batch* b = makeBatch(fx.m, adaptive);
    static Checked r[kN];
    for (int i = 0; i < 4; ++i) {
        const char* o[] = {maxNew[i], NULL};
        submitChecked(&fx, b, prompts[i], lens[i], o, &r[i]);
    }
    const char* victimOpts[] = {maxNew[5], NULL};
    submitChecked(&fx, b, prompts[5], lens[5], victimOpts, &r[5]); /* queued behind the first four; cancelled below */
    size_t pending = 0;
    for (int s = 0; s < 3; ++s) OK(dfl2_batch_step(b, &pending));
    const char* o4[] = {maxNew[4], NULL};
    submitChecked(&fx, b, prompts[4], lens[4], o4, &r[4]); /* joins mid-way */
    dfl2_batch_info info;
    int cancelled = 0;
    while (pending) {
        OK(dfl2_batch_step(b, &pending));
        if (!cancelled && r[5].req.stream.n >= 5) {
            OK(dfl2_batch_cancel(b, r[5].req.id));
            cancelled = 1;
        }
    }
    CHECK(cancelled);
    for (int i = 0; i < 5; ++i) EXPECT_SESSION(b, &r[i], DFL2_FINISH_LENGTH);
    CHECK(r[5].req.done == 1 && r[5].req.reason == DFL2_FINISH_CANCELLED);
    const int32_t* t = NULL;
    size_t n = 0;
    OK(dfl2_batch_get_result(b, r[5].req.id, &t, &n, NULL, NULL));
    CHECK(n >= 5 && n < r[5].nWant && memcmp(t, r[5].want, n * sizeof(int32_t)) == 0);
    OK(dfl2_batch_get_info(b, &info));
    CHECK(info.active == 0 && info.queued == 0);
    CHECK(info.largest_plain >= 2 && info.drafting_steps > 0 && info.drafting_steps < info.steps && info.cycles > 0);
    CHECK(fx.bt.largestCall >= 3 && fx.bt.badCalls == 0 && fx.bt.resets == kN && fx.bt.releases == kN);
    dfl2_batch_free(b);

    /* 2. every speculative request drafts (adaptive=false): a request with one token left steps plain in the same
     *    call as the others' verifies (ragged rows in one call); a request that never speculates rides along */
    memset(&fx.bt, 0, sizeof fx.bt);
    const char* always[] = {"adaptive=false", "max_batch=2", NULL};
    b = makeBatch(fx.m, always);
    for (int i = 0; i < kN; ++i) {
        const char* o[] = {maxNew[i], i == 3 ? "speculative=false" : "speculative=true", NULL};
        submitChecked(&fx, b, prompts[i], lens[i], o, &r[i]);
    }
    SERVE_CHECKED(b, r, kN);
    int accepted = 0, plain = 0;
    for (int i = 0; i < kN; ++i) {
        dfl2_stats st;
        int32_t p = 0;
        OK(dfl2_batch_get_result(b, r[i].req.id, &t, &n, &st, &p));
        for (int c = 0; c < st.cycles; ++c) accepted += st.accepted[c];
        plain += p;
        if (i == 3) CHECK(st.cycles == 0 && p == (int32_t) n - 1);
    }
    OK(dfl2_batch_get_info(b, &info));
    CHECK(accepted > 0 && plain > 0 && fx.bt.mixedCalls > 0 && info.largest_step == 2 && fx.bt.badCalls == 0);
    dfl2_batch_free(b);
    fixtureClose(&fx);
}

/* T > 0 beside T = 0: a plain sampling request draws exactly its own session's tokens for its seed (the built-in
 * generator, the same draw order); with every request drafting (adaptive=false) a speculative sampling request's
 * tokens do not depend on its neighbours; seeds differ; greedy neighbours are unchanged. */
static void testBatchSampling(void)
{
    static BatchFixture fx;
    fixtureOpen(&fx, 4);
    static const int32_t prompt[4] = {3, 9, 27, 17};
    const char* greedy[] = {"speculative=false", "max_new_tokens=30", NULL};
    const char* t09[] = {"speculative=false", "max_new_tokens=30", "temperature=0.9", "seed=5", NULL};
    const char* t13[] = {"speculative=false", "max_new_tokens=30", "temperature=1.3", "seed=6", NULL};
    const char* spec[] = {"max_new_tokens=30", "temperature=0.8", "seed=7", NULL};
    const char* spec8[] = {"max_new_tokens=30", "temperature=0.8", "seed=8", NULL};

    const char* always[] = {"adaptive=false", NULL};
    dfl2_batch* b = makeBatch(fx.m, always);
    static Checked r[3]; /* greedy, T 0.9, T 1.3: their sessions' tokens */
    static Req s[2];     /* speculative sampling: compared with itself */
    memset(s, 0, sizeof s);
    submitChecked(&fx, b, prompt, 4, greedy, &r[0]);
    submitChecked(&fx, b, prompt, 4, t09, &r[1]);
    submit(b, prompt, 4, spec, &s[0]);
    submitChecked(&fx, b, prompt, 4, t13, &r[2]);
    CHECK(r[1].nWant == 30 && r[2].nWant == 30 && memcmp(r[1].want, r[2].want, 30 * sizeof(int32_t)) != 0);
    SERVE_CHECKED(b, r, 3);
    const int32_t* t = NULL;
    size_t n = 0;
    dfl2_stats st;
    OK(dfl2_batch_get_result(b, s[0].id, &t, &n, &st, NULL));
    int32_t beside[MAXPOS];
    memcpy(beside, t, n * sizeof(int32_t));
    size_t nBeside = n;
    int accepted = 0;
    for (int c = 0; c < st.cycles; ++c) accepted += st.accepted[c];
    CHECK(nBeside == 30 && st.cycles > 0 && accepted > 0);
    /* the same speculative sampling request alone, and with another seed */
    memset(s, 0, sizeof s);
    submit(b, prompt, 4, spec, &s[0]);
    submit(b, prompt, 4, spec8, &s[1]);
    stepUntilIdle(b);
    EXPECT_RESULT(b, &s[0], beside, nBeside, DFL2_FINISH_LENGTH);
    OK(dfl2_batch_get_result(b, s[1].id, &t, &n, NULL, NULL));
    CHECK(n == 30 && memcmp(t, beside, 30 * sizeof(int32_t)) != 0);
    CHECK(fx.bt.badCalls == 0);
    dfl2_batch_free(b);
    fixtureClose(&fx);
}

/* A request's own failure ends only that request (its error through on_done and get_result); a failed target call
 * ends the requests in it; the batch goes on; uniforms that are not in [0, 1) fail their request. */
static int32_t badBatchUniforms(void* u, dfl2_uniform_use use, double* out, size_t n)
{
    (void) u;
    (void) use;
    for (size_t i = 0; i < n; ++i) out[i] = -0.5;
    return 0;
}

static void testBatchFailures(void)
{
    static BatchFixture fx;
    fixtureOpen(&fx, 3);
    static const int32_t prompt[4] = {3, 9, 27, 17};
    const char* always[] = {"adaptive=false", NULL};
    dfl2_batch* b = makeBatch(fx.m, always);
    const char* opts[] = {"max_new_tokens=20", NULL};
    static Checked good;
    static Req r[2];
    memset(r, 0, sizeof r);
    submitChecked(&fx, b, prompt, 4, opts, &good); /* slot 0 */
    submit(b, prompt, 4, opts, &r[0]);            /* slot 1: its drafter fails */
    dfl2_options* o = optionsOf((const char*[]){"max_new_tokens=20", "temperature=0.7", NULL});
    dfl2_request q;
    memset(&q, 0, sizeof q);
    q.struct_size = sizeof q;
    q.prompt = prompt;
    q.n_prompt = 4;
    q.options = o;
    q.on_done = onDone;
    q.user_data = &r[1];
    q.uniforms = badBatchUniforms;
    OK(dfl2_batch_submit(b, &q, &r[1].id)); /* slot 2: its first token's uniform is refused */
    dfl2_options_free(o);
    fx.bt.failProposeSlot = 2;
    SERVE_CHECKED(b, &good, 1);
    const int32_t* t = NULL;
    size_t n = 0;
    EXPECT(dfl2_batch_get_result(b, r[0].id, &t, &n, NULL, NULL), DFL2_ERR_CALLBACK, "batch_drafter_propose returned 6");
    CHECK(n == 1 && t[0] == good.want[0] && r[0].done == 1 && r[0].reason == DFL2_FINISH_ERROR &&
          r[0].error == DFL2_ERR_CALLBACK);
    EXPECT(dfl2_batch_get_result(b, r[1].id, &t, &n, NULL, NULL), DFL2_ERR_CALLBACK, "outside [0, 1)");
    CHECK(n == 0 && r[1].reason == DFL2_FINISH_ERROR);
    CHECK(fx.bt.resets == 3 && fx.bt.releases == 3 && fx.bt.badCalls == 0);

    /* a failing target call ends the requests in it; the next requests run */
    fx.bt.failProposeSlot = 0;
    fx.bt.forwards = 0;
    fx.bt.failForwardAt = 3; /* admission, one step, then the failing step */
    memset(r, 0, sizeof r);
    submit(b, prompt, 4, opts, &r[0]);
    submit(b, prompt, 4, opts, &r[1]);
    stepUntilIdle(b);
    for (int i = 0; i < 2; ++i) {
        EXPECT(dfl2_batch_get_result(b, r[i].id, &t, &n, NULL, NULL), DFL2_ERR_CALLBACK,
               "the step's target forward: callback batch_target_forward returned 9");
        CHECK(r[i].reason == DFL2_FINISH_ERROR && n >= 2 && memcmp(t, good.want, n * sizeof(int32_t)) == 0);
    }
    /* a failing prefill ends the requests it computes, before their first token */
    fx.bt.forwards = 0;
    fx.bt.failForwardAt = 1;
    memset(r, 0, sizeof r);
    submit(b, prompt, 4, opts, &r[0]);
    submit(b, prompt, 4, opts, &r[1]);
    stepUntilIdle(b);
    for (int i = 0; i < 2; ++i) {
        EXPECT(dfl2_batch_get_result(b, r[i].id, &t, &n, NULL, NULL), DFL2_ERR_CALLBACK,
               "the prefill's target forward: callback batch_target_forward returned 9");
        CHECK(r[i].reason == DFL2_FINISH_ERROR && n == 0);
    }
    fx.bt.failForwardAt = 0;
    submitChecked(&fx, b, prompt, 4, opts, &good);
    SERVE_CHECKED(b, &good, 1);
    CHECK(fx.bt.badCalls == 0);
    dfl2_batch_free(b);
    fixtureClose(&fx);
}

/* Calls from inside the batch's own callbacks: on_tokens cancels its request, submits a follow-up and is refused a
 * nested step; on_done reads its result. Nothing deadlocks. */
typedef struct Reentrant {
    Stream stream; /* first: onTokens-style user data */
    dfl2_batch* batch;
    uint64_t id;
    uint64_t followUp;
    dfl2_code nestedStep;
    size_t doneTokens;
    int doneCalls;
} Reentrant;

static int32_t reentrantTokens(void* u, const int32_t* tokens, size_t n)
{
    Reentrant* r = (Reentrant*) u;
    onTokens(&r->stream, tokens, n);
    if (r->stream.chunks == 3) {
        OK(dfl2_batch_cancel(r->batch, r->id));
        dfl2_status* st = dfl2_batch_step(r->batch, NULL);
        r->nestedStep = dfl2_status_code(st);
        dfl2_status_free(st);
        static const int32_t prompt[2] = {7, 8};
        dfl2_request q;
        memset(&q, 0, sizeof q);
        q.struct_size = sizeof q;
        q.prompt = prompt;
        q.n_prompt = 2;
        OK(dfl2_batch_submit(r->batch, &q, &r->followUp));
    }
    return 0;
}

static void reentrantDone(void* u, uint64_t id, dfl2_finish_reason reason, const dfl2_status* error)
{
    Reentrant* r = (Reentrant*) u;
    const int32_t* t = NULL;
    OK(dfl2_batch_get_result(r->batch, id, &t, &r->doneTokens, NULL, NULL));
    r->doneCalls += reason == DFL2_FINISH_CANCELLED && error == NULL;
}

static void testBatchReentrant(void)
{
    static BatchFixture fx;
    fixtureOpen(&fx, 2);
    dfl2_batch* b = makeBatch(fx.m, NULL);
    static Reentrant r;
    memset(&r, 0, sizeof r);
    r.batch = b;
    static const int32_t prompt[3] = {1, 2, 3};
    dfl2_request q;
    memset(&q, 0, sizeof q);
    q.struct_size = sizeof q;
    q.prompt = prompt;
    q.n_prompt = 3;
    q.on_tokens = reentrantTokens;
    q.on_done = reentrantDone;
    q.user_data = &r;
    OK(dfl2_batch_submit(b, &q, &r.id));
    stepUntilIdle(b);
    CHECK(r.nestedStep == DFL2_ERR_INVALID_ARGUMENT && r.doneCalls == 1 && r.doneTokens == r.stream.n);
    CHECK(r.stream.chunks == 3 && r.followUp == r.id + 1);
    const int32_t* t = NULL;
    size_t n = 0;
    OK(dfl2_batch_get_result(b, r.followUp, &t, &n, NULL, NULL)); /* the follow-up ran to its length */
    CHECK(n == 64 && fx.bt.badCalls == 0);
    dfl2_batch_free(b);
    fixtureClose(&fx);
}

/* A request queue served on one thread while two threads submit, one cancels, and the main thread waits for
 * on_done: every request ends once with its own tokens; a second stepper is refused; stop ends serve. The cancelled
 * request's first chunk waits in on_tokens until its client has issued the cancel, so it ends cancelled however the
 * threads are scheduled (it once ran to its length first on a loaded machine). */
typedef struct Server {
    dfl2_batch* batch;
    dfl2_status* status;
} Server;

static void* serveThread(void* arg)
{
    Server* s = (Server*) arg;
    s->status = dfl2_batch_serve(s->batch);
    return NULL;
}

typedef struct Client {
    dfl2_batch* batch;
    Req* reqs;
    int n;
    int cancelLast;
} Client;

static void* clientThread(void* arg)
{
    Client* c = (Client*) arg;
    static const int32_t prompt[4] = {3, 9, 27, 17};
    const char* opts[] = {"max_new_tokens=24", NULL};
    const char* longOpts[] = {"max_new_tokens=90", NULL};
    for (int i = 0; i < c->n; ++i) {
        int isLast = i == c->n - 1 && c->cancelLast;
        c->reqs[i].stream.waitGate = isLast; /* its first chunk waits for the cancel: it cannot end first */
        submit(c->batch, prompt, 4, isLast ? longOpts : opts, &c->reqs[i]);
    }
    if (c->cancelLast) {
        OK(dfl2_batch_cancel(c->batch, c->reqs[c->n - 1].id));
        openGate();
    }
    return NULL;
}

static void testBatchServe(void)
{
    static BatchFixture fx;
    fixtureOpen(&fx, 2);
    static const int32_t prompt[4] = {3, 9, 27, 17}; /* every client's request (clientThread) */
    const char* ar[] = {"speculative=false", "max_new_tokens=24", NULL};
    int32_t want[MAXPOS];
    size_t nWant = sessionTokens(fx.ref, ar, prompt, 4, want);

    dfl2_batch* b = makeBatch(fx.m, NULL);
    Server server = {b, NULL};
    pthread_t st;
    CHECK(pthread_create(&st, NULL, serveThread, &server) == 0);
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    enum { kPER = 3 };
    static Req reqs[2][kPER];
    memset(reqs, 0, sizeof reqs);
    for (int c = 0; c < 2; ++c) {
        for (int i = 0; i < kPER; ++i) {
            reqs[c][i].lock = &lock;
            reqs[c][i].cond = &cond;
        }
    }
    Client clients[2] = {{b, reqs[0], kPER, 0}, {b, reqs[1], kPER, 1}};
    pthread_t ct[2];
    for (int c = 0; c < 2; ++c) CHECK(pthread_create(&ct[c], NULL, clientThread, &clients[c]) == 0);
    for (int c = 0; c < 2; ++c) pthread_join(ct[c], NULL);
    pthread_mutex_lock(&lock);
    for (;;) {
        int all = 1;
        for (int c = 0; c < 2; ++c) {
            for (int i = 0; i < kPER; ++i) all = all && reqs[c][i].done;
        }
        if (all) break;
        pthread_cond_wait(&cond, &lock);
    }
    pthread_mutex_unlock(&lock);
    size_t pending = 0;
    EXPECT(dfl2_batch_step(b, &pending), DFL2_ERR_INVALID_ARGUMENT, "already being stepped");
    OK(dfl2_batch_stop(b));
    pthread_join(st, NULL);
    CHECK(server.status == NULL);
    dfl2_status_free(server.status);
    for (int c = 0; c < 2; ++c) {
        for (int i = 0; i < kPER; ++i) {
            Req* r = &reqs[c][i];
            if (c == 1 && i == kPER - 1) {
                const int32_t* t = NULL;
                size_t n = 0;
                OK(dfl2_batch_get_result(b, r->id, &t, &n, NULL, NULL));
                CHECK(r->done == 1 && r->reason == DFL2_FINISH_CANCELLED && n < 90 && n == r->stream.n);
            } else {
                EXPECT_RESULT(b, r, want, nWant, DFL2_FINISH_LENGTH);
            }
        }
    }
    OK(dfl2_batch_stop(b)); /* no serve running: the next serve returns at once */
    OK(dfl2_batch_serve(b));
    CHECK(fx.bt.badCalls == 0 && fx.bt.resets >= 2 * kPER - 1 && fx.bt.releases == fx.bt.resets); /* the cancel may come before admission */
    dfl2_batch_free(b);
    fixtureClose(&fx);
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
    testBatchErrors();
    testBatchGreedy();
    testBatchSampling();
    testBatchFailures();
    testBatchReentrant();
    testBatchServe();
    return dfl2TestReport("capiC");
}
