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

/// A user's number as they would write it back: plain below a billion,
/// in exponent form above (Rust's plain form of 1e30 is 31 digits that
/// were never typed).
pub fn fmt_given(x: f64) -> String {
    if x.is_finite() && x.abs() >= 1e9 {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Human-readable GiB with two decimals, e.g. `"17.42 GiB"`.
pub fn fmt_gib(bytes: u64) -> String {
    format!("{:.2} GiB", to_gib(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_numbers_print_as_typed() {
        assert_eq!(fmt_given(52.3), "52.3");
        assert_eq!(fmt_given(1e30), "1e30");
        assert_eq!(fmt_given(1e300), "1e300");
        assert_eq!(fmt_given(f64::NAN), "NaN");
        assert_eq!(fmt_given(-2.5e12), "-2.5e12");
    }
}
