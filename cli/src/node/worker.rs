//! A prefill or decode node's process: its runtime and telemetry, the dKV
//! key, the model, the gRPC services of its role, and the drain at
//! shutdown.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tandem_decode_node::{DecodeConfig, DecodeService};
use tandem_discovery::Role;
use tandem_prefill_node::PrefillService;
use tandem_worker::node::serve as serve_node;
use tandem_worker::service::WorkerService;
use tandem_worker::{NodeCore, NodeOptions};

use super::args::{NodeArgs, node_options};
use crate::serve::{EngineArgs, SHUTDOWN_GRACE, runtime, shutdown_signal};
use crate::telemetry::Telemetry;

pub(super) fn run_node(
    engine: &EngineArgs,
    node: &NodeArgs,
    role: Role,
    decode: Option<DecodeConfig>,
) -> Result<()> {
    let mut opts = node_options(node, role)?;
    if let Some(d) = &decode {
        d.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let rt = runtime()?;
    // Before anything records: instruments made earlier would be no-ops.
    let telemetry = {
        let _rt = rt.enter();
        Telemetry::install(role.as_str(), &node.telemetry)?
    };
    let key = rt.block_on(crate::dkv_key::resolve(
        node.dkv_key_file.as_deref(),
        opts.etcd.as_ref(),
    ));
    let result = key.and_then(|key| {
        opts.dkv_key = Some(key);
        serve_node_role(engine, &opts, decode, &rt, &telemetry)
    });
    telemetry.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    eprintln!("tandem: {} node stopped", role.as_str());
    result
}

fn serve_node_role(
    engine: &EngineArgs,
    opts: &NodeOptions,
    decode: Option<DecodeConfig>,
    rt: &tokio::runtime::Runtime,
    telemetry: &Telemetry,
) -> Result<()> {
    let render = telemetry.render();
    let served = engine.load_served(opts.role == Role::Prefill)?;
    eprintln!(
        "tandem: {} node loaded {}; engine: {}",
        opts.role.as_str(),
        served.model.text().name,
        served.summary
    );
    let sched = engine.scheduler_config(served.model.config().context_length)?;
    let model = served.model;
    rt.block_on(async {
        let (core, scheduler) = NodeCore::start(model, sched, opts)?;
        let mut builder = tandem_worker::grpc::server(opts)?;
        let worker = WorkerService::new(Arc::clone(&core)).into_server();
        let r = match decode {
            None => {
                let grpc = builder
                    .add_service(worker)
                    .add_service(PrefillService::new(Arc::clone(&core)).into_server());
                serve_node(Arc::clone(&core), opts, grpc, render, shutdown_signal()).await
            }
            Some(cfg) => {
                let svc = DecodeService::new(Arc::clone(&core), cfg);
                let grpc = builder
                    .add_service(worker)
                    .add_service(svc.clone().into_server());
                let r = serve_node(Arc::clone(&core), opts, grpc, render, shutdown_signal()).await;
                svc.drain(SHUTDOWN_GRACE).await;
                r
            }
        };
        drop(core);
        // Every handle is gone with the node's tasks; the actor can stop.
        tokio::task::spawn_blocking(move || scheduler.shutdown())
            .await
            .context("stopping the scheduler")?;
        r.map_err(anyhow::Error::from)
    })
}
