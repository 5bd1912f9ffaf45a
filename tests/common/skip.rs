//! A test that cannot run on this machine says so where `cargo test` shows it. libtest captures
//! only what the `print!` / `eprint!` family writes, and shows it only for failing tests, so an
//! `eprintln!` note of a passing test never reaches a CI log. A write to the process's stderr
//! handle is not captured: it appears in the output of every run, `--nocapture` or not.
//! (Shared by the library's unit tests and the integration tests.)

/// Prints `SKIPPED <test>: <reason>` straight to stderr.
pub fn skip_note(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}
