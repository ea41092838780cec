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

#[cfg(feature = "s3")]
mod s3 {
    // Against the S3 endpoint of the test environment (Ceph RGW in CI): see
    // `S3Store::from_test_env` for the variables; each test gets its own key prefix.
    objectcache::conformance_tests!(async {
        objectcache::store::S3Store::from_test_env("conformance")
            .await
            .expect("S3 test endpoint answers but refuses us")
    });
}
