//! The prefill scale's regression: an exponentially weighted least-squares line through
//! (predicted queue plus prefill at the configured rate, measured time to first byte), whose slope
//! is the backend's prefill scale and whose intercept is the gateway and network overhead.

/// Fewest (weighted) observations, and least spread of their predictions (ms²), to fit a line.
const MIN_FIT_WEIGHT: f64 = 8.0;
const MIN_FIT_VARIANCE: f64 = 25.0;

/// How far, in units of the configured rate, a backend's prefill rate is believed to be from the
/// rate it has now before any new data (see `Fit::line`).
const SLOPE_PRIOR_SD: f64 = 0.25;

/// An exponentially weighted least-squares line `y = a + b x`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Fit {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    syy: f64,
}

impl Fit {
    pub(super) fn observe(&mut self, x: f64, y: f64, rate: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        let keep = 1.0 - rate.clamp(0.0, 1.0);
        self.w = self.w * keep + 1.0;
        self.sx = self.sx * keep + x;
        self.sy = self.sy * keep + y;
        self.sxx = self.sxx * keep + x * x;
        self.sxy = self.sxy * keep + x * y;
        self.syy = self.syy * keep + y * y;
    }

    /// The mean and the variance of the predictions, once there are enough observations
    /// ([`MIN_FIT_WEIGHT`]) spread widely enough ([`MIN_FIT_VARIANCE`]) to fit a slope.
    fn spread(&self) -> Option<(f64, f64)> {
        if self.w < MIN_FIT_WEIGHT {
            return None;
        }
        let mx = self.sx / self.w;
        let var = self.sxx / self.w - mx * mx;
        (var >= MIN_FIT_VARIANCE).then_some((mx, var))
    }

    /// The slope of the line through intercept `a` (least squares with `a` fixed), shrunk
    /// towards `prior` as [`Fit::line`] does, once there are enough observations spread widely
    /// enough.
    pub(super) fn slope_through(&self, a: f64, prior: f64) -> Option<f64> {
        self.spread()?;
        let fitted = (self.sxy - a * self.sx) / self.sxx;
        // Residuals around y = a + fitted x, from the sums.
        let sse = self.syy - 2.0 * a * self.sy - 2.0 * fitted * self.sxy
            + a * a * self.w
            + 2.0 * a * fitted * self.sx
            + fitted * fitted * self.sxx;
        let se2 = sse.max(0.0) / ((self.w - 1.0).max(1.0) * self.sxx);
        let b = shrunk(fitted, se2, prior);
        (b.is_finite() && b > 0.0).then_some(b)
    }

    /// `(a, b)` once there are enough observations spread widely enough, the slope shrunk
    /// towards `prior` as far as the data leave it uncertain: the fitted slope and the prior are
    /// averaged with weights `1 / se²` and `1 / SLOPE_PRIOR_SD²`, `se` being the fitted slope's
    /// standard error from the residuals. A backend measured through a noisy gateway (time to
    /// first byte varying by hundreds of milliseconds for reasons of its own) then keeps a rate
    /// near what it had instead of one that swings between the bounds.
    pub(super) fn line(&self, prior: f64) -> Option<(f64, f64)> {
        let (mx, var) = self.spread()?;
        let my = self.sy / self.w;
        let cov = self.sxy / self.w - mx * my;
        let fitted = cov / var;
        let residual = (self.syy / self.w - my * my - fitted * cov).max(0.0);
        // Effective sample size of the exponentially weighted sums, less the two fitted terms.
        let se2 = residual / (var * (self.w - 2.0).max(1.0));
        let b = shrunk(fitted, se2, prior);
        (b.is_finite() && b > 0.0).then_some((my - b * mx, b))
    }
}

/// A fitted slope of squared standard error `se2` averaged with `prior`, weighted `1 / se2` and
/// `1 / SLOPE_PRIOR_SD²`.
fn shrunk(fitted: f64, se2: f64, prior: f64) -> f64 {
    let (data, belief) = (
        1.0 / se2.max(1e-12),
        1.0 / (SLOPE_PRIOR_SD * SLOPE_PRIOR_SD),
    );
    (fitted * data + prior * belief) / (data + belief)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_a_given_intercept_takes_the_rest_into_its_slope() {
        let mut f = Fit::default();
        for i in 0..50 {
            let x = 50.0 + f64::from(i % 10) * 30.0;
            f.observe(x, 170.0 + x, 0.05);
        }
        let (a, b) = f.line(1.0).unwrap();
        assert!((a - 170.0).abs() < 1.0 && (b - 1.0).abs() < 0.01, "{a} {b}");
        // Through 0, 170 ms more on x of 50-320 ms is a steeper line.
        let b0 = f.slope_through(0.0, 1.0).unwrap();
        assert!(b0 > 1.5, "{b0}");
        // Through its own intercept, the same slope.
        let b170 = f.slope_through(170.0, 1.0).unwrap();
        assert!((b170 - 1.0).abs() < 0.01, "{b170}");
    }
}
