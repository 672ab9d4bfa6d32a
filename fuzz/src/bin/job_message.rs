//! A job message as a worker receives it: decoded and checked, never trusted.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(job) = proto::decode_message::<proto::Job>(data, 4 * 1024 * 1024) {
            if job.check().is_ok() {
                assert!(proto::names::project_of(&job.ticket).is_some());
                assert!(job
                    .implementer
                    .user
                    .as_deref()
                    .is_none_or(|u| !proto::names::is_root_user(u)));
            }
        }
    });
}
