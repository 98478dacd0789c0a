//! What the top-level tests of the examples share.

use std::path::PathBuf;

/// The example `name`'s binary, built by `cargo test` beside this test's:
/// `target/<profile>/deps/<test>` → `target/<profile>/examples/<name>`.
///
/// # Panics
///
/// If it is not there.
pub fn example_binary(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().unwrap();
    let profile_dir = test_binary.parent().unwrap().parent().unwrap();
    let binary = profile_dir.join("examples").join(name);
    assert!(
        binary.exists(),
        "{} is missing: `cargo test` builds the examples first",
        binary.display()
    );
    binary
}
