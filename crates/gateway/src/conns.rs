//! Connections shared fairly between senders, in the relay and the gateway alike: each sender
//! (a stage's address) is served on at most [`PER_SENDER`] connections at once; more of its
//! connections wait their turn (up to [`QUEUED_PER_SENDER`], beyond which its newest are
//! closed) without taking another sender's place. A connection that sends nothing within
//! [`FIRST_BYTE`] is closed before it takes a place at all.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most connections of one sender served at once.
pub const PER_SENDER: usize = 256;
/// The most connections of one sender held at all (served and waiting).
pub const QUEUED_PER_SENDER: usize = 4096;
/// The time a connection has to send its first byte.
pub const FIRST_BYTE: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Sender {
    served: Arc<Semaphore>,
    held: usize,
}

/// The places of every sender.
#[derive(Debug, Default)]
pub struct Senders {
    senders: Mutex<HashMap<IpAddr, Sender>>,
}

/// A connection's place: served while held; the sender's count drops with it.
#[derive(Debug)]
pub struct Place {
    senders: Arc<Senders>,
    sender: IpAddr,
    /// Taken once the sender has a free place (a waiting connection's place is counted too).
    served: Option<OwnedSemaphorePermit>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.senders.release(self.sender);
    }
}

impl Senders {
    fn release(&self, sender: IpAddr) {
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = senders.get_mut(&sender) {
            entry.held = entry.held.saturating_sub(1);
            if entry.held == 0 {
                senders.remove(&sender);
            }
        }
    }

    /// Waits for a place of `sender`; `None` when the sender already holds
    /// [`QUEUED_PER_SENDER`] connections (this one is to be closed).
    pub async fn place(self: &Arc<Senders>, sender: IpAddr) -> Option<Place> {
        let served = {
            let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
            let entry = senders.entry(sender).or_insert_with(|| Sender {
                served: Arc::new(Semaphore::new(PER_SENDER)),
                held: 0,
            });
            if entry.held >= QUEUED_PER_SENDER {
                return None;
            }
            entry.held += 1;
            Arc::clone(&entry.served)
        };
        // Counted from here: a wait given up (its connection closed) releases it too.
        let mut place = Place {
            senders: Arc::clone(self),
            sender,
            served: None,
        };
        place.served = Some(served.acquire_owned().await.ok()?);
        Some(place)
    }
}

/// Waits until `stream` has a first byte to read, for at most [`FIRST_BYTE`]; false when it
/// sent none (or closed).
pub async fn first_byte(stream: &tokio::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(FIRST_BYTE, stream.peek(&mut byte)).await,
        Ok(Ok(1))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: one sender's connections taking every place (others reset), or a sender's
    /// count never coming down (it would be shut out for good).
    #[tokio::test]
    async fn a_sender_is_capped_and_others_keep_their_places() {
        let senders = Arc::new(Senders::default());
        let greedy: IpAddr = "10.0.0.2".parse().unwrap();
        let other: IpAddr = "10.0.0.3".parse().unwrap();
        let mut held = Vec::new();
        for _ in 0..PER_SENDER {
            held.push(senders.place(greedy).await.unwrap());
        }
        let waiting = tokio::time::timeout(Duration::from_millis(50), senders.place(greedy)).await;
        assert!(
            waiting.is_err(),
            "the greedy sender's next connection waits"
        );
        let place = tokio::time::timeout(Duration::from_millis(50), senders.place(other)).await;
        assert!(place.unwrap().is_some(), "another sender is served at once");
        held.clear();
        let again = senders.place(greedy).await;
        assert!(again.is_some());
        drop(again);
        assert!(
            senders.senders.lock().unwrap().is_empty(),
            "a given-up wait was released too"
        );
    }
}
