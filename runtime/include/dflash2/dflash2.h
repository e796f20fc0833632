/*
 * dflash2.h — the C API of the dflash2_trt runtime (C99; also valid C++17).
 *
 * DFlash 2 speculative decoding, lossless: the tokens equal the target model's own decoding (greedy: identical;
 * sampling: identical in distribution, and identical token for token to the Python runtime when the same
 * uniforms are supplied, see dfl2_uniform_fn). One prompt at a time per session (dfl2_session), or many at once
 * in a batch (dfl2_batch: continuous batching with ragged acceptance and load-adaptive speculation; callbacks
 * models with batched callbacks, or TensorRT engines built with a batch dimension — see BACKENDS there).
 *
 * TOKEN IDS ONLY. Prompts go in and generated tokens come out as int32 token ids; turning text into ids
 * and back is the caller's tokenizer's job (the export folder carries the tokenizer files for that).
 *
 * OBJECTS (opaque handles; every create has a free that accepts NULL):
 *   dfl2_status   an error: a code and a message, both owned by the status. NULL means success.
 *   dfl2_options  string-keyed options with typed setters (see OPTIONS below).
 *   dfl2_model    what generation runs on: an export folder loaded by dfl2_model_load (backend chosen by the
 *                 manifest and the "backend" option), or caller-supplied engines (dfl2_model_create_callbacks).
 *   dfl2_session  one generation's state (KV caches through the backend, tokens, statistics).
 *   dfl2_batch    a request queue decoded together (BATCHED DECODING below): requests are submitted, stream
 *                 their tokens, end (EOS, length, cancel, error) and leave a result until released.
 *
 * OWNERSHIP AND LIFETIME.
 *   - A function returning dfl2_status* returns NULL on success; a non-NULL status belongs to the caller,
 *     who frees it with dfl2_status_free. Its message stays valid until then.
 *   - Output handles (model, session, options) belong to the caller until the matching *_free.
 *     On failure the output handle is set to NULL.
 *   - A session keeps a reference to its model: free every session of a model before the model.
 *   - Options are copied where they are used: an options object may be changed or freed right after the
 *     call that took it.
 *   - Pointers a session returns (tokens, statistics arrays) stay valid until that session's next
 *     dfl2_session_generate or dfl2_session_free.
 *   - Input arrays (prompt ids, option arrays) are only read during the call.
 *
 * THREAD SAFETY.
 *   - dfl2_api_version, dfl2_status_* on distinct statuses, and option objects used from one thread at a
 *     time are safe.
 *   - A model may be shared by sessions on several threads. Sessions of a callbacks model call the same
 *     caller functions: the library serializes their dfl2_session_generate calls with a lock held by the
 *     model, so the callbacks never run concurrently. A TensorRT model gives each session its own
 *     execution contexts (at most 8 captured shape buckets per engine, least recently used dropped), buffers
 *     and CUDA stream, and also serializes dfl2_session_generate across its sessions (their contexts share
 *     the engines' optimization profiles): sessions on several threads are safe but take turns.
 *   - Sessions of an ONNX Runtime model run concurrently: the model's ONNX Runtime sessions are shared (ONNX Runtime
 *     runs them from several threads), each dfl2_session has its own caches and bindings.
 *   - A session is used by one thread at a time (no internal locking).
 *   - Callbacks run on the thread that called dfl2_session_generate.
 *
 * OPTIONS (key: type, default; unknown keys and wrong types are rejected by the setter):
 *   generation (read by dfl2_session_create and, per request, by dfl2_batch_submit):
 *     "max_new_tokens"  int    64     tokens to generate at most (>= 1; the export's capacity also limits)
 *     "temperature"     double 0.0    0 = greedy (argmax); > 0 samples softmax(logits / T)
 *     "seed"            int    0      seed of the built-in uniform generator (see dfl2_uniform_fn)
 *     "speculative"     bool   true   false = plain autoregressive decoding of the target (the baseline)
 *     "measure_oracle"  bool   false  also count the oracle top-K acceptance (extra target passes; sessions only)
 *     "eos_ids"         int[]  model  stop tokens (an empty array disables EOS stopping)
 *     "proposer"        string "auto" who proposes a cycle's drafts: "dflash2" (the drafter) | "ngram" (prompt
 *                                     lookup only: the drafter is never called; no match = a plain target step) |
 *                                     "auto" (per cycle, PROMPT LOOKUP below)
 *     "ngram_rows"      int    0      most prompt-lookup drafts per cycle; 0 = max(4, block_size - 1)
 *     "guard"           bool   false  the acceptance guard (sessions; the Python API's default): plain target steps
 *                                     while the drafter's measured tokens per cycle do not pay for its cycles, probed
 *                                     again after a doubling backoff (dflash2_trt/runtime/guard.py states the rule).
 *                                     Lossless; its choices follow measured times, so with it a seed fixes the law of
 *                                     the tokens at T > 0 but not the sample
 *     "prefix_cache_bytes" int 1 GiB  a session's prefix reuse (PREFIX REUSE below): the most bytes the sequences it
 *                                     keeps may hold together (target K/V rows, drafter context, queued features,
 *                                     snapshots; least recently used evicted first; API 1.5: several sequences, 1.4
 *                                     kept the last one); 0: every request starts from empty caches (sessions).
 *                                     Read by dfl2_batch_create too (API 1.5): the most bytes the batch's shared
 *                                     prefix cache may hold over all its entries (PREFIX REUSE IN A BATCH below)
 *   sampling (API 1.4; applied as dflash2_trt/runtime/sampling.py applies them, in this order, to the target's logits
 *   at every prefill, plain step and verify row — row i of a verify seeing the drafts before it as committed — so the
 *   tokens are the transformed target's: its argmax at T = 0, its law at T > 0; an independent draft (draft_mode
 *   "independent") is drawn again from its proposal under the same transforms, and rejection sampling is fed the law
 *   the drafts were drawn from; neutral values change nothing):
 *     "logit_bias"      string ""     "id:bias,id:bias,..." added to those logits (bias in [-100, 100]; id < vocab)
 *     "repetition_penalty" double 1.0 > 0: a seen token's logit divided by it when > 0, multiplied otherwise
 *     "frequency_penalty" double 0.0  in [-2, 2]: subtracted once per occurrence of a seen token (prompt + committed)
 *     "presence_penalty" double 0.0   in [-2, 2]: subtracted from every seen token's logit
 *     "top_k"           int    0      keep the k most likely tokens (0 or -1: all; ties at the k-th kept)
 *     "top_p"           double 1.0    in (0, 1]: keep the most likely tokens whose mass before them is < top_p
 *     "min_p"           double 0.0    in [0, 1]: keep the tokens of probability >= min_p x the largest
 *     "logprobs"        bool   false  each generated token's log-probability (dfl2_session_get_logprobs)
 *     "top_logprobs"    int    0      in [0, 20] (needs "logprobs"): each token's row's most likely tokens with theirs
 *   model (read by dfl2_model_load / dfl2_model_create_callbacks):
 *     "backend"         string "auto" "auto" (TensorRT where it loads, else ONNX Runtime; dfl2_model_get_note says
 *                                     why) | "tensorrt" (or "trt") | "ort" (dfl2_model_load); callbacks models ignore it
 *     "draft_mode"      string "greedy" "greedy" | "viterbi" | "independent" (which drafter head runs)
 *     "verify_checksums" bool  true   hash every file the manifest lists before loading
 *     "plugin_library"  string ""     libdflash2_plugins.so to load ("": $DFLASH2_PLUGIN_LIB, else the engines' copy)
 *     "device"          int    0      CUDA device ordinal (TensorRT)
 *     "cuda_graphs"     bool   true   capture the draft and verify steps as CUDA graphs (TensorRT)
 *     "threads"         int    0      intra-op threads of every ONNX Runtime session (0: ONNX Runtime's default)
 *     "ort_library"     string ""     libonnxruntime to open ("": $ORT_LIBRARY, else the system's
 *                                     libonnxruntime.so.1, else the onnxruntime wheel's copy in $VIRTUAL_ENV)
 *     "ort_ops_library" string ""     the project's ONNX Runtime op library ("": $DFLASH2_ORT_OPS, else
 *                                     libdflash2_ort_ops.so beside libdflash2; none: ONNX Runtime's own ops). With it the
 *                                     fused target runs dflash2.DecodeAttention (+ PanelMatMul where its kernels run
 *                                     AVX-512, or $DFLASH2_ORT_PANELS=1) and the drafter its one-node layer and selector
 *                                     graphs, as the Python runtime does
 *   batch (read by dfl2_batch_create; the rule is stated under BATCHED DECODING):
 *     "max_batch"       int    0      sequences decoded together (slots); 0 = the model's max_batch (callbacks:
 *                                     dfl2_callbacks.max_batch; TensorRT: the target engine's batch)
 *     "adaptive"        bool   true   draft only while it pays (the rule); false = every speculative request drafts
 *     "prior_tau"       double 1.5    a request's estimated tokens per cycle before its first cycles
 *     "prior_weight"    double 2.0    cycles the prior counts for (> 0)
 *     "tau_window"      int    32     cycles per request in its estimate
 *     "probe_after"     int    64     plain steps in a row after which a request's estimate returns to the prior
 *     "fixed_costs"     string ""     "" = step costs measured in this run; "a,b,d,v" = given costs in seconds:
 *                                     plain target call over n requests a + b * n, one draft d, one verify v;
 *                                     "a,b,d,v,s,r" (API 1.6) also a whole step s and one chunked prompt row r
 *     "prefill_chunk"   int    512    most prompt rows a step computes over the prompts joining while other
 *                                     requests decode (API 1.5; chunked prefill, BATCHED DECODING below); 0 = no cap
 *     "prefill_share"   double 1.5    (API 1.6) fewer rows where they are measured dear: those whose target call
 *                                     takes about this many decoding steps; 0 = "prefill_chunk" rows (both 0:
 *                                     whole prompts)
 *   A setter stores any known key on any options object; each create reads the keys it uses.
 */
