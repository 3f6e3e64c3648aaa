//! Where and when a benchmark ran: the machine's CPU and memory, how the gateway ran, and the UTC
//! date and time
//! (from the system clock, without a date library).

use std::collections::BTreeMap;

/// Machine facts for the report.
pub fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(
        "nproc".into(),
        std::thread::available_parallelism().map_or("?".into(), |n| n.to_string()),
    );
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if let Some(model) = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
    {
        m.insert("cpu".into(), model.trim().to_string());
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    if let Some(kb) = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
    {
        m.insert("memory".into(), format!("{:.0} GiB", kb / 1024.0 / 1024.0));
    }
    // How scripts/bench.sh ran the gateway (the built Worker in workerd, or under wrangler dev).
    if let Ok(gateway) = std::env::var("BENCH_GATEWAY_RUNTIME") {
        m.insert("gateway".into(), gateway);
    }
    m
}

/// `(YYYY-MM-DD, HH:MM:SS)` in UTC, from the system clock.
pub fn utc_now() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (date, tod) = ((secs / 86_400) as i64, secs % 86_400);
    (
        civil_date(date),
        format!("{:02}:{:02}:{:02}", tod / 3600, tod / 60 % 60, tod % 60),
    )
}

/// The proleptic Gregorian date of a day number since 1970-01-01 (Howard Hinnant's algorithm).
pub fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(19_723), "2024-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
    }
}
