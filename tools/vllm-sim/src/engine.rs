//! The engine task: drives the [`Scheduler`] in real time and connects it to request handlers.
//!
//! Handlers [`EngineHandle::submit`] a sequence and get a channel of [`SeqEvent`]s. One task owns the
//! scheduler and loops: take new submissions, plan a step, sleep the step's simulated duration divided
//! by `--time-scale`, apply the step and send each sequence its events. A client that goes away drops
//! its receiver; the engine notices when a send fails (or in a periodic sweep for sequences that get no
//! events, such as queued or non-streamed ones) and aborts the sequence, freeing its blocks.
//!
//! The engine also times each sequence (arrival, first scheduled step, first and last token) for the
//! latency histograms, in wall-clock seconds, like the scraper-visible latencies of a real server,
//! and splits each one's time to first token into queue, prefill and decode interference
//! ([`EngineSplit`], reported with `--report-engine-timing`). For the rest of the answer it keeps
//! the engine's end-to-end time (arrival to last token) and the decode stall: the share of the
//! steps it decoded in that went to other sequences' prompt tokens (`Finish::engine_e2e_ms`,
//! `Finish::engine_decode_stall_ms`).
//! When no sequence can compute (only stalled ones, see the `stall_after_tokens` fault), the engine
//! waits for a submission or the next sweep instead of spinning.
//!
//! Steps shorter than the timer's 1 ms resolution are paced against a running deadline
//! ([`next_deadline`]): the engine sleeps only when it is ahead of schedule, so the average rate is
//! exact even when single steps last microseconds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::metrics::{MetricsState, Observations};
use crate::scheduler::{
    EngineSplit, Finish, Scheduler, SchedulerConfig, SeqId, SeqOutput, SequenceSpec, StepTiming,
};

/// How far behind schedule the engine may fall before it stops catching up.
const MAX_LAG: Duration = Duration::from_millis(5);
/// Steps ending sooner than this after now are not slept for.
const MIN_SLEEP: Duration = Duration::from_micros(100);
/// How often sequences without events are checked for departed clients.
const SWEEP_EVERY: Duration = Duration::from_millis(20);

/// What the engine tells a request handler.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// New text (streaming only) and the output token count so far.
    Token {
        /// Text to append (may be empty while a possible stop string is held back).
        delta: String,
        /// Output tokens so far.
        output_tokens: u32,
    },
    /// The sequence finished.
    Finished(Finish),
}

/// The engine has stopped (the process is shutting down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineGone;

struct Submission {
    spec: SequenceSpec,
    events: mpsc::UnboundedSender<SeqEvent>,
    arrival: Instant,
}

/// A cloneable handle for submitting sequences to the engine.
#[derive(Clone)]
pub struct EngineHandle {
    submissions: mpsc::UnboundedSender<Submission>,
}

impl EngineHandle {
    /// Queues a sequence that arrived at `arrival`; its events come on the returned channel.
    pub fn submit(
        &self,
        spec: SequenceSpec,
        arrival: Instant,
    ) -> Result<mpsc::UnboundedReceiver<SeqEvent>, EngineGone> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.submissions
            .send(Submission {
                spec,
                events,
                arrival,
            })
            .map_err(|_| EngineGone)?;
        Ok(receiver)
    }
}

/// When the step that starts now and lasts `step` should end, given the previous step's deadline:
/// back to back with it unless the engine fell more than [`MAX_LAG`] behind.
pub fn next_deadline(previous: Option<Instant>, now: Instant, step: Duration) -> Instant {
    let start = match previous {
        Some(p) if p + MAX_LAG >= now => p,
        _ => now,
    };
    start + step
}

/// A submitted sequence's channel and the times its latency metrics are made of.
struct Client {
    events: mpsc::UnboundedSender<SeqEvent>,
    arrival: Instant,
    /// Start of the first step that computed it.
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Output tokens seen so far.
    tokens: u32,
    /// Until the first token: the decoding sequences' share of its steps so far, seconds.
    decode_interference_s: f64,
    /// Until the first token: other prompts' share of its steps so far, seconds.
    shared_prefill_s: f64,
    /// After the first token: other sequences' prompt tokens' share of the steps it decoded in
    /// so far, seconds.
    decode_stall_s: f64,
}

