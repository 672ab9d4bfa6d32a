//! A provider's answer on its way back to the stage: its bytes pass through the [`Meter`],
//! then to the stage with the provider's key masked; when the answer ends (or the stage hangs
//! up) its usage is settled against the run's reservation, added to the stage's pass, and
//! counted in the metrics. A successful answer that never stated its final usage (cut short,
//! a stream not asked for it, a hostile provider) is settled at its reservation: what it
//! cost is unknown, and the worst case bounds it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use hyper::body::Frame;

use crate::ledger::{Amount, Reservation};
use crate::meter::Meter;
use crate::policy::Redactor;
use crate::providers::Provider;
use crate::request::Worst;
use crate::{Counts, Gateway, GrantState};

/// A provider's answer on its way to the stage: every chunk passes through the meter; the
/// reservation is settled when the answer ends, or when it is dropped (the stage hung up).
pub(crate) struct MeteredBody {
    pub(crate) inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    pub(crate) meter: Option<Meter>,
    pub(crate) redactor: Option<Redactor>,
    pub(crate) reservation: Option<Reservation>,
    /// A spending call's worst case.
    pub(crate) worst: Option<Worst>,
    pub(crate) grant: Arc<GrantState>,
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) price_of: Provider,
    pub(crate) requested_model: Option<String>,
    pub(crate) status: u16,
    pub(crate) started: Instant,
}

impl Stream for MeteredBody {
    type Item = Result<Frame<Bytes>, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.inner.poll_next_unpin(context) {
            Poll::Ready(Some(Ok(bytes))) => {
                if let Some(meter) = self.meter.as_mut() {
                    meter.feed(&bytes);
                }
                let bytes = match self.redactor.as_mut() {
                    Some(redactor) if !redactor.passes(&bytes) => {
                        Bytes::from(redactor.feed(&bytes))
                    }
                    _ => bytes,
                };
                Poll::Ready(Some(Ok(Frame::data(bytes))))
            }
            Poll::Ready(Some(Err(error))) => {
                self.settle();
                Poll::Ready(Some(Err(std::io::Error::other(error.without_url()))))
            }
            Poll::Ready(None) => {
                self.settle();
                let held = self.redactor.as_mut().map(Redactor::finish);
                match held.filter(|h| !h.is_empty()) {
                    Some(held) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(held))))),
                    None => Poll::Ready(None),
                }
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl MeteredBody {
    fn settle(&mut self) {
        let Some(meter) = self.meter.take() else {
            return;
        };
        let metered = meter.finish();
        let model = metered
            .counts
            .model
            .clone()
            .or_else(|| self.requested_model.clone());
        let success = (200..300).contains(&self.status);
        let (counts, cost) = match self.worst {
            // Billed, and not said how much: as much as it could have been.
            Some(worst) if success && !metered.stated => (
                Counts {
                    input: worst.input,
                    output: worst.output,
                    model: model.clone(),
                    ..Counts::default()
                },
                worst.cost_usd,
            ),
            _ => {
                let cost = self.price_of.price(model.as_deref()).cost(&metered.counts);
                (metered.counts, cost)
            }
        };
        if self.worst.is_some() && success && !metered.stated {
            tracing::info!(profile = %self.grant.request.profile, "an answer ended without stating its usage: settled at its reservation");
        }
        if let Some(reservation) = self.reservation.take() {
            reservation.settle(Amount {
                tokens: counts.total(),
                cost_usd: cost,
            });
        }
        {
            let mut stage = self.grant.meter.lock().unwrap_or_else(|p| p.into_inner());
            stage.counts.add(&Counts {
                model: model.clone(),
                ..counts.clone()
            });
            stage.cost_usd += cost;
        }
        let profile = self.grant.request.profile.clone();
        self.gateway.observe_request(
            &profile,
            &self.price_of,
            model.as_deref(),
            self.status,
            self.started,
        );
        self.gateway
            .observe_usage(&profile, &self.price_of, model.as_deref(), &counts, cost);
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        self.settle();
    }
}

impl Gateway {
    /// A model label that stays bounded: a model of the provider's price table, or `other`.
    fn model_label<'a>(provider: &'a Provider, model: Option<&str>) -> &'a str {
        model
            .and_then(|m| provider.prices.get_key_value(m))
            .map_or("other", |(name, _)| name.as_str())
    }

    pub(crate) fn observe_request(
        &self,
        profile: &str,
        provider: &Provider,
        model: Option<&str>,
        code: u16,
        started: Instant,
    ) {
        if let Some(metrics) = &self.metrics {
            metrics.model_request(
                profile,
                &provider.name,
                Gateway::model_label(provider, model),
                code,
                started.elapsed().as_secs_f64(),
            );
        }
    }

    fn observe_usage(
        &self,
        profile: &str,
        provider: &Provider,
        model: Option<&str>,
        counts: &Counts,
        cost: f64,
    ) {
        if let Some(metrics) = &self.metrics {
            metrics.model_usage(
                profile,
                Gateway::model_label(provider, model),
                [
                    ("input", counts.input),
                    ("output", counts.output),
                    ("cache_read", counts.cache_read),
                    ("cache_write", counts.cache_write),
                ],
                cost,
            );
        }
    }
}
