//! The wait for room: how long a request would wait on a backend that lacks KV-cache space or
//! sequence slots, or that queues requests itself, before vLLM admits it.

/// How long a request waits for room on a backend that is out of KV-cache space or sequence
/// slots: vLLM admits it only when running sequences finish and free theirs. A full backend frees
/// its whole capacity once per `drain_ms` (the pool passes the time its sequences take: their
/// prefills one after another, `capacity / mean tokens per sequence × mean prefill`, then their
/// decode together, `mean expected output × step`), so a shortfall of `s` tokens (or sequences)
/// takes that fraction of a drain to free, however many requests are queued ahead:
///
/// ```text
/// memory wait = drain_ms × max(tokens + request − capacity, 0) / capacity
/// slot wait   = drain_ms × max(sequences + 1 − max_num_seqs, 0) / max_num_seqs
/// queue wait  = drain_ms / 4 × waiting / running
/// ```
///
/// and the largest of the three counts. `tokens` are the backend's in-flight tokens (the distinct
/// prompt blocks its leases hold plus their expected output, or what vLLM reports pinned, if
/// more). `waiting` and `running` are the server's own queue and batch at the last probe (vLLM's
/// `num_requests_waiting` and `num_requests_running`): a request sent there waits behind what the
/// server queues itself too. The drain and the queue's weight were chosen against the timed
/// simulation and `make bench` (README, "Benchmarks").
pub fn room_wait_ms(
    in_flight_tokens: u64,
    request_tokens: u64,
    capacity_tokens: u64,
    sequences: u32,
    max_num_seqs: u32,
    drain_ms: f64,
    engine_queue: (f64, f64),
) -> f64 {
    let decode = drain_ms.max(0.0);
    let half = decode / 2.0;
    let short_tokens = (in_flight_tokens + request_tokens).saturating_sub(capacity_tokens);
    let memory = decode * short_tokens as f64 / capacity_tokens.max(1) as f64;
    let short_seqs = (sequences + 1).saturating_sub(max_num_seqs.max(1));
    let slots = decode * f64::from(short_seqs) / f64::from(max_num_seqs.max(1));
    let (waiting, running) = engine_queue;
    let queued = if waiting.is_finite() && waiting > 0.0 {
        half / 2.0 * waiting / running.max(1.0)
    } else {
        0.0
    };
    memory.max(slots).max(queued)
}
