//! The disaggregated roles' entry points: `tandem prefill`, `tandem
//! decode` (`worker.rs` runs either node) and `tandem router`, with the
//! flags they share (`args.rs`). `tandem cluster up`, which starts them as
//! processes, is `crate::cluster`.

mod args;
mod decode;
mod prefill;
mod router;
mod worker;

pub use decode::{DecodeArgs, run_decode};
pub use prefill::{PrefillArgs, run_prefill};
pub use router::{RouterArgs, run_router};
