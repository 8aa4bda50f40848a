//! Performance models of a Tandem node, from measurements.
//!
//! An [`EngineProfile`] is what `tandem bench-engine --profile` measured on
//! one machine for one model: how long a forward call takes as a function of
//! prompt tokens, decode batch and context. The mock engine
//! (`--engine mock`) times its steps with it, and the planner simulates
//! clusters with it ([`sim`]) and searches topologies ([`search`]).

pub mod profile;
pub mod search;
pub mod sim;

pub use profile::{DecodePoint, EngineProfile, PrefillPoint, ProfileError};
