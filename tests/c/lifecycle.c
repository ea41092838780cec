/*
 * C ABI lifecycle test: drives libobjectcache through ffi/objectcache.h against a real store
 * (a directory: the embedded store) and checks every result, including bad arguments.
 *
 * Usage: lifecycle STORE_URL
 * Prints one line per failed check and, at the end, "c_abi: N passed, M failed".
 * Compiled and run by tests/integration/c_abi.rs.
 */
#include "objectcache.h"

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define LAYERS 4
#define TOKENS_PER_CHUNK 16
#define HASH_LEN 32

/* The test's geometry: BF16, TOKENS_PER_CHUNK-token chunks at TP 1. */
static objectcache_geometry geom(void) {
    return bf16_geometry(LAYERS, 2, 8, TOKENS_PER_CHUNK, "test/c-abi-tiny");
}

static unsigned char pattern(int layer, size_t chunk, size_t i) {
    return (unsigned char)(layer * 31 + chunk * 7 + i * 13 + 1);
}

/* Fills a layer buffer of n chunks with the test pattern. */
static void fill(unsigned char *buf, int layer, size_t n, uint64_t slice) {
    for (size_t c = 0; c < n; c++)
        for (uint64_t i = 0; i < slice; i++)
            buf[c * slice + i] = pattern(layer, c, (size_t)i);
}

/* One destination per layer, consecutive in buf: layer l's is per_layer bytes at
 * buf + l x per_layer. */
static void layer_dests(objectcache_layer_dest *d, unsigned char *buf, int n_layers,
                        size_t per_layer) {
    for (int l = 0; l < n_layers; l++) {
        d[l].addr = buf + (size_t)l * per_layer;
        d[l].len = per_layer;
    }
}

/* Load parameters of n_chunks chunks (hashes) into n_layers destinations, no hints. */
static objectcache_load_params load_params(const objectcache_geometry *g, const uint8_t *hashes,
                                           size_t n_chunks, const objectcache_layer_dest *d,
                                           size_t n_layers) {
    objectcache_load_params lp;
    ABI_INIT(lp);
    lp.geometry = g;
    lp.hashes = hashes;
    lp.hash_len = HASH_LEN;
    lp.n_chunks = n_chunks;
    lp.layers = d;
    lp.n_layers = n_layers;
    return lp;
}

/* Deadline fallback through the C ABI (objectcache_transfer_stall_advice), on a load at the
 * geometry of the smollm2-135m compute model (30 layers, 3 KV heads of 64, BF16): a load
 * that completed advises waiting; a load whose chunk is not cached advises recomputing the
 * whole prefix from layer 0. */
