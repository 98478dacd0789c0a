//! Checkpoints that survive a crash, as burn-train checkpointers, and the run identity that a
//! resumed run must match.
//!
//! burn-train saves the model, the optimizer and the learning-rate scheduler of an epoch as
//! three records, each through its own checkpointer. [`AtomicCheckpointer`] writes each record
//! beside its final name, fsyncs it, renames it into place and fsyncs the folder: a file named
//! `NAME-EPOCH.bpk` is always complete. An epoch is resumable when all three of its files
//! exist ([`latest_complete_epoch`]); what a crash leaves (`*.partial`) is ignored and removed.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::Module;
use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use serde::{Deserialize, Serialize};

use crate::model::{Transformer, TransformerConfig};
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
    /// Optimizer steps per epoch (burn-train validates and checkpoints once per epoch).
    pub epoch_steps: usize,
    pub seed: u64,
}

impl RunIdentity {
    /// Epochs of the whole run: its steps rounded up to whole epochs.
    pub fn epochs(&self) -> usize {
        self.steps.div_ceil(self.epoch_steps)
    }
}

/// The three records of an epoch, by the names burn-train's own checkpointers use.
pub const RECORDS: [&str; 3] = ["model", "optim", "scheduler"];

/// Where a run's checkpoints live.
pub fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

fn record_path(directory: &Path, name: &str, epoch: usize) -> PathBuf {
    directory.join(format!("{name}-{epoch}.bpk"))
}

/// Milliseconds the model checkpointer waits with a record written but not yet in place (for
/// the crash test).
const PAUSE_VARIABLE: &str = "TRAIN_DEMO_SAVE_PAUSE_MS";

/// A burn-train checkpointer whose files are complete or absent, whenever the process dies.
pub struct AtomicCheckpointer {
    directory: PathBuf,
    name: &'static str,
}

impl AtomicCheckpointer {
    pub fn new(out: &Path, name: &'static str) -> Result<Self, String> {
        let directory = checkpoint_dir(out);
        std::fs::create_dir_all(&directory).map_err(|e| format!("{}: {e}", directory.display()))?;
        Ok(Self { directory, name })
    }

    fn write(&self, epoch: usize, bytes: &[u8]) -> std::io::Result<()> {
        let path = record_path(&self.directory, self.name, epoch);
        let partial = path.with_extension("bpk.partial");
        let mut file = File::create(&partial)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        if self.name == RECORDS[0]
            && let Some(pause) = std::env::var(PAUSE_VARIABLE)
                .ok()
                .and_then(|ms| ms.parse().ok())
        {
            eprintln!("checkpoint: epoch {epoch} written, not yet in place");
            std::thread::sleep(Duration::from_millis(pause));
        }
        std::fs::rename(&partial, &path)?;
        File::open(&self.directory)?.sync_all()
    }
}

impl<R: Checkpoint> Checkpointer<R> for AtomicCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let bytes = record
            .checkpoint_into_bytes()
            .map_err(CheckpointerError::Record)?;
        self.write(epoch, &bytes)
            .map_err(CheckpointerError::IOError)?;
        // For logs (and the crash test); on a terminal the dashboard owns the screen.
        if !std::io::stderr().is_terminal() {
            eprintln!("checkpoint: epoch {epoch} {} saved", self.name);
        }
        Ok(())
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        match std::fs::remove_file(record_path(&self.directory, self.name, epoch)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(CheckpointerError::IOError(error))
            }
            _ => Ok(()),
        }
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        let bytes = std::fs::read(record_path(&self.directory, self.name, epoch))
            .map_err(CheckpointerError::IOError)?;
        R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(CheckpointerError::Record)
    }
}

/// The last epoch whose three records are all in place, if any.
pub fn latest_complete_epoch(out: &Path) -> Option<usize> {
    let directory = checkpoint_dir(out);
    let entries = std::fs::read_dir(&directory).ok()?;
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse::<usize>()
                .ok()
        })
        .filter(|&epoch| {
            RECORDS
                .iter()
                .all(|name| record_path(&directory, name, epoch).is_file())
        })
        .max()
}

