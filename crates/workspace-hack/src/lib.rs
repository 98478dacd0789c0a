//! Feature unification for the workspace (no code): see this crate's `Cargo.toml`.
