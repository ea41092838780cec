//! The `objectcache` Python package (`ffi/python`): installed with pip from the source tree
//! (bundling this build's cdylib), then its pytest suite against the embedded store and
//! against our server (`objectcache serve`, started by the suite). Uses the Python of the vLLM
//! venv (`scripts/vllm-setup.sh`), which has pytest.

use crate::py_support;

#[test]
fn python_package_suite() {
    let Some(p) = py_support::installed("python_package_suite") else {
        return;
    };
    py_support::pytest(
        &p.py,
        &p.site,
        &["test_embedded.py", "test_server.py", "test_stub.py"],
        &[],
    );
}
