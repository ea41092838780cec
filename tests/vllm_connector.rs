//! `objectcache.vllm.ObjectCacheConnector` inside a real vLLM (0.32, CPU) with a real model
//! (SmolLM2-135M): cross-replica hits on the embedded file store, our server (gather) and Ceph
//! RGW (ranged GETs), cache salts, 8 concurrent requests through the OpenAI-compatible server,
//! and every stored object corrupted (`ffi/python/tests/test_vllm.py`); failed loads of each
//! kind (missing, corrupt, truncated, stalled, killed gateway, store down) in both load modes,
//! with and without vLLM's async scheduling, and chunk keys at every hash granularity
//! (`test_vllm_failures.py`); the model families: a Gemma 3 style sliding-window hybrid through
//! vLLM's hybrid KV cache manager, DeepSeek-V2 style MLA saved once at TP 2, Llama at TP 2,
//! and a recurrent model refused (`test_vllm_models.py`, models of
//! `scripts/vllm-tiny-models.py`). The cases are pytest files run by the vLLM venv's Python, in
//! two lanes side by side on machines with 2 CPUs or more (their output lines prefixed
//! `[vllm-a]` and `[vllm-b]`); this test installs the package from `ffi/python` with pip and
//! creates the RGW bucket.
//!
//! Needs the venv and model of `scripts/vllm-setup.sh` (`$OBJECTCACHE_VLLM_DIR`, default
//! `target/vllm`) and, for the RGW case, the test S3 endpoint (`OBJECTCACHE_TEST_S3_*`).
//! Without them it prints SKIP, or fails when `OBJECTCACHE_REQUIRE_ALL` is set.

mod common;
mod py_support;

use objectcache::store::{S3Config, S3Store};

#[test]
fn vllm_connector_in_a_real_vllm() {
    let Some(p) = py_support::installed("vllm_connector_in_a_real_vllm") else {
        return;
    };
    let c = S3Config::from_test_env();
    let mut env = vec![("OBJECTCACHE_VLLM_MODEL", p.model.display().to_string())];
    if let objectcache::store::S3Credentials::Static {
        access_key,
        secret_key,
        ..
    } = &c.credentials
    {
        // One set of credentials for RGW and for the server the suite starts.
        for (k, v) in [
            ("OBJECTCACHE_TEST_S3_ACCESS_KEY", access_key),
            ("AWS_ACCESS_KEY_ID", access_key),
            ("OBJECTCACHE_TEST_S3_SECRET_KEY", secret_key),
            ("AWS_SECRET_ACCESS_KEY", secret_key),
        ] {
            env.push((k, v.clone()));
        }
    }
    env.push((
        "AWS_REGION",
        c.region.clone().unwrap_or_else(|| "us-east-1".into()),
    ));
    env.push(("AWS_EC2_METADATA_DISABLED", "true".into()));
    let rt = tokio::runtime::Runtime::new().unwrap();
    match rt.block_on(S3Store::from_test_env("vllm")) {
        Ok(Some((_, prefix))) => env.push((
            "OBJECTCACHE_VLLM_RGW_URL",
            format!(
                "s3://{}/{prefix}?endpoint={}&region={}&addressing=path",
                c.bucket,
                c.endpoint.clone().unwrap_or_default(),
                c.region.clone().unwrap_or_else(|| "us-east-1".into()),
            ),
        )),
        Ok(None) => println!(
            "no S3 endpoint at {:?}: the RGW case is skipped",
            c.endpoint
        ),
        Err(e) => panic!("the test S3 endpoint refused the bucket: {e}"),
    }
    // Two lanes side by side, a core each (py_support::pytest_lanes). The failure tests are
    // bound by their fault rounds' compute, the other two files by replica start-ups: on a
    // 2-core EPYC the lanes took 665 s and 566 s with one fault round's case (about 100 s) in
    // the second lane; the abort test (about 75 s) goes there too.
    const MOVED: [&str; 2] = [
        "test_vllm_failures.py::test_failed_loads_recompute_once_with_the_right_output[layerwise-True]",
        "test_vllm_failures.py::test_aborted_requests_cancel_their_loads_and_leak_nothing",
    ];
    let deselect = MOVED.map(|t| format!("--deselect=tests/{t}"));
    py_support::pytest_lanes(
        &p.py,
        &p.site,
        &[
            &["test_vllm_failures.py", &deselect[0], &deselect[1]],
            &["test_vllm.py", "test_vllm_models.py", MOVED[0], MOVED[1]],
        ],
        &env,
    );
}