#ifndef DFLASH2_DFLASH2_H
#define DFLASH2_DFLASH2_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define DFL2_API
#elif defined(DFL2_BUILDING_LIBRARY)
#define DFL2_API __attribute__((visibility("default")))
#else
#define DFL2_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ---------------------------------------------------------------------------------------- */

#define DFL2_API_VERSION_MAJOR 1
#define DFL2_API_VERSION_MINOR 6 /* 1.1: dfl2_batch, the batched callbacks, DFL2_FINISH_ERROR; 1.2: prompt lookup
                                  * ("proposer", "ngram_rows", dfl2_session_get_proposers, dfl2_batch_get_proposers);
                                  * 1.3: the ONNX Runtime backend ("backend" "ort", "threads", "ort_library",
                                  * dfl2_model_get_note); 1.4: a session's prefix reuse ("prefix_cache_bytes",
                                  * dfl2_stats.cached_tokens: the struct grew at its end, so a program compiled
                                  * against an older header must be rebuilt before it calls dfl2_*_get_stats or
                                  * dfl2_batch_get_result with stats); the sampling options and logprobs
                                  * (dfl2_logprob, dfl2_session_get_logprobs, dfl2_batch_get_logprobs); 1.5:
                                  * chunked prefill and prefix reuse in a batch ("prefill_chunk",
                                  * "prefix_cache_bytes" read by dfl2_batch_create, dfl2_stats.cached_tokens in a
                                  * batch's results, dfl2_batch_info's prefill and prefix counters: the struct grew
                                  * at its end, so a program compiled against an older header must be rebuilt
                                  * before it calls dfl2_batch_get_info); 1.6: the prefill's time budget
                                  * ("prefill_share", "fixed_costs" with 6 numbers) */
