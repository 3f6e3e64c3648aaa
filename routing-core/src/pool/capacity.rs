//! The pool's capacity rule: whether a backend has room for one more request (admission control,
//! [`crate::admission`], queues the requests for which no backend has).

use crate::backend::cost::InFlight;
use crate::backend::Capacity;

/// Whether a backend carrying `in_flight` may take a request adding `tokens` of KV-cache work,
/// `headroom` over its capacity (0 = strict). An idle backend always has room, so a request larger
/// than a whole KV cache is not queued forever.
pub fn has_room(in_flight: &InFlight, capacity: &Capacity, tokens: u64, headroom: f64) -> bool {
    let scale = 1.0 + headroom.clamp(0.0, 10.0);
    let seqs = (f64::from(capacity.max_num_seqs.max(1)) * scale)
        .floor()
        .max(1.0);
    if f64::from(in_flight.leases) >= seqs {
        return false;
    }
    if capacity.kv_blocks > 0 && in_flight.leases > 0 {
        let used = in_flight
            .prompt_tokens
            .saturating_add(in_flight.output_tokens)
            .saturating_add(tokens);
        if used as f64 > capacity.capacity_tokens() as f64 * scale {
            return false;
        }
    }
    true
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_counts_sequences_and_known_kv_tokens() {
        let cap = Capacity {
            max_num_seqs: 2,
            kv_blocks: 0,
            block_size: 16,
            kv_tokens: 0,
        };
        let mut f = InFlight::default();
        assert!(
            has_room(&f, &cap, 1_000_000, 0.0),
            "an idle backend always has room"
        );
        f.add(10, 10);
        assert!(has_room(&f, &cap, 10, 0.0));
        f.add(10, 10);
        assert!(
            !has_room(&f, &cap, 10, 0.0),
            "two sequences fill max_num_seqs 2"
        );
        assert!(
            has_room(&f, &cap, 10, 0.5),
            "50% over capacity allows a third"
        );
        let kv = Capacity {
            max_num_seqs: 100,
            kv_blocks: 10,
            block_size: 16,
            kv_tokens: 0,
        };
        let mut g = InFlight::default();
        g.add(100, 40);
        assert!(has_room(&g, &kv, 20, 0.0), "140 + 20 tokens fit in 160");
        assert!(!has_room(&g, &kv, 21, 0.0), "161 tokens do not");
        assert!(has_room(&g, &kv, 21, 0.1));
    }
}
