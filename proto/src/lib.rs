//! Wire types (gRPC/protobuf) shared by the router and the nodes, and their
//! validation into domain types. Every message from the network passes
//! through a `TryFrom` / `validate_*` here before any other code sees it.

use std::time::Duration;

use tandem_types::ModelFingerprint;
use tandem_types::{Constraint, FinishReason, GenFailure, GenerationRequest};
use tandem_types::{MinTokens, Sampled, SamplingParams};

/// Generated protobuf and gRPC code.
#[allow(clippy::all, missing_debug_implementations)]
pub mod pb {
    tonic::include_proto!("tandem.v1");
}

pub mod tls;
pub mod trace;

/// Bumped on any incompatible change of the messages' meaning (2: KV
/// regions carry grants, and KV moves as checked messages, not puts).
pub const PROTOCOL_VERSION: u32 = 2;

/// Longest prompt a message may carry (a bound on allocation; the node's own
/// `--max-length` is checked after).
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;

/// Longest prefill deadline a decode node may ask for.
pub const MAX_DEADLINE: Duration = Duration::from_secs(600);
/// Most prefill workers one `Generate` may name (the first and retries).
pub const MAX_PREFILL_TARGETS: usize = 4;

/// Why a message was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("protocol version {got} is not supported (this node speaks {PROTOCOL_VERSION})")]
    Version { got: u32 },
    #[error("incompatible peer: {0}")]
    Fingerprint(String),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ProtoError {
    ProtoError::Invalid {
        field,
        reason: reason.into(),
    }
}

fn check_version(v: u32) -> Result<(), ProtoError> {
    if v == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(ProtoError::Version { got: v })
    }
}

impl From<&ModelFingerprint> for pb::Fingerprint {
    fn from(f: &ModelFingerprint) -> Self {
        Self {
            model_id: f.model_id.clone(),
            weights_hash: format!("{:016x}", f.weights_hash),
            kv_dtype: f.kv_dtype.clone(),
            block_size: f.block_size as u32,
            kv_layout: f.kv_layout.clone(),
            num_layers: f.num_layers as u32,
            num_kv_heads: f.num_kv_heads as u32,
            head_dim: f.head_dim as u32,
        }
    }
}

impl TryFrom<pb::Fingerprint> for ModelFingerprint {
    type Error = ProtoError;

    fn try_from(f: pb::Fingerprint) -> Result<Self, ProtoError> {
        let weights_hash = u64::from_str_radix(&f.weights_hash, 16)
            .map_err(|_| invalid("fingerprint.weights_hash", "not a hex u64"))?;
        for (field, v) in [
            ("fingerprint.block_size", f.block_size),
            ("fingerprint.num_layers", f.num_layers),
            ("fingerprint.num_kv_heads", f.num_kv_heads),
            ("fingerprint.head_dim", f.head_dim),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be > 0"));
            }
        }
        Ok(Self {
            model_id: f.model_id,
            weights_hash,
            kv_dtype: f.kv_dtype,
            block_size: f.block_size as usize,
            kv_layout: f.kv_layout,
            num_layers: f.num_layers as usize,
            num_kv_heads: f.num_kv_heads as usize,
            head_dim: f.head_dim as usize,
        })
    }
}

/// Checks a peer's fingerprint against ours.
pub fn check_fingerprint(
    ours: &ModelFingerprint,
    theirs: Option<pb::Fingerprint>,
) -> Result<(), ProtoError> {
    let theirs =
        ModelFingerprint::try_from(theirs.ok_or_else(|| invalid("fingerprint", "missing"))?)?;
    match ours.mismatch(&theirs) {
        None => Ok(()),
        Some(m) => Err(ProtoError::Fingerprint(m)),
    }
}

impl From<&SamplingParams> for pb::SamplingParams {
    fn from(p: &SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            repetition_penalty: p.repetition_penalty,
            top_logprobs: p.top_logprobs as u32,
            logprobs: p.logprobs,
            logit_bias: p
                .logit_bias
                .iter()
                .map(|&(token, bias)| pb::TokenBias { token, bias })
                .collect(),
            min_tokens: p.min_tokens.as_ref().map(|m| pb::MinTokens {
                count: m.count,
                stop_ids: m.stop_ids.clone(),
            }),
        }
    }
}

