//! [`Gateways`]: where a store's objects may also be loaded over the gather protocol, in
//! which order for a load, and its endpoints' connection pools warmed: the transport side of
//! a store, held by the engine beside its [`Store`], so that the trait stays object_store's
//! shape (objects, not transports) and a store that wraps another forwards nothing of it.
//!
//! | store | gateways |
//! |---|---|
//! | `S3Store` at a plain `http://` endpoint | that endpoint (an ObjectCache server or any S3 server: the connector's probe tells them apart) |
//! | `S3Store` at an `https://` endpoint or AWS S3 | none (ranged GETs only); its connection pool is still warmed |
//! | `GatewayStore` | every endpoint, in placement order per load, marked down and counted by the loads |
//! | local stores, wrappers | none |

use super::Store;

/// A server endpoint that may speak the gather protocol for a store's objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherTarget {
    /// `host:port` of the server (the S3 endpoint's).
    pub addr: String,
    /// Bucket holding the objects.
    pub bucket: String,
    /// Key prefix inside the bucket (empty, or without leading/trailing `/`).
    pub key_prefix: String,
    /// `(access_key_id, secret_key)` the gather connection authenticates with (the store's
    /// S3 credentials); `None` for a server without authentication.
    pub credentials: Option<(String, String)>,
}

/// What the connector observed about one gateway ([`Gateways::event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointEvent {
    /// A gather connection to it could not be opened, or broke in the middle of a load.
    Unreachable,
    /// A gather load started on it.
    LoadStarted,
    /// A gather load on it ended.
    LoadEnded,
}

/// The gather endpoints in front of a store and their connection pools (module
/// documentation). Cheap to clone: clones share the endpoints' state (up or down, loads in
/// flight).
#[derive(Debug, Clone, Default)]
pub struct Gateways(Kind);

#[derive(Debug, Clone, Default)]
enum Kind {
    /// No endpoint: loads take ranged GETs (or read local files), nothing to warm.
    #[default]
    None,
    /// One S3 endpoint.
    #[cfg(feature = "s3")]
    One(std::sync::Arc<super::S3Store>),
    /// Several endpoints serving the same bucket.
    #[cfg(feature = "s3")]
    Many(super::GatewayStore),
}

impl Gateways {
    /// No gateway: every load reads through the store's object operations.
    pub fn none() -> Self {
        Gateways(Kind::None)
    }

    /// The gateways of a store this crate knows: an `S3Store`'s endpoint, a `GatewayStore`'s
    /// endpoints, none for any other store (local stores, and stores that wrap another: pass
    /// the wrapped store's gateways with the wrapper, as `Engine::with_gateways` takes them).
    pub fn of(store: &dyn Store) -> Self {
        #[cfg(feature = "s3")]
        {
            let any: &dyn std::any::Any = store;
            if let Some(s) = any.downcast_ref::<super::S3Store>() {
                return s.gateways();
            }
            if let Some(g) = any.downcast_ref::<super::GatewayStore>() {
                return g.gateways();
            }
        }
        let _ = store;
        Gateways::none()
    }

    #[cfg(feature = "s3")]
    pub(super) fn one(store: super::S3Store) -> Self {
        Gateways(Kind::One(std::sync::Arc::new(store)))
    }

    #[cfg(feature = "s3")]
    pub(super) fn many(store: super::GatewayStore) -> Self {
        Gateways(Kind::Many(store))
    }

    /// The first gateway where loads may use gather, if any (over several, the first one
    /// given; loads use [`Gateways::route`]).
    pub fn first(&self) -> Option<GatherTarget> {
        match &self.0 {
            Kind::None => None,
            #[cfg(feature = "s3")]
            Kind::One(s) => s.gather_target(),
            #[cfg(feature = "s3")]
            Kind::Many(g) => g.first_target(),
        }
    }

    /// The gateways for a load whose prefix has route key `route`
    /// ([`crate::sched::placement::route_key`] of its first chunk hash), in the order to try
    /// them: over several, the placement policy's order, up ones first.
    pub fn route(&self, route: u64) -> Vec<GatherTarget> {
        match &self.0 {
            Kind::None => {
                let _ = route;
                Vec::new()
            }
            #[cfg(feature = "s3")]
            Kind::One(s) => s.gather_target().into_iter().collect(),
            #[cfg(feature = "s3")]
            Kind::Many(g) => g.gather_route(route),
        }
    }

    /// Tells the gateway at `addr` (a [`GatherTarget::addr`]) what a load saw: over several,
    /// an unreachable one is marked down until a health check finds it up, and loads in
    /// flight count for load-aware placement. Ignored for one endpoint or none.
    pub fn event(&self, addr: &str, event: EndpointEvent) {
        match &self.0 {
            #[cfg(feature = "s3")]
            Kind::Many(g) => g.endpoint_event(addr, event),
            _ => {
                let _ = (addr, event);
            }
        }
    }

    /// Opens up to `connections` pooled connections to the store's endpoint ahead of use, so
    /// that the first load does not pay a connection set-up (TCP, TLS) per request (for an
    /// `S3Store`, `connections` concurrent `HeadBucket` requests, see `S3Store::warm`). Never
    /// fails; returns the number of requests answered: 0 with no endpoint, and over several
    /// gateways (whose loads use gather connections, warmed by the engine's probe).
    pub async fn warm(&self, connections: usize) -> usize {
        match &self.0 {
            #[cfg(feature = "s3")]
            Kind::One(s) => s.warm(connections).await,
            _ => {
                let _ = connections;
                0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_stores_and_wrappers_have_no_gateways() {
        let mem = std::sync::Arc::new(super::super::MemoryStore::new());
        assert!(Gateways::of(&*mem).first().is_none());
        let metered = super::super::MeteredStore::new(mem);
        assert!(Gateways::of(&metered).route(7).is_empty());
    }
}
