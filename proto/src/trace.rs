//! W3C trace context carried in gRPC metadata (`traceparent`), so that one
//! request's spans on the router, the decode node and the prefill node
//! share a trace id.

use std::sync::atomic::{AtomicU64, Ordering};

/// The metadata key.
pub const TRACEPARENT: &str = "traceparent";

/// A trace id and the id of the span that made the outgoing call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    pub span_id: u64,
}

fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id()) << 32;
    // splitmix64 finaliser: ids need to be unique, not secret.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)).max(1)
}

impl TraceContext {
    /// A new trace (the router starts one per request).
    pub fn new_root() -> Self {
        Self {
            trace_id: (u128::from(random_u64()) << 64) | u128::from(random_u64()),
            span_id: random_u64(),
        }
    }

    /// The same trace, with a new span id for this hop's outgoing calls.
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id,
            span_id: random_u64(),
        }
    }

    pub fn to_header(&self) -> String {
        format!("00-{:032x}-{:016x}-01", self.trace_id, self.span_id)
    }

    /// Parses a `traceparent` value; `None` if malformed (then the callee
    /// starts its own trace).
    pub fn parse(v: &str) -> Option<Self> {
        let mut parts = v.split('-');
        let (ver, trace, span, _flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if ver != "00" || trace.len() != 32 || span.len() != 16 || parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        Some(Self { trace_id, span_id })
    }

    /// Reads the context from a request's metadata.
    pub fn from_metadata(md: &tonic::metadata::MetadataMap) -> Option<Self> {
        md.get(TRACEPARENT)?.to_str().ok().and_then(Self::parse)
    }

    /// Writes the context into outgoing metadata.
    pub fn inject(&self, md: &mut tonic::metadata::MetadataMap) {
        if let Ok(v) = self.to_header().parse() {
            md.insert(TRACEPARENT, v);
        }
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_malformed() {
        let c = TraceContext::new_root();
        assert_eq!(TraceContext::parse(&c.to_header()), Some(c));
        let child = c.child();
        assert_eq!(child.trace_id, c.trace_id);
        assert_ne!(child.span_id, c.span_id);
        for bad in [
            "",
            "00-abc-def-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }
}
