//! Byte units. Everything inside gpumem is integer bytes; MiB appear only at the edges.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// MiB (as written in files and on the command line) to bytes, rounded to the nearest byte.
pub fn mib_to_bytes(mib: f64) -> u64 {
    (mib.max(0.0) * MIB as f64).round() as u64
}

/// The fewest whole MiB that hold `bytes`: what a request in MiB (a scheduler's, a sharing
/// system's) asks for, never less than the bytes it stands for.
pub fn whole_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// Bytes to MiB for display.
pub fn bytes_to_mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// Bytes to MiB to one decimal: the MiB figures of machine output (beside the exact bytes).
pub fn mib(bytes: u64) -> f64 {
    (bytes_to_mib(bytes) * 10.0).round() / 10.0
}
