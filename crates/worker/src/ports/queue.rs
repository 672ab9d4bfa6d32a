//! The job-queue seam, and the in-process queue used by embedded mode.
//!
//! A consumer takes a [`Delivery`], runs it, and settles it: `ack` once the run's final event
//! is safely published, `requeue` to hand it to another consumer, or `reject` to dead-letter
//! it. The RabbitMQ implementation lives with the distributed services; this one keeps jobs in
//! memory and is only for one process.

use std::future::Future;

use proto::Job;
use tokio::sync::{mpsc, Mutex};

/// How a delivery was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settlement {
    /// Done: remove it from the queue.
    Ack,
    /// Give it to a consumer again.
    Requeue,
    /// Dead-letter it, with the reason.
    Reject(String),
}

/// A job handed to a consumer.
#[derive(Debug)]
pub struct Delivery {
    /// The job.
    pub job: Job,
    /// How many times it was delivered before.
    pub redeliveries: u32,
}

/// A queue of jobs.
pub trait JobQueue: Send + Sync {
    /// Publishes a job; returns once the queue holds it.
    fn publish(&self, job: Job) -> impl Future<Output = Result<(), QueueError>> + Send;
    /// Waits for the next job; `None` when the queue is closed.
    fn next(&self) -> impl Future<Output = Option<Delivery>> + Send;
    /// Settles a delivery.
    fn settle(
        &self,
        delivery: Delivery,
        how: Settlement,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;
}

/// A failed queue operation.
#[derive(Debug, thiserror::Error)]
#[error("job queue: {0}")]
pub struct QueueError(pub String);

/// An in-process queue: a channel, with requeue putting the job back at the end.
#[derive(Debug)]
pub struct InMemoryQueue {
    sender: mpsc::UnboundedSender<Delivery>,
    receiver: Mutex<mpsc::UnboundedReceiver<Delivery>>,
    dead: std::sync::Mutex<Vec<(Job, String)>>,
}

impl Default for InMemoryQueue {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        InMemoryQueue {
            sender,
            receiver: Mutex::new(receiver),
            dead: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl InMemoryQueue {
    /// The jobs that were rejected, with their reasons.
    pub fn dead_letters(&self) -> Vec<(Job, String)> {
        self.dead.lock().map(|d| d.clone()).unwrap_or_default()
    }
}

impl JobQueue for InMemoryQueue {
    async fn publish(&self, job: Job) -> Result<(), QueueError> {
        self.sender
            .send(Delivery {
                job,
                redeliveries: 0,
            })
            .map_err(|_| QueueError("the queue is closed".into()))
    }

    async fn next(&self) -> Option<Delivery> {
        self.receiver.lock().await.recv().await
    }

    async fn settle(&self, delivery: Delivery, how: Settlement) -> Result<(), QueueError> {
        match how {
            Settlement::Ack => Ok(()),
            Settlement::Requeue => self
                .sender
                .send(Delivery {
                    job: delivery.job,
                    redeliveries: delivery.redeliveries + 1,
                })
                .map_err(|_| QueueError("the queue is closed".into())),
            Settlement::Reject(reason) => {
                if let Ok(mut dead) = self.dead.lock() {
                    dead.push((delivery.job, reason));
                }
                Ok(())
            }
        }
    }
}
