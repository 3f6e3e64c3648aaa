//! A sequence's output text and its `stop` strings, like vLLM's detokenizer and stop checker.
//!
//! Text grows one piece per token. When a stop string appears, the text is cut just before it and the
//! sequence finishes with `finish_reason: "stop"` and `stop_reason` set to that string. While streaming,
//! the last `longest stop string - 1` bytes are held back, as vLLM does, so a client never receives the
//! beginning of a stop string that the next token completes.

/// Output text of one sequence plus what has already been streamed.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    text: String,
    sent: usize,
    stops: Vec<String>,
    hold_back: usize,
}

impl StopChecker {
    /// A checker for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let hold_back = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        StopChecker {
            text: String::new(),
            sent: 0,
            stops,
            hold_back,
        }
    }

    /// Appends a piece; when `check_stops` and a stop string now appears in the unsent text, cuts the
    /// text before it and returns the stop string.
    pub fn push(&mut self, piece: &str, check_stops: bool) -> Option<String> {
        self.text.push_str(piece);
        if !check_stops || self.stops.is_empty() {
            return None;
        }
        let unsent = &self.text[self.sent..];
        let (at, stop) = self
            .stops
            .iter()
            .filter_map(|s| unsent.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)?;
        let stop = stop.clone();
        let cut = self.sent + at;
        self.text.truncate(cut);
        Some(stop)
    }

    /// The text that can be streamed now: everything unsent except the held-back tail.
    pub fn take_delta(&mut self) -> String {
        let mut end = self
            .text
            .len()
            .saturating_sub(self.hold_back)
            .max(self.sent);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let delta = self.text[self.sent..end].to_string();
        self.sent = end;
        delta
    }

    /// Everything not yet streamed (at the end of the sequence).
    pub fn take_rest(&mut self) -> String {
        let rest = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_stops_every_piece_streams_at_once() {
        let mut c = StopChecker::new(vec![]);
        assert_eq!(c.push(" the", true), None);
        assert_eq!(c.take_delta(), " the");
        c.push(" cat", true);
        assert_eq!(c.take_delta(), " cat");
        assert_eq!(c.take_rest(), "");
    }

    #[test]
    fn cuts_before_a_stop_spanning_pieces_and_never_streams_its_start() {
        let mut c = StopChecker::new(vec!["e c".into()]);
        assert_eq!(c.push(" the", true), None);
        let first = c.take_delta();
        assert_eq!(first, " t"); // "he" held back: up to 2 bytes may start the 3-byte stop string.
        assert_eq!(c.push(" cat", true), Some("e c".to_string()));
        assert_eq!(format!("{first}{}", c.take_rest()), " th");
    }

    #[test]
    fn earliest_stop_wins_and_min_tokens_defers_checks() {
        let mut c = StopChecker::new(vec!["cat".into(), "the".into()]);
        assert_eq!(c.push(" the", false), None);
        assert_eq!(c.push(" cat", true), Some("the".to_string()));
        assert_eq!(c.take_rest(), " ");
    }

    #[test]
    fn non_streamed_text_is_returned_whole() {
        let mut c = StopChecker::new(vec!["zzz".into()]);
        c.push(" the", true);
        c.push(" dog", true);
        assert_eq!(c.take_rest(), " the dog");
    }
}