impl TryFrom<pb::SamplingParams> for SamplingParams {
    type Error = ProtoError;

    fn try_from(p: pb::SamplingParams) -> Result<Self, ProtoError> {
        let s = SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            repetition_penalty: p.repetition_penalty,
            top_logprobs: p.top_logprobs as usize,
            logprobs: p.logprobs,
            logit_bias: p.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
            min_tokens: p.min_tokens.map(|m| MinTokens {
                count: m.count,
                stop_ids: m.stop_ids,
            }),
        };
        s.validate()
            .map_err(|e| invalid("sampling", e.to_string()))?;
        Ok(s)
    }
}

impl From<&Sampled> for pb::Token {
    fn from(s: &Sampled) -> Self {
        Self {
            id: s.token,
            logprob: s.logprob,
            top: s
                .top
                .iter()
                .map(|&(token, logprob)| pb::TopLogprob { token, logprob })
                .collect(),
        }
    }
}

impl TryFrom<pb::Token> for Sampled {
    type Error = ProtoError;

    fn try_from(t: pb::Token) -> Result<Self, ProtoError> {
        if t.top.len() > tandem_types::MAX_TOP_LOGPROBS {
            return Err(invalid("token.top", "too many alternatives"));
        }
        if t.logprob.is_some_and(|l| l.is_nan() || l > 0.0) {
            return Err(invalid("token.logprob", "not a log-probability"));
        }
        Ok(Sampled {
            token: t.id,
            logprob: t.logprob,
            top: t.top.into_iter().map(|a| (a.token, a.logprob)).collect(),
        })
    }
}

/// A peer's gRPC status, for a request it was running, as a typed failure
/// (classified by code: the message is detail for logs).
pub fn failure_from_status(s: &tonic::Status) -> GenFailure {
    use tonic::Code;
    let detail = format!("{:?}: {}", s.code(), s.message());
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange => GenFailure::Rejected(s.message().to_string()),
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Aborted
        | Code::Cancelled => GenFailure::Unavailable(detail),
        // A connection that broke under the call (the node died or the
        // network cut it): the node is unavailable, not faulty.
        _ if broken_connection(s) => GenFailure::Unavailable(detail),
        _ => GenFailure::Internal(detail),
    }
}

