//! Prometheus rendering of the pool (see [`crate::metrics`]).

use super::Pool;

impl Pool {
    /// Renders the pool's metrics in the Prometheus text format (see [`crate::metrics`]).
    pub fn render_metrics(&self, out: &mut String) {
        crate::metrics::render(self, out);
    }
}