#define DFL2_API_VERSION_PATCH 0
/* (major << 16) | (minor << 8) | patch, of the header a program was compiled with */
#define DFL2_API_VERSION \
    ((DFL2_API_VERSION_MAJOR << 16) | (DFL2_API_VERSION_MINOR << 8) | DFL2_API_VERSION_PATCH)
/* The manifest_version of export folders this library reads: DFL2_MANIFEST_VERSION, and
 * DFL2_MANIFEST_STATE_VERSION for a target with Gated DeltaNet "linear" layers (their state the target graph takes
 * and returns; run by the ONNX Runtime and TensorRT backends) or "sliding" window layers (their K/V in ring buffers;
 * run by the ONNX Runtime and TensorRT backends) beside "attention" layers. */
#define DFL2_MANIFEST_VERSION 2
#define DFL2_MANIFEST_STATE_VERSION 3

/* The version of the loaded library, encoded like DFL2_API_VERSION. A program compiled against major M
 * must check (dfl2_api_version() >> 16) == M. */
DFL2_API uint32_t dfl2_api_version(void);

/* ---- status ----------------------------------------------------------------------------------------- */

typedef enum dfl2_code {
    DFL2_OK = 0,
    DFL2_ERR_INVALID_ARGUMENT = 1,  /* NULL handle or pointer, bad size, bad value */
    DFL2_ERR_UNKNOWN_OPTION = 2,    /* option key not in the list above */
    DFL2_ERR_OPTION_TYPE = 3,       /* option set with the wrong typed setter / unparsable value */
    DFL2_ERR_OPTION_VALUE = 4,      /* option value out of its range or not one of its choices */
    DFL2_ERR_NOT_FOUND = 5,         /* export folder, manifest or a listed file is missing */
    DFL2_ERR_CORRUPT = 6,           /* manifest is not valid JSON / lacks entries; checksum mismatch */
    DFL2_ERR_VERSION_MISMATCH = 7,  /* manifest format or version this library does not read */
    DFL2_ERR_UNAVAILABLE = 8,       /* backend not compiled in / cannot run here (no GPU, no TensorRT) */
    DFL2_ERR_OUT_OF_RANGE = 9,      /* token id outside [0, vocab) */
    DFL2_ERR_TOO_LONG = 10,         /* prompt does not fit the positions the export can hold */
    DFL2_ERR_CALLBACK = 11,         /* a caller callback returned non-zero */
    DFL2_ERR_BACKEND = 12,          /* the inference backend failed (CUDA / TensorRT error) */
    DFL2_ERR_OUT_OF_MEMORY = 13,
    DFL2_ERR_INTERNAL = 14
} dfl2_code;

typedef struct dfl2_status dfl2_status;

/* The code of a status; DFL2_OK for NULL. */
DFL2_API dfl2_code dfl2_status_code(const dfl2_status* status);
/* The message of a status ("ok" for NULL); owned by the status. */
DFL2_API const char* dfl2_status_message(const dfl2_status* status);
DFL2_API void dfl2_status_free(dfl2_status* status);

/* ---- options ---------------------------------------------------------------------------------------- */

typedef struct dfl2_options dfl2_options;

DFL2_API dfl2_status* dfl2_options_create(dfl2_options** out);
DFL2_API void dfl2_options_free(dfl2_options* options);
DFL2_API dfl2_status* dfl2_options_set_int(dfl2_options* options, const char* key, int64_t value);
DFL2_API dfl2_status* dfl2_options_set_double(dfl2_options* options, const char* key, double value);
DFL2_API dfl2_status* dfl2_options_set_bool(dfl2_options* options, const char* key, int value);
DFL2_API dfl2_status* dfl2_options_set_string(dfl2_options* options, const char* key, const char* value);
/* values: n int32 (may be NULL when n == 0) */
DFL2_API dfl2_status* dfl2_options_set_int_array(dfl2_options* options, const char* key, const int32_t* values,
                                                 size_t n);
/* "key=value" with the value written as text and parsed by the key's type: int / double as decimal,
 * bool as true|false|1|0, int[] as comma-separated ints (empty = no ids), string verbatim. */
DFL2_API dfl2_status* dfl2_options_parse(dfl2_options* options, const char* key_equals_value);

/* ---- models ----------------------------------------------------------------------------------------- */

typedef struct dfl2_model dfl2_model;

/* Load an export folder (what dflash2-export writes): reads and checks manifest.json (format
 * "dflash2-trt-export", manifest_version DFL2_MANIFEST_VERSION or DFL2_MANIFEST_STATE_VERSION), the manifest's
 * JSON Schema, listed files,
 * checksums)
 * and opens the backend ("backend" option). "tensorrt" when this library was built with it and a GPU with
 * TensorRT is present; "ort": ONNX Runtime on the CPU (when this library was built with its C API headers; the
 * library itself is opened at run time, see "ort_library"), the export's fused target graph and the drafter's
 * context, block and selector-head graphs; "auto": TensorRT, else ONNX Runtime. A backend that cannot run here gives
 * DFL2_ERR_UNAVAILABLE with the reason (ONNX Runtime absent, its C API older than the headers', not compiled in). */
DFL2_API dfl2_status* dfl2_model_load(const char* export_dir, const dfl2_options* options, dfl2_model** out);

/* Check an export folder's manifest without opening a backend (format, version, entries, files; checksums
 * when options say so, which is the default). */