/// Starts the engine task; `metrics` is updated after every step.
pub fn spawn(
    config: SchedulerConfig,
    time_scale: f64,
    metrics: Arc<Mutex<MetricsState>>,
) -> EngineHandle {
    let (submissions, receiver) = mpsc::unbounded_channel();
    let engine = Engine {
        timing: config.timing,
        scheduler: Scheduler::new(config),
        clients: HashMap::new(),
        next_id: 0,
        time_scale,
        metrics,
    };
    tokio::spawn(engine.run(receiver));
    EngineHandle { submissions }
}

struct Engine {
    timing: StepTiming,
    scheduler: Scheduler,
    clients: HashMap<SeqId, Client>,
    next_id: SeqId,
    time_scale: f64,
    metrics: Arc<Mutex<MetricsState>>,
}

impl Engine {
    async fn run(mut self, mut submissions: mpsc::UnboundedReceiver<Submission>) {
        let mut deadline: Option<Instant> = None;
        let mut last_sweep = Instant::now();
        loop {
            if self.scheduler.is_idle() {
                self.publish(&Observations::default());
                match submissions.recv().await {
                    Some(s) => self.add(s),
                    None => return,
                }
                deadline = None;
            }
            while let Ok(s) = submissions.try_recv() {
                self.add(s);
            }
            if last_sweep.elapsed() >= SWEEP_EVERY {
                self.sweep();
                last_sweep = Instant::now();
            }

            let plan = self.scheduler.schedule();
            let now = Instant::now();
            if plan.is_empty() {
                // Nothing can compute (only stalled sequences, or none that fit): hand out what
                // finished outside a step, then wait for new work or the next sweep, not spin.
                let outputs = self.scheduler.complete(plan);
                let observed = self.deliver(outputs, now);
                self.publish(&observed);
                if !self.scheduler.is_idle() {
                    match tokio::time::timeout(SWEEP_EVERY, submissions.recv()).await {
                        Ok(Some(s)) => self.add(s),
                        Ok(None) => return,
                        Err(_) => {}
                    }
                }
                deadline = None;
                continue;
            }
            self.mark_scheduled(&plan, now);
            let step = Duration::from_secs_f64(plan.duration_us / 1e6 / self.time_scale);
            let end = next_deadline(deadline, now, step);
            if end > now + MIN_SLEEP {
                tokio::time::sleep_until(end.into()).await;
            } else {
                tokio::task::yield_now().await;
            }
            deadline = Some(end);
            self.charge_shared_steps(&plan, now.elapsed());

            let outputs = self.scheduler.complete(plan);
            let observed = self.deliver(outputs, Instant::now());
            self.publish(&observed);
        }
    }

    /// Notes the start of the first step that computes each sequence of `plan` (starting `now`).
    fn mark_scheduled(&mut self, plan: &crate::scheduler::StepPlan, now: Instant) {
        for &(id, _) in &plan.work {
            if let Some(client) = self.clients.get_mut(&id) {
                client.scheduled.get_or_insert(now);
            }
        }
    }

    /// Shares out this step's wall time (`wall`) as the step model adds it up: every sequence
    /// still waiting for its first token that computed in it is charged with the decoding
    /// sequences' share and the other prompts' share; every sequence that decoded in it (one
    /// token, after its first) with the prompt tokens' share, all of them other sequences' (a
    /// decode is not a prompt token), as its decode stall.
    fn charge_shared_steps(&mut self, plan: &crate::scheduler::StepPlan, wall: Duration) {
        if plan.duration_us <= 0.0 {
            return;
        }
        let wall = wall.as_secs_f64();
        let share = |us: f64| wall * (us / plan.duration_us).clamp(0.0, 1.0);
        let decodes = share(self.timing.per_decode_seq_us * plan.decode_seqs as f64);
        let prefills = share(self.timing.per_prefill_token_us * f64::from(plan.prefill_tokens));
        for &(id, tokens) in &plan.work {
            let Some(client) = self.clients.get_mut(&id) else {
                continue;
            };
            if client.first_token.is_some() {
                // A decode computes one token; more is the recompute of a preempted sequence,
                // its own prompt, not a stall.
                if tokens == 1 {
                    client.decode_stall_s += prefills;
                }
                continue;
            }
            let others = plan.prefill_tokens.saturating_sub(tokens);
            client.decode_interference_s += decodes;
            client.shared_prefill_s += share(self.timing.per_prefill_token_us * f64::from(others));
        }
    }

