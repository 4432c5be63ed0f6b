//! Byte units. GiB (2^30) and GB (10^9) are different; everything inside
//! gpufit is bytes (`u64`), conversions happen only at the edges.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const GB: u64 = 1_000_000_000;
pub const MB: u64 = 1_000_000;

/// Bytes → GiB as f64, for display.
pub fn to_gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

/// GiB (possibly fractional) → bytes, rounded.
pub fn gib(x: f64) -> u64 {
    (x * GIB as f64).round().max(0.0) as u64
}

/// GB (10^9, possibly fractional) → bytes, rounded.
pub fn gb(x: f64) -> u64 {
    (x * GB as f64).round().max(0.0) as u64
}

/// Human-readable GiB with two decimals, e.g. `"17.42 GiB"`.
pub fn fmt_gib(bytes: u64) -> String {
    format!("{:.2} GiB", to_gib(bytes))
}
