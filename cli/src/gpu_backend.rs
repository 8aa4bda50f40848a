//! The front end's [`Backend`] over one sequence on a GPU (`tandem serve
//! --devices gpu:N`): a device thread owns the [`GpuLlama`] and runs the
//! requests one at a time, in arrival order. No batching and no prefix
//! cache yet (the CPU scheduler has both); a request waits for the one
//! ahead of it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tandem_engine::sampler::Sampler;
use tandem_frontend::{Backend, BackendHealth, BackendRequest, GenerationStream, SubmitError};
use tandem_gpu::GpuError;
use tandem_gpu::llama::GpuLlama;
use tandem_types::{FinishReason, GenEvent, GenFailure, InvalidRequest, RequestLimits, Usage};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// How often an idle device thread looks at the stop flag.
const IDLE_POLL: Duration = Duration::from_millis(100);

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
    /// Starts the device thread over `model`, whose pool holds
    /// `limits.max_length` positions.
    pub fn spawn(model: GpuLlama, limits: RequestLimits) -> std::io::Result<(Self, GpuWorker)> {
        let (jobs, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let device = model.device().name().to_string();
        let thread = std::thread::Builder::new()
            .name("tandem-gpu".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || device_thread(&model, &rx, &shared)
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
        BackendHealth {
            ready: !self.shared.stop.load(Ordering::Relaxed),
            reason: if self.shared.stop.load(Ordering::Relaxed) {
                "shutting down"
            } else {
                "ok"
            },
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

fn device_thread(model: &GpuLlama, jobs: &mpsc::Receiver<Job>, shared: &Shared) {
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

impl From<GpuError> for Stop {
    fn from(e: GpuError) -> Self {
        Stop::Failed(e.to_string())
    }
}

/// Runs one request to its end: `Some(usage)` when it finished, `None`
/// when its client went away.
fn run(model: &GpuLlama, job: &Job, stop: &AtomicBool) -> Result<Option<Usage>, Stop> {
    let req = &job.req;
    // The front end checked both against the same rules already.
    let mut sampler = Sampler::new(req.sampling.clone(), &req.prompt)
        .map_err(|e| Stop::Failed(format!("sampling parameters: {e}")))?;
    let Some((&last, rest)) = req.prompt.split_last() else {
        return Err(Stop::Failed("empty prompt".into()));
    };
    // The pool's positions are overwritten from 0: one sequence at a time.
    for (pos, &t) in rest.iter().enumerate() {
        if job.events.is_closed() {
            return Ok(None);
        }
        if stop.load(Ordering::Relaxed) {
            return Err(Stop::ShuttingDown);
        }
        model.feed(t, pos)?;
    }
    let mut pos = rest.len();
    let mut logits = model.step(last, pos)?;
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
        pos += 1;
        logits = model.step(token, pos)?;
    };
    Ok(Some(Usage {
        prompt_tokens: req.prompt.len(),
        completion_tokens: generated,
        cached_tokens: 0,
        finish,
    }))
}
