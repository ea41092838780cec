//! The ObjectCache server: S3-compatible storage plus the one-request layer-ordered gather.
