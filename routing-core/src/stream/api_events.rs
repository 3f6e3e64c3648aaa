//! The error event that ends a Responses API or Anthropic Messages stream whose backend failed
//! after the first byte, in the shape each API's clients read: vLLM's Responses `error` event
//! (`type`, `code`, `message`, `param`, `sequence_number`) and Anthropic's `error` event
//! (`{"type":"error","error":{"type":"api_error","message"}}`). These streams are not resumed
//! (`Endpoint::is_generation`): their sequence numbers, item and message ids and opening events would
//! repeat in a continuation, so a failure ends them with this event. Chat and completions keep
//! the relay's OpenAI `data:` error event and `[DONE]`, as do the audio routes' streams; for them
//! this gives `None`.

use crate::request::endpoint::Endpoint;
use serde_json::json;

/// The final error event of a failed stream to `endpoint`, or `None` for the OpenAI shape.
pub fn error_event(endpoint: Endpoint, code: &str, message: &str) -> Option<String> {
    let data = match endpoint {
        Endpoint::Responses => json!({
            "type": "error",
            "code": code,
            "message": message,
            "param": null,
            "sequence_number": 0,
        }),
        Endpoint::Messages | Endpoint::MessagesCountTokens => json!({
            "type": "error",
            "error": {"type": "api_error", "message": format!("{message} ({code})")},
        }),
        // Chat, completions and the pass-through routes (audio streams) speak OpenAI's shape.
        _ => return None,
    };
    Some(format!("event: error\ndata: {data}\n\n"))
}

/// Whether a backend's 404 body is vLLM's answer for a `previous_response_id` (or response id) it
/// does not hold (`Response with id '...' not found.`, `param: response_id`): the client's error
/// to relay, not a backend without the endpoint.
pub fn is_response_not_found(body: &[u8]) -> bool {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let error = value.get("error").unwrap_or(&value);
    error.get("param").and_then(serde_json::Value::as_str) == Some("response_id")
        || error
            .get("message")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|m| m.starts_with("Response with id"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn data(event: &str) -> Value {
        let line = event.lines().nth(1).unwrap();
        serde_json::from_str(line.strip_prefix("data: ").unwrap()).unwrap()
    }

    #[test]
    fn each_api_gets_its_own_error_event() {
        assert_eq!(error_event(Endpoint::Chat, "c", "m"), None);
        let responses = error_event(Endpoint::Responses, "upstream_stream_error", "cut").unwrap();
        assert!(responses.starts_with("event: error\n") && responses.ends_with("\n\n"));
        assert_eq!(data(&responses)["code"], "upstream_stream_error");
        let messages = error_event(Endpoint::Messages, "upstream_stream_error", "cut").unwrap();
        assert_eq!(data(&messages)["error"]["type"], "api_error");
        assert_eq!(data(&messages)["type"], "error");
    }

    #[test]
    fn vllms_unknown_response_404_is_recognised() {
        let body = br#"{"error":{"message":"Response with id 'resp_x' not found.","type":"invalid_request_error","param":"response_id","code":404}}"#;
        assert!(is_response_not_found(body));
        assert!(!is_response_not_found(br#"{"detail":"Not Found"}"#));
        assert!(!is_response_not_found(b"<html>"));
    }
}
