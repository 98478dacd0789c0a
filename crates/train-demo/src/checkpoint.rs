//! Checkpoints: model and optimizer (burnpack) and the run state (JSON), written crash-safely
//! (see [`save`]); refused on resume when they do not match the run.
//!
//! Layout of a run folder: `checkpoints/step-N-T/` holds complete checkpoints, and the symbolic
//! link `checkpoint` points at the latest one; everything that reads a checkpoint goes through
//! the link.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use serde::{Deserialize, Serialize};

use crate::model::{Transformer, TransformerConfig};
use crate::rng::Rng;
use crate::tasks::TaskKind;

/// What a run is: a checkpoint resumes only into the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub task: TaskKind,
    pub model: TransformerConfig,
    pub seq_len: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub steps: usize,
    pub seed: u64,
}

/// Where training stands.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunState {
    pub identity: RunIdentity,
    /// Optimizer steps taken.
    pub step: usize,
    /// The training data generator, as it is after `step` batches.
    pub data_rng: Rng,
}

/// The latest complete checkpoint (a link into `checkpoints/`).
pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// Where the checkpoints themselves live.
fn store_dir(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

/// Milliseconds to wait with a checkpoint written but not yet in place (for the crash test).
const PAUSE_VARIABLE: &str = "TRAIN_DEMO_SAVE_PAUSE_MS";

/// Writes a checkpoint so that a crash at any moment leaves the last complete one in place:
///
/// 1. every file is written into a new `checkpoints/step-N-T.partial/` and fsynced, then the
///    folder itself;
/// 2. the folder is renamed to `checkpoints/step-N-T/` (and `checkpoints/` fsynced);
/// 3. one rename swaps the `checkpoint` link to it (and the run folder is fsynced).
///
/// Until step 3 `checkpoint` points at the previous checkpoint, which is removed only after
/// it; what a crash leaves behind (a partial folder, an unlinked one) is removed by the next
/// save.
pub fn save(
    out: &Path,
    state: &RunState,
    model: &Transformer,
    optimizer: &ModuleOptimizer,
) -> Result<(), String> {
    let store = store_dir(out);
    std::fs::create_dir_all(&store).map_err(|e| format!("{}: {e}", store.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    let name = format!("step-{:09}-{stamp}", state.step);
    let partial = store.join(format!("{name}.partial"));
    std::fs::create_dir_all(&partial).map_err(|e| format!("{}: {e}", partial.display()))?;
    model
        .clone()
        .save_file(partial.join("model.bpk"))
        .map_err(|e| format!("saving the model: {e}"))?;
    optimizer
        .save(partial.join("optimizer.bpk"))
        .map_err(|e| format!("saving the optimizer: {e}"))?;
    let json = serde_json::to_string_pretty(state).expect("state serializes");
    std::fs::write(partial.join("state.json"), json)
        .map_err(|e| format!("saving the state: {e}"))?;
    for file in ["model.bpk", "optimizer.bpk", "state.json"] {
        sync(&partial.join(file))?;
    }
    sync(&partial)?;
    if let Some(pause) = std::env::var(PAUSE_VARIABLE)
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        eprintln!("checkpoint: step {} written, not yet in place", state.step);
        std::thread::sleep(Duration::from_millis(pause));
    }
    let complete = store.join(&name);
    rename(&partial, &complete)?;
    sync(&store)?;
    link_latest(out, &name)?;
    remove_all_but(&store, &name);
    Ok(())
}

/// Points `checkpoint` at `checkpoints/<name>` with one rename (a link made beside it, renamed
/// over it).
fn link_latest(out: &Path, name: &str) -> Result<(), String> {
    let link = checkpoint_dir(out);
    let next = out.join("checkpoint.next");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(Path::new("checkpoints").join(name), &next)
        .map_err(|e| format!("{}: {e}", next.display()))?;
    // A folder from before checkpoints were linked cannot be renamed over: move it aside.
    if link.is_dir() && !link.is_symlink() {
        rename(&link, &store_dir(out).join("unlinked"))?;
    }
    rename(&next, &link)?;
    sync(out)
}

/// Removes every entry of `store` but `keep`: older checkpoints, and what a crash left.
fn remove_all_but(store: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(store) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name() != keep {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn rename(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::rename(from, to).map_err(|e| format!("{} -> {}: {e}", from.display(), to.display()))
}

/// Flushes a file, or a folder's entries, to the disk.
fn sync(path: &Path) -> Result<(), String> {
    File::open(path)
        .and_then(|file| file.sync_all())
        .map_err(|e| format!("syncing {}: {e}", path.display()))
}

/// Reads the run state of a checkpoint.
pub fn load_state(out: &Path) -> Result<RunState, String> {
    let path = checkpoint_dir(out).join("state.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("no checkpoint at {}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("checkpoint {} is corrupt: {e}", path.display()))
}

/// What differs between the checkpoint's run and this one, field by field. The step count may
/// differ: a run can be resumed to train longer (its schedule then follows the new total).
pub fn differences(saved: &RunIdentity, current: &RunIdentity) -> Vec<String> {
    let mut saved_json = serde_json::to_value(saved).expect("serializes");
    let current_json = serde_json::to_value(current).expect("serializes");
    saved_json["steps"] = current_json["steps"].clone();
    let mut differences = Vec::new();
    flatten_diff("", &saved_json, &current_json, &mut differences);
    differences
}

fn flatten_diff(
    path: &str,
    saved: &serde_json::Value,
    current: &serde_json::Value,
    out: &mut Vec<String>,
) {
    match (saved, current) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (key, value) in a {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                flatten_diff(
                    &child,
                    value,
                    b.get(key).unwrap_or(&serde_json::Value::Null),
                    out,
                );
            }
        }
        _ if saved != current => out.push(format!(
            "{path}: checkpoint has {saved}, this run has {current}"
        )),
        _ => {}
    }
}

/// Loads model and optimizer; an unreadable or mismatched file is an error, never a panic.
pub fn load(
    out: &Path,
    model: Transformer,
    optimizer: ModuleOptimizer,
) -> Result<(Transformer, ModuleOptimizer), String> {
    let dir = checkpoint_dir(out);
    let record = ModuleRecord::load(dir.join("model.bpk")).map_err(|e| {
        format!(
            "checkpoint model {} is corrupt: {e}",
            dir.join("model.bpk").display()
        )
    })?;
    let model = model
        .try_load_record(record)
        .map_err(|e| format!("checkpoint model does not fit this model: {e}"))?;
    let optimizer = optimizer.load(dir.join("optimizer.bpk")).map_err(|e| {
        format!(
            "checkpoint optimizer {} is corrupt: {e}",
            dir.join("optimizer.bpk").display()
        )
    })?;
    Ok((model, optimizer))
}