DFL2_API dfl2_status* dfl2_manifest_check(const char* export_dir, const dfl2_options* options);

/* "Bring your own engines": the caller runs the target and the drafter, the library runs the DFlash 2
 * loop. Every function returns 0 on success; non-zero stops generation with DFL2_ERR_CALLBACK. Arrays are
 * row-major; V = vocab_size, F = feature_dim, L = block_size - 1, K = top_k. The library owns every buffer
 * passed to a callback; they are valid only during the call. */
typedef struct dfl2_callbacks {
    uint32_t struct_size;  /* sizeof(dfl2_callbacks): only that many bytes are read, so the struct can grow;
                            * fields past a caller's (older, smaller) struct read as absent (zero) */
    void* user_data;       /* first argument of every callback */
    int32_t vocab_size;    /* V */
    int32_t feature_dim;   /* F: context features per position (target -> drafter); may be 0 */
    int32_t block_size;    /* bs >= 2: the anchor and L = bs - 1 draft rows */
    int32_t top_k;         /* K >= 1 candidates per draft row */
    int32_t max_positions; /* positions the caches can hold (prompt + generated) */
    const int32_t* eos_ids; /* default stop tokens (copied at create); may be NULL when n_eos_ids == 0 */
    size_t n_eos_ids;

    /* Target: forget the cache (a new request). */
    int32_t (*target_reset)(void* user_data);
    /* Target: run ids[n] at positions cache_length .. cache_length + n - 1 (appended to the cache);
     * write logits [n, V] and context features [n, F]. */
    int32_t (*target_forward)(void* user_data, const int32_t* ids, int32_t n, float* logits, float* features);
    /* Target: keep the first `length` cached positions. */
    int32_t (*target_crop)(void* user_data, int32_t length);
    /* Drafter: forget the context (a new request). */
    int32_t (*drafter_reset)(void* user_data);
    /* Drafter: features [m, F] of positions start .. start + m - 1 join the draft context. */
    int32_t (*drafter_add_context)(void* user_data, const float* features, int32_t m, int32_t start);
    /* Drafter: draft the block [anchor, MASK x L] at positions pos .. pos + L, of which the first `rows`
     * (0 <= rows <= L; fewer than L on a final partial block) will be verified: a selector drafter chooses
     * its path over those rows alone by giving the rows past them zero hidden states. uniforms [L] in
     * [0, 1) when temperature > 0, else NULL. Write tokens [L], proposal [L, K] (the probability the
     * drafter gave each candidate; one-hot at T = 0) and cand [L, K] (the row's top-K candidates); rows past
     * `rows` are not read. A drafter whose sampling proposal is not confined to cand (no selector) writes it
     * over the whole vocabulary into vocab_proposal [L, V] and sets *vocab_proposal_used = 1 (else leave
     * both untouched). */
    int32_t (*drafter_propose)(void* user_data, int32_t anchor, int32_t pos, int32_t rows, float temperature,
                               const float* uniforms, int32_t* tokens, float* proposal, int32_t* cand,
                               float* vocab_proposal, int32_t* vocab_proposal_used);

    /* ---- batched decoding (dfl2_batch; API 1.1). A model that only runs sessions leaves these zero. ----
     * Slots 0 .. max_batch - 1: a request holds one slot from its admission to its end; each slot has its own
     * target cache (ragged: every slot its own length) and its own drafter context. Buffers as above (owned by
     * the library, valid during the call). The functions above are still required (sessions use them). */
    int32_t max_batch; /* slots the batched callbacks serve (>= 1 to use dfl2_batch; 0: no batched callbacks) */
    /* Target: a new request takes `slot`; its cache starts empty. */
    int32_t (*batch_target_reset)(void* user_data, int32_t slot);
    /* Target: the slot's request ended (free its memory, skip it) until the next batch_target_reset of the slot.
     * May be NULL. */
    int32_t (*batch_target_release)(void* user_data, int32_t slot);
    /* Target, one call over n_seqs >= 1 requests of distinct slots: request i appends rows[i] >= 1 ids at
     * positions cache_lengths[i] .. cache_lengths[i] + rows[i] - 1 of its slot's cache (cache_lengths[i] = the
     * positions its slot holds, as this library counts them after crops). ids are packed [sum(rows)] in request
     * order; write features [sum(rows), F] and logits in the same order: [sum(rows), V], or with last_logits = 1
     * only each request's last row, [n_seqs, V]. One call per step over every active request (plain: 1 row,
     * drafting: 1 + drafts; last_logits 0), and one per admission over the new prompts (last_logits 1). */
    int32_t (*batch_target_forward)(void* user_data, int32_t n_seqs, const int32_t* slots,
                                    const int32_t* cache_lengths, const int32_t* rows, const int32_t* ids,
                                    int32_t last_logits, float* logits, float* features);
    /* Target: the slot keeps its first `length` cached positions. */
    int32_t (*batch_target_crop)(void* user_data, int32_t slot, int32_t length);
    /* Drafter of a slot: forget the context (a new request). */
    int32_t (*batch_drafter_reset)(void* user_data, int32_t slot);
    /* Drafter of a slot: features [m, F] of positions start .. start + m - 1 join its context (the prompt's and
     * the plain steps' features arrive together, before the slot's next draft). */
    int32_t (*batch_drafter_add_context)(void* user_data, int32_t slot, const float* features, int32_t m,
                                         int32_t start);
    /* Drafter of a slot: drafter_propose. */
    int32_t (*batch_drafter_propose)(void* user_data, int32_t slot, int32_t anchor, int32_t pos, int32_t rows,
                                     float temperature, const float* uniforms, int32_t* tokens, float* proposal,
                                     int32_t* cand, float* vocab_proposal, int32_t* vocab_proposal_used);
} dfl2_callbacks;