    /// Sends each sequence its events, aborts those whose clients are gone, and times the tokens.
    fn deliver(&mut self, outputs: Vec<SeqOutput>, now: Instant) -> Observations {
        let mut observed = Observations::default();
        for output in outputs {
            let Some(client) = self.clients.get_mut(&output.id) else {
                continue;
            };
            let secs =
                |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
            if output.output_tokens > client.tokens {
                // A token was sampled in this step.
                if output.first_token {
                    observed.ttft.push(secs(client.arrival, now));
                    client.first_token = Some(now);
                } else if let Some(last) = client.last_token {
                    observed.inter_token.push(secs(last, now));
                }
                client.last_token = Some(now);
                client.tokens = output.output_tokens;
            }
            let mut delivered = true;
            if let Some(delta) = output.delta {
                delivered = client
                    .events
                    .send(SeqEvent::Token {
                        delta,
                        output_tokens: output.output_tokens,
                    })
                    .is_ok();
            }
            if let Some(mut finish) = output.finish {
                finish.engine_ttft_ms = client
                    .first_token
                    .map(|first| secs(client.arrival, first) * 1e3);
                finish.engine_split = match (client.scheduled, client.first_token) {
                    (Some(scheduled), Some(first)) => {
                        let to_first = secs(scheduled, first);
                        let interference = client.decode_interference_s.min(to_first);
                        let shared = client.shared_prefill_s.min(to_first - interference);
                        Some(EngineSplit {
                            queue_ms: secs(client.arrival, scheduled) * 1e3,
                            prefill_ms: (to_first - interference - shared) * 1e3,
                            shared_prefill_ms: shared * 1e3,
                            decode_interference_ms: interference * 1e3,
                        })
                    }
                    _ => None,
                };
                finish.engine_e2e_ms = client
                    .last_token
                    .map(|last| secs(client.arrival, last) * 1e3);
                finish.engine_decode_stall_ms = match (client.first_token, client.last_token) {
                    (Some(first), Some(last)) => {
                        Some(client.decode_stall_s.min(secs(first, last)) * 1e3)
                    }
                    _ => None,
                };
                observed.e2e.push(secs(client.arrival, now));
                if let (Some(scheduled), Some(first), Some(last)) =
                    (client.scheduled, client.first_token, client.last_token)
                {
                    observed.queue.push(secs(client.arrival, scheduled));
                    observed.prefill.push(secs(scheduled, first));
                    observed.decode.push(secs(first, last));
                    observed.inference.push(secs(scheduled, last));
                }
                let _ = client.events.send(SeqEvent::Finished(finish));
                self.clients.remove(&output.id);
            } else if !delivered {
                self.clients.remove(&output.id);
                self.scheduler.abort(output.id);
            }
        }
        observed
    }

    fn add(&mut self, submission: Submission) {
        let id = self.next_id;
        self.next_id += 1;
        self.scheduler.add(id, submission.spec);
        if submission.events.is_closed() {
            // Its client went away before the engine took it: aborted, as vLLM counts a request
            // aborted from its waiting queue (`finished_reason="abort"`).
            self.scheduler.abort(id);
            return;
        }
        self.clients.insert(
            id,
            Client {
                events: submission.events,
                arrival: submission.arrival,
                scheduled: None,
                first_token: None,
                last_token: None,
                tokens: 0,
                decode_interference_s: 0.0,
                shared_prefill_s: 0.0,
                decode_stall_s: 0.0,
            },
        );
    }

