//! What request bodies being received may hold: bytes by their declared
//! length, from the server's budget (`--max-buffered-body-bytes`, 503
//! beyond it), of which one client address or one API key holds at most a
//! share (`--max-buffered-body-bytes-per-client`, 429 beyond it), so that
//! slow uploads from one place cannot lock every other client out. Each
//! body is paced (`body_pace`) from the moment it is admitted.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::AppState;
use crate::error::ApiError;
use crate::metrics::record_rejected;

/// The digest of the API key a request authenticated with, put in its
/// extensions by the key check for the body budget to charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyId(pub(crate) [u8; 32]);

/// Who holds part of the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Holder {
    /// A client address; IPv6 addresses by their /64 (one host's range).
    Addr(IpAddr),
    Key([u8; 32]),
}

impl Holder {
    fn addr(peer: SocketAddr) -> Self {
        match peer.ip().to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                Self::Addr(IpAddr::V6(prefix.into()))
            }
            v4 => Self::Addr(v4),
        }
    }
}

/// Why a body was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its address or key already holds its share.
    Share { key: bool, share: usize },
    /// The whole budget is taken.
    Full,
}

impl Refused {
    fn error(self) -> ApiError {
        match self {
            Self::Share { key, share } => ApiError::RateLimited(format!(
                "This {} already has {share} bytes of request bodies being received \
                 (--max-buffered-body-bytes-per-client). Retry later.",
                if key { "API key" } else { "client address" }
            )),
            Self::Full => ApiError::Overloaded(
                "The server is receiving too many request bodies at once. Retry later.".into(),
            ),
        }
    }
}

/// The server's body budget and what each holder has of it.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    total: Arc<Semaphore>,
    share: usize,
    held: Mutex<HashMap<Holder, usize>>,
}

/// Bytes of the budget held until dropped (the request is handled).
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<BodyBudget>,
    holders: Vec<Holder>,
    bytes: usize,
    _permit: OwnedSemaphorePermit,
}

impl BodyBudget {
    /// `total` bytes, at most `share` of them per holder.
    pub(crate) fn new(total: usize, share: usize) -> Self {
        Self {
            total: Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))),
            share,
            held: Mutex::default(),
        }
    }

    /// Reserves `bytes` for a body from `peer` (when known) sent with
    /// `key` (when keys are configured).
    pub(crate) fn reserve(
        self: &Arc<Self>,
        bytes: usize,
        peer: Option<SocketAddr>,
        key: Option<KeyId>,
    ) -> Result<Reservation, Refused> {
        let bytes = bytes.max(1);
        let holders: Vec<Holder> = peer
            .map(Holder::addr)
            .into_iter()
            .chain(key.map(|k| Holder::Key(k.0)))
            .collect();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        for h in &holders {
            let has = held.get(h).copied().unwrap_or(0);
            if has.saturating_add(bytes) > self.share {
                let key = matches!(h, Holder::Key(_));
                return Err(Refused::Share {
                    key,
                    share: self.share,
                });
            }
        }
        let permits = u32::try_from(bytes).map_err(|_| Refused::Full)?;
        let permit = Arc::clone(&self.total)
            .try_acquire_many_owned(permits)
            .map_err(|_| Refused::Full)?;
        for h in &holders {
            *held.entry(*h).or_default() += bytes;
        }
        Ok(Reservation {
            budget: Arc::clone(self),
            holders,
            bytes,
            _permit: permit,
        })
    }

    /// How many holders have bytes held.
    #[cfg(test)]
    fn holders(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut held = self
            .budget
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for h in &self.holders {
            if let Some(n) = held.get_mut(h) {
                *n -= self.bytes.min(*n);
                if *n == 0 {
                    held.remove(h);
                }
            }
        }
    }
}

/// A refusal that also closes the connection: the body it declared is
/// not read.
fn refuse(e: ApiError) -> Response {
    record_rejected(&e);
    let mut r = e.into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The JSON check, the budget and the pace of a POST body (the middleware
/// of every route): the declared type must be JSON; the declared length
/// (the limit when none is declared) is reserved until the request is
/// handled; the body is then read at its pace or not at all.
pub(crate) async fn admit_body(
    State(state): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    // Bodies are JSON: a declared type must say so (a missing one is
    // accepted, as clients that send JSON often leave it out).
    if let Some(ct) = req.headers().get(header::CONTENT_TYPE) {
        let essence = ct
            .to_str()
            .ok()
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase());
        let json = essence
            .as_deref()
            .is_some_and(|e| e == "application/json" || e.ends_with("+json"));
        if !json {
            return refuse(ApiError::UnsupportedMediaType(
                "The request body must be JSON, sent with Content-Type: application/json".into(),
            ));
        }
    }
    let config = state.config();
    let limit = config.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(limit)
        .min(limit);
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let key = req.extensions().get::<KeyId>().copied();
    let _reserved = match state.inner.body_budget.reserve(declared, peer, key) {
        Ok(r) => r,
        Err(refused) => return refuse(refused.error()),
    };
    let (parts, body) = req.into_parts();
    let body = config.body_pace.apply(body);
    next.run(axum::extract::Request::from_parts(parts, body))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> Option<SocketAddr> {
        Some(SocketAddr::new(ip.parse().expect("an address"), 40000))
    }

    #[test]
    fn one_address_or_key_holds_at_most_its_share() {
        let b = Arc::new(BodyBudget::new(1000, 400));
        let a1 = b.reserve(300, peer("10.0.0.1"), None).expect("admitted");
        // The same address (another port) is over its share; another is not.
        assert_eq!(
            b.reserve(200, peer("10.0.0.1"), None).err(),
            Some(Refused::Share {
                key: false,
                share: 400
            })
        );
        let a2 = b.reserve(400, peer("10.0.0.2"), None).expect("admitted");
        // One key across addresses.
        let k = Some(KeyId([7; 32]));
        let k1 = b.reserve(250, peer("10.0.0.3"), k).expect("admitted");
        assert_eq!(
            b.reserve(200, peer("10.0.0.4"), k).err(),
            Some(Refused::Share {
                key: true,
                share: 400
            })
        );
        // The whole budget: 950 of 1000 taken.
        assert_eq!(
            b.reserve(100, peer("10.0.0.5"), None).err(),
            Some(Refused::Full)
        );
        drop((a1, k1));
        let again = b.reserve(400, peer("10.0.0.1"), None).expect("admitted");
        drop((a2, again));
        assert_eq!(b.holders(), 0, "idle holders are forgotten");
        assert_eq!(b.total.available_permits(), 1000);
    }

    #[test]
    fn ipv6_clients_are_held_by_their_64_prefix() {
        let b = Arc::new(BodyBudget::new(1000, 400));
        let _a = b.reserve(300, peer("2001:db8::1"), None).expect("admitted");
        assert!(b.reserve(200, peer("2001:db8::ffff:1"), None).is_err());
        assert!(b.reserve(200, peer("2001:db8:0:1::1"), None).is_ok());
        // An IPv4-mapped address is its IPv4 address.
        let _v4 = b.reserve(300, peer("10.0.0.9"), None).expect("admitted");
        assert!(b.reserve(200, peer("::ffff:10.0.0.9"), None).is_err());
    }
}