DFL2_API dfl2_status* dfl2_model_create_callbacks(const dfl2_callbacks* callbacks, const dfl2_options* options,
                                                  dfl2_model** out);
/* Frees a model (NULL is fine). Its sessions must have been freed. */
DFL2_API void dfl2_model_free(dfl2_model* model);

typedef struct dfl2_model_info {
    int32_t vocab_size;
    int32_t block_size;
    int32_t top_k;
    int32_t max_positions;
    const char* backend; /* "callbacks" | "tensorrt" | "onnxruntime"; owned by the model */
} dfl2_model_info;

DFL2_API dfl2_status* dfl2_model_get_info(const dfl2_model* model, dfl2_model_info* out);
/* One line on what runs the model and why: the backend, for ONNX Runtime its version, which rule found the library
 * and its path, the graphs and threads; with "backend" "auto", why TensorRT was not taken. Owned by the model. */
DFL2_API dfl2_status* dfl2_model_get_note(const dfl2_model* model, const char** note);

/* ---- sessions --------------------------------------------------------------------------------------- */

typedef struct dfl2_session dfl2_session;

DFL2_API dfl2_status* dfl2_session_create(dfl2_model* model, const dfl2_options* options, dfl2_session** out);
DFL2_API void dfl2_session_free(dfl2_session* session);

/* Streaming: called with each newly committed chunk of tokens (the first token alone, then accepted drafts +
 * the bonus token of each cycle, cut after an EOS). Return 0 to go on, non-zero to cancel: generation stops
 * after that chunk, finish_reason becomes DFL2_FINISH_CANCELLED and dfl2_session_generate returns NULL. */
typedef int32_t (*dfl2_token_fn)(void* user_data, const int32_t* tokens, size_t n);

/* Where random numbers come from when temperature > 0. The loop asks, in the Python runtime's order, for
 * n uniforms in [0, 1): DFL2_UNIFORM_DRAFT (n = L, float32 precision, handed to the drafter) once per
 * cycle, and DFL2_UNIFORM_ACCEPT (n = 1, float64) for each rejection test and each sampled token.
 * Supplying numpy.random.Generator.random draws (dtype float32 for DRAFT) reproduces the Python runtime's
 * tokens for the same seed. Without one, a built-in generator seeded by the "seed" option is used (the
 * same stream on every platform, but not numpy's). Return non-zero to fail with DFL2_ERR_CALLBACK. */
typedef enum dfl2_uniform_use { DFL2_UNIFORM_DRAFT = 0, DFL2_UNIFORM_ACCEPT = 1 } dfl2_uniform_use;
typedef int32_t (*dfl2_uniform_fn)(void* user_data, dfl2_uniform_use use, double* out, size_t n);

/* fn NULL restores the built-in generator. Kept for every later generate of this session. */
DFL2_API dfl2_status* dfl2_session_set_uniform_source(dfl2_session* session, dfl2_uniform_fn fn, void* user_data);

/* Generate from prompt ids[n] (each in [0, vocab); 1 <= n and n + 1 <= max_positions). One session serves many
 * requests one after another: each starts from what the session kept of the earlier ones (PREFIX REUSE below), the
 * rest of its state reset. on_tokens may be NULL.
 *
 * PREFIX REUSE (API 1.4; several sequences from 1.5). After a request the session keeps a copy of its sequence
 * (ONNX Runtime backend; the callbacks and TensorRT backends keep nothing: every request starts empty): the prompt +
 * generated tokens its target cache holds, their K/V rows, the drafter's context (its K/V and the features of
 * positions it had not taken in yet) and, for a target with linear (Gated DeltaNet) or sliding-window layers, whose
 * state cannot be cropped, snapshots after the prompt's prefill and at the request's end. The next prompt restores
 * the kept sequence sharing the longest common prefix with it by token ids: at most all but the prompt's last token;
 * for a request that drafts with the DFlash 2 drafter, within the drafter context the sequence rebuilds; for a
 * stateful target the longest snapshot at or below the match. A sequence extending a kept one replaces it (its
 * snapshots kept); least recently used sequences are evicted so that all stay within "prefix_cache_bytes". Exact:
 * the tokens equal a run from an empty session (greedy; at T > 0 the same uniforms give the same tokens), and the
 * drafter drafts from the context it would have had. dfl2_stats.cached_tokens says how many prompt positions were
 * restored. The twin of dflash2_trt/runtime/prefix_cache.py's PrefixCache (the same class serves a batch's slots:
 * PREFIX REUSE IN A BATCH). A failed generate keeps nothing of its own sequence. */
DFL2_API dfl2_status* dfl2_session_generate(dfl2_session* session, const int32_t* prompt, size_t n,
                                            dfl2_token_fn on_tokens, void* user_data);

typedef enum dfl2_finish_reason {
    DFL2_FINISH_NONE = 0,       /* no generation yet, or it failed */
    DFL2_FINISH_EOS = 1,        /* a stop token was generated (it is the last token) */
    DFL2_FINISH_LENGTH = 2,     /* max_new_tokens or the export's capacity reached */
    DFL2_FINISH_CANCELLED = 3,  /* the token callback asked to stop (batches: or dfl2_batch_cancel) */
    DFL2_FINISH_ERROR = 4       /* batches: the request failed (its error: on_done, dfl2_batch_get_result) */
} dfl2_finish_reason;

/* The tokens of the last generate (EOS included when hit); valid until the next generate / free. */
DFL2_API dfl2_status* dfl2_session_get_tokens(const dfl2_session* session, const int32_t** tokens, size_t* n);