/// Whether the status carries an I/O error from the transport: a
/// connection reset, closed or cut mid-call.
fn broken_connection(s: &tonic::Status) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = cur {
        if e.is::<std::io::Error>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// The status a node answers with when a request it was running fails:
/// the inverse of [`failure_from_status`].
pub fn failure_to_status(f: &GenFailure) -> tonic::Status {
    match f {
        GenFailure::ShuttingDown => tonic::Status::unavailable(f.to_string()),
        GenFailure::Unavailable(_) => tonic::Status::unavailable(f.to_string()),
        GenFailure::Rejected(m) => tonic::Status::invalid_argument(m.clone()),
        GenFailure::Internal(_) => tonic::Status::internal(f.to_string()),
    }
}

/// Longest constraint source a message may carry.
pub const MAX_CONSTRAINT_BYTES: usize = 1 << 20;

pub fn constraint_to_pb(c: &Constraint) -> pb::Constraint {
    use pb::constraint::Kind;
    let kind = match c {
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
        Constraint::Lark(s) => Kind::Lark(s.clone()),
    };
    pb::Constraint { kind: Some(kind) }
}

/// A constraint from the wire; its grammar is checked when the node's
/// scheduler compiles it.
pub fn constraint_from_pb(c: Option<pb::Constraint>) -> Result<Option<Constraint>, ProtoError> {
    use pb::constraint::Kind;
    let Some(kind) = c.and_then(|c| c.kind) else {
        return Ok(None);
    };
    let text = |s: String| {
        if s.len() > MAX_CONSTRAINT_BYTES {
            Err(invalid("constraint", "too long"))
        } else {
            Ok(s)
        }
    };
    Ok(Some(match kind {
        Kind::JsonSchema(s) => Constraint::JsonSchema(text(s)?),
        Kind::JsonObject(true) => Constraint::JsonObject,
        Kind::JsonObject(false) => return Ok(None),
        Kind::Regex(s) => Constraint::Regex(text(s)?),
        Kind::Lark(s) => Constraint::Lark(text(s)?),
    }))
}

pub fn finish_to_pb(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

pub fn finish_from_pb(v: i32) -> Result<FinishReason, ProtoError> {
    match pb::FinishReason::try_from(v) {
        Ok(pb::FinishReason::Stop) => Ok(FinishReason::Stop),
        Ok(pb::FinishReason::Length) => Ok(FinishReason::Length),
        _ => Err(invalid("finished.finish", format!("unknown reason {v}"))),
    }
}

fn check_prompt(prompt: &[u32]) -> Result<(), ProtoError> {
    if prompt.is_empty() {
        return Err(invalid("prompt", "empty"));
    }
    if prompt.len() > MAX_PROMPT_TOKENS {
        return Err(invalid("prompt", format!("{} tokens", prompt.len())));
    }
    Ok(())
}

/// A gRPC endpoint a node can dial: `http://host:port`, or `https://` in a
/// cluster under mutual TLS (whether the scheme is the cluster's own is the
/// dialler's check, `tls::PeerConnector::endpoint`).
fn check_endpoint(field: &'static str, e: &str) -> Result<(), ProtoError> {
    let rest = e
        .strip_prefix("http://")
        .or_else(|| e.strip_prefix("https://"))
        .ok_or_else(|| {
            invalid(
                field,
                format!("`{e}` does not start with http:// or https://"),
            )
        })?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid(field, format!("`{e}` has no port")))?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(invalid(field, format!("`{e}` is not host:port")));
    }
    Ok(())
}

/// A prefill worker a decode node may ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    pub worker_id: String,
    pub endpoint: String,
}

/// A validated [`pb::GenerateRequest`]: the generation and where its
/// prompt may be prefilled. Its conversions are the one place a
/// [`GenerationRequest`] crosses the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateJob {
    pub request: GenerationRequest,
    /// Prefill workers to try in order; empty means prefill locally.
    pub prefill: Vec<PrefillTarget>,
    /// A worker that holds more of the prompt's leading blocks, if the
    /// router knows one.
    pub prefix_source: Option<PrefixSource>,
}

/// A worker the router's index says holds the prompt's first `blocks`
/// full blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixSource {
    pub worker_id: String,
    pub endpoint: String,
    pub blocks: usize,
}

