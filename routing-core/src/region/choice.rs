//! The order in which a request tries pools: the one where it would see its first token soonest,
//! the network included, with a margin so traffic does not flap, and never a pool outside the
//! request's allowed jurisdictions.
//!
//! The request's anchor is its conversation's home pool (the one the Worker knows holds its
//! history) or else the nearest pool. Each pool's cost is `round_trips x rtt + ttft`, where `ttft`
//! comes from the pool's [`TimeCard`] for the tokens it would have to prefill there (the whole
//! prompt, less what the Worker knows the pool holds), so a conversation moves from its home only
//! when waiting there costs more than recomputing its history elsewhere. A pool whose card is
//! missing or older than `card_max_age_ms` has no cost: it is never chosen for its card, and it
//! keeps its place by proximity after the pools with a cost. The anchor goes first unless a pool
//! is cheaper by more than the margin (`max(margin_ms, margin_ratio x anchor's cost)`); between one
//! and two margins a request moves with a probability that grows from 0 to 1, so a whole colo's
//! traffic does not move at once on one card and back on the next. An anchor whose fresh card says
//! it cannot take a request now gives way to the cheapest pool that can. A card is a few seconds
//! old when it is read, and every request this Worker sent the pool since then adds its wait
//! ([`TimeCard::backlog_ms`]), so the Worker does not send a whole card's interval of traffic to
//! the pool that looked idle when the card was made; and the card's waiting drains with its age
//! ([`TimeCard::drained_ms`]), so a pool that was backed up when its card was made is not avoided
//! after its backlog is gone.

use super::time_card::TimeCard;

/// Knobs of the choice between pools.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChoiceConfig {
    /// Whether pools are chosen on predicted time (otherwise nearest first).
    pub enabled: bool,
    /// Smallest saving, in ms, that moves a request from its anchor.
    pub margin_ms: u32,
    /// The saving that moves a request, as a share of the anchor's cost, when larger.
    pub margin_ratio: f64,
    /// Cards older than this are not trusted, in ms.
    pub card_max_age_ms: u64,
    /// Edge-to-pool round trips a request pays before its first token (the lease and the fetch).
    pub round_trips: u32,
}

impl Default for ChoiceConfig {
    fn default() -> Self {
        ChoiceConfig {
            enabled: true,
            margin_ms: 50,
            margin_ratio: 0.25,
            card_max_age_ms: 30_000,
            round_trips: 2,
        }
    }
}

/// One pool as the choice sees it, given in proximity order (nearest first).
#[derive(Debug, Clone, Copy)]
pub struct PoolOption<'a> {
    /// Its time card, as the pool list brought it.
    pub card: Option<&'a TimeCard>,
    /// Round trip from this Worker to it, in ms.
    pub rtt_ms: u32,
    /// Prompt tokens the Worker believes it holds for this request (its home pool's).
    pub cached_tokens: u32,
    /// Whether it is the request's home pool.
    pub home: bool,
    /// Requests this Worker sent the pool since its card was computed that still hold a slot
    /// (their wait is added).
    pub sent_since_card: u32,
    /// Their mean output tokens asked for.
    pub sent_tokens: u32,
}

/// Why the first pool was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChoiceReason {
    /// The nearest pool, and nothing predicted faster by the margin.
    Nearest,
    /// The conversation's home pool, and nothing predicted faster by the margin.
    Home,
    /// Another pool, predicted faster than the anchor by more than the margin.
    Faster,
    /// The anchor's card says it cannot take a request now: the fastest that can.
    AnchorFull,
}

impl ChoiceReason {
    /// The reason's name in headers, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ChoiceReason::Nearest => "nearest",
            ChoiceReason::Home => "home",
            ChoiceReason::Faster => "faster",
            ChoiceReason::AnchorFull => "anchor_full",
        }
    }
}

/// The pools in the order to try them.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolChoice {
    /// Indices into the options, first to try first.
    pub order: Vec<usize>,
    /// Why the first one is first.
    pub reason: ChoiceReason,
    /// Predicted cost (round trips plus time to first token) of each option, by index; `None`
    /// without a fresh card.
    pub predicted_ms: Vec<Option<u64>>,
    /// The anchor's index (the home pool, else the nearest): what a request moved away from.
    pub anchor: usize,
}

