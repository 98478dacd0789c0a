//! What the top-level tests of the examples share.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod served;

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

/// `command`'s output once it exits, or a panic with what it printed if it runs past `limit`
/// (then killed): an example that loops forever fails its test instead of hanging it.
pub fn output_within(command: &mut Command, limit: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes as the child writes, so that a full pipe cannot stall it.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            pipe.unwrap().read_to_end(&mut bytes).unwrap();
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|pipe| Box::new(pipe) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|pipe| Box::new(pipe) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!(
                "{command:?} ran past {limit:?} and was killed; it printed:\n{}\n{}",
                String::from_utf8_lossy(&stdout.join().unwrap()),
                String::from_utf8_lossy(&stderr.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}