impl GenerateJob {
    pub fn validate(req: pb::GenerateRequest, ours: &ModelFingerprint) -> Result<Self, ProtoError> {
        check_version(req.version)?;
        check_fingerprint(ours, req.fingerprint)?;
        check_prompt(&req.prompt)?;
        if req.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be > 0"));
        }
        let sampling = req
            .sampling
            .ok_or_else(|| invalid("sampling", "missing"))?
            .try_into()?;
        if req.prefill.len() > MAX_PREFILL_TARGETS {
            return Err(invalid(
                "prefill",
                format!(
                    "{} targets; at most {MAX_PREFILL_TARGETS}",
                    req.prefill.len()
                ),
            ));
        }
        let prefill = req
            .prefill
            .into_iter()
            .map(|t| {
                check_endpoint("prefill.endpoint", &t.endpoint)?;
                Ok(PrefillTarget {
                    worker_id: t.worker_id,
                    endpoint: t.endpoint,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let prefix_source = req
            .prefix_source
            .map(|p| {
                check_endpoint("prefix_source.endpoint", &p.endpoint)?;
                let blocks = p.blocks as usize;
                if blocks == 0 || blocks > req.prompt.len() / ours.block_size {
                    return Err(invalid(
                        "prefix_source.blocks",
                        format!(
                            "{blocks} is not a count of the prompt's {} full blocks",
                            req.prompt.len() / ours.block_size
                        ),
                    ));
                }
                Ok(PrefixSource {
                    worker_id: p.worker_id,
                    endpoint: p.endpoint,
                    blocks,
                })
            })
            .transpose()?;
        let request = GenerationRequest {
            prompt: req.prompt,
            sampling,
            max_tokens: req.max_tokens as usize,
            stop_token_ids: req.stop_token_ids,
            constraint: constraint_from_pb(req.constraint)?,
        };
        Ok(Self {
            request,
            prefill,
            prefix_source,
        })
    }

    pub fn to_pb(&self, fingerprint: &ModelFingerprint) -> pb::GenerateRequest {
        let r = &self.request;
        pb::GenerateRequest {
            version: PROTOCOL_VERSION,
            fingerprint: Some(fingerprint.into()),
            prompt: r.prompt.clone(),
            sampling: Some((&r.sampling).into()),
            max_tokens: r.max_tokens.min(u32::MAX as usize) as u32,
            stop_token_ids: r.stop_token_ids.clone(),
            prefill: self
                .prefill
                .iter()
                .map(|t| pb::PrefillTarget {
                    worker_id: t.worker_id.clone(),
                    endpoint: t.endpoint.clone(),
                })
                .collect(),
            constraint: r.constraint.as_ref().map(constraint_to_pb),
            prefix_source: self.prefix_source.as_ref().map(|p| pb::PrefixSource {
                worker_id: p.worker_id.clone(),
                endpoint: p.endpoint.clone(),
                blocks: p.blocks.min(u32::MAX as usize) as u32,
            }),
        }
    }
}

/// A decode node's KV pool and its grant for one transfer, as sent by the
/// decode node (the grant's secret is in `grant`: not for logs).
#[derive(Clone, PartialEq, Eq)]
pub struct KvRegion {
    pub worker_address: Vec<u8>,
    pub grant: Vec<u8>,
    pub len: u64,
    pub connector: String,
}

impl std::fmt::Debug for KvRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRegion")
            .field("len", &self.len)
            .field("connector", &self.connector)
            .finish_non_exhaustive()
    }
}

/// A validated [`pb::PrefillRequest`]: `dst_blocks` are checked to lie in
/// the region, and to be exactly the blocks of the prompt after
/// `skip_blocks`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillJob {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub skip_blocks: usize,
    pub dst_blocks: Vec<u32>,
    /// The decode node's KV pools, one per tensor-parallel rank (rank 0
    /// first); each holds `num_kv_heads / regions.len()` heads per block.
    pub regions: Vec<KvRegion>,
    pub deadline: Duration,
    /// The first token is sampled under it.
    pub constraint: Option<Constraint>,
}

impl PrefillJob {
    pub fn validate(
        req: pb::PrefillRequest,
        ours: &ModelFingerprint,
        block_bytes: u64,
    ) -> Result<Self, ProtoError> {
        check_version(req.version)?;
        check_fingerprint(ours, req.fingerprint)?;
        check_prompt(&req.prompt)?;
        let sampling = req
            .sampling
            .ok_or_else(|| invalid("sampling", "missing"))?
            .try_into()?;
        let regions = regions_from_pb(req.region, req.rank_regions, ours)?;
        let total = req.prompt.len().div_ceil(ours.block_size);
        let skip = req.skip_blocks as usize;
        if skip > total || req.dst_blocks.len() != total - skip {
            return Err(invalid(
                "dst_blocks",
                format!(
                    "{} blocks after skipping {skip} do not cover a prompt of {} tokens ({total} blocks)",
                    req.dst_blocks.len(),
                    req.prompt.len()
                ),
            ));
        }
        check_dst_blocks(&regions, &req.dst_blocks, block_bytes)?;
        let deadline = deadline_from_ms(req.deadline_ms)?;
        Ok(Self {
            prompt: req.prompt,
            sampling,
            skip_blocks: skip,
            dst_blocks: req.dst_blocks,
            regions,
            deadline,
            constraint: constraint_from_pb(req.constraint)?,
        })
    }