#define SMOL_LAYERS 30
static void stall_advice_checks(objectcache_engine *e, const uint8_t *hashes) {
    objectcache_geometry g = bf16_geometry(SMOL_LAYERS, 3, 64, TOKENS_PER_CHUNK, "test/c-abi-smol");
    uint64_t slice = 0;
    EXPECT(objectcache_slice_bytes(&g, &slice), OBJECTCACHE_OK);
    unsigned char *src[SMOL_LAYERS];
    for (int l = 0; l < SMOL_LAYERS; l++) {
        src[l] = malloc(slice);
        fill(src[l], l, 1, slice);
    }
    EXPECT(objectcache_save(e, &g, hashes, HASH_LEN, 1, (const void *const *)src, SMOL_LAYERS,
                            slice, NULL),
           OBJECTCACHE_OK);
    unsigned char *dst = calloc(SMOL_LAYERS, slice);
    objectcache_region *region = NULL;
    EXPECT(objectcache_register_memory(e, dst, SMOL_LAYERS * slice, OBJECTCACHE_MEM_HOST, 0,
                                       &region),
           OBJECTCACHE_OK);
    objectcache_layer_dest d[SMOL_LAYERS];
    layer_dests(d, dst, SMOL_LAYERS, slice);
    objectcache_load_params lp = load_params(&g, hashes, 1, d, SMOL_LAYERS);
    objectcache_stall_params sp;
    ABI_INIT(sp);
    sp.model = "smollm2-135m";
    sp.gpu = "h100";
    sp.load_tokens = TOKENS_PER_CHUNK;
    sp.new_tokens = 64;
    objectcache_stall_advice adv;

    /* Whole prefix loaded: keep it (wait), finishing when the prefill would. */
    objectcache_transfer *t = NULL;
    EXPECT(objectcache_load(e, &lp, &t), OBJECTCACHE_OK);
    EXPECT(objectcache_transfer_wait_all(t, OBJECTCACHE_WAIT_FOREVER), OBJECTCACHE_OK);
    for (int l = 0; l < SMOL_LAYERS; l++)
        CHECK(memcmp(d[l].addr, src[l], slice) == 0, "smol layer %d bytes differ", l);
    memset(&adv, 0xAB, sizeof adv);
    adv.struct_size = sizeof adv;
    EXPECT(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_OK);
    CHECK(adv.recompute == 0 && adv.from_layer == SMOL_LAYERS && adv.recompute_tokens == 0,
          "complete load: recompute %u from %u tokens %llu", adv.recompute, adv.from_layer,
          (unsigned long long)adv.recompute_tokens);
    CHECK(adv.finish_s > 0 && adv.finish_s == adv.wait_finish_s, "finish %g wait %g",
          adv.finish_s, adv.wait_finish_s);
    /* The measured mode (the caller's per-layer time) is accepted too, and scales the time. */
    sp.compute_us_per_layer = 20000; /* 20 ms per layer: 0.6 s of compute */
    EXPECT(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_OK);
    CHECK(adv.recompute == 0 && adv.finish_s >= 0.6, "measured: finish %g", adv.finish_s);
    sp.compute_us_per_layer = 0;
    /* Bad inputs are refused by name; out is left alone. */
    sp.model = "no-such-model";
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "unknown model");
    sp.model = "llama-3.1-8b";
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "32 layers");
    sp.model = "smollm2-135m";
    sp.gpu = "tpu";
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "unknown GPU kind");
    sp.gpu = NULL;
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "params->gpu");
    sp.gpu = "h100";
    objectcache_stall_params bad_sp = sp;
    bad_sp.struct_size = sizeof sp - 8;
    EXPECT(objectcache_transfer_stall_advice(t, &bad_sp, &adv), OBJECTCACHE_ERR_ABI_MISMATCH);
    EXPECT(objectcache_transfer_stall_advice(t, &sp, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_transfer_stall_advice(t, NULL, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);
    EXPECT(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_HANDLE);

    /* The chunk is not cached (another hash): nothing will arrive, so recompute the whole
     * prefix from layer 0. */
    lp.hashes = hashes + HASH_LEN;
    EXPECT(objectcache_load(e, &lp, &t), OBJECTCACHE_OK);
    EXPECT(objectcache_transfer_wait_all(t, OBJECTCACHE_WAIT_FOREVER),
           OBJECTCACHE_ERR_LAYER_MISSING);
    EXPECT(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_OK);
    CHECK(adv.recompute == 1 && adv.from_layer == 0 && adv.recompute_tokens == TOKENS_PER_CHUNK,
          "missed load: recompute %u from %u tokens %llu", adv.recompute, adv.from_layer,
          (unsigned long long)adv.recompute_tokens);
    /* Its layers failed, so waiting never ends: recompute, however large the prefix. */
    CHECK(isinf(adv.wait_finish_s) && adv.finish_s >= 0, "missed load: finish %g wait %g",
          adv.finish_s, adv.wait_finish_s);
    sp.load_tokens = 1ull << 26;
    EXPECT(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_OK);
    CHECK(adv.recompute == 1 && adv.recompute_tokens == (1ull << 26) && isinf(adv.wait_finish_s),
          "missed load, 2^26 tokens: recompute %u wait %g", adv.recompute, adv.wait_finish_s);
    /* Values past their limits are refused by name. */
    sp.load_tokens = (1ull << 26) + 1;
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "at most");
    sp.load_tokens = TOKENS_PER_CHUNK;
    sp.new_tokens = UINT64_MAX;
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "at most");
    sp.new_tokens = 64;
    sp.compute_us_per_layer = 5000000000ull;
    EXPECT_MSG(objectcache_transfer_stall_advice(t, &sp, &adv), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "compute_us_per_layer");
    sp.compute_us_per_layer = 0;
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);

    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_OK);
    free(dst);
    for (int l = 0; l < SMOL_LAYERS; l++) free(src[l]);
}

struct waiter {
    objectcache_transfer *t;
    objectcache_status result[LAYERS];
};

static void *wait_all_layers(void *arg) {
    struct waiter *w = arg;
    for (uint32_t l = 0; l < LAYERS; l++)
        w->result[l] = objectcache_transfer_wait_layer(w->t, l, OBJECTCACHE_WAIT_FOREVER);
    return NULL;
}

/* One of several threads loading the same cached prefix at once into its own memory. */
struct loader {
    objectcache_engine *e;
    objectcache_load_params lp; /* geometry and hashes shared, layers filled here */
    unsigned char *dst;         /* LAYERS x per_layer bytes, registered by main */
    size_t per_layer;
    unsigned char **expect;     /* expected bytes per layer */
    int ok;
};

