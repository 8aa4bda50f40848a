//! The front end's [`Backend`] over one sequence on a GPU (`tandem serve
//! --devices gpu:N`): a device thread owns the model (any
//! [`SequenceModel`]; [`GpuSequence`] in `serve`) and runs the requests one
//! at a time, in arrival order. No batching and no prefix cache yet (the
//! CPU scheduler has both); a request waits for the one ahead of it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tandem_engine::RequestError;
use tandem_engine::generate::SequenceModel;
use tandem_engine::sampler::Sampler;
use tandem_frontend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
use tandem_gpu::GpuDevice;
use tandem_gpu::llama::GpuLlama;
use tandem_modelfile::ModelText;
use tandem_modelfile::config::ModelConfig;
use tandem_modelfile::gguf::GgufFile;
use tandem_types::{FinishReason, GenEvent, GenFailure, InvalidRequest, RequestLimits, Usage};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// How often an idle device thread looks at the stop flag.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// Prompt tokens per forward call: cancellation and shutdown are seen
/// between chunks.
const PROMPT_CHUNK: usize = 32;

/// [`GpuLlama`] as a [`SequenceModel`]: prompts run a token at a time.
pub struct GpuSequence(pub GpuLlama);

impl SequenceModel for GpuSequence {
    fn forward(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        want_logits: bool,
    ) -> Result<Vec<f32>, RequestError> {
        let device = |e: tandem_gpu::GpuError| RequestError::Device(e.to_string());
        let Some((&last, rest)) = tokens.split_last() else {
            return Ok(Vec::new());
        };
        for (i, &t) in rest.iter().enumerate() {
            self.0.feed(t, start_pos + i).map_err(device)?;
        }
        let pos = start_pos + rest.len();
        if want_logits {
            self.0.step(last, pos).map_err(device)
        } else {
            self.0.feed(last, pos).map_err(device).map(|()| Vec::new())
        }
    }
}

/// A GGUF file for a GPU run: the file, its config and its text side
/// (tokenizer, chat template). Nothing of the CPU engine is loaded.
pub fn open_gguf(path: &Path, id: usize) -> anyhow::Result<(GgufFile, ModelConfig, ModelText)> {
    let g = GgufFile::open(path)
        .with_context(|| format!("--devices gpu:{id} needs a GGUF file: {}", path.display()))?;
    let config = ModelConfig::from_gguf(&g)?;
    let (tokenizer, chat_template) = tandem_modelfile::meta::gguf_text(&g, &config)?;
    let text = ModelText {
        name: tandem_modelfile::meta::gguf_name(&g, path),
        tokenizer,
        chat_template,
    };
    Ok((g, config, text))
}

/// `g`'s weights on GPU `id` with a KV pool of `max_ctx` positions, and
/// the adapter's name for the startup line.
pub fn load_on_gpu(
    g: &GgufFile,
    id: usize,
    max_ctx: usize,
) -> anyhow::Result<(GpuSequence, String)> {
    let dev = GpuDevice::open(id)?;
    let adapter = dev.name().to_string();
    Ok((GpuSequence(GpuLlama::load(dev, g, max_ctx)?), adapter))
}

/// The model the device thread owns.
type Model = Box<dyn SequenceModel + Send>;

/// One accepted request and where its events go.
struct Job {
    req: BackendRequest,
    events: UnboundedSender<GenEvent>,
}

/// What the device thread and the backend both see.
#[derive(Debug, Default)]
struct Shared {
    waiting: AtomicUsize,
    running: AtomicUsize,
    stop: AtomicBool,
}

#[derive(Debug)]
pub struct GpuBackend {
    jobs: mpsc::Sender<Job>,
    limits: RequestLimits,
    device: String,
    shared: Arc<Shared>,
}

/// The device thread; [`GpuWorker::shutdown`] stops and joins it.
pub struct GpuWorker {
    thread: JoinHandle<()>,
    shared: Arc<Shared>,
}

impl GpuWorker {
    /// Stops the device thread (a request still running fails with
    /// "shutting down") and waits for it.
    pub fn shutdown(self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if self.thread.join().is_err() {
            tracing::error!("the GPU device thread panicked");
        }
    }
}

impl GpuBackend {
    /// Starts the device thread over `model` (on `device`, as `/health`
    /// names it), whose KV cache holds `limits.max_length` positions.
    pub fn spawn(
        mut model: Model,
        device: String,
        limits: RequestLimits,
    ) -> std::io::Result<(Self, GpuWorker)> {
        let (jobs, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("tandem-gpu".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || device_thread(model.as_mut(), &rx, &shared)
            })?;
        let worker = GpuWorker {
            thread,
            shared: Arc::clone(&shared),
        };
        let backend = GpuBackend {
            jobs,
            limits,
            device,
            shared,
        };
        Ok((backend, worker))
    }
}

