//! End to end, observed: the Grafana dashboards and alert rules against a
//! real scrape of a running cluster (`dashboards`), and OTLP traces and
//! metrics arriving at a real OTLP receiver (`otlp`).
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd` and libucx
//! (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

mod dashboards;
mod otlp;
