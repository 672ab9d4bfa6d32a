//! A run request as the API (JSON) and the CLI (TOML or JSON) read it.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = dispatcher::request::from_json(data);
        if let Ok(text) = std::str::from_utf8(data) {
            let _ = dispatcher::request::from_file_text(text);
        }
    });
}
