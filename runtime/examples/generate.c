/* generate — prompt token ids in, streamed token ids out, with libdflash2.
 *
 *   generate EXPORT_DIR ID [ID ...] [-o key=value ...]
 *
 * Loads an export folder (dflash2 export [+ build-engines]), generates from the prompt ids and prints each
 * committed chunk of ids as it arrives (one line per chunk), then one summary line on stderr:
 * tokens, cycles, τ, finish reason. Tokenizing text is the caller's job: e.g.
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
    size_t n = 0;
    dfl2_options* opts = NULL;
    dfl2_model* model = NULL;
    dfl2_session* session = NULL;
    dfl2_status* st = dfl2_options_create(&opts);
    int rc = 1;
    if (st || !prompt) {
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
        char* end = NULL;
        errno = 0;
        long v = strtol(argv[i], &end, 10);
        if (errno || end == argv[i] || *end || v < INT32_MIN || v > INT32_MAX) {
            fprintf(stderr, "generate: '%s' is not a token id\n", argv[i]);
            goto done;
        }
        prompt[n++] = (int32_t) v;
    }
    if ((st = dfl2_model_load(argv[1], opts, &model)) != NULL) {
        rc = fail(st, "load");
        goto done;
    }
    if ((st = dfl2_session_create(model, opts, &session)) != NULL) {
        rc = fail(st, "session");
        goto done;
    }
    if ((st = dfl2_session_generate(session, prompt, n, printChunk, NULL)) != NULL) {
        rc = fail(st, "generate");
        goto done;
    }
    dfl2_stats stats;
    if ((st = dfl2_session_get_stats(session, &stats)) != NULL) {
        rc = fail(st, "stats");
        goto done;
    }
    static const char* const kReasons[] = {"none", "eos", "length", "cancelled"};
    fprintf(stderr, "generate: %d tokens, %d cycles, tau %.3f, finish %s, %.3f s\n", stats.n_tokens, stats.cycles,
            stats.tau, kReasons[stats.finish_reason], stats.elapsed_s);
    rc = 0;
done:
    dfl2_session_free(session);
    dfl2_model_free(model);
    dfl2_options_free(opts);
    free(prompt);
    return rc;
}
