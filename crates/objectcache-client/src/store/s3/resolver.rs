//! DNS answers fixed by the configuration ([`super::S3Config::resolve`]), for the SDK's HTTP
//! client.

use std::net::IpAddr;

/// DNS resolution with fixed answers for some names ([`S3Config::resolve`]).
#[derive(Debug, Clone)]
pub(super) struct Resolver {
    pub(super) fixed: Vec<(String, IpAddr)>,
}

impl aws_smithy_runtime_api::client::dns::ResolveDns for Resolver {
    fn resolve_dns<'a>(
        &'a self,
        name: &'a str,
    ) -> aws_smithy_runtime_api::client::dns::DnsFuture<'a> {
        use aws_smithy_runtime_api::client::dns::{DnsFuture, ResolveDnsError};
        if let Some(ip) = fixed_answer(&self.fixed, name) {
            return DnsFuture::ready(Ok(vec![ip]));
        }
        DnsFuture::new(async move {
            let addrs = tokio::net::lookup_host((name, 0))
                .await
                .map_err(ResolveDnsError::new)?;
            Ok(addrs.map(|a| a.ip()).collect())
        })
    }
}

/// The fixed answer for `name` in `fixed` (a pattern `*.suffix` matches any name ending in
/// `.suffix`; any other pattern the name itself, case aside), if any. The SDK's resolver and
/// the direct ranged GETs (`direct.rs`) both look names up here.
pub(super) fn fixed_answer(fixed: &[(String, IpAddr)], name: &str) -> Option<IpAddr> {
    fixed
        .iter()
        .find(|(pat, _)| match pat.strip_prefix("*.") {
            Some(suffix) => {
                name.len() > suffix.len() + 1
                    && name.ends_with(suffix)
                    && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
            }
            None => pat.eq_ignore_ascii_case(name),
        })
        .map(|(_, ip)| *ip)
}
