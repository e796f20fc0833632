/* generate — prompt token ids in, streamed token ids out, with libdflash2.
 *
 *   generate EXPORT_DIR ID [ID ...] [-o key=value ...]
 *   generate EXPORT_DIR -b ID [ID ...] [, ID [ID ...] ...] [-o key=value ...]
 *   generate EXPORT_DIR -s ID [ID ...] [, ID [ID ...] ...] [-o key=value ...]
 *
 * Loads an export folder (dflash2 export [+ build-engines]; -o backend=ort runs it with ONNX Runtime), says on
 * stderr what runs it (dfl2_model_get_note), generates from the prompt ids and prints each committed chunk of ids
 * as it arrives (one line per chunk), then one summary line on stderr: tokens, cycles, τ, finish reason, seconds,
 * tokens/s. With -b the prompts separated by "," are requests of one dfl2_batch (batch options such as
 * -o max_batch=4 -o fixed_costs=... apply); each request's ids are printed on one line, in the order given, once
 * all have ended, and one summary line per request goes to stderr. With -s they are decoded one after another by
 * one session (each request's ids on one line when it ends, a summary line per request). Tokenizing text is the
 * caller's job: e.g.
 *   python -c "from tokenizers import Tokenizer as T; print(*T.from_file('DIR/tokenizer.json').encode('Hi').ids)"
 * Errors: one line on stderr, exit status 1. Options: see dflash2.h (e.g. -o max_new_tokens=64
 * -o temperature=0.7 -o draft_mode=viterbi). */
#include "dflash2/dflash2.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int32_t printChunk(void* user, const int32_t* tokens, size_t n)
{
    (void) user;
    for (size_t i = 0; i < n; ++i) printf(i ? " %d" : "%d", (int) tokens[i]);
    printf("\n");
    fflush(stdout);
    return 0; /* non-zero would cancel */
}

/* -b: every request's prompt (ids[starts[i] .. starts[i] + lens[i] - 1]) in one batch; ids printed per request. */
static int runBatch(dfl2_model* model, const dfl2_options* opts, const int32_t* ids, const size_t* starts,
                    const size_t* lens, size_t nReq);

static int fail(dfl2_status* st, const char* what)
{
    fprintf(stderr, "generate: %s: %s\n", what, dfl2_status_message(st));
    dfl2_status_free(st);
    return 1;
}

int main(int argc, char** argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s EXPORT_DIR ID [ID ...] [-o key=value ...]\n", argv[0]);
        return 1;
    }
    if ((dfl2_api_version() >> 16) != DFL2_API_VERSION_MAJOR) {
        fprintf(stderr, "generate: libdflash2 API %u does not match the header's major %d\n",
                dfl2_api_version() >> 16, DFL2_API_VERSION_MAJOR);
        return 1;
    }
    int32_t* prompt = (int32_t*) calloc((size_t) argc, sizeof(int32_t));
    size_t* starts = (size_t*) calloc((size_t) argc, sizeof(size_t));
    size_t* lens = (size_t*) calloc((size_t) argc, sizeof(size_t));
    size_t n = 0, nReq = 0;
    int batched = 0;
    dfl2_options* opts = NULL;
    dfl2_model* model = NULL;
    dfl2_session* session = NULL;
    dfl2_status* st = dfl2_options_create(&opts);
    int rc = 1;
    if (st || !prompt || !starts || !lens) {
        rc = fail(st, "options");
        goto done;
    }
    for (int i = 2; i < argc; ++i) {
        if (strcmp(argv[i], "-o") == 0 && i + 1 < argc) {
            if ((st = dfl2_options_parse(opts, argv[++i])) != NULL) {
                rc = fail(st, "option");
                goto done;
            }
            continue;
        }
        if (strcmp(argv[i], "-b") == 0 || strcmp(argv[i], "-s") == 0) {
            batched = argv[i][1] == 'b' ? 1 : 2;
            continue;
        }
        if (strcmp(argv[i], ",") == 0) { /* the next request's prompt starts here */
            if (n == starts[nReq]) {
                fprintf(stderr, "generate: an empty request (no ids before ',')\n");
                goto done;
            }
            lens[nReq] = n - starts[nReq];
            ++nReq;
            starts[nReq] = n;
            continue;
        }
        char* end = NULL;
        errno = 0;
        long v = strtol(argv[i], &end, 10);
        if (errno || end == argv[i] || *end || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "generate: '%s' is not a token id (an integer >= 0)\n", argv[i]);
            goto done;
        }
        prompt[n++] = (int32_t) v;
    }
    if (n > starts[nReq]) {
        lens[nReq] = n - starts[nReq];
        ++nReq;
    } else if (nReq > 0) {
        fprintf(stderr, "generate: an empty request (no ids after the last ',')\n");
        goto done;
    }
    if (nReq == 0 || (nReq > 1 && !batched)) {
        fprintf(stderr, nReq == 0 ? "generate: no prompt ids\n"
                                  : "generate: one prompt without -b or -s (',' separates the prompts)\n");
        goto done;
    }
    if ((st = dfl2_model_load(argv[1], opts, &model)) != NULL) {
        rc = fail(st, "load");
        goto done;
    }
    const char* note = NULL;
    if ((st = dfl2_model_get_note(model, &note)) != NULL) {
        rc = fail(st, "note");
        goto done;
    }
    fprintf(stderr, "generate: %s\n", note);
    if (batched == 1) {
        rc = runBatch(model, opts, prompt, starts, lens, nReq);
        goto done;
    }
    if ((st = dfl2_session_create(model, opts, &session)) != NULL) {
        rc = fail(st, "session");
        goto done;
    }
    for (size_t r = 0; r < nReq; ++r) { /* one request, or -s: each in turn */
        if ((st = dfl2_session_generate(session, prompt + starts[r], lens[r], batched ? NULL : printChunk, NULL))
            != NULL) {
            rc = fail(st, "generate");
            goto done;
        }
        dfl2_stats stats;
        const int32_t* t = NULL;
        size_t k = 0;
        if ((st = dfl2_session_get_stats(session, &stats)) != NULL || (st = dfl2_session_get_tokens(session, &t, &k))) {
            rc = fail(st, "stats");
            goto done;
        }
        if (batched) printChunk(NULL, t, k);
        static const char* const kReasons[] = {"none", "eos", "length", "cancelled"};
        fprintf(stderr, "generate: %s%.0zu%s%d tokens, %d cycles, tau %.3f, finish %s, %.3f s, %.1f tokens/s\n",
                batched ? "request " : "", batched ? r + 1 : (size_t) 0, batched ? ": " : "", stats.n_tokens,
                stats.cycles, stats.tau, kReasons[stats.finish_reason], stats.elapsed_s,
                stats.elapsed_s > 0 ? stats.n_tokens / stats.elapsed_s : 0.0);
    }
    rc = 0;
