//! Authentication of a gather connection (protocol version 2): the server sends a 32-byte
//! random nonce (`AuthChallenge`), the client answers with its access key id and
//! `HMAC-SHA256(secret_key, AUTH_CONTEXT || nonce || access_key_id)` (`Auth`), the server
//! recomputes it with the secret it has for that key id and compares in constant time. The
//! keys are the server's S3 access keys (the same pairs SigV4 checks). The secret never
//! crosses the wire; a captured answer is useless on another connection (another nonce).
//!
//! HMAC is RFC 2104 over SHA-256 (FIPS 180-4), from the `hmac` and `sha2` crates.

use hmac::{KeyInit, Mac};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Bytes of the server's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of the client's MAC.
pub const MAC_LEN: usize = 32;
/// Longest access key id accepted in an `Auth` frame, bytes.
pub const MAX_ACCESS_KEY_LEN: usize = 256;
/// Domain separation: the MAC of a gather handshake can't be a valid MAC of anything else.
const AUTH_CONTEXT: &[u8] = b"OCGATHER-AUTH-v2\0";

/// The client's answer to `nonce`: `HMAC-SHA256(secret_key, context || nonce || access_key)`.
pub fn auth_mac(access_key: &str, secret_key: &str, nonce: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
    let mut m =
        HmacSha256::new_from_slice(secret_key.as_bytes()).expect("HMAC accepts keys of any length");
    m.update(AUTH_CONTEXT);
    m.update(nonce);
    m.update(access_key.as_bytes());
    m.finalize().into_bytes().into()
}

/// `true` if `mac` is the right answer to `nonce` for this key pair (constant-time compare).
pub fn verify_mac(
    access_key: &str,
    secret_key: &str,
    nonce: &[u8; NONCE_LEN],
    mac: &[u8; MAC_LEN],
) -> bool {
    let mut m =
        HmacSha256::new_from_slice(secret_key.as_bytes()).expect("HMAC accepts keys of any length");
    m.update(AUTH_CONTEXT);
    m.update(nonce);
    m.update(access_key.as_bytes());
    m.verify_slice(mac).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn right_secret_verifies_wrong_ones_do_not() {
        let n = [7u8; NONCE_LEN];
        let mac = auth_mac("ak", "secret", &n);
        assert!(verify_mac("ak", "secret", &n, &mac));
        assert!(!verify_mac("ak", "secreT", &n, &mac));
        assert!(!verify_mac("ak2", "secret", &n, &mac));
        let mut n2 = n;
        n2[0] ^= 1;
        assert!(!verify_mac("ak", "secret", &n2, &mac));
    }

    #[test]
    fn rfc4231_case_2() {
        // RFC 4231 test case 2 checks the HMAC-SHA256 primitive itself.
        let mut m = HmacSha256::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(m.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
