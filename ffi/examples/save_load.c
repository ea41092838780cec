/* save_load.c: save a prefix's KV, find it again by its tokens, and load it back layer by
 * layer into registered memory. Build: cc save_load.c $(pkg-config --cflags --libs objectcache)
 * Run: ./a.out /tmp/objectcache-example   (a directory: the embedded store) */
#include <objectcache.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what, objectcache_status s) {
    fprintf(stderr, "%s: %s: %s\n", what, objectcache_status_name(s), objectcache_last_error());
    return 1;
}

int main(int argc, char **argv) {
    const char *keys[] = {"store", "namespace"};
    const char *vals[] = {argc > 1 ? argv[1] : "memory://", "example"};
    objectcache_engine *e;
    objectcache_status s = objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, vals, 2, &e);
    if (s) return fail("create", s);

    /* A small model: 2 layers, 4 KV heads of dim 16, bf16, 32 tokens per chunk, TP rank 0
     * of 1; no engine layout (NULL, block size 0): ObjectCache's canonical K-then-V slices. */
    objectcache_geometry g = {sizeof g, 2, 4, 16, OBJECTCACHE_DTYPE_BF16, 32, 0, 1, "example/m",
                              NULL, 0, 0};
    objectcache_hash_params hp = {sizeof hp, 32, "0", NULL};
    uint32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = 100 + i;
    uint8_t hashes[2 * 32];
    size_t chunks;
    if ((s = objectcache_chunk_hashes(&hp, tokens, 64, hashes, sizeof hashes, &chunks)))
        return fail("hash", s);

    uint64_t slice;
    objectcache_slice_bytes(&g, &slice); /* bytes of one chunk's one layer (K and V) */
    size_t per_layer = chunks * slice;
    unsigned char *kv = malloc(2 * per_layer); /* layer-major: layer 0, then layer 1 */
    for (size_t i = 0; i < 2 * per_layer; i++) kv[i] = (unsigned char)(i * 7);
    const void *layers[2] = {kv, kv + per_layer};
    if ((s = objectcache_save(e, &g, hashes, 32, chunks, layers, 2, per_layer, NULL)))
        return fail("save", s);

    size_t hit;
    if ((s = objectcache_lookup_tokens(e, &g, &hp, tokens, 64, &hit))) return fail("lookup", s);
    printf("cached prefix: %zu chunks = %zu tokens\n", hit, hit * g.tokens_per_chunk);

    unsigned char *dst = calloc(2, per_layer);
    objectcache_region *r;
    if ((s = objectcache_register_memory(e, dst, 2 * per_layer, OBJECTCACHE_MEM_HOST, 0, &r)))
        return fail("register", s);
    objectcache_layer_dest d[2] = {{dst, per_layer}, {dst + per_layer, per_layer}};
    objectcache_load_params lp = {0};
    lp.struct_size = sizeof lp;
    lp.request_id = 1;
    lp.geometry = &g;
    lp.hashes = hashes;
    lp.hash_len = 32;
    lp.n_chunks = hit;
    lp.layers = d;
    lp.n_layers = 2;
    objectcache_transfer *t;
    if ((s = objectcache_load(e, &lp, &t))) return fail("load", s);
    int differ = 0;
    for (uint32_t l = 0; l < 2; l++) {
        if ((s = objectcache_transfer_wait_layer(t, l, 10000))) return fail("wait", s);
        /* Layer l is verified KV now: run layer l's attention here while later layers land. */
        differ |= memcmp(d[l].addr, layers[l], per_layer) != 0;
        printf("layer %u ready, %s\n", l, differ ? "bytes DIFFER" : "bytes match");
    }
    objectcache_transfer_release(t); /* waits for in-flight copies; dst is ours again */
    objectcache_deregister_memory(e, r);
    objectcache_engine_destroy(e);
    free(kv);
    free(dst);
    return differ;
}
