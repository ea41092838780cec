/*
 * The checks shared by the C ABI tests (lifecycle.c, paged.c): CHECK counts a passed or
 * failed condition and prints each failure with the library's last error; EXPECT checks a
 * call's status; EXPECT_MSG also the message. Each test prints the counts at its end.
 * Also the structs both tests build: ABI_INIT and bf16_geometry.
 */
#ifndef OBJECTCACHE_TEST_CHECK_H
#define OBJECTCACHE_TEST_CHECK_H

#include "objectcache.h"

#include <stdio.h>
#include <string.h>

static int passed, failed;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (cond) {                                                                        \
            passed++;                                                                      \
        } else {                                                                           \
            failed++;                                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, " (last error: %s)\n", objectcache_last_error());              \
        }                                                                                  \
    } while (0)

/* Expects `call` to return `want`; on an error code also expects a non-empty message. */
#define EXPECT(call, want)                                                                 \
    do {                                                                                   \
        objectcache_status got_ = (call);                                                  \
        CHECK(got_ == (want), "%s returned %s, expected %s", #call,                        \
              objectcache_status_name(got_), objectcache_status_name(want));               \
        if ((want) > OBJECTCACHE_PENDING)                                                  \
            CHECK(objectcache_last_error()[0] != '\0', "no message for %s", #call);        \
    } while (0)

#define EXPECT_MSG(call, want, needle)                                                     \
    do {                                                                                   \
        EXPECT(call, want);                                                                \
        CHECK(strstr(objectcache_last_error(), (needle)) != NULL,                          \
              "message of %s lacks \"%s\"", #call, (needle));                              \
    } while (0)

/* Zeroes an ABI struct and sets its struct_size, as every caller of the library must. */
#define ABI_INIT(s) (memset(&(s), 0, sizeof(s)), (s).struct_size = sizeof(s))

/* A BF16 geometry at TP 1 (rank 0 of 1), no paged layout. */
static inline objectcache_geometry bf16_geometry(uint32_t layers, uint32_t kv_heads,
                                                 uint32_t head_dim, uint32_t tokens_per_chunk,
                                                 const char *model) {
    objectcache_geometry g;
    ABI_INIT(g);
    g.layers = layers;
    g.kv_heads = kv_heads;
    g.head_dim = head_dim;
    g.dtype = OBJECTCACHE_DTYPE_BF16;
    g.tokens_per_chunk = tokens_per_chunk;
    g.tp_rank = 0;
    g.tp_world = 1;
    g.model = model;
    return g;
}

#endif