impl Backend for GpuBackend {
    fn limits(&self) -> RequestLimits {
        self.limits
    }

    fn submit(
        &self,
        req: BackendRequest,
    ) -> BoxFuture<'_, Result<Box<dyn GenerationStream>, SubmitError>> {
        Box::pin(async move {
            if req.constraint.is_some() {
                return Err(InvalidRequest::Constraint(
                    "structured output is not supported on the GPU backend yet".into(),
                )
                .into());
            }
            let (events, rx) = unbounded_channel();
            self.shared.waiting.fetch_add(1, Ordering::Relaxed);
            if self.jobs.send(Job { req, events }).is_err() {
                self.shared.waiting.fetch_sub(1, Ordering::Relaxed);
                return Err(GenFailure::ShuttingDown.into());
            }
            Ok(Box::new(GpuStream(rx)) as Box<dyn GenerationStream>)
        })
    }

    fn health(&self) -> BackendHealth {
        let mut details = serde_json::Map::new();
        details.insert("device".into(), self.device.clone().into());
        for (k, v) in [
            ("running", &self.shared.running),
            ("waiting", &self.shared.waiting),
        ] {
            details.insert(k.into(), v.load(Ordering::Relaxed).into());
        }
        let stopping = self.shared.stop.load(Ordering::Relaxed);
        BackendHealth {
            ready: !stopping,
            reason: if stopping { "shutting down" } else { "ok" },
            details,
        }
    }
}

/// A request's events; dropping it cancels the request (the device thread
/// sees the closed channel at its next token).
struct GpuStream(UnboundedReceiver<GenEvent>);

impl GenerationStream for GpuStream {
    fn next(&mut self) -> BoxFuture<'_, Option<GenEvent>> {
        Box::pin(self.0.recv())
    }
}

fn device_thread(model: &mut dyn SequenceModel, jobs: &mpsc::Receiver<Job>, shared: &Shared) {
    while !shared.stop.load(Ordering::Relaxed) {
        let job = match jobs.recv_timeout(IDLE_POLL) {
            Ok(job) => job,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        shared.waiting.fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            continue; // cancelled while it waited
        }
        shared.running.store(1, Ordering::Relaxed);
        let end = match run(model, &job, &shared.stop) {
            Ok(Some(usage)) => Some(GenEvent::Finished(usage)),
            Ok(None) => None,
            Err(Stop::ShuttingDown) => Some(GenEvent::Failed(GenFailure::ShuttingDown)),
            Err(Stop::Failed(why)) => {
                tracing::error!("a request failed on the GPU: {why}");
                Some(GenEvent::Failed(GenFailure::Internal(why)))
            }
        };
        if let Some(event) = end {
            // A client gone by now needs nothing more.
            let _ = job.events.send(event);
        }
        shared.running.store(0, Ordering::Relaxed);
    }
    // Whatever is still queued is refused, not left hanging.
    while let Ok(job) = jobs.try_recv() {
        let _ = job.events.send(GenEvent::Failed(GenFailure::ShuttingDown));
    }
}

/// Why a request stopped before its end.
enum Stop {
    ShuttingDown,
    /// A kernel or the device failed (detail for the log).
    Failed(String),
}

impl From<RequestError> for Stop {
    fn from(e: RequestError) -> Self {
        Stop::Failed(e.to_string())
    }
}

