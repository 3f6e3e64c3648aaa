//! Short text forms shared by the report's parts: loads and percentages.

use crate::driver::Load;

/// How a load reads in a table or chart.
pub fn load_label(l: Load) -> String {
    match l {
        Load::Concurrency(c) => format!("{c} concurrent streams"),
        Load::Rate(r) => format!("open loop {r} req/s"),
        Load::Replay(x) => format!("trace replay x{x}"),
    }
}

/// A fraction as a percentage with one decimal.
pub fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}
