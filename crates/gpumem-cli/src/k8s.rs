//! `gpumem k8s webhook`: the mutating admission webhook that fills in a pod's GPU-memory
//! request for HAMi, Volcano or KAI from gpumem's upper bound (gpumem-k8s does the work).

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand};
use gpumem_k8s::{Sharing, Webhook, WebhookServeError};

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct K8sArgs {
    #[command(subcommand)]
    command: K8sCommand,
}

#[derive(Subcommand)]
enum K8sCommand {
    /// Serve the mutating admission webhook over HTTPS (POST /mutate, GET /healthz).
    Webhook(WebhookArgs),
}

#[derive(Args)]
struct WebhookArgs {
    /// PEM certificate chain the API server trusts (its caBundle signs it).
    #[arg(long)]
    tls_cert: PathBuf,
    /// PEM private key of that certificate.
    #[arg(long)]
    tls_key: PathBuf,
    #[arg(long, default_value = "0.0.0.0:8443")]
    addr: String,
    /// The GPU-sharing system whose request to write: hami, volcano or kai.
    #[arg(long, default_value = "hami")]
    sharing: String,
    /// The GPU type a pod without gpumem.io/gpu is sized for (a built-in profile).
    #[arg(long, default_value = "a100-40gb")]
    gpu: String,
}

pub fn k8s(a: K8sArgs) -> CliResult {
    let K8sCommand::Webhook(w) = a.command;
    let sharing =
        Sharing::parse(&w.sharing).map_err(|e| CliError::input(format!("--sharing: {e}")))?;
    let hook = Webhook::new(sharing, &w.gpu).map_err(|e| CliError::input(format!("--gpu: {e}")))?;
    let addr = std::net::ToSocketAddrs::to_socket_addrs(w.addr.as_str())
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| CliError::input(format!("--addr `{}` is not HOST:PORT", w.addr)))?;
    gpumem_k8s::serve_tls(Arc::new(hook), addr, &w.tls_cert, &w.tls_key).map_err(|e| match e {
        e @ (WebhookServeError::Pem { .. } | WebhookServeError::Tls { .. }) => CliError::input(e),
        e => CliError::other(e),
    })
}