static void *load_in_thread(void *arg) {
    struct loader *ld = arg;
    objectcache_layer_dest d[LAYERS];
    layer_dests(d, ld->dst, LAYERS, ld->per_layer);
    ld->lp.layers = d;
    objectcache_transfer *t = NULL;
    ld->ok = objectcache_load(ld->e, &ld->lp, &t) == OBJECTCACHE_OK;
    for (uint32_t l = 0; ld->ok && l < LAYERS; l++)
        ld->ok = objectcache_transfer_wait_layer(t, l, OBJECTCACHE_WAIT_FOREVER) == OBJECTCACHE_OK &&
                 memcmp(d[l].addr, ld->expect[l], ld->per_layer) == 0;
    if (t && objectcache_transfer_release(t) != OBJECTCACHE_OK) ld->ok = 0;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s STORE_URL\n", argv[0]);
        return 2;
    }
    const char *store = argv[1];

    /* ---- Version and sizes ---- */
    CHECK(objectcache_abi_version() == OBJECTCACHE_ABI_VERSION, "abi %u",
          objectcache_abi_version());
    CHECK(strlen(objectcache_version()) > 0, "empty version");
    CHECK(objectcache_struct_size("objectcache_geometry") == sizeof(objectcache_geometry),
          "geometry size");
    CHECK(objectcache_struct_size("objectcache_load_params") == sizeof(objectcache_load_params),
          "load params size");
    CHECK(objectcache_struct_size("objectcache_metrics") == sizeof(objectcache_metrics),
          "metrics size");
    CHECK(objectcache_struct_size("no_such_struct") == 0, "unknown struct");
    CHECK(objectcache_struct_size(NULL) == 0, "NULL struct name");
    /* Fields as the library was built, in the header's order, at the header's offsets. */
    {
        static const struct { const char *name; size_t off; } geometry_fields[] = {
            {"struct_size", offsetof(objectcache_geometry, struct_size)},
            {"layers", offsetof(objectcache_geometry, layers)},
            {"kv_heads", offsetof(objectcache_geometry, kv_heads)},
            {"head_dim", offsetof(objectcache_geometry, head_dim)},
            {"dtype", offsetof(objectcache_geometry, dtype)},
            {"tokens_per_chunk", offsetof(objectcache_geometry, tokens_per_chunk)},
            {"tp_rank", offsetof(objectcache_geometry, tp_rank)},
            {"tp_world", offsetof(objectcache_geometry, tp_world)},
            {"model", offsetof(objectcache_geometry, model)},
            {"layout", offsetof(objectcache_geometry, layout)},
            {"block_size", offsetof(objectcache_geometry, block_size)},
            {"_reserved", offsetof(objectcache_geometry, _reserved)},
        };
        size_t n = sizeof geometry_fields / sizeof geometry_fields[0];
        for (size_t i = 0; i < n; i++) {
            size_t off = (size_t)-1;
            const char *f = objectcache_struct_field("objectcache_geometry", i, &off);
            CHECK(f != NULL && strcmp(f, geometry_fields[i].name) == 0, "geometry field %zu: %s",
                  i, f ? f : "(none)");
            CHECK(off == geometry_fields[i].off, "geometry.%s at %zu, header %zu",
                  geometry_fields[i].name, off, geometry_fields[i].off);
        }
        CHECK(objectcache_struct_field("objectcache_geometry", n, NULL) == NULL,
              "a field past the last");
        size_t off = 0;
        const char *m = objectcache_struct_field("objectcache_metrics", 9, &off);
        CHECK(m != NULL && strcmp(m, "registered_regions") == 0 &&
                  off == offsetof(objectcache_metrics, registered_regions),
              "metrics.registered_regions");
        CHECK(objectcache_struct_field("no_such_struct", 0, NULL) == NULL, "unknown struct");
        CHECK(objectcache_struct_field(NULL, 0, NULL) == NULL, "NULL struct name");
    }
    CHECK(strcmp(objectcache_status_name(OBJECTCACHE_ERR_CONFIG), "OBJECTCACHE_ERR_CONFIG") == 0,
          "status name");
    CHECK(strcmp(objectcache_status_name(9999), "unknown status") == 0, "unknown status name");
    /* The settings list starts with the store and names every key this test passes. */
    const char *known = objectcache_config_keys();
    CHECK(strncmp(known, "store,namespace,", 16) == 0, "config keys: %s", known);
    CHECK(strstr(known, ",load_timeout_ms,") && strstr(known, ",lookup_cache_ttl_ms,"),
          "config keys: %s", known);

    /* ---- Engine creation, good and bad ---- */
    const char *keys[] = {"store", "namespace", "load_timeout_ms", "lookup_cache_ttl_ms"};
    const char *vals[] = {store, "capi-test", "60000", "0"};
    objectcache_engine *e = NULL;
    EXPECT(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, vals, 4, &e), OBJECTCACHE_OK);
    CHECK(e != NULL, "engine is NULL");

    const char *bad_keys[] = {"store", "windw_bytes"};
    const char *bad_vals[] = {store, "1024"};
    objectcache_engine *bad = NULL;
    EXPECT_MSG(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, bad_keys, bad_vals, 2, &bad),
               OBJECTCACHE_ERR_CONFIG, "windw_bytes");
    CHECK(bad == NULL, "engine written on error");
    const char *bad_vals2[] = {store, "-3"};
    const char *num_keys[] = {"store", "max_requests"};
    EXPECT_MSG(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, num_keys, bad_vals2, 2, &bad),
               OBJECTCACHE_ERR_CONFIG, "max_requests");
    EXPECT_MSG(objectcache_engine_create(OBJECTCACHE_ABI_VERSION + 1, keys, vals, 4, &bad),
               OBJECTCACHE_ERR_ABI_MISMATCH, "ABI version");
    EXPECT(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, vals, 4, NULL),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT_MSG(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, NULL, vals, 1, &bad),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "keys");
    const char *null_val[] = {NULL};
    EXPECT_MSG(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, null_val, 1, &bad),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "values[0]");

    /* ---- Geometry and hashing ---- */
    objectcache_geometry g = geom();
    uint64_t slice = 0;
    EXPECT(objectcache_slice_bytes(&g, &slice), OBJECTCACHE_OK);
    CHECK(slice == 2ull * TOKENS_PER_CHUNK * 2 * 8 * 2, "slice bytes %llu",
          (unsigned long long)slice);
    objectcache_geometry g_bad = g;
    g_bad.struct_size = sizeof g - 8;
    EXPECT_MSG(objectcache_slice_bytes(&g_bad, &slice), OBJECTCACHE_ERR_ABI_MISMATCH,
               "struct_size");
    g_bad = g;
    g_bad.dtype = 77;
    EXPECT_MSG(objectcache_slice_bytes(&g_bad, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT, "dtype");
    g_bad = g;
    g_bad.model = NULL;
    EXPECT_MSG(objectcache_slice_bytes(&g_bad, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT, "model");
    g_bad = g;
    g_bad.layers = 0;
    EXPECT_MSG(objectcache_slice_bytes(&g_bad, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT, "layers");
    EXPECT(objectcache_slice_bytes(NULL, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_slice_bytes(&g, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);

    enum { N_TOKENS = 4 * TOKENS_PER_CHUNK + 5 }; /* 4 full chunks and a partial one */
    uint32_t tokens[N_TOKENS];
    for (uint32_t i = 0; i < N_TOKENS; i++)
        tokens[i] = 1000 + i * 3;
    objectcache_hash_params hp;
    ABI_INIT(hp);
    hp.block_size = TOKENS_PER_CHUNK;
    hp.seed = "0";
    hp.salt = "tenant-a";
    uint8_t hashes[4 * HASH_LEN];
    size_t n_chunks = 0;
    EXPECT_MSG(objectcache_chunk_hashes(&hp, tokens, N_TOKENS, hashes, 3 * HASH_LEN, &n_chunks),
               OBJECTCACHE_ERR_BUFFER_TOO_SMALL, "need");
    CHECK(n_chunks == 4, "needed chunk count %zu", n_chunks);
    EXPECT(objectcache_chunk_hashes(&hp, tokens, N_TOKENS, hashes, sizeof hashes, &n_chunks),
           OBJECTCACHE_OK);
    CHECK(n_chunks == 4, "chunks %zu", n_chunks);
    uint8_t hashes2[4 * HASH_LEN];
    objectcache_hash_params hp2 = hp;
    hp2.salt = "tenant-b";
    EXPECT(objectcache_chunk_hashes(&hp2, tokens, N_TOKENS, hashes2, sizeof hashes2, &n_chunks),
           OBJECTCACHE_OK);
    CHECK(memcmp(hashes, hashes2, HASH_LEN) != 0, "salt does not change the first hash");
    EXPECT(objectcache_chunk_hashes(&hp, NULL, 5, hashes, sizeof hashes, &n_chunks),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);

    /* ---- Lookup before save: nothing cached ---- */
    size_t hit = 99;
    EXPECT(objectcache_lookup(e, &g, hashes, HASH_LEN, 4, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "hit %zu before save", hit);
    EXPECT(objectcache_lookup(NULL, &g, hashes, HASH_LEN, 4, &hit), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_lookup(e, NULL, hashes, HASH_LEN, 4, &hit), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT_MSG(objectcache_lookup(e, &g, hashes, 0, 4, &hit), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "hash_len");
    EXPECT(objectcache_lookup(e, &g, NULL, HASH_LEN, 4, &hit), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_lookup(e, &g, hashes, HASH_LEN, 4, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);

    /* ---- Save 3 of the 4 chunks ---- */
    size_t per_layer = 3 * (size_t)slice;
    unsigned char *src[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        src[l] = malloc(per_layer);
        fill(src[l], l, 3, slice);
    }
    objectcache_save_report rep;
    ABI_INIT(rep);
    EXPECT_MSG(objectcache_save(e, &g, hashes, HASH_LEN, 3, (const void *const *)src, LAYERS,
                                per_layer - 1, &rep),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "bytes_per_layer");
    EXPECT_MSG(objectcache_save(e, &g, hashes, HASH_LEN, 3, (const void *const *)src, LAYERS - 1,
                                per_layer, &rep),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_layers");
    EXPECT(objectcache_save(e, &g, hashes, HASH_LEN, 3, NULL, LAYERS, per_layer, &rep),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);
    objectcache_save_report bad_rep = rep;
    bad_rep.struct_size = 4;
    EXPECT(objectcache_save(e, &g, hashes, HASH_LEN, 3, (const void *const *)src, LAYERS,
                            per_layer, &bad_rep),
           OBJECTCACHE_ERR_ABI_MISMATCH);
    EXPECT(objectcache_save(e, &g, hashes, HASH_LEN, 3, (const void *const *)src, LAYERS,
                            per_layer, &rep),
           OBJECTCACHE_OK);
    CHECK(rep.written == 3 && rep.already_present == 0, "written %llu present %llu",
          (unsigned long long)rep.written, (unsigned long long)rep.already_present);
    CHECK(rep.bytes > 3 * LAYERS * slice, "bytes %llu", (unsigned long long)rep.bytes);
    EXPECT(objectcache_save(e, &g, hashes, HASH_LEN, 3, (const void *const *)src, LAYERS,
                            per_layer, NULL),
           OBJECTCACHE_OK);

    /* ---- Lookup after save: 3 leading chunks, by hashes and by tokens ---- */
    EXPECT(objectcache_lookup(e, &g, hashes, HASH_LEN, 4, &hit), OBJECTCACHE_OK);
    CHECK(hit == 3, "hit %zu after save", hit);
    EXPECT(objectcache_lookup_tokens(e, &g, &hp, tokens, N_TOKENS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 3, "token hit %zu", hit);
    EXPECT(objectcache_lookup_tokens(e, &g, &hp2, tokens, N_TOKENS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "other salt hit %zu", hit);
    objectcache_hash_params hp_bs = hp;
    hp_bs.block_size = 8;
    EXPECT_MSG(objectcache_lookup_tokens(e, &g, &hp_bs, tokens, N_TOKENS, &hit),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "block_size");

    /* ---- Register memory ---- */
    size_t dst_bytes = LAYERS * 4 * (size_t)slice;
    unsigned char *dst = malloc(dst_bytes);
    memset(dst, 0xEE, dst_bytes);
    objectcache_region *region = NULL;
    EXPECT(objectcache_register_memory(e, dst, dst_bytes, OBJECTCACHE_MEM_HOST, 0, &region),
           OBJECTCACHE_OK);
    objectcache_region *dev = NULL;
    {
        /* Host memory as device memory: UNSUPPORTED without the cuda feature or without a
         * CUDA driver/GPU; INVALID_ARGUMENT (not device memory) in a cuda build with a GPU. */
        objectcache_status s =
            objectcache_register_memory(e, dst, dst_bytes, OBJECTCACHE_MEM_DEVICE, 0, &dev);
        CHECK(s == OBJECTCACHE_ERR_UNSUPPORTED || s == OBJECTCACHE_ERR_INVALID_ARGUMENT,
              "host memory registered as device memory returned %s", objectcache_status_name(s));
        CHECK(strstr(objectcache_last_error(), "device") != NULL,
              "message lacks \"device\"");
    }
    EXPECT(objectcache_register_memory(e, NULL, 64, OBJECTCACHE_MEM_HOST, 0, &dev),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_register_memory(e, dst, 0, OBJECTCACHE_MEM_HOST, 0, &dev),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_register_memory(e, dst, 64, 7, 0, &dev), OBJECTCACHE_ERR_INVALID_ARGUMENT);

    /* ---- Load the 3 cached chunks, layer by layer ---- */
    objectcache_layer_dest dests[LAYERS];
    layer_dests(dests, dst, LAYERS, 4 * slice);
    objectcache_load_params lp = load_params(&g, hashes, 3, dests, LAYERS);
    lp.request_id = 42;
    lp.priority = 1;
    objectcache_transfer *t = NULL;
    /* Scheduling hints reach the engine, which checks them: a compute time beyond the
     * wire's u32 microseconds, or deadlines that overflow it, are refused by name. */
    lp.compute_us_per_layer = 5000000000ull;
    EXPECT_MSG(objectcache_load(e, &lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "layer compute times");
    lp.compute_us_per_layer = 0;
    lp.deadline_ms = 5000000ull;
    EXPECT_MSG(objectcache_load(e, &lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "layer deadlines");
    CHECK(t == NULL, "a refused load returned a transfer");
    /* Valid hints: layer 0 needed within 50 ms, then every 2 ms. */
    lp.deadline_ms = 50;
    lp.compute_us_per_layer = 2000;
    EXPECT(objectcache_load(e, &lp, &t), OBJECTCACHE_OK);
    for (uint32_t l = 0; l < LAYERS; l++) {
        EXPECT(objectcache_transfer_wait_layer(t, l, OBJECTCACHE_WAIT_FOREVER), OBJECTCACHE_OK);
        CHECK(memcmp(dests[l].addr, src[l], per_layer) == 0, "layer %u bytes differ", l);
        /* Bytes past n_chunks x slice are never written. */
        CHECK(((unsigned char *)dests[l].addr)[per_layer] == 0xEE, "layer %u overrun", l);
        EXPECT(objectcache_transfer_poll_layer(t, l), OBJECTCACHE_OK);
    }
    EXPECT(objectcache_transfer_wait_all(t, 0), OBJECTCACHE_OK);
    stall_advice_checks(e, hashes);
    uint8_t cs[8];
    size_t n = 0;
    EXPECT(objectcache_transfer_chunk_status(t, cs, sizeof cs, &n), OBJECTCACHE_OK);
    CHECK(n == 3, "chunk count %zu", n);
    for (size_t c = 0; c < n; c++)
        CHECK(cs[c] == OBJECTCACHE_CHUNK_OK, "chunk %zu status %u", c, cs[c]);
    EXPECT(objectcache_transfer_chunk_status(t, cs, 1, &n), OBJECTCACHE_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 3, "needed %zu", n);
    objectcache_transfer_stats ts;
    ABI_INIT(ts);
    EXPECT(objectcache_transfer_stats_get(t, &ts), OBJECTCACHE_OK);
    CHECK(ts.request_id == 42, "request id %llu", (unsigned long long)ts.request_id);
    CHECK(ts.layers_ready == LAYERS, "layers ready %u", ts.layers_ready);
    CHECK(ts.bytes == LAYERS * 3 * slice, "bytes %llu", (unsigned long long)ts.bytes);
    CHECK(ts.ttfl_s >= 0 && ts.ttll_s >= ts.ttfl_s, "ttfl %f ttll %f", ts.ttfl_s, ts.ttll_s);
    ts.struct_size = 3;
    EXPECT(objectcache_transfer_stats_get(t, &ts), OBJECTCACHE_ERR_ABI_MISMATCH);
    EXPECT_MSG(objectcache_transfer_poll_layer(t, LAYERS), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "out of range");
    EXPECT(objectcache_transfer_wait_layer(t, 0, -5), OBJECTCACHE_ERR_INVALID_ARGUMENT);

    /* In use: the region and the engine refuse to go away. */
    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_ERR_BUSY);
    EXPECT(objectcache_engine_destroy(e), OBJECTCACHE_ERR_BUSY);
    /* Handles of the wrong kind. */
    EXPECT_MSG(objectcache_transfer_poll_layer((objectcache_transfer *)e, 0),
               OBJECTCACHE_ERR_INVALID_HANDLE, "not a transfer");
    EXPECT(objectcache_transfer_release((objectcache_transfer *)region),
           OBJECTCACHE_ERR_INVALID_HANDLE);

    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);
    EXPECT_MSG(objectcache_transfer_release(t), OBJECTCACHE_ERR_INVALID_HANDLE, "not live");
    EXPECT(objectcache_transfer_poll_layer(t, 0), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_transfer_release(NULL), OBJECTCACHE_ERR_INVALID_HANDLE);

    /* ---- A load whose 4th chunk is not cached: a miss, never bytes ---- */
    lp.n_chunks = 4;
    lp.request_id = 43;
    EXPECT(objectcache_load(e, &lp, &t), OBJECTCACHE_OK);
    EXPECT(objectcache_transfer_wait_all(t, OBJECTCACHE_WAIT_FOREVER),
           OBJECTCACHE_ERR_LAYER_MISSING);
    CHECK(strstr(objectcache_last_error(), "request 43") != NULL, "request id not in message");
    /* Every layer needs chunk 3, so every layer is a miss (failures may land layer by layer). */
    for (uint32_t l = 0; l < LAYERS; l++)
        EXPECT(objectcache_transfer_wait_layer(t, l, OBJECTCACHE_WAIT_FOREVER),
               OBJECTCACHE_ERR_LAYER_MISSING);
    for (uint32_t l = 0; l < LAYERS; l++)
        EXPECT(objectcache_transfer_poll_layer(t, l), OBJECTCACHE_ERR_LAYER_MISSING);
    EXPECT(objectcache_transfer_chunk_status(t, cs, sizeof cs, &n), OBJECTCACHE_OK);
    CHECK(n == 4 && cs[3] == OBJECTCACHE_CHUNK_MISSING, "chunk 3 status %u", cs[3]);
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);

    /* ---- Bad load arguments ---- */
    lp.n_chunks = 3;
    objectcache_load_params bad_lp = lp;
    bad_lp.struct_size = sizeof lp + 8;
    EXPECT(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_ABI_MISMATCH);
    EXPECT(objectcache_load(e, NULL, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_load(e, &lp, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    bad_lp = lp;
    bad_lp.n_layers = LAYERS + 1;
    EXPECT_MSG(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_layers");
    bad_lp = lp;
    bad_lp.layers = NULL;
    EXPECT(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    bad_lp = lp;
    bad_lp.n_chunks = 0;
    EXPECT(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    objectcache_layer_dest bad_dests[LAYERS];
    memcpy(bad_dests, dests, sizeof dests);
    bad_dests[2].len = slice; /* too small for 3 chunks */
    bad_lp = lp;
    bad_lp.layers = bad_dests;
    EXPECT_MSG(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "layers[2]");
    memcpy(bad_dests, dests, sizeof dests);
    bad_dests[1].addr = dests[0].addr; /* overlaps layer 0 */
    EXPECT_MSG(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "overlap");
    unsigned char unregistered[4096];
    memcpy(bad_dests, dests, sizeof dests);
    bad_dests[3].addr = unregistered;
    bad_dests[3].len = sizeof unregistered;
    EXPECT_MSG(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "registered");
    memcpy(bad_dests, dests, sizeof dests);
    bad_dests[3].addr = dst + dst_bytes - slice; /* runs past the registered region */
    EXPECT_MSG(objectcache_load(e, &bad_lp, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "registered");

    /* ---- Cancel, with a second thread waiting ---- */
    enum { BIG = 64 };
    uint32_t big_tokens[BIG * TOKENS_PER_CHUNK];
    for (uint32_t i = 0; i < BIG * TOKENS_PER_CHUNK; i++)
        big_tokens[i] = 7 + i;
    uint8_t big_hashes[BIG * HASH_LEN];
    EXPECT(objectcache_chunk_hashes(&hp, big_tokens, BIG * TOKENS_PER_CHUNK, big_hashes,
                                    sizeof big_hashes, &n_chunks),
           OBJECTCACHE_OK);
    size_t big_layer = BIG * (size_t)slice;
    unsigned char *big_src = malloc(big_layer * LAYERS);
    const void *big_ptrs[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        fill(big_src + l * big_layer, l, BIG, slice);
        big_ptrs[l] = big_src + l * big_layer;
    }
    EXPECT(objectcache_save(e, &g, big_hashes, HASH_LEN, BIG, big_ptrs, LAYERS, big_layer, NULL),
           OBJECTCACHE_OK);
    unsigned char *big_dst = malloc(big_layer * LAYERS);
    objectcache_region *big_region = NULL;
    EXPECT(objectcache_register_memory(e, big_dst, big_layer * LAYERS, OBJECTCACHE_MEM_HOST, 0,
                                       &big_region),
           OBJECTCACHE_OK);
    objectcache_layer_dest big_dests[LAYERS];
    layer_dests(big_dests, big_dst, LAYERS, big_layer);
    objectcache_load_params blp = lp;
    blp.request_id = 44;
    blp.hashes = big_hashes;
    blp.n_chunks = BIG;
    blp.layers = big_dests;
    EXPECT(objectcache_load(e, &blp, &t), OBJECTCACHE_OK);
    struct waiter w = {.t = t};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, wait_all_layers, &w) == 0, "pthread_create");
    EXPECT(objectcache_transfer_cancel(t), OBJECTCACHE_OK);
    EXPECT(objectcache_transfer_cancel(t), OBJECTCACHE_OK); /* idempotent */
    pthread_join(th, NULL);
    int cancelled = 0;
    for (uint32_t l = 0; l < LAYERS; l++) {
        /* Each layer ended either ready (before the cancel) or cancelled; none is pending. */
        objectcache_status s = objectcache_transfer_poll_layer(t, l);
        CHECK(s == OBJECTCACHE_OK || s == OBJECTCACHE_ERR_CANCELLED, "layer %u after cancel: %s",
              l, objectcache_status_name(s));
        CHECK(w.result[l] == s, "waiter saw %s, poll says %s", objectcache_status_name(w.result[l]),
              objectcache_status_name(s));
        if (s == OBJECTCACHE_OK)
            CHECK(memcmp(big_dests[l].addr, big_ptrs[l], big_layer) == 0, "ready layer %u differs",
                  l);
        else
            cancelled++;
    }
    printf("cancel: %d of %d layers were cancelled, the rest had arrived\n", cancelled, LAYERS);
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);

    /* Release with a waiter still blocked: release wakes it and returns. */
    EXPECT(objectcache_load(e, &blp, &t), OBJECTCACHE_OK);
    w.t = t;
    CHECK(pthread_create(&th, NULL, wait_all_layers, &w) == 0, "pthread_create");
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);
    pthread_join(th, NULL);
    for (uint32_t l = 0; l < LAYERS; l++)
        CHECK(w.result[l] == OBJECTCACHE_OK || w.result[l] == OBJECTCACHE_ERR_CANCELLED ||
                  w.result[l] == OBJECTCACHE_ERR_INVALID_HANDLE,
              "waiter after release: %s", objectcache_status_name(w.result[l]));

    /* ---- Concurrent loads from several threads on one engine ---- */
    enum { THREADS = 4 };
    unsigned char *mt = malloc(THREADS * LAYERS * per_layer);
    objectcache_region *mt_region = NULL;
    EXPECT(objectcache_register_memory(e, mt, THREADS * LAYERS * per_layer, OBJECTCACHE_MEM_HOST, 0,
                                       &mt_region),
           OBJECTCACHE_OK);
    struct loader ld[THREADS];
    pthread_t ths[THREADS];
    for (int i = 0; i < THREADS; i++) {
        ld[i].e = e;
        ld[i].lp = lp;
        ld[i].lp.request_id = 100 + i;
        ld[i].dst = mt + (size_t)i * LAYERS * per_layer;
        ld[i].per_layer = per_layer;
        ld[i].expect = src;
        ld[i].ok = 0;
        CHECK(pthread_create(&ths[i], NULL, load_in_thread, &ld[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(ths[i], NULL);
        CHECK(ld[i].ok, "thread %d's load", i);
    }
    EXPECT(objectcache_deregister_memory(e, mt_region), OBJECTCACHE_OK);
    free(mt);

    /* ---- Metrics ---- */
    objectcache_metrics m;
    ABI_INIT(m);
    EXPECT(objectcache_metrics_get(e, &m), OBJECTCACHE_OK);
    /* (stall_advice_checks saved once and loaded twice.) */
    CHECK(m.saves == 3 + 1, "saves %llu", (unsigned long long)m.saves);
    CHECK(m.loads == 4 + 2 + THREADS, "loads %llu", (unsigned long long)m.loads);
    CHECK(m.lookups == 4, "lookups %llu", (unsigned long long)m.lookups);
    CHECK(m.live_transfers == 0, "live %llu", (unsigned long long)m.live_transfers);
    CHECK(m.registered_regions == 2, "regions %llu", (unsigned long long)m.registered_regions);
    CHECK(m.bytes_saved > 0, "bytes saved");
    m.struct_size = sizeof m - 8;
    EXPECT(objectcache_metrics_get(e, &m), OBJECTCACHE_ERR_ABI_MISMATCH);
    EXPECT(objectcache_metrics_get(e, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);

    /* ---- Teardown, and everything twice ---- */
    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_OK);
    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_engine_destroy(e), OBJECTCACHE_OK);
    EXPECT(objectcache_engine_destroy(e), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_deregister_memory(e, big_region), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_lookup(e, &g, hashes, HASH_LEN, 4, &hit), OBJECTCACHE_ERR_INVALID_HANDLE);
    EXPECT(objectcache_engine_destroy(NULL), OBJECTCACHE_ERR_INVALID_HANDLE);

    /* A second engine over the same store sees what the first saved. */
    EXPECT(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, vals, 4, &e), OBJECTCACHE_OK);
    EXPECT(objectcache_lookup_tokens(e, &g, &hp, tokens, N_TOKENS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 3, "second engine hit %zu", hit);
    EXPECT(objectcache_engine_destroy(e), OBJECTCACHE_OK);

    for (int l = 0; l < LAYERS; l++)
        free(src[l]);
    free(dst);
    free(big_src);
    free(big_dst);
    printf("c_abi: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