/// Runs one request to its end: `Some(usage)` when it finished, `None`
/// when its client went away.
fn run(model: &mut dyn SequenceModel, job: &Job, stop: &AtomicBool) -> Result<Option<Usage>, Stop> {
    let req = &job.req;
    // The front end checked both against the same rules already.
    let mut sampler = Sampler::new(req.sampling.clone(), &req.prompt)
        .map_err(|e| Stop::Failed(format!("sampling parameters: {e}")))?;
    if req.prompt.is_empty() {
        return Err(Stop::Failed("empty prompt".into()));
    }
    // The cache's positions are overwritten from 0: one sequence at a time.
    let mut logits = Vec::new();
    let mut pos = 0;
    for chunk in req.prompt.chunks(PROMPT_CHUNK) {
        if job.events.is_closed() {
            return Ok(None);
        }
        if stop.load(Ordering::Relaxed) {
            return Err(Stop::ShuttingDown);
        }
        pos += chunk.len();
        logits = model.forward(chunk, pos - chunk.len(), pos == req.prompt.len())?;
    }
    let mut generated = 0;
    let finish = loop {
        let s = sampler.sample(&mut logits);
        let token = s.token;
        if req.stop_token_ids.contains(&token) {
            break FinishReason::Stop;
        }
        generated += 1;
        if job.events.send(GenEvent::Token(s)).is_err() {
            return Ok(None);
        }
        if generated == req.max_tokens {
            break FinishReason::Length;
        }
        if stop.load(Ordering::Relaxed) {
            return Err(Stop::ShuttingDown);
        }
        logits = model.forward(&[token], pos, true)?;
        pos += 1;
    };
    Ok(Some(Usage {
        prompt_tokens: req.prompt.len(),
        completion_tokens: generated,
        cached_tokens: 0,
        finish,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::trace::TraceContext;
    use tandem_types::SamplingParams;

    const VOCAB: usize = 8;
    /// A prompt holding this token makes the fake model fail.
    const POISON: u32 = 7;

    /// Greedy picks `(last token + 1) % VOCAB`; a poisoned chunk fails as
    /// a device would.
    struct Fake;

    impl SequenceModel for Fake {
        fn forward(
            &mut self,
            tokens: &[u32],
            _start_pos: usize,
            want_logits: bool,
        ) -> Result<Vec<f32>, RequestError> {
            if tokens.contains(&POISON) {
                return Err(RequestError::Device("injected kernel failure".into()));
            }
            let mut logits = vec![0.0; VOCAB];
            if want_logits && let Some(&last) = tokens.last() {
                logits[(last as usize + 1) % VOCAB] = 5.0;
            }
            Ok(logits)
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize) -> BackendRequest {
        BackendRequest {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens,
            stop_token_ids: vec![5],
            constraint: None,
            trace: TraceContext {
                trace_id: 1,
                span_id: 1,
                sampled: false,
            },
        }
    }

    fn backend() -> (GpuBackend, GpuWorker) {
        let limits = RequestLimits {
            max_length: 64,
            vocab_size: VOCAB,
        };
        GpuBackend::spawn(Box::new(Fake), "fake".into(), limits).expect("spawn")
    }

    /// Every event of `req` until its end.
    async fn events(b: &GpuBackend, req: BackendRequest) -> Vec<GenEvent> {
        let mut stream = b.submit(req).await.expect("accepted");
        let mut out = Vec::new();
        while let Some(e) = stream.next().await {
            let end = !matches!(e, GenEvent::Token(_));
            out.push(e);
            if end {
                break;
            }
        }
        out
    }

    fn tokens(events: &[GenEvent]) -> Vec<u32> {
        events
            .iter()
            .filter_map(|e| match e {
                GenEvent::Token(s) => Some(s.token),
                _ => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_failing_request_fails_alone_and_the_next_one_runs() {
        let (b, worker) = backend();
        let ok = events(&b, request(vec![1, 2], 2)).await;
        assert_eq!(tokens(&ok), vec![3, 4]);
        assert!(
            matches!(ok.last(), Some(GenEvent::Finished(u)) if u.finish == FinishReason::Length && u.completion_tokens == 2),
            "{ok:?}"
        );
        let failed = events(&b, request(vec![1, POISON], 2)).await;
        assert!(
            matches!(failed.as_slice(), [GenEvent::Failed(GenFailure::Internal(why))] if why.contains("injected")),
            "{failed:?}"
        );
        // The stop token ends the next one early: 3, 4, then 5.
        let after = events(&b, request(vec![2], 10)).await;
        assert_eq!(tokens(&after), vec![3, 4]);
        assert!(
            matches!(after.last(), Some(GenEvent::Finished(u)) if u.finish == FinishReason::Stop),
            "{after:?}"
        );
        drop(b);
        worker.shutdown();
    }

    #[tokio::test]
    async fn structured_output_is_refused_and_a_dropped_stream_frees_the_queue() {
        let (b, worker) = backend();
        let mut req = request(vec![1], 1);
        req.constraint = Some(tandem_types::Constraint::JsonObject);
        assert!(matches!(
            b.submit(req).await,
            Err(SubmitError::Invalid(InvalidRequest::Constraint(_)))
        ));
        // Submitted and dropped unread: skipped or cancelled, never stuck.
        for _ in 0..3 {
            drop(b.submit(request(vec![1], 50)).await.expect("accepted"));
        }
        let ok = events(&b, request(vec![0], 1)).await;
        assert_eq!(tokens(&ok), vec![1]);
        assert_eq!(b.shared.waiting.load(Ordering::Relaxed), 0);
        drop(b);
        worker.shutdown();
    }

    #[tokio::test]
    async fn shutdown_refuses_new_requests() {
        let (b, worker) = backend();
        worker.shutdown();
        assert!(!b.health().ready);
        let events = match b.submit(request(vec![1], 1)).await {
            Err(SubmitError::Failed(GenFailure::ShuttingDown)) => return,
            Err(e) => panic!("{e}"),
            Ok(mut stream) => stream.next().await,
        };
        assert!(
            matches!(
                events,
                Some(GenEvent::Failed(GenFailure::ShuttingDown)) | None
            ),
            "{events:?}"
        );
    }
}
