//! Where S3 credentials come from: the application's configuration, the environment, or a
//! named profile in the shared AWS files; refused credentials are `PermissionDenied`.
//! Against the real S3 server of the test environment (Ceph RGW in CI).
//!
//! One test function, because it changes process-wide environment variables step by step.
#![cfg(feature = "s3")]

mod s3_support;

use bytes::Bytes;
use objectcache::store::{open_store, S3Credentials, S3Store, Store, StoreExt};
use objectcache::StoreError;
use s3_support::rgw_config;

const ENV_KEYS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
];

#[tokio::test]
async fn credentials_from_config_environment_and_profile() {
    let Some(c) = rgw_config("credentials").await else {
        return;
    };
    let S3Credentials::Static {
        access_key,
        secret_key,
        ..
    } = c.credentials.clone()
    else {
        unreachable!("test settings carry fixed keys")
    };
    let endpoint = c.endpoint.clone().unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = format!("creds-{}-{nanos}/obj", std::process::id());
    let data = Bytes::from_static(b"written with configured credentials");

    // 1. From the configuration.
    let store = S3Store::new(c.clone()).await.unwrap();
    store.create_bucket().await.unwrap();
    store.put(&key, data.clone()).await.unwrap();

    // Nothing below may fall through to an instance metadata service.
    std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    for k in ENV_KEYS {
        std::env::remove_var(k);
    }
    let url = format!("s3://{}?endpoint={endpoint}&region=us-east-1", c.bucket);

    // 2. From a named profile in the shared files.
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("credentials");
    let config = dir.path().join("config");
    std::fs::write(
        &creds,
        format!(
            "[ocprofile]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n"
        ),
    )
    .unwrap();
    std::fs::write(&config, "[profile ocprofile]\nregion = us-east-1\n").unwrap();
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", &creds);
    std::env::set_var("AWS_CONFIG_FILE", &config);
    let via_profile = open_store(&format!("{url}&profile=ocprofile"))
        .await
        .unwrap();
    assert_eq!(via_profile.get_bytes(&key).await.unwrap(), data);

    // A profile with the wrong secret is refused by the server.
    std::fs::write(&creds, format!("[ocprofile]\naws_access_key_id = {access_key}\naws_secret_access_key = wrong{secret_key}\n")).unwrap();
    let wrong = open_store(&format!("{url}&profile=ocprofile"))
        .await
        .unwrap();
    let e = wrong.get_bytes(&key).await.unwrap_err();
    assert!(matches!(e, StoreError::PermissionDenied { .. }), "{e:?}");

    // 3. From the environment (it comes before any profile).
    std::env::set_var("AWS_ACCESS_KEY_ID", &access_key);
    std::env::set_var("AWS_SECRET_ACCESS_KEY", &secret_key);
    let via_env = open_store(&url).await.unwrap();
    assert_eq!(via_env.get_bytes(&key).await.unwrap(), data);

    // Refused configured keys.
    let mut bad = c.clone();
    bad.credentials = S3Credentials::Static {
        access_key: "no-such-user".into(),
        secret_key: "x".repeat(20),
        session_token: None,
    };
    let e = S3Store::new(bad)
        .await
        .unwrap()
        .get_bytes(&key)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::PermissionDenied { .. }), "{e:?}");
    assert!(e.to_string().contains("403"), "{e}");

    store.delete(&key).await.unwrap();
}
