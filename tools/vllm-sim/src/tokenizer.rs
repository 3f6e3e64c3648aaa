//! The sim's tokenizer approximation, shared by prompts and generated text.
//!
//! Real tokenizers average a little under 4 bytes of English per token, so the sim counts **one token
//! per 4 bytes of UTF-8, rounded up** (`ceil(bytes / 4)`). The gateway estimates tokens the same way,
//! which makes its estimates and the sim's `usage` agree exactly. Generated text is drawn from a fixed
//! vocabulary of 4-byte ASCII pieces (a space and a three-letter word), so every output token is exactly
//! 4 bytes and a reply re-sent as history costs the same number of tokens it was generated with.
//! Prompts given as token ids (`/v1/completions` with a list of integers) become 4 bytes per id
//! (little-endian), so they too count one token per id.

/// Bytes that make one token.
pub const BYTES_PER_TOKEN: usize = 4;

/// The pieces generated text is made of; each is exactly [`BYTES_PER_TOKEN`] bytes of ASCII.
pub const VOCABULARY: [&str; 64] = [
    " the", " and", " for", " are", " but", " not", " you", " all", " any", " can", " had", " her",
    " was", " one", " our", " out", " day", " get", " has", " him", " his", " how", " man", " new",
    " now", " old", " see", " two", " way", " who", " boy", " did", " its", " let", " put", " say",
    " she", " too", " use", " map", " key", " run", " log", " far", " big", " sky", " sea", " sun",
    " red", " top", " end", " set", " air", " art", " box", " car", " cat", " dog", " eye", " fox",
    " hat", " ice", " job", " joy",
];

/// Number of tokens in `bytes` bytes of text: `ceil(bytes / 4)`.
pub fn count_tokens(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(BYTES_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// The text of vocabulary piece `index` (taken modulo the vocabulary size).
pub fn piece(index: u64) -> &'static str {
    VOCABULARY[(index % VOCABULARY.len() as u64) as usize]
}

/// Bytes standing for a prompt given as token ids: 4 little-endian bytes per id, so the prompt counts
/// exactly one token per id and equal id lists share prefix blocks.
pub fn token_ids_to_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_one_token_per_four_bytes_rounded_up() {
        assert_eq!(count_tokens(0), 0);
        assert_eq!(count_tokens(1), 1);
        assert_eq!(count_tokens(4), 1);
        assert_eq!(count_tokens(5), 2);
        assert_eq!(count_tokens(4000), 1000);
        // Multi-byte UTF-8 counts by bytes: "é" is 2 bytes.
        assert_eq!(count_tokens("ééé".len()), 2);
    }

    #[test]
    fn every_piece_is_one_token_of_ascii() {
        for p in VOCABULARY {
            assert_eq!(p.len(), BYTES_PER_TOKEN, "{p:?}");
            assert!(p.is_ascii());
            assert_eq!(count_tokens(p.len()), 1);
        }
        assert_eq!(piece(0), piece(64));
    }

    #[test]
    fn token_ids_count_one_token_each() {
        let bytes = token_ids_to_bytes(&[1, 2, 70000]);
        assert_eq!(bytes.len(), 12);
        assert_eq!(count_tokens(bytes.len()), 3);
        assert_eq!(&bytes[8..], &70000u32.to_le_bytes());
    }
}
