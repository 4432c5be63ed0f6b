//! Leader election with a `coordination.k8s.io/v1` Lease, so several
//! replicas can run: only the leader reconciles (the webhook is served by
//! every replica). The holder renews the Lease every `renew_every`; another
//! replica takes over once `renewTime + leaseDurationSeconds` has passed.
//! Writes use `replace` with the read `resourceVersion`, so two replicas
//! racing for an expired Lease cannot both win (the loser gets 409).
//! A leader that cannot renew steps down before its Lease could expire, so
//! two leaders never reconcile at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;
use tokio::sync::watch;

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    pub lease_name: String,
    pub namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_every: Duration,
}

/// Tries to take or keep the Lease once; `Ok(true)` when this replica holds it.
pub async fn try_acquire(api: &Api<Lease>, cfg: &LeaderConfig) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let secs = cfg.lease_duration.as_secs().max(1) as i32;
    match api.get_opt(&cfg.lease_name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.lease_name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
            let mine = holder.as_deref() == Some(cfg.identity.as_str());
            let duration = spec.lease_duration_seconds.unwrap_or(secs).max(1) as i64;
            let expired = match &spec.renew_time {
                Some(t) => t.0 + SignedDuration::from_secs(duration) < now,
                None => true,
            };
            if !mine && holder.is_some() && !expired {
                return Ok(false);
            }
            if !mine {
                spec.holder_identity = Some(cfg.identity.clone());
                spec.acquire_time = Some(MicroTime(now));
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.lease_duration_seconds = Some(secs);
            spec.renew_time = Some(MicroTime(now));
            match api
                .replace(&cfg.lease_name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.is_conflict() => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// Gives the Lease up (on shutdown) so another replica takes over at once.
pub async fn release(api: &Api<Lease>, cfg: &LeaderConfig) -> Result<(), kube::Error> {
    if let Some(mut lease) = api.get_opt(&cfg.lease_name).await? {
        if let Some(spec) = lease.spec.as_mut() {
            if spec.holder_identity.as_deref() == Some(cfg.identity.as_str()) {
                spec.holder_identity = None;
                api.replace(&cfg.lease_name, &PostParams::default(), &lease)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Keeps trying to lead until `shutdown`; publishes leadership on `tx`.
pub async fn run(
    client: Client,
    cfg: LeaderConfig,
    tx: watch::Sender<bool>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut last_renew: Option<std::time::Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let leading = match try_acquire(&api, &cfg).await {
            Ok(l) => {
                if l {
                    last_renew = Some(std::time::Instant::now());
                }
                l
            }
            Err(e) => {
                tracing::warn!(error = %e, lease = %cfg.lease_name, "cannot read or renew the leader Lease");
                // Step down well before the Lease can expire for the others.
                let margin = cfg.lease_duration.saturating_sub(cfg.renew_every);
                *tx.borrow() && last_renew.is_some_and(|t| t.elapsed() < margin)
            }
        };
        tx.send_if_modified(|cur| {
            if *cur != leading {
                tracing::info!(identity = %cfg.identity, leading, "leadership changed");
                *cur = leading;
                true
            } else {
                false
            }
        });
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(cfg.renew_every) => {}
        }
    }
    if *tx.borrow() {
        let _ = tx.send(false);
        if let Err(e) = release(&api, &cfg).await {
            tracing::warn!(error = %e, "cannot release the leader Lease; it expires by itself");
        }
    }
}