/* docs/design.md statistics of the last generate. tau = mean over cycles of accepted drafts + 1 (0 without
 * cycles); per-position arrays have n_positions = the largest block's draft rows: cumulative r_i =
 * P(drafts 1..i accepted) over cycles that proposed >= i drafts, conditional c_i = r_i / r_{i-1}.
 * oracle_tau < 0 when not measured. Arrays are owned by the session (valid until next generate / free). */
typedef struct dfl2_stats {
    double tau;
    double oracle_tau;
    int32_t cycles;
    int32_t n_tokens;
    int32_t n_positions;
    dfl2_finish_reason finish_reason;
    const double* per_position_cumulative;  /* [n_positions] */
    const double* per_position_conditional; /* [n_positions] */
    const int32_t* accepted;                /* [cycles] accepted drafts per cycle */
    const int32_t* proposed;                /* [cycles] drafts verified per cycle */
    const int32_t* oracle_accepted;         /* [cycles] when measured, else NULL */
    double elapsed_s;                       /* wall time, oracle passes excluded */
    int32_t cached_tokens;                  /* prompt positions restored by prefix reuse, not computed (API 1.4:
                                             * sessions; 1.5: a batch's results too) */
} dfl2_stats;

DFL2_API dfl2_status* dfl2_session_get_stats(const dfl2_session* session, dfl2_stats* out);

/* A generated token's log-probability under the transformed target law (the log of the law the sampling options
 * make, at temperature 1 for a greedy request; a token cut by top_k / top_p / min_p is -inf and never listed among
 * the top ones): the target's, never the drafter's (API 1.4). */
typedef struct dfl2_logprob {
    int32_t token;
    double logprob;
    int32_t n_top;               /* entries below: min(top_logprobs, tokens of finite logprob) */
    const int32_t* top_ids;      /* [n_top] the row's most likely tokens, most likely first (ties: lower id) */
    const double* top_logprobs;  /* [n_top] theirs */
} dfl2_logprob;

/* The logprobs of the last generate's tokens (n = its tokens when "logprobs" was set, else 0; *logprobs NULL when
 * n = 0), owned by the session (valid until the next generate / free). */
DFL2_API dfl2_status* dfl2_session_get_logprobs(const dfl2_session* session, const dfl2_logprob** logprobs, size_t* n);

/* ---- prompt lookup (API 1.2) -----------------------------------------------------------------------------
 *
 * Beside the DFlash 2 drafter a cycle's drafts can come from prompt lookup: the continuation of the context's
 * latest earlier occurrence of its own last n tokens (n = 4 down to 2; context = prompt + generated), up to
 * "ngram_rows" drafts, no model (the twin of dflash2_trt/runtime/ngram.py). Its drafts are deterministic, verified
 * like the drafter's against a one-hot proposal (greedy matching at T = 0, rejection sampling at T > 0; a lookup
 * cycle draws no DRAFT uniforms), so the output stays the target's own. "auto" takes the lookup when the context has
 * a match and the lookup's measured tokens per cycle (an exponential mean, decay 0.8, both proposers starting at 2;
 * a lookup with a match that was not taken drifts back towards 2) are at least the drafter's, else the drafter.
 * While lookups run, the committed positions' features wait and join the drafter's context in one
 * drafter_add_context call when the drafter runs next. In a batch the load-adaptive rule weighs each request's
 * preferred proposal (a lookup costs its verify only, no draft time) and, for a request whose drafter proposal it
 * leaves out, its lookup. Every model has a drafter (the callbacks are required); with "ngram" it is never called.
 */
typedef enum dfl2_proposer { DFL2_PROPOSER_DFLASH2 = 0, DFL2_PROPOSER_NGRAM = 1 } dfl2_proposer;

/* Who proposed each cycle of the last generate: proposers [n] (dfl2_proposer values; n = dfl2_stats.cycles), owned
 * by the session (valid until the next generate / free). */
DFL2_API dfl2_status* dfl2_session_get_proposers(const dfl2_session* session, const int32_t** proposers, size_t* n);

