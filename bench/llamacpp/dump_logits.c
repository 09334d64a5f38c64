/* Next-token logits of llama.cpp at every prompt position, for `bench.llamacpp`'s logits
 * check: one batch of the given token ids, every position's logits written as float32.
 *
 *   dump_logits MODEL.gguf TOKENS.txt OUT.f32 THREADS
 *
 * TOKENS.txt holds whitespace-separated token ids; OUT.f32 gets n_tokens x n_vocab floats.
 */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.txt OUT.f32 THREADS\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[2], "r");
    if (!in) {
        perror(argv[2]);
        return 1;
    }
    int cap = 1024, n = 0;
    llama_token *tokens = malloc(sizeof(llama_token) * cap);
    int t;
    while (fscanf(in, "%d", &t) == 1) {
        if (n == cap) {
            cap *= 2;
            tokens = realloc(tokens, sizeof(llama_token) * cap);
        }
        tokens[n++] = t;
    }
    fclose(in);
    if (n == 0) {
        fprintf(stderr, "no tokens in %s\n", argv[2]);
        return 1;
    }

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + 16;
    cp.n_batch = n;
    cp.n_ubatch = n;
    cp.n_threads = atoi(argv[4]);
    cp.n_threads_batch = cp.n_threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[3], "wb");
    if (!out) {
        perror(argv[3]);
        return 1;
    }
    for (int i = 0; i < n; i++) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    }
    fclose(out);
    fprintf(stderr, "wrote %d x %d logits\n", n, n_vocab);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tokens);
    return 0;
}