/// Removes what a crash left: records written but never renamed into place.
pub fn remove_partial_records(out: &Path) {
    let Ok(entries) = std::fs::read_dir(checkpoint_dir(out)) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().ends_with(".partial") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Reads every record of `epoch`, so that a corrupt one is an error before training starts
/// (burn-train panics on a record it cannot load); returns the model with the checkpoint's
/// weights.
pub fn verify(out: &Path, epoch: usize, model: Transformer) -> Result<Transformer, String> {
    let directory = checkpoint_dir(out);
    let read = |name: &str| {
        let path = record_path(&directory, name, epoch);
        std::fs::read(&path)
            .map(|bytes| (path.clone(), Bytes::from_bytes_vec(bytes)))
            .map_err(|e| format!("checkpoint {}: {e}", path.display()))
    };
    let corrupt = |path: &Path, error: &dyn std::fmt::Display| {
        format!("checkpoint {} is corrupt: {error}", path.display())
    };
    let (path, bytes) = read(RECORDS[0])?;
    let record = ModuleRecord::from_bytes(bytes).map_err(|e| corrupt(&path, &e))?;
    let model = model
        .try_load_record(record)
        .map_err(|e| format!("checkpoint model does not fit this model: {e}"))?;
    let (path, bytes) = read(RECORDS[1])?;
    OptimizerRecord::from_bytes(bytes).map_err(|e| corrupt(&path, &e))?;
    let (path, bytes) = read(RECORDS[2])?;
    LrSchedulerRecord::from_bytes(bytes).map_err(|e| corrupt(&path, &e))?;
    Ok(model)
}

/// Writes the run's identity (`config.json`) beside its checkpoints, crash-safely.
pub fn save_identity(out: &Path, identity: &RunIdentity) -> Result<(), String> {
    let path = out.join("config.json");
    let partial = out.join("config.json.partial");
    let json = serde_json::to_string_pretty(identity).expect("the identity serializes");
    std::fs::write(&partial, json)
        .and_then(|()| std::fs::rename(&partial, &path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads a run's identity.
pub fn load_identity(out: &Path) -> Result<RunIdentity, String> {
    let path = out.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("no run at {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is corrupt: {e}", path.display()))
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

/// The latest complete checkpoint's model, for `eval` and `predict`.
pub fn load_model(out: &Path, model: Transformer) -> Result<Transformer, String> {
    let epoch = latest_complete_epoch(out).ok_or_else(|| {
        format!(
            "no complete checkpoint in {}",
            checkpoint_dir(out).display()
        )
    })?;
    verify(out, epoch, model)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("train-demo-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_epoch_is_complete_only_with_all_three_records() {
        let out = scratch("complete");
        let checkpointers = RECORDS.map(|name| AtomicCheckpointer::new(&out, name).unwrap());
        let record = || LrSchedulerRecord::new().with_scalar("step", 3.0);
        assert_eq!(latest_complete_epoch(&out), None);
        for checkpointer in &checkpointers {
            Checkpointer::<LrSchedulerRecord>::save(checkpointer, 1, record()).unwrap();
        }
        Checkpointer::<LrSchedulerRecord>::save(&checkpointers[0], 2, record()).unwrap();
        std::fs::write(checkpoint_dir(&out).join("optim-2.bpk.partial"), b"cut").unwrap();
        assert_eq!(
            latest_complete_epoch(&out),
            Some(1),
            "epoch 2 lacks two records"
        );
        remove_partial_records(&out);
        assert!(!checkpoint_dir(&out).join("optim-2.bpk.partial").exists());
        let restored: LrSchedulerRecord = checkpointers[2].restore(1).unwrap();
        assert_eq!(restored.scalar::<f64>("step"), Some(3.0));
        Checkpointer::<LrSchedulerRecord>::delete(&checkpointers[1], 1).unwrap();
        assert_eq!(latest_complete_epoch(&out), None);
    }
}
