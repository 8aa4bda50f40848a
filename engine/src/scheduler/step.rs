//! One step of the actor: plan (`plan.rs`), run the forward pass (token
//! masks of constrained sequences computed alongside, an exported prompt's
//! layers reported as they are written), sample each sequence whose chunk
//! ends its known tokens, and retire the sequences that leave the batch.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use opentelemetry::KeyValue;

use tandem_grammar::{ConstraintState, GrammarError, TokenMask};
use tandem_types::{FinishReason, GenFailure};

use super::actor::{Actor, Seq, register_full_blocks};
use super::plan::Planned;
use super::stream::{Tx, layer_done};
use super::{ExportEvent, Exported, LayerDone};
use crate::backend::{LogitsForm, StepLogits};
use crate::error::RequestError;
use crate::kv_cache::BlockId;
use crate::metrics::{BatchType, metrics};
use crate::model::SeqChunk;
use crate::sampler::Sampled;

/// Token masks of the constrained sequences sampling this step, by index
/// into `running`.
type Masks = HashMap<usize, Result<TokenMask, GrammarError>>;

/// What running a step left: the forward pass's outcome, the logits in the
/// form asked for (`want`) and the masks.
struct Ran {
    result: Result<(), RequestError>,
    logits: StepLogits,
    want: LogitsForm,
    masks: Masks,
}

/// Why a sequence leaves the batch after a step.
enum Leave {
    Finished(FinishReason),
    /// An exported prompt and its first token: held for its transfer.
    Exported(Sampled),
    Failed(GrammarError),
}

impl Actor {
    /// Plans and runs one batch, then samples and retires sequences.
    /// Returns false when there was nothing to run.
    pub(super) fn step(&mut self) -> bool {
        let plan = self.plan();
        if plan.is_empty() {
            return false;
        }
        let batch_type = self.record_batch(&plan);
        let started = std::time::Instant::now();
        let Ran {
            result,
            mut logits,
            want,
            mut masks,
        } = self.run_batch(&plan, batch_type);
        self.count_prompt_time(&plan, started.elapsed());
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let vocab = self.model.config().vocab_size;
        let rows = plan.iter().filter(|p| p.samples(&self.running)).count();
        let result = result.and_then(|()| check_logits(&logits, want, rows, vocab));
        if let Err(e) = result {
            self.fail_batch(&plan, &e);
            return true;
        }
        self.stats.failed_steps_in_a_row.store(0, Ordering::Relaxed);
        let leaving = self.sample(&plan, &mut masks, &mut logits);
        self.logits = logits;
        self.retire(leaving);
        true
    }

