/* th_generate MODEL.gguf PROMPTS.ids N_TOKENS THREADS
 * Greedy decoding by llama.cpp, one prompt per line of PROMPTS.ids (token ids separated by
 * spaces), each in a fresh KV cache: prints the generated ids of each prompt on a line of their
 * own (stopping after an end-of-generation token, not printed), then on stderr a line
 * "decode TOKENS SECONDS" (the generation steps only, prompt processing excluded): tokens/s
 * beside toyharness's sampler on the same file (tools/sample_speed.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

static int fail(const char * msg, const char * what) {
    fprintf(stderr, "th_generate: %s %s\n", msg, what ? what : "");
    return 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int argmax(const float * v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (v[i] > v[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc != 5) return fail("usage: th_generate MODEL.gguf PROMPTS.ids N_TOKENS THREADS", NULL);
    const int n_gen = atoi(argv[3]), threads = atoi(argv[4]);
    FILE * in = fopen(argv[2], "r");
    if (!in) return fail("cannot read", argv[2]);

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;   /* as th_logits: the cpu repack crashes on the tests' small models */
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("could not load", argv[1]);
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    static char line[1 << 20];
    int ids[8192];
    long decoded = 0;
    double decode_s = 0;
    while (fgets(line, sizeof line, in)) {
        int n = 0;
        for (char * tok = strtok(line, " \n"); tok && n < 8192; tok = strtok(NULL, " \n")) ids[n++] = atoi(tok);
        if (n == 0) { printf("\n"); continue; }
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = (uint32_t) (n + n_gen + 1);
        cp.n_batch = cp.n_ubatch = (uint32_t) n;
        cp.n_threads = cp.n_threads_batch = threads;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) return fail("could not create a context for", argv[1]);
        if (llama_decode(ctx, llama_batch_get_one(ids, n)) != 0) return fail("llama_decode failed on", argv[1]);
        int next = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        double t0 = now_s();
        for (int i = 0; i < n_gen && !llama_vocab_is_eog(vocab, next); i++) {
            printf(i ? " %d" : "%d", next);
            if (i + 1 == n_gen) break;
            if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) return fail("llama_decode failed on", argv[1]);
            decoded++;
            next = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        }
        decode_s += now_s() - t0;
        printf("\n");
        fflush(stdout);
        llama_free(ctx);
    }
    fclose(in);
    fprintf(stderr, "decode %ld %.6f\n", decoded, decode_s);
    llama_model_free(model);
    return 0;
}