/* ---- batched decoding (API 1.1) --------------------------------------------------------------------------
 *
 * A dfl2_batch is a request queue decoded together, the twin of the Python runtime's BatchDecoder
 * (dflash2_trt/runtime/batch.py): requests join and leave between steps (continuous batching), every request has
 * its own accepted length each cycle (ragged acceptance), its own EOS ids, max tokens, temperature and seed. Greedy,
 * a request's tokens are exactly its own single-session output whatever the batch; at T > 0 it draws its own
 * uniforms in the single loop's order, so its tokens follow the target's law and depend on the others only through
 * the rule's choice of plain step or cycle (not at all with "adaptive" false or "speculative" false).
 * A step: admit queued requests into free slots; one prefill call (below); choose which requests draft (the rule
 * below); draft for those; ONE target call for every active request whose prompt is whole (ragged rows: a plain
 * request's last token, a drafting request's [last token, drafts], each slot at its own cache length); accept per
 * request (its own accepted length); retire the ended ones, freeing their slots.
 * CHUNKED PREFILL (API 1.5; the twin of the Python BatchDecoder's prefill_chunk and prefill_share). The prompts
 * still prefilling, in the order they were admitted, compute their next rows in one target call per step while other
 * requests decode (a long prompt joining running streams delays their next token by one chunk's time, not by the
 * whole prompt's): at most "prefill_chunk" rows over all of them, and with "prefill_share" s > 0 (API 1.6) the rows
 * r = max(1, floor(s * step / row)) by the measured (or "fixed_costs") seconds of a whole step and of one chunked
 * prompt row, 8 while either is unmeasured; whole prompts while nobody decodes, or with both options 0. A
 * prompt whose last row is computed draws its first token; its rows' features reach its drafter in one
 * batch_drafter_add_context call when the drafter first proposes. The tokens are those of whole-prompt prefill.
 * dfl2_batch_info counts the prefill calls and rows.
 * PREFIX REUSE IN A BATCH (API 1.5; ONNX Runtime backend; the twin of the Python batch loop's PrefixCache). A batch
 * keeps finished requests' sequences (prompt + generated tokens) in one cache its slots share: entries hold copies of
 * the target's K/V rows, the snapshots of a hybrid target's linear states / a sliding target's rings (after each
 * prompt's prefill and at each request's end) and the drafter's context. A request admitted to a slot restores the
 * entry sharing the longest common prefix by token ids with its prompt (at most all but its last token; a stateful
 * target's longest snapshot at or below the match; a drafting request's only as far as the entry rebuilds the
 * drafter's context) and prefills the rest, so requests diverging from one cached prefix, admitted together, each
 * start from it. A sequence that extends an entry replaces it (its snapshots kept); least recently used entries are
 * evicted so that the entries never hold more than "prefix_cache_bytes" (0: nothing kept). Exact: the tokens are
 * those of a batch without the cache (greedy; at T > 0 the same uniforms give the same tokens).
 * dfl2_stats.cached_tokens gives a request's restored positions, dfl2_batch_info the cache's hits, bytes, entries
 * and evictions. The callbacks and TensorRT backends keep nothing in a batch.
 *
 * THE RULE ("adaptive" = true). Per step, with n active requests and the speculative ones sorted by their
 * estimated tokens per cycle t_1 >= t_2 >= ..., draft for the k that maximise
 *     ((n - k) + t_1 + ... + t_k) / (plain(n) + k * (draft + max(verify, 0))),
 * plain(m) = the time of a step's target call over m requests none of which drafts, draft = one drafter
 * proposal (a prompt's context excluded), verify = what one drafting request adds to a step's target call
 * ((call time - plain(n)) / k over drafting steps): measured in this run in wall time (running means; plain
 * linear between measured sizes; a GPU deployment may give "fixed_costs" calibrated on the device) or given by
 * "fixed_costs". A request's estimate = (prior_tau * prior_weight + tokens
 * committed over its last tau_window cycles) / (prior_weight + cycles) + one standard error of those cycles (from
 * the first cycle on, their spread taken as at least 0.5: it stops drafting on evidence, not after an unlucky stretch); for a final partial block of r < L
 * draft rows only its share of the gain, 1 + (estimate - 1) * r / L. Until costs are measured: the first step
 * is plain, the next ones draft for the speculative request of the best estimate (one) until a proposal and a
 * verify are measured. A request kept plain probe_after steps in a row returns to the prior (its acceptance is
 * measured again). So at low load a request whose drafts are accepted drafts, at high load the batch decodes in
 * batched plain steps. Measured costs add the realized check: per batch size n, the tokens per second of whole
 * steps that drafted and of plain ones (exponential means over 8 steps); the first 4 steps at each n are plain;
 * then while drafting steps made fewer tokens per second than plain ones, or (drafting not yet measured at n) the
 * rule's last choice at n was plain (a step whose candidates offered it no proposal, prompt lookups without a
 * match, is no choice), steps at n are plain without weighing, every 16th weighed (a probe). Lossless
 * either way (the rule picks which exact procedure makes a request's next tokens).
 *
 * BACKENDS. A callbacks model with max_batch >= 1 and the batch_* callbacks. A TensorRT model: up to the batch its
 * target engine takes per call (dflash2 build-engines --max-batch N; engines built without it take 1, so their
 * batches have one slot: a request queue decoded one at a time). The step's sequences run in one target engine
 * call (ragged cache lengths; a prompt longer than the engine's step rows is prefilled alone), each slot drafts
 * with its own B = 1 drafter. A batch has its own CUDA stream, target contexts, buffers and KV cache [max_batch
 * slots, ...] and one drafter's state per slot; it takes turns with the model's sessions and other batches. The
 * batched TensorRT path has NOT been run on a GPU (runtime/README.md: what is verified where). An ONNX Runtime
 * model: up to 16 slots, each slot its own B = 1 target and drafter caches, a step's sequences run one after
 * another (a batched request's tokens are its single run's).
 *
 * OWNERSHIP AND LIFETIME. A batch keeps a reference to its model (free batches before the model). A request's
 * prompt and options are copied by dfl2_batch_submit. The result of an ended request (tokens, statistics) stays
 * in the batch until dfl2_batch_release or dfl2_batch_free; the pointers dfl2_batch_get_result returns are valid
 * until then. dfl2_batch_free drops requests still queued or active without calling their on_done.
 *
 * THREADS.
 *   - dfl2_batch_submit, dfl2_batch_cancel, dfl2_batch_stop, dfl2_batch_get_info, dfl2_batch_get_result and
 *     dfl2_batch_release may be called from any thread at any time, also from inside this batch's callbacks
 *     (they take the batch's own lock, never the model's).
 *   - dfl2_batch_step and dfl2_batch_serve run the loop on the calling thread, one at a time: a second caller
 *     (another thread, or a callback of this batch) gets DFL2_ERR_INVALID_ARGUMENT and nothing runs.
 *   - Every callback (the model's, on_tokens, on_done, uniforms) runs on the thread inside dfl2_batch_step or
 *     dfl2_batch_serve. The model's callbacks and on_tokens run under the model's lock (the model's sessions and
 *     other batches take turns), so they must not call dfl2_session_generate or step a batch of the same model;
 *     on_done runs after the lock is released.
 *   - dfl2_batch_free: no other call on the batch may be running or follow.
 */

typedef struct dfl2_batch dfl2_batch;

/* Called once when a request ends: reason EOS / LENGTH / CANCELLED, or ERROR with `error` (owned by the library,
 * valid during the call; NULL otherwise). Its result can be read (dfl2_batch_get_result) from inside the call. */