    /// Adds this step's prompt tokens and their share of its time (by
    /// token count) to the stats, from which peers' fetches are weighed
    /// against computing (`SchedulerStats::prompt_token_time`).
    fn count_prompt_time(&self, plan: &[Planned], took: std::time::Duration) {
        let prompt: usize = plan
            .iter()
            .filter(|p| self.running[p.seq].computed < self.running[p.seq].prompt_len)
            .map(|p| p.len)
            .sum();
        let all: usize = plan.iter().map(|p| p.len).sum();
        if prompt == 0 || all == 0 {
            return;
        }
        let share = took.as_nanos() * prompt as u128 / all as u128;
        self.stats
            .prompt_tokens_computed
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.stats
            .prompt_compute_nanos
            .fetch_add(u64::try_from(share).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Runs the forward pass over the planned chunks, computing the
    /// constrained sequences' token masks on another thread meanwhile.
    fn run_batch(&mut self, plan: &[Planned], batch_type: BatchType) -> Ran {
        // Export sequences' blocks that this step fills: their layers can
        // leave as soon as each layer is written.
        let filling = self.filling(plan);
        let mut layers = |layer: usize| {
            for (tx, first_block, blocks) in &filling {
                let done = LayerDone {
                    layer,
                    first_block: *first_block,
                    blocks: blocks.clone(),
                };
                layer_done(tx, done);
            }
        };
        let mut constrained = self.take_constraints(plan);
        let want = self.logits_form(plan, constrained.is_empty());
        // The step's logits, in a buffer kept across steps.
        let mut logits = std::mem::take(&mut self.logits);
        let (result, masks) = std::thread::scope(|scope| {
            let masker = (!constrained.is_empty()).then(|| {
                scope.spawn(|| {
                    constrained
                        .iter_mut()
                        .map(|(_, c)| c.mask())
                        .collect::<Vec<_>>()
                })
            });
            let result = self.forward(plan, &mut layers, want, &mut logits, batch_type);
            let masks = masker.map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![Err(GrammarError::Engine("mask thread panicked".into())); 1]
                })
            });
            (result, masks)
        });
        let masks: Masks = constrained
            .iter()
            .map(|(i, _)| *i)
            .zip(masks.unwrap_or_default())
            .collect();
        for (i, c) in constrained {
            self.running[i].constraint = Some(c);
        }
        Ran {
            result,
            logits,
            want,
            masks,
        }
    }

    /// The blocks of exports that this step fills, with each export's
    /// event channel and the index of the first of them.
    fn filling(&self, plan: &[Planned]) -> Vec<(Tx<ExportEvent>, usize, Vec<BlockId>)> {
        let bs = self.config.block_size;
        plan.iter()
            .filter_map(|p| {
                let s = &self.running[p.seq];
                let tx = s.sink.layers()?;
                let (from, to) = (s.computed / bs, (s.computed + p.len).min(s.prompt_len) / bs);
                (to > from).then(|| (tx.clone(), from, s.table[from..to].to_vec()))
            })
            .collect()
    }

    /// Takes the grammar states of the constrained sequences sampling this
    /// step (given back after the forward pass).
    fn take_constraints(&mut self, plan: &[Planned]) -> Vec<(usize, ConstraintState)> {
        plan.iter()
            .filter_map(|p| {
                p.samples(&self.running)
                    .then(|| self.running[p.seq].constraint.take())
                    .flatten()
                    .map(|c| (p.seq, c))
            })
            .collect()
    }

    /// The forward pass itself, timed by batch type.
    fn forward(
        &mut self,
        plan: &[Planned],
        layer_done: &mut dyn FnMut(usize),
        want: LogitsForm,
        logits: &mut StepLogits,
        batch_type: BatchType,
    ) -> Result<(), RequestError> {
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|p| {
                let s = &self.running[p.seq];
                SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + p.len],
                    start_pos: s.computed,
                    block_table: &s.table,
                    want_logits: p.samples(&self.running),
                }
            })
            .collect();
        let t0 = std::time::Instant::now();
        let result = self
            .exec
            .forward(&chunks, &mut self.cache, layer_done, want, logits);
        metrics().forward_time.record(
            t0.elapsed().as_secs_f64() * 1e3,
            &[KeyValue::new("batch_type", batch_type.label())],
        );
        result
    }

    /// A failed forward pass fails the batch's sequences, not the server
    /// (inputs are validated at submit, so this is a bug or a device
    /// fault).
    fn fail_batch(&mut self, plan: &[Planned], e: &RequestError) {
        self.stats
            .failed_steps_in_a_row
            .fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_failed_step_us
            .store(tandem_types::clock::unix_micros(), Ordering::Relaxed);
        tracing::error!(error = %e, "forward pass failed");
        let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
        idx.sort_unstable_by(|a, b| b.cmp(a));
        for i in idx {
            let mut s = self.running.swap_remove(i);
            s.sink.fail(GenFailure::Internal(e.to_string()));
            self.free(&mut s);
        }
    }

    /// Advances every planned sequence past its chunk and samples those
    /// whose chunk ended their known tokens (one logits row each, in plan
    /// order). Returns the sequences leaving the batch.
    fn sample(
        &mut self,
        plan: &[Planned],
        masks: &mut Masks,
        logits: &mut StepLogits,
    ) -> Vec<(usize, Leave)> {
        let vocab = self.model.config().vocab_size;
        let mut row = 0;
        let mut leaving = Vec::new();
        for p in plan {
            let s = &mut self.running[p.seq];
            s.computed += p.len;
            register_full_blocks(&mut self.cache, s, self.config.block_size);
            if s.computed < s.tokens.len() {
                continue;
            }
            let this = row;
            row += 1;
            let sampled = match sample_row(s, masks.remove(&p.seq), logits, this, vocab) {
                Ok(sampled) => sampled,
                Err(e) => {
                    leaving.push((p.seq, Leave::Failed(e)));
                    continue;
                }
            };
            if s.sink.is_export() {
                // The decode node judges stop tokens; report whatever came.
                leaving.push((p.seq, Leave::Exported(sampled)));
                continue;
            }
            if let Some(finish) = s.accept(sampled) {
                leaving.push((p.seq, Leave::Finished(finish)));
            }
        }
        leaving
    }

    /// Takes the sequences leaving the batch out of `running` (highest
    /// index first, so the others keep theirs): finished ones report and
    /// free, exported ones are held for their transfer.
    fn retire(&mut self, mut leaving: Vec<(usize, Leave)>) {
        leaving.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, why) in leaving {
            let mut s = self.running.swap_remove(i);
            match why {
                Leave::Finished(finish) => self.finish(s, finish),
                // A grammar engine failure ends its sequence, not the batch.
                Leave::Failed(e) => {
                    s.sink.fail(GenFailure::Internal(e.to_string()));
                    self.free(&mut s);
                }
                Leave::Exported(first) => {
                    s.sink.exported(Exported {
                        first,
                        blocks: s.table.clone(),
                        cached_tokens: s.cached_tokens,
                    });
                    self.held.push(s);
                }
            }
        }
    }
}

