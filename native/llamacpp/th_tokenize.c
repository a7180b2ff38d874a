/* th_tokenize MODEL.gguf TEXTS.bin
 * TEXTS.bin holds texts as [uint32 little-endian byte length][UTF-8 bytes], one after another.
 * Loads only the vocabulary (no tensors needed) and prints, per text, one line: llama.cpp's ids
 * with add_special and parse_special on (BOS/EOS as the file says; special-token strings become
 * their ids), separated by spaces. Used to derive tests/data/tokenizer_agreement.json. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

static int fail(const char * msg, const char * what) {
    fprintf(stderr, "th_tokenize: %s %s\n", msg, what ? what : "");
    return 1;
}

int main(int argc, char ** argv) {
    if (argc != 3) return fail("usage: th_tokenize MODEL.gguf TEXTS.bin", NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.vocab_only = 1;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("could not load", argv[1]);
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    FILE * in = fopen(argv[2], "rb");
    if (!in) return fail("cannot read", argv[2]);
    unsigned char len_bytes[4];
    while (fread(len_bytes, 1, 4, in) == 4) {
        const uint32_t len = (uint32_t) len_bytes[0] | ((uint32_t) len_bytes[1] << 8) |
                             ((uint32_t) len_bytes[2] << 16) | ((uint32_t) len_bytes[3] << 24);
        char * text = malloc(len + 1);
        if (!text || fread(text, 1, len, in) != len) return fail("truncated text in", argv[2]);
        text[len] = 0;
        int n_max = (int) len + 8;
        llama_token * ids = malloc(sizeof(llama_token) * (size_t) n_max);
        int n = llama_tokenize(vocab, text, (int32_t) len, ids, n_max, 1, 1);
        if (n < 0) {   /* more ids than the guess: -n is the count needed */
            n_max = -n;
            ids = realloc(ids, sizeof(llama_token) * (size_t) n_max);
            n = llama_tokenize(vocab, text, (int32_t) len, ids, n_max, 1, 1);
        }
        if (n < 0) return fail("tokenization failed in", argv[2]);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(ids);
        free(text);
    }
    fclose(in);
    llama_model_free(model);
    return 0;
}
