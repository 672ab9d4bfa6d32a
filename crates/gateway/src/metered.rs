//! A provider's answer on its way back to the stage: its bytes pass through the [`Meter`]
//! unchanged, and when the answer ends (or the stage hangs up) its usage is settled against
//! the run's reservation, added to the stage's pass, and counted in the metrics.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use hyper::body::Frame;

use crate::ledger::{Amount, Reservation};
use crate::meter::Meter;
use crate::providers::Provider;
use crate::{Counts, Gateway, GrantState};

/// A provider's answer on its way to the stage: every chunk passes through the meter; the
/// reservation is settled when the answer ends, or when it is dropped (the stage hung up).
pub(crate) struct MeteredBody {
    pub(crate) inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    pub(crate) meter: Option<Meter>,
    pub(crate) reservation: Option<Reservation>,
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
                Poll::Ready(Some(Ok(Frame::data(bytes))))
            }
            Poll::Ready(Some(Err(error))) => {
                self.settle();
                Poll::Ready(Some(Err(std::io::Error::other(error.without_url()))))
            }
            Poll::Ready(None) => {
                self.settle();
                Poll::Ready(None)
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
        let (counts, _overflowed) = meter.finish();
        let model = counts
            .model
            .clone()
            .or_else(|| self.requested_model.clone());
        let cost = self.price_of.price(model.as_deref()).cost(&counts);
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
