//! The client engine: save, lookup and layer-ordered load of prefix KV cache.