done:
    dfl2_session_free(session);
    dfl2_model_free(model);
    dfl2_options_free(opts);
    free(prompt);
    free(starts);
    free(lens);
    return rc;
}

static int runBatch(dfl2_model* model, const dfl2_options* opts, const int32_t* ids, const size_t* starts,
                    const size_t* lens, size_t nReq)
{
    static const char* const kReasons[] = {"none", "eos", "length", "cancelled", "error"};
    dfl2_batch* batch = NULL;
    uint64_t* rid = (uint64_t*) calloc(nReq + 1, sizeof(uint64_t));
    dfl2_status* st = rid ? dfl2_batch_create(model, opts, &batch) : NULL;
    int rc = 1;
    if (!rid || st) {
        rc = fail(st, "batch");
        goto done;
    }
    for (size_t i = 0; i < nReq; ++i) {
        dfl2_request q;
        memset(&q, 0, sizeof q);
        q.struct_size = sizeof q;
        q.prompt = ids + starts[i];
        q.n_prompt = lens[i];
        q.options = opts;
        if ((st = dfl2_batch_submit(batch, &q, &rid[i])) != NULL) {
            rc = fail(st, "submit");
            goto done;
        }
    }
    for (size_t pending = nReq; pending;) {
        if ((st = dfl2_batch_step(batch, &pending)) != NULL) {
            rc = fail(st, "step");
            goto done;
        }
    }
    rc = 0;
    dfl2_batch_info info;
    if ((st = dfl2_batch_get_info(batch, &info)) == NULL) {
        fprintf(stderr, "generate: batch: %lld steps, %lld prefill calls, %lld prefill rows\n", (long long) info.steps,
                (long long) info.prefill_calls, (long long) info.prefill_rows);
    }
    dfl2_status_free(st);
    for (size_t i = 0; i < nReq; ++i) {
        const int32_t* t = NULL;
        size_t k = 0;
        dfl2_stats stats;
        int32_t plain = 0;
        st = dfl2_batch_get_result(batch, rid[i], &t, &k, &stats, &plain);
        printChunk(NULL, t, k);
        fprintf(stderr, "generate: request %zu: %d tokens, %d cycles, %d plain steps, finish %s, %.3f s%s%s\n", i + 1,
                stats.n_tokens, stats.cycles, plain, kReasons[stats.finish_reason], stats.elapsed_s,
                st ? ": " : "", st ? dfl2_status_message(st) : "");
        rc = st ? 1 : rc;
        dfl2_status_free(st);
    }
done:
    dfl2_batch_free(batch);
    free(rid);
    return rc;
}