/// Samples a sequence's next token from its row `row` of `logits` (whose
/// shape `check_logits` checked), under its grammar's mask if it has one,
/// and advances the grammar past it.
fn sample_row(
    s: &mut Seq,
    mask: Option<Result<TokenMask, GrammarError>>,
    logits: &mut StepLogits,
    row: usize,
    vocab: usize,
) -> Result<Sampled, GrammarError> {
    let mask = match mask {
        Some(mask) => Some(mask?),
        None if s.constraint.is_some() => {
            return Err(GrammarError::Engine("no mask computed".into()));
        }
        None => None,
    };
    let sampled = match (logits.form, mask) {
        (LogitsForm::Full, mask) => {
            // Sampled in place: each row belongs to one sequence.
            let l = &mut logits.values[row * vocab..(row + 1) * vocab];
            if let Some(mask) = mask {
                mask.apply(l);
            }
            s.sampler.sample(l)
        }
        (LogitsForm::Top(k), None) => {
            let at = row * k..(row + 1) * k;
            let ids = &logits.ids[at.clone()];
            let n = ids.iter().take_while(|&&i| (i as usize) < vocab).count();
            let values = &logits.values[at];
            s.sampler
                .sample_top(&ids[..n], &values[..n], logits.log_z[row])
        }
        // Top rows are asked for only when no sequence is constrained.
        (LogitsForm::Top(_), Some(_)) => {
            return Err(GrammarError::Engine(
                "a constrained sequence got reduced logits".into(),
            ));
        }
    };
    if let Some(c) = &mut s.constraint {
        c.consume(sampled.token)?;
    }
    Ok(sampled)
}

/// Whether a runner's `logits` hold `rows` rows in the form asked for
/// (`want`) or full: the sampling indexes them.
fn check_logits(
    logits: &StepLogits,
    want: LogitsForm,
    rows: usize,
    vocab: usize,
) -> Result<(), RequestError> {
    let (width, fits) = match (logits.form, want) {
        (LogitsForm::Full, _) => (vocab, logits.values.len() == rows * vocab),
        (LogitsForm::Top(k), LogitsForm::Top(asked)) => (
            k,
            k >= asked
                && logits.values.len() == rows * k
                && logits.ids.len() == rows * k
                && logits.log_z.len() == rows,
        ),
        (LogitsForm::Top(k), LogitsForm::Full) => (k, false),
    };
    if fits {
        Ok(())
    } else {
        Err(RequestError::LogitsShape {
            rows,
            width,
            got: logits.values.len(),
        })
    }
}