typedef void (*dfl2_done_fn)(void* user_data, uint64_t request, dfl2_finish_reason reason, const dfl2_status* error);

typedef struct dfl2_request {
    uint32_t struct_size;          /* sizeof(dfl2_request) */
    const int32_t* prompt;         /* [n_prompt] ids in [0, vocab); 1 <= n_prompt and n_prompt + 1 <= max_positions */
    size_t n_prompt;
    const dfl2_options* options;   /* the generation keys ("measure_oracle" is refused); NULL: defaults */
    dfl2_token_fn on_tokens;       /* each committed chunk (as for sessions); non-zero return cancels; may be NULL */
    dfl2_done_fn on_done;          /* may be NULL */
    void* user_data;               /* first argument of on_tokens and on_done */
    dfl2_uniform_fn uniforms;      /* this request's random numbers; NULL: the built-in generator seeded by "seed" */
    void* uniforms_user_data;
} dfl2_request;

/* A batch over a model's batched backend (options: the batch keys). DFL2_ERR_UNAVAILABLE when the model has no
 * batched backend; DFL2_ERR_OPTION_VALUE when max_batch exceeds the model's. */
DFL2_API dfl2_status* dfl2_batch_create(dfl2_model* model, const dfl2_options* options, dfl2_batch** out);
DFL2_API void dfl2_batch_free(dfl2_batch* batch);

/* Queue a request (checked now: prompt ids, length, options); it joins at the next step with a free slot.
 * *request_id: its id (>= 1, never reused by this batch). */
DFL2_API dfl2_status* dfl2_batch_submit(dfl2_batch* batch, const dfl2_request* request, uint64_t* request_id);

/* Cancel a queued or active request: it ends at the start of the next step (DFL2_FINISH_CANCELLED, keeping the
 * tokens it has; its slot is freed). A request that already ended: nothing happens. An id this batch never
 * gave: DFL2_ERR_INVALID_ARGUMENT. */
DFL2_API dfl2_status* dfl2_batch_cancel(dfl2_batch* batch, uint64_t request_id);

/* One step on the calling thread. *pending (may be NULL): requests queued or active afterwards (0: idle). A
 * request's own failure (a callback error in its slot's reset, its draft or acceptance, its uniforms; every request
 * of a failed target call) ends that request with DFL2_FINISH_ERROR and is not the step's error. */
DFL2_API dfl2_status* dfl2_batch_step(dfl2_batch* batch, size_t* pending);

/* Serve on the calling thread: step while requests are queued or active, wait for submissions when idle, return
 * once dfl2_batch_stop was called (after the step in progress; requests left stay for a later step / serve). */
DFL2_API dfl2_status* dfl2_batch_serve(dfl2_batch* batch);
/* Make dfl2_batch_serve return (the running one, or else the next one at once). */
DFL2_API dfl2_status* dfl2_batch_stop(dfl2_batch* batch);

/* The result of an ended request: tokens (valid until release / free), statistics (stats may be NULL; its
 * arrays valid as long as the tokens; oracle fields unmeasured) and plain steps (may be NULL: tokens made by
 * batched plain steps). For a request that failed the outputs are filled too (the tokens it made) and the
 * request's error is returned. DFL2_ERR_INVALID_ARGUMENT while the request is queued or active, or after release. */
DFL2_API dfl2_status* dfl2_batch_get_result(dfl2_batch* batch, uint64_t request_id, const int32_t** tokens,
                                            size_t* n, dfl2_stats* stats, int32_t* plain_steps);
/* Forget an ended request's result. */
DFL2_API dfl2_status* dfl2_batch_release(dfl2_batch* batch, uint64_t request_id);
/* Who proposed each cycle of an ended request (API 1.2): proposers [n] (dfl2_proposer values), valid as long as its
 * tokens; errors as dfl2_batch_get_result (for a failed request: the cycles it ran, and its error). */
DFL2_API dfl2_status* dfl2_batch_get_proposers(dfl2_batch* batch, uint64_t request_id, const int32_t** proposers,
                                               size_t* n);

/* The logprobs of an ended request's tokens (API 1.4), as dfl2_session_get_logprobs; valid as long as its tokens;
 * errors as dfl2_batch_get_result. */
DFL2_API dfl2_status* dfl2_batch_get_logprobs(dfl2_batch* batch, uint64_t request_id, const dfl2_logprob** logprobs,
                                              size_t* n);

typedef struct dfl2_batch_info {
    int32_t max_batch;      /* slots */
    int32_t active;         /* requests in slots after the last step */
    int32_t queued;         /* requests waiting for a slot */
    int32_t largest_step;   /* most requests in one step's target call so far */
    int32_t largest_plain;  /* most plain steps (one row each) in one step's target call so far */
    int64_t steps;          /* steps that ran requests */
    int64_t drafting_steps; /* steps where at least one request drafted */
    int64_t cycles;         /* speculative cycles, all requests */
    int64_t prefill_calls;  /* target calls that computed prompt rows (API 1.5; a chunked prompt: one per chunk) */
    int64_t prefill_rows;   /* prompt rows those calls computed (API 1.5) */
    int64_t prefix_hits;         /* requests that started from a cached prefix (API 1.5; PREFIX REUSE IN A BATCH) */
    int64_t cached_tokens;       /* prompt positions restored from the batch's prefix cache, all requests */
    int64_t prefix_cache_bytes;  /* what the cache's entries hold now (never over "prefix_cache_bytes") */
    int64_t prefix_entries;      /* sequences it holds now */
    int64_t prefix_evictions;    /* entries evicted (least recently used first) to stay within the budget */
} dfl2_batch_info;

DFL2_API dfl2_status* dfl2_batch_get_info(dfl2_batch* batch, dfl2_batch_info* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DFLASH2_DFLASH2_H */
