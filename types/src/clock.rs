//! Wall-clock time as the wire and the API carry it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Time since the Unix epoch; zero on a clock set before 1970, since every
/// use (event timestamps, `created` fields, id salt) tolerates a zero better
/// than an error.
pub fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

/// Microseconds since the Unix epoch (KV events' emit time).
pub fn unix_micros() -> u64 {
    u64::try_from(since_epoch().as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_reads_after_2020_and_moves_forward() {
        // 2020-01-01T00:00:00Z.
        let a = unix_micros();
        assert!(a > 1_577_836_800_000_000, "clock reads {a}");
        std::thread::sleep(Duration::from_millis(2));
        assert!(unix_micros() > a);
        assert_eq!(since_epoch().as_secs(), unix_micros() / 1_000_000);
    }
}
