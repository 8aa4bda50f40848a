//! End to end, deployed: the Helm chart's rendered manifests run as local
//! processes (`manifests`), and several routers behind a real load
//! balancer (`load_balancer`).
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd`, libucx, helm and
//! haproxy (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

mod load_balancer;
mod manifests;
