//! The peer ranks of a tensor-parallel step runner: ranks 1.. each on a
//! thread of its own, running the commands rank 0 sends, in order, and
//! answering every one. Rank 0 runs on the caller's thread between
//! [`PeerRanks::broadcast`] and [`PeerRanks::gather`]; the CPU engine's
//! `TpExecutor` and `tandem-gpu`'s runner both drive their groups this way.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::error::{CollectiveError, RequestError};

/// Threads running a tensor-parallel group's ranks 1.., each serving
/// commands of type `C` with answers `Result<(), E>`. Dropping it closes
/// every rank's channel (the rank's loop ends) and joins the threads.
pub struct PeerRanks<C, E> {
    peers: Vec<Peer<C, E>>,
}

struct Peer<C, E> {
    tx: Option<mpsc::Sender<C>>,
    done: mpsc::Receiver<Result<(), E>>,
    thread: Option<JoinHandle<()>>,
}

impl<C, E> std::fmt::Debug for PeerRanks<C, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerRanks")
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl<C, E> Default for PeerRanks<C, E> {
    fn default() -> Self {
        PeerRanks { peers: Vec::new() }
    }
}

/// A peer rank stopped: its thread ended (it panicked, or its channel
/// closed), so the group cannot step.
pub fn rank_gone() -> RequestError {
    CollectiveError::RankGone.into()
}

impl<C: Send + 'static, E: Send + 'static> PeerRanks<C, E> {
    /// Starts the next rank on a thread named `name`, running `serve` on
    /// each command it is sent.
    pub fn spawn(
        &mut self,
        name: String,
        mut serve: impl FnMut(C) -> Result<(), E> + Send + 'static,
    ) -> std::io::Result<()> {
        let (tx, rx) = mpsc::channel::<C>();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            while let Ok(cmd) = rx.recv() {
                if done_tx.send(serve(cmd)).is_err() {
                    return;
                }
            }
        })?;
        self.peers.push(Peer {
            tx: Some(tx),
            done,
            thread: Some(thread),
        });
        Ok(())
    }

    /// Peer ranks (the group's size less rank 0).
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Sends every peer the command `cmd` makes; fails if one is gone.
    pub fn broadcast(&self, cmd: impl Fn() -> C) -> Result<(), RequestError> {
        for p in &self.peers {
            let sent = p.tx.as_ref().map(|tx| tx.send(cmd()));
            if !matches!(sent, Some(Ok(()))) {
                return Err(rank_gone());
            }
        }
        Ok(())
    }

    /// Every peer's answer to the last command, the first failure
    /// (`classify` turns a rank's error into the step's). It waits for all
    /// of them even after a failure, so no answer is left for the next
    /// command to read.
    pub fn gather(&self, classify: impl Fn(E) -> RequestError) -> Result<(), RequestError> {
        let mut first = Ok(());
        for p in &self.peers {
            let r = match p.done.recv() {
                Ok(r) => r.map_err(&classify),
                Err(_) => Err(rank_gone()),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl<C, E> Drop for PeerRanks<C, E> {
    fn drop(&mut self) {
        for p in &mut self.peers {
            p.tx.take();
        }
        for p in &mut self.peers {
            if let Some(t) = p.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_is_gathered_even_after_a_failure() {
        // Rank 1 fails odd commands, rank 2 never does: the failure is
        // the step's, and the next command reads fresh answers.
        let device = |e: String| RequestError::Device(e.into());
        let mut ranks: PeerRanks<u32, String> = PeerRanks::default();
        ranks
            .spawn("r1".into(), |c| {
                if c % 2 == 1 {
                    Err(format!("odd {c}"))
                } else {
                    Ok(())
                }
            })
            .expect("spawn");
        ranks.spawn("r2".into(), |_| Ok(())).expect("spawn");
        assert_eq!(ranks.len(), 2);
        ranks.broadcast(|| 1).expect("sent");
        let err = ranks.gather(device).expect_err("rank 1 failed");
        assert!(err.to_string().contains("odd 1"), "{err}");
        ranks.broadcast(|| 2).expect("sent");
        ranks.gather(device).expect("both ok");
    }

    #[test]
    fn a_rank_that_panicked_is_gone_not_a_hang() {
        let mut ranks: PeerRanks<u32, String> = PeerRanks::default();
        ranks
            .spawn("r1".into(), |c| {
                if c == 0 { panic!("rank down") } else { Ok(()) }
            })
            .expect("spawn");
        ranks.broadcast(|| 0).expect("sent");
        assert!(matches!(
            ranks.gather(|e: String| RequestError::Device(e.into())),
            Err(RequestError::Collective(CollectiveError::RankGone))
        ));
        // Its channel is closed now: sending fails cleanly.
        assert!(ranks.broadcast(|| 1).is_err());
    }
}
