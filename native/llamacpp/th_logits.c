/* th_logits MODEL.gguf OUT.f32 [--lora ADAPTER.gguf SCALE] ID...
 * Writes n_ids x n_vocab float32 logits (row-major), one row per input position. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static int fail(const char * msg, const char * what) {
    fprintf(stderr, "th_logits: %s %s\n", msg, what ? what : "");
    return 1;
}

int main(int argc, char ** argv) {
    if (argc < 4) return fail("usage: th_logits MODEL.gguf OUT.f32 [--lora ADAPTER.gguf SCALE] ID...", NULL);
    const char * model_path = argv[1];
    const char * out_path = argv[2];
    int first_id = 3;
    const char * lora_path = NULL;
    float lora_scale = 1.0f;
    if (strcmp(argv[3], "--lora") == 0) {
        if (argc < 7) return fail("--lora needs a path and a scale", NULL);
        lora_path = argv[4];
        lora_scale = (float) atof(argv[5]);
        first_id = 6;
    }
    const int n = argc - first_id;

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    /* no repacked weights: in this llama.cpp its cpu repack of q4_0, q8_0 and q4_k crashes
     * (SIGSEGV) on the small models the tests write, and q5_0, which has no repack, runs */
    mp.use_extra_bufts = false;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) return fail("could not load", model_path);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n;
    cp.n_batch = (uint32_t) n;
    cp.n_ubatch = (uint32_t) n;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;   /* an f16 KV cache would round K and V */
    cp.type_v = GGML_TYPE_F32;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("could not create a context for", model_path);

    if (lora_path) {
        struct llama_adapter_lora * adapter = llama_adapter_lora_init(model, lora_path);
        if (!adapter) return fail("could not load the adapter", lora_path);
        if (llama_set_adapters_lora(ctx, &adapter, 1, &lora_scale) != 0) return fail("could not apply", lora_path);
    }

    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = atoi(argv[first_id + i]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed on", model_path);

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * out = fopen(out_path, "wb");
    if (!out) return fail("cannot write", out_path);
    for (int i = 0; i < n; i++) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t) n_vocab, out);
    }
    fclose(out);
    printf("%d %d\n", n, n_vocab);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
