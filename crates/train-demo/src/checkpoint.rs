//! Checkpoints: model and optimizer (burnpack) and the run state (JSON), written to a
//! temporary folder and renamed into place; refused on resume when they do not match the run.

use std::path::{Path, PathBuf};

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

pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// Writes the checkpoint atomically: a complete temporary folder replaces the old one.
pub fn save(
    out: &Path,
    state: &RunState,
    model: &Transformer,
    optimizer: &ModuleOptimizer,
) -> Result<(), String> {
    let final_dir = checkpoint_dir(out);
    let temporary = out.join("checkpoint.tmp");
    let _ = std::fs::remove_dir_all(&temporary);
    std::fs::create_dir_all(&temporary).map_err(|e| format!("{}: {e}", temporary.display()))?;
    model
        .clone()
        .save_file(temporary.join("model.bpk"))
        .map_err(|e| format!("saving the model: {e}"))?;
    optimizer
        .save(temporary.join("optimizer.bpk"))
        .map_err(|e| format!("saving the optimizer: {e}"))?;
    let json = serde_json::to_string_pretty(state).expect("state serializes");
    std::fs::write(temporary.join("state.json"), json)
        .map_err(|e| format!("saving the state: {e}"))?;
    let old = out.join("checkpoint.old");
    let _ = std::fs::remove_dir_all(&old);
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old).map_err(|e| format!("{}: {e}", final_dir.display()))?;
    }
    std::fs::rename(&temporary, &final_dir).map_err(|e| format!("{}: {e}", final_dir.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
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