    /// Aborts sequences whose clients went away.
    fn sweep(&mut self) {
        let gone: Vec<SeqId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.clients.remove(&id);
            self.scheduler.abort(id);
        }
    }

    fn publish(&self, observed: &Observations) {
        let pool = self.scheduler.pool();
        let Ok(mut m) = self.metrics.lock() else {
            return;
        };
        m.running = self.scheduler.num_running();
        m.waiting = self.scheduler.num_waiting();
        m.stalled = self.scheduler.num_stalled();
        m.kv_usage = pool.usage();
        m.cached_blocks = pool.num_cached();
        m.evictions = pool.evictions();
        m.stats = self.scheduler.stats().clone();
        m.record(observed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::StepPlan;

    #[test]
    fn deadlines_run_back_to_back_so_short_steps_keep_their_average_rate() {
        let t0 = Instant::now();
        let step = Duration::from_micros(100);
        let mut deadline = None;
        let mut now = t0;
        for i in 0..10 {
            let end = next_deadline(deadline, now, step);
            assert_eq!(end, t0 + step * (i + 1));
            deadline = Some(end);
            // The timer wakes late by up to 1 ms; the next deadline still follows the previous one.
            now = t0 + Duration::from_millis(1);
        }
    }

    #[test]
    fn a_lagging_engine_restarts_from_now() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_millis(50);
        let end = next_deadline(Some(t0), late, Duration::from_millis(2));
        assert_eq!(end, late + Duration::from_millis(2));
        assert_eq!(next_deadline(None, t0, Duration::ZERO), t0);
    }

    /// An engine that is not running, to be stepped by hand on a virtual clock.
    fn idle_engine(max_num_batched_tokens: u32) -> Engine {
        let config = SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens,
            num_blocks: 256,
            block_size: 4,
            max_model_len: 4096,
            spec_tokens: 0,
            timing: StepTiming {
                base_us: 1000.0,
                per_decode_seq_us: 100.0,
                per_prefill_token_us: 10.0,
            },
        };
        Engine {
            timing: config.timing,
            scheduler: Scheduler::new(config),
            clients: HashMap::new(),
            next_id: 0,
            time_scale: 1.0,
            metrics: Arc::new(Mutex::new(MetricsState::default())),
        }
    }

    /// Submits a streamed sequence of `prompt_tokens` tokens and `max_output_tokens` outputs
    /// arriving at `arrival`.
    fn submit(
        engine: &mut Engine,
        prompt_tokens: usize,
        max_output_tokens: u32,
        arrival: Instant,
    ) -> mpsc::UnboundedReceiver<SeqEvent> {
        let (events, receiver) = mpsc::unbounded_channel();
        let spec = SequenceSpec {
            prompt: vec![b'a' + engine.next_id as u8; 4 * prompt_tokens], // 4 bytes a token
            max_output_tokens,
            stream: true,
            ..SequenceSpec::default()
        };
        engine.add(Submission {
            spec,
            events,
            arrival,
        });
        receiver
    }

    /// Runs one step as [`Engine::run`] does, its wall time exactly its modelled duration, on the
    /// virtual clock `now`; returns the step's plan.
    fn step(engine: &mut Engine, now: &mut Instant) -> StepPlan {
        let plan = engine.scheduler.schedule();
        engine.mark_scheduled(&plan, *now);
        let wall = Duration::from_secs_f64(plan.duration_us / 1e6);
        *now += wall;
        engine.charge_shared_steps(&plan, wall);
        let outputs = engine.scheduler.complete(plan.clone());
        engine.deliver(outputs, *now);
        plan
    }

    fn finish_of(events: &mut mpsc::UnboundedReceiver<SeqEvent>) -> Finish {
        while let Ok(event) = events.try_recv() {
            if let SeqEvent::Finished(finish) = event {
                return finish;
            }
        }
        panic!("not finished");
    }

    #[test]
    fn a_decode_alone_has_no_stall_and_its_e2e_is_its_steps() {
        let mut engine = idle_engine(1024);
        let t0 = Instant::now();
        let mut now = t0;
        let mut events = submit(&mut engine, 20, 10, t0);
        let mut modelled_us = 0.0;
        while !engine.scheduler.is_idle() {
            modelled_us += step(&mut engine, &mut now).duration_us;
        }
        let f = finish_of(&mut events);
        assert_eq!(f.output_tokens, 10);
        assert_eq!(
            f.engine_decode_stall_ms,
            Some(0.0),
            "nothing else prefilled"
        );
        // 20 prompt tokens in one step, then 9 decode steps.
        assert!((modelled_us - (1000.0 + 200.0 + 9.0 * 1100.0)).abs() < 1e-6);
        let e2e = f.engine_e2e_ms.expect("e2e");
        assert!((e2e - modelled_us / 1e3).abs() < 1e-3, "{e2e} ms");
        assert!(e2e > f.engine_ttft_ms.expect("ttft"));
    }

    #[test]
    fn another_prompts_prefill_in_its_decode_steps_is_its_stall() {
        // Chunks of 128 tokens: a 400-token prompt arriving while the first sequence decodes
        // takes four steps, each of them also one of its decode steps.
        let mut engine = idle_engine(128);
        let t0 = Instant::now();
        let mut now = t0;
        let mut decoder = submit(&mut engine, 8, 12, t0);
        step(&mut engine, &mut now); // its prefill and first token
        let mut prompt = submit(&mut engine, 400, 1, now);
        let mut plans = Vec::new();
        while !engine.scheduler.is_idle() {
            plans.push(step(&mut engine, &mut now));
        }
        let carried: u32 = plans
            .iter()
            .filter(|p| p.decode_seqs == 1)
            .map(|p| p.prefill_tokens)
            .sum();
        assert_eq!(carried, 400, "the whole prompt shared its decode steps");
        let d = finish_of(&mut decoder);
        let stall = d.engine_decode_stall_ms.expect("stall");
        // The prompt's modelled prefill time: 400 tokens x 10 us.
        assert!((stall - 4.0).abs() < 1e-3, "{stall} ms");
        let e2e = d.engine_e2e_ms.expect("e2e");
        assert!(e2e > stall + d.engine_ttft_ms.expect("ttft"), "{e2e} ms");
        // The prompt itself produced one token and never decoded: no stall, e2e = its TTFT.
        let p = finish_of(&mut prompt);
        assert_eq!(p.engine_decode_stall_ms, Some(0.0));
        assert_eq!(p.engine_e2e_ms, p.engine_ttft_ms);
    }

    #[tokio::test]
    async fn streams_tokens_and_finishes_through_channels() {
        let metrics = Arc::new(Mutex::new(MetricsState::default()));
        let config = SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 512,
            num_blocks: 64,
            block_size: 4,
            max_model_len: 1024,
            spec_tokens: 0,
            timing: crate::scheduler::StepTiming {
                base_us: 100.0,
                per_decode_seq_us: 0.0,
                per_prefill_token_us: 1.0,
            },
        };
        let engine = spawn(config, 1.0, metrics.clone());
        let spec = SequenceSpec {
            prompt: b"hello world".to_vec(),
            max_output_tokens: 3,
            stream: true,
            ..SequenceSpec::default()
        };
        let mut rx = engine.submit(spec, Instant::now()).unwrap();
        let mut tokens = 0;
        let finish = loop {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
                Ok(Some(SeqEvent::Token { .. })) => tokens += 1,
                Ok(Some(SeqEvent::Finished(f))) => break f,
                other => panic!("unexpected {other:?}"),
            }
        };
        assert_eq!(tokens, 2);
        assert_eq!(finish.output_tokens, 3);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let m = metrics.lock().unwrap();
        assert_eq!(m.stats.generation_tokens, 3);
        assert_eq!(m.ttft.count(), 1);
        assert_eq!(m.running, 0);
    }
}