    pub fn to_pb(&self, fingerprint: &ModelFingerprint) -> pb::PrefillRequest {
        pb::PrefillRequest {
            version: PROTOCOL_VERSION,
            fingerprint: Some(fingerprint.into()),
            prompt: self.prompt.clone(),
            sampling: Some((&self.sampling).into()),
            skip_blocks: self.skip_blocks as u32,
            dst_blocks: self.dst_blocks.clone(),
            region: self.regions.first().map(region_to_pb),
            rank_regions: self.regions.iter().skip(1).map(region_to_pb).collect(),
            deadline_ms: self.deadline.as_millis().min(u128::from(u32::MAX)) as u32,
            constraint: self.constraint.as_ref().map(constraint_to_pb),
        }
    }
}

/// The destination pools of a transfer, one per tensor-parallel rank of the
/// receiving node (rank 0 first); the ranks must split the KV heads evenly.
fn regions_from_pb(
    first: Option<pb::KvRegion>,
    rest: Vec<pb::KvRegion>,
    ours: &ModelFingerprint,
) -> Result<Vec<KvRegion>, ProtoError> {
    let first = first.ok_or_else(|| invalid("region", "missing"))?;
    let mut regions = Vec::with_capacity(1 + rest.len());
    for r in std::iter::once(first).chain(rest) {
        if r.worker_address.is_empty() || r.grant.is_empty() {
            return Err(invalid("region", "empty worker address or grant"));
        }
        regions.push(KvRegion {
            worker_address: r.worker_address,
            grant: r.grant,
            len: r.len,
            connector: r.connector,
        });
    }
    let dst_tp = regions.len();
    if !ours.num_kv_heads.is_multiple_of(dst_tp) {
        return Err(invalid(
            "rank_regions",
            format!(
                "{dst_tp} decode ranks do not divide {} KV heads",
                ours.num_kv_heads
            ),
        ));
    }
    Ok(regions)
}

/// Every destination block lies inside every rank's region, each rank's
/// block holding its share of a whole-model block of `block_bytes`.
fn check_dst_blocks(regions: &[KvRegion], dst: &[u32], block_bytes: u64) -> Result<(), ProtoError> {
    let block_bytes = block_bytes / regions.len().max(1) as u64;
    let region_blocks = regions
        .iter()
        .map(|r| r.len.checked_div(block_bytes).unwrap_or(0))
        .min()
        .unwrap_or(0);
    match dst.iter().find(|&&b| u64::from(b) >= region_blocks) {
        Some(b) => Err(invalid(
            "dst_blocks",
            format!("block {b} lies outside the registered region of {region_blocks} blocks"),
        )),
        None => Ok(()),
    }
}

fn deadline_from_ms(ms: u32) -> Result<Duration, ProtoError> {
    let deadline = Duration::from_millis(u64::from(ms));
    if deadline.is_zero() || deadline > MAX_DEADLINE {
        return Err(invalid(
            "deadline_ms",
            format!("{ms} must be in 1..={}", MAX_DEADLINE.as_millis()),
        ));
    }
    Ok(deadline)
}

/// A validated [`pb::FetchRequest`]: the prompt is exactly the blocks up to
/// the last one asked for, and every destination block lies in the regions.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchJob {
    /// The prompt's first `skip_blocks + dst_blocks.len()` full blocks.
    pub prompt: Vec<u32>,
    pub skip_blocks: usize,
    pub dst_blocks: Vec<u32>,
    /// The fetching node's pools, one per tensor-parallel rank.
    pub regions: Vec<KvRegion>,
    pub deadline: Duration,
}

