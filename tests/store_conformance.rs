//! The storage conformance suite on every backend (one test per case per backend).

mod memory {
    objectcache::conformance_tests!(async {
        Some((objectcache::store::MemoryStore::new(), "conf".to_string()))
    });
}

mod fs {
    objectcache::conformance_tests!(async {
        let dir = tempfile::tempdir().unwrap().keep();
        Some((
            objectcache::store::FsStore::new(dir, objectcache::store::FsyncPolicy::Never).unwrap(),
            "conf".to_string(),
        ))
    });
}
