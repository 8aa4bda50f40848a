//! Routing and starting one request: the prompt's block hashes, both pools
//! ranked, the prefill candidates named to the decode node, and the
//! `Generate` call, passed on to the next decode worker when one refuses
//! (up to `decode_attempts`; an invalid request is not retried). Each
//! attempt names the worker holding more of the prompt's leading blocks
//! than that decode worker, if there is one (`prefix_source`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tandem_discovery::Role;
use tandem_frontend::{BackendRequest, SubmitError};
use tandem_proto::{GenerateJob, PrefillTarget, failure_from_status, pb};
use tandem_types::{GenFailure, block_hashes};
use tonic::Code;

use super::prefix_source::prefix_source;
use super::{Cluster, RemoteStream, metrics};

/// One request, routed.
#[derive(Debug)]
pub struct Placement {
    pub decode: String,
    pub prefill: Vec<String>,
}

impl Cluster {
    /// Routes and starts one generation on a decode node. `req` has
    /// passed the front end's checks; `vocab` bounds the tokens it returns.
    pub async fn generate(
        &self,
        req: BackendRequest,
        vocab: usize,
    ) -> Result<(RemoteStream, Placement), SubmitError> {
        let BackendRequest { request, trace } = req;
        let m = metrics();
        let t0 = Instant::now();
        let hashes = block_hashes(&request.prompt, self.fingerprint.block_size);
        let prompt_blocks = request.prompt.len().div_ceil(self.fingerprint.block_size);
        let t1 = Instant::now();
        let ready = self.ready(&hashes);
        let decodes = self.rank_ready(Role::Decode, &ready, prompt_blocks);
        let prefills = self.rank_ready(Role::Prefill, &ready, prompt_blocks);
        let t2 = Instant::now();
        if decodes.is_empty() {
            return Err(
                GenFailure::Unavailable("no verified decode worker is available".into()).into(),
            );
        }
        let targets: Vec<PrefillTarget> = prefills
            .iter()
            .take(self.routing.prefill_candidates)
            .map(|(w, _)| PrefillTarget {
                worker_id: w.record.id.clone(),
                endpoint: w.record.grpc_endpoint.clone(),
            })
            .collect();
        let job = GenerateJob {
            request,
            prefill: targets,
            prefix_source: None,
        };
        let req = job.to_pb(&self.fingerprint);
        m.hashing.record((t1 - t0).as_secs_f64() * 1e6, &[]);
        m.lookup.record((t2 - t1).as_secs_f64() * 1e6, &[]);
        m.scheduling.record(t2.elapsed().as_secs_f64() * 1e6, &[]);
        let mut last_err = None;
        for (w, c) in decodes.iter().take(self.routing.decode_attempts) {
            let overlap = c.overlap.blocks;
            let source = prefix_source(w, overlap, &ready, &self.routing);
            let mut req = req.clone();
            req.prefix_source = source.as_ref().map(|p| pb::PrefixSource {
                worker_id: p.worker_id.clone(),
                endpoint: p.endpoint.clone(),
                blocks: p.blocks.min(u32::MAX as usize) as u32,
            });
            let mut request = tonic::Request::new(req);
            trace.inject(request.metadata_mut());
            let mut client = pb::decode_client::DecodeClient::new(w.channel.clone());
            w.pending.fetch_add(1, Ordering::Relaxed);
            let result = client.generate(request).await;
            w.pending.fetch_sub(1, Ordering::Relaxed);
            match result {
                Ok(resp) => {
                    m.overlap.record(overlap as u64, &[]);
                    if let Some(p) = &source {
                        m.prefix_sources.add(1, &[]);
                        tracing::debug!(decode = %w.record.id, source = %p.worker_id, blocks = p.blocks, have = overlap, "prefix source named");
                    }
                    let placement = Placement {
                        decode: w.record.id.clone(),
                        prefill: job.prefill.iter().map(|t| t.worker_id.clone()).collect(),
                    };
                    let stream = RemoteStream::start(resp.into_inner(), vocab);
                    return Ok((stream, placement));
                }
                Err(s) if s.code() == Code::InvalidArgument => {
                    return Err(failure_from_status(&s).into());
                }
                Err(s) => {
                    tracing::warn!(worker = %w.record.id, code = ?s.code(), error = %s.message(), "decode worker refused; trying another");
                    last_err = Some(s);
                }
            }
        }
        let why = last_err.map_or_else(String::new, |s| s.message().to_string());
        Err(
            GenFailure::Unavailable(format!("no decode worker could take the request: {why}"))
                .into(),
        )
    }
}