impl FetchJob {
    pub fn validate(
        req: pb::FetchRequest,
        ours: &ModelFingerprint,
        block_bytes: u64,
    ) -> Result<Self, ProtoError> {
        check_version(req.version)?;
        check_fingerprint(ours, req.fingerprint)?;
        check_prompt(&req.prompt)?;
        let regions = regions_from_pb(req.region, req.rank_regions, ours)?;
        let skip = req.skip_blocks as usize;
        let blocks = skip.checked_add(req.dst_blocks.len());
        if req.dst_blocks.is_empty()
            || blocks.and_then(|b| b.checked_mul(ours.block_size)) != Some(req.prompt.len())
        {
            return Err(invalid(
                "dst_blocks",
                format!(
                    "{skip} skipped and {} asked blocks are not the {} tokens sent",
                    req.dst_blocks.len(),
                    req.prompt.len()
                ),
            ));
        }
        check_dst_blocks(&regions, &req.dst_blocks, block_bytes)?;
        Ok(Self {
            prompt: req.prompt,
            skip_blocks: skip,
            dst_blocks: req.dst_blocks,
            regions,
            deadline: deadline_from_ms(req.deadline_ms)?,
        })
    }

    pub fn to_pb(&self, fingerprint: &ModelFingerprint) -> pb::FetchRequest {
        pb::FetchRequest {
            version: PROTOCOL_VERSION,
            fingerprint: Some(fingerprint.into()),
            prompt: self.prompt.clone(),
            skip_blocks: self.skip_blocks as u32,
            dst_blocks: self.dst_blocks.clone(),
            region: self.regions.first().map(region_to_pb),
            rank_regions: self.regions.iter().skip(1).map(region_to_pb).collect(),
            deadline_ms: self.deadline.as_millis().min(u128::from(u32::MAX)) as u32,
        }
    }
}

fn region_to_pb(r: &KvRegion) -> pb::KvRegion {
    pb::KvRegion {
        worker_address: r.worker_address.clone(),
        grant: r.grant.clone(),
        len: r.len,
        connector: r.connector.clone(),
    }
}

/// Role names in records and keys.
pub const ROLE_PREFILL: &str = "prefill";
pub const ROLE_DECODE: &str = "decode";

/// A validated [`pb::WorkerRecord`] (the etcd value of a worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    pub id: String,
    pub role: String,
    pub grpc_endpoint: String,
    pub metrics_endpoint: String,
    pub fingerprint: ModelFingerprint,
    pub kv_blocks_total: usize,
    pub max_batch_size: usize,
    pub tp: usize,
    pub dp: usize,
}

impl WorkerRecord {
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtoError> {
        let r = <pb::WorkerRecord as prost::Message>::decode(bytes)
            .map_err(|e| invalid("worker record", e.to_string()))?;
        check_version(r.version)?;
        if r.id.is_empty() {
            return Err(invalid("worker record id", "empty"));
        }
        if r.role != ROLE_PREFILL && r.role != ROLE_DECODE {
            return Err(invalid("worker record role", format!("`{}`", r.role)));
        }
        check_endpoint("grpc_endpoint", &r.grpc_endpoint)?;
        let fingerprint = r
            .fingerprint
            .ok_or_else(|| invalid("fingerprint", "missing"))?
            .try_into()?;
        Ok(Self {
            id: r.id,
            role: r.role,
            grpc_endpoint: r.grpc_endpoint,
            metrics_endpoint: r.metrics_endpoint,
            fingerprint,
            kv_blocks_total: r.kv_blocks_total as usize,
            max_batch_size: r.max_batch_size as usize,
            tp: (r.tp as usize).max(1),
            dp: (r.dp as usize).max(1),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let r = pb::WorkerRecord {
            version: PROTOCOL_VERSION,
            id: self.id.clone(),
            role: self.role.clone(),
            grpc_endpoint: self.grpc_endpoint.clone(),
            metrics_endpoint: self.metrics_endpoint.clone(),
            fingerprint: Some((&self.fingerprint).into()),
            kv_blocks_total: self.kv_blocks_total as u32,
            max_batch_size: self.max_batch_size as u32,
            tp: self.tp as u32,
            dp: self.dp as u32,
        };
        prost::Message::encode_to_vec(&r)
    }
}

#[cfg(test)]
mod tests;
