//! The C ABI (`ffi/objectcache.h`): a thin layer over [`crate::connector`].