/// Whether a pool of `jurisdiction` may serve a request allowed in `allowed` (empty: anywhere). A
/// pool without a jurisdiction never serves a restricted request.
pub fn allowed_in(jurisdiction: &str, allowed: &[String]) -> bool {
    allowed.is_empty() || allowed.iter().any(|a| a == jurisdiction)
}

/// Orders `options` (proximity order) for a request of `prompt_tokens`; `u` is uniform in [0, 1).
pub fn order_pools(
    options: &[PoolOption<'_>],
    prompt_tokens: u32,
    now_ms: u64,
    u: f64,
    config: &ChoiceConfig,
) -> PoolChoice {
    let anchor = options.iter().position(|o| o.home).unwrap_or(0);
    let anchor_reason = if options.get(anchor).is_some_and(|o| o.home) {
        ChoiceReason::Home
    } else {
        ChoiceReason::Nearest
    };
    let max_age = config.card_max_age_ms;
    let fresh = |o: &PoolOption<'_>| o.card.is_some_and(|c| c.age_ms(now_ms) <= max_age);
    let predicted_ms: Vec<Option<u64>> = options
        .iter()
        .map(|o| {
            let card = o.card.filter(|_| fresh(o))?;
            let uncached = prompt_tokens.saturating_sub(o.cached_tokens);
            let ttft = card
                .predict_ms(uncached)?
                .saturating_sub(card.drained_ms(card.age_ms(now_ms)))
                + card.backlog_ms(o.sent_since_card, o.sent_tokens);
            Some(u64::from(config.round_trips) * u64::from(o.rtt_ms) + ttft)
        })
        .collect();
    // Proximity order with the anchor first, then pools with a cost before those without.
    let mut order: Vec<usize> = (0..options.len()).collect();
    if !config.enabled || options.is_empty() {
        return PoolChoice {
            order,
            reason: anchor_reason,
            predicted_ms,
            anchor,
        };
    }
    order.sort_by_key(|&i| (i != anchor, predicted_ms[i].is_none(), predicted_ms[i]));
    let best = (0..options.len())
        .filter(|&i| predicted_ms[i].is_some())
        .min_by_key(|&i| (predicted_ms[i], i != anchor, i));
    let Some(best) = best.filter(|&b| b != anchor) else {
        return PoolChoice {
            order,
            reason: anchor_reason,
            predicted_ms,
            anchor,
        };
    };
    let best_ms = predicted_ms[best].unwrap_or(0) as f64;
    let moves = match predicted_ms[anchor] {
        Some(anchor_ms) => {
            let anchor_ms = anchor_ms as f64;
            let margin = f64::from(config.margin_ms).max(config.margin_ratio * anchor_ms);
            let gain = anchor_ms - best_ms;
            let p = ((gain - margin) / margin.max(1.0)).clamp(0.0, 1.0);
            (u < p).then_some(ChoiceReason::Faster)
        }
        // A fresh card with no prediction: the anchor cannot take a request now.
        None if options.get(anchor).is_some_and(fresh) => Some(ChoiceReason::AnchorFull),
        // No fresh card for the anchor: nothing to compare it with, so it keeps its place.
        None => None,
    };
    let Some(reason) = moves else {
        return PoolChoice {
            order,
            reason: anchor_reason,
            predicted_ms,
            anchor,
        };
    };
    order.retain(|&i| i != best);
    order.insert(0, best);
    PoolChoice {
        order,
        reason,
        predicted_ms,
        anchor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(at_ms: u64, cached: u32, short: u32, long: u32) -> TimeCard {
        TimeCard {
            at_ms,
            cached_ms: Some(cached),
            short_ms: Some(short),
            long_ms: Some(long),
            ..TimeCard::default()
        }
    }

    fn opt(card: Option<&TimeCard>, rtt_ms: u32) -> PoolOption<'_> {
        PoolOption {
            card,
            rtt_ms,
            cached_tokens: 0,
            home: false,
            sent_since_card: 0,
            sent_tokens: 0,
        }
    }

    const NOW: u64 = 100_000;

    #[test]
    fn lightly_loaded_pools_keep_every_request_at_home() {
        let near = card(NOW, 20, 120, 800);
        let far = card(NOW, 20, 120, 800);
        for u in [0.0, 0.5, 0.999] {
            let c = order_pools(
                &[opt(Some(&near), 0), opt(Some(&far), 80)],
                512,
                NOW,
                u,
                &ChoiceConfig::default(),
            );
            assert_eq!(c.order, vec![0, 1]);
            assert_eq!(c.reason, ChoiceReason::Nearest);
        }
    }

    #[test]
    fn a_backed_up_nearest_pool_sends_requests_to_a_faster_one_the_network_included() {
        // Nearest: 2 s to first token. Far: 300 ms plus two round trips of 80 ms.
        let near = card(NOW, 2000, 2100, 2800);
        let far = card(NOW, 200, 300, 1000);
        let c = order_pools(
            &[opt(Some(&near), 0), opt(Some(&far), 80)],
            1024,
            NOW,
            0.999,
            &ChoiceConfig::default(),
        );
        assert_eq!(c.order, vec![1, 0]);
        assert_eq!(c.reason, ChoiceReason::Faster);
        assert_eq!(c.predicted_ms, vec![Some(2100), Some(460)]);
    }

    #[test]
    fn savings_within_the_margin_do_not_move_and_between_one_and_two_margins_some_do() {
        let near = card(NOW, 300, 300, 300);
        // 100 ms better: under the 25% margin of 300 = 75 ms? 100 > 75 so partly; p = 25/75.
        let far = card(NOW, 200, 200, 200);
        let config = ChoiceConfig {
            round_trips: 0,
            ..ChoiceConfig::default()
        };
        let opts = [opt(Some(&near), 0), opt(Some(&far), 0)];
        let moved = (0..100)
            .filter(|i| order_pools(&opts, 10, NOW, *i as f64 / 100.0, &config).order[0] == 1)
            .count();
        assert!((30..=36).contains(&moved), "{moved} of 100 moved");
        // 40 ms better: within the 50 ms floor of the margin, nothing moves.
        let close = card(NOW, 260, 260, 260);
        let opts = [opt(Some(&near), 0), opt(Some(&close), 0)];
        assert!(
            (0..100).all(|i| order_pools(&opts, 10, NOW, i as f64 / 100.0, &config).order[0] == 0)
        );
    }

    #[test]
    fn a_conversation_stays_home_unless_moving_saves_more_than_recomputing_costs() {
        // Home holds 8k tokens of history: it prefills 100 tokens, elsewhere all 8,292.
        let home = card(NOW, 400, 500, 1200);
        let other = card(NOW, 50, 150, 850);
        let mut opts = [opt(Some(&other), 0), opt(Some(&home), 30)];
        opts[1].home = true;
        opts[1].cached_tokens = 8192;
        let c = order_pools(&opts, 8292, NOW, 0.0, &ChoiceConfig::default());
        assert_eq!(c.order, vec![1, 0], "{:?}", c.predicted_ms);
        assert_eq!(c.reason, ChoiceReason::Home);
        // Home backed up far beyond a recompute: the conversation moves.
        let busy_home = card(NOW, 5000, 5100, 5800);
        opts[1].card = Some(&busy_home);
        let c = order_pools(&opts, 8292, NOW, 0.0, &ChoiceConfig::default());
        assert_eq!(c.order, vec![0, 1]);
        assert_eq!(c.reason, ChoiceReason::Faster);
    }

    #[test]
    fn a_stale_card_is_not_trusted() {
        let near = card(NOW, 2000, 2100, 2800);
        // It claims to be idle, but it is a minute old.
        let stale = card(NOW - 60_000, 10, 20, 30);
        let c = order_pools(
            &[opt(Some(&near), 0), opt(Some(&stale), 10)],
            100,
            NOW,
            0.0,
            &ChoiceConfig::default(),
        );
        assert_eq!(c.order, vec![0, 1]);
        assert_eq!(c.predicted_ms[1], None);
        // A stale anchor keeps its place: nothing to compare it with.
        let fresh_far = card(NOW, 10, 20, 30);
        let stale_near = card(NOW - 60_000, 5000, 5000, 5000);
        let c = order_pools(
            &[opt(Some(&stale_near), 0), opt(Some(&fresh_far), 10)],
            100,
            NOW,
            0.0,
            &ChoiceConfig::default(),
        );
        assert_eq!(c.order, vec![0, 1]);
        assert_eq!(c.reason, ChoiceReason::Nearest);
    }

    #[test]
    fn an_anchor_backed_up_when_its_card_was_made_keeps_its_traffic_once_that_has_drained() {
        // Two seconds of backlog on the nearest pool; the far pool idle, 80 ms away.
        let far = card(NOW, 10, 60, 400);
        let cases = [
            (NOW, vec![1, 0], ChoiceReason::Faster),
            (NOW - 10_000, vec![0, 1], ChoiceReason::Nearest),
        ];
        for (at, order, reason) in cases {
            let near = card(at, 2000, 2050, 2400);
            let c = order_pools(
                &[opt(Some(&near), 0), opt(Some(&far), 80)],
                100,
                NOW,
                0.0,
                &ChoiceConfig::default(),
            );
            assert_eq!((c.order, c.reason), (order, reason), "card made at {at}");
        }
    }

    #[test]
    fn a_full_anchor_gives_way_and_pools_without_cards_come_last_in_proximity_order() {
        let full = TimeCard {
            at_ms: NOW,
            ..TimeCard::default()
        };
        let a = card(NOW, 900, 900, 900);
        let b = card(NOW, 100, 100, 100);
        let c = order_pools(
            &[
                opt(Some(&full), 0),
                opt(None, 5),
                opt(Some(&a), 10),
                opt(Some(&b), 20),
            ],
            100,
            NOW,
            0.9,
            &ChoiceConfig::default(),
        );
        assert_eq!(c.order, vec![3, 0, 2, 1]);
        assert_eq!(c.reason, ChoiceReason::AnchorFull);
    }

    #[test]
    fn what_this_worker_sent_since_the_card_counts_against_the_pool_it_went_to() {
        let near = card(NOW, 600, 600, 600);
        let mut far = card(NOW, 100, 100, 100);
        far.running = 8;
        far.max_seqs = 8;
        far.decode_ms = Some(800);
        let mut opts = [opt(Some(&near), 0), opt(Some(&far), 0)];
        let config = ChoiceConfig {
            round_trips: 0,
            ..ChoiceConfig::default()
        };
        assert_eq!(order_pools(&opts, 10, NOW, 0.0, &config).order[0], 1);
        // Five requests later the far pool's slots are five requests more behind: 100 + 500.
        opts[1].sent_since_card = 5;
        opts[1].sent_tokens = 256;
        let c = order_pools(&opts, 10, NOW, 0.0, &config);
        assert_eq!(c.predicted_ms[1], Some(600));
        assert_eq!(c.order[0], 0);
    }

    #[test]
    fn turned_off_it_is_nearest_first() {
        let near = card(NOW, 2000, 2100, 2800);
        let far = card(NOW, 10, 10, 10);
        let config = ChoiceConfig {
            enabled: false,
            ..ChoiceConfig::default()
        };
        let c = order_pools(
            &[opt(Some(&near), 0), opt(Some(&far), 1)],
            1,
            NOW,
            0.0,
            &config,
        );
        assert_eq!(c.order, vec![0, 1]);
    }

    #[test]
    fn residency_admits_only_the_listed_jurisdictions() {
        let eu = vec!["eu".to_string()];
        assert!(allowed_in("eu", &eu));
        assert!(!allowed_in("us", &eu));
        assert!(
            !allowed_in("", &eu),
            "a pool without a jurisdiction is not in the EU"
        );
        assert!(allowed_in("", &[]));
    }
}
