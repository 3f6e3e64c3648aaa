//! The compact wire form of a prompt's prefix-block hashes: little-endian `u64`s, base64 in JSON
//! (how [`crate::request::prompt::RequestFeatures`] travels from the Worker to the pool).
//!
//! A 16k-token prompt has about a thousand block hashes; as decimal JSON numbers they take about
//! 20 bytes each and cost a number parse apiece in the Durable Object. As eight raw bytes in
//! base64 they take 10.7 characters each and decode with a table lookup per character. Use it as
//! `#[serde(with = "routing_core::request::block_hash_encoding")]` on a `Vec<u64>` field.

use serde::{Deserialize, Deserializer, Serializer};

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const INVALID: u8 = 0xff;

/// Which 6-bit value each byte stands for ([`INVALID`] for bytes outside the alphabet).
const DECODE: [u8; 256] = {
    let mut table = [INVALID; 256];
    let mut i = 0;
    while i < 64 {
        table[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    table
};

/// Encodes hashes as base64 (no padding) of their little-endian bytes.
pub fn encode(hashes: &[u64]) -> String {
    let mut bytes = Vec::with_capacity(hashes.len() * 8);
    for h in hashes {
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// Decodes [`encode`]'s output; `None` for anything else (bad characters, or a length that is not
/// a whole number of hashes).
pub fn decode(text: &str) -> Option<Vec<u64>> {
    let text = text.as_bytes();
    let bytes_len = text.len() * 6 / 8;
    if !bytes_len.is_multiple_of(8) || text.len() % 4 == 1 {
        return None;
    }
    let mut hashes = Vec::with_capacity(bytes_len / 8);
    // 32 characters are 24 bytes, three whole hashes: the bulk decodes without a byte buffer.
    let mut groups = text.chunks_exact(32);
    for group in &mut groups {
        let mut bytes = [0u8; 24];
        let mut invalid = 0;
        for (quad, out) in group.chunks_exact(4).zip(bytes.chunks_exact_mut(3)) {
            let (n, bad) = sextets(quad);
            invalid |= bad;
            out.copy_from_slice(&n.to_be_bytes()[1..]);
        }
        if invalid == INVALID {
            return None;
        }
        for h in bytes.chunks_exact(8) {
            hashes.push(u64::from_le_bytes(h.try_into().unwrap_or_default()));
        }
    }
    let rest = groups.remainder();
    let mut bytes = Vec::with_capacity(16);
    for quad in rest.chunks(4) {
        let (n, bad) = sextets(quad);
        if bad == INVALID {
            return None;
        }
        bytes.extend_from_slice(&n.to_be_bytes()[1..quad.len()]);
    }
    for h in bytes.chunks_exact(8) {
        hashes.push(u64::from_le_bytes(h.try_into().unwrap_or_default()));
    }
    Some(hashes)
}

/// Up to four characters as 24 bits (missing ones as zeros), and [`INVALID`] if any character is
/// outside the alphabet (0 otherwise).
fn sextets(quad: &[u8]) -> (u32, u8) {
    let mut n = 0u32;
    let mut bad = 0u8;
    for (i, c) in quad.iter().enumerate() {
        let v = DECODE[*c as usize];
        bad |= v & 0x80;
        n |= u32::from(v & 63) << (18 - 6 * i);
    }
    (n, if bad != 0 { INVALID } else { 0 })
}

/// Serde: writes the hashes as one base64 string.
pub fn serialize<S: Serializer>(hashes: &[u64], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(hashes))
}

/// Serde: reads the hashes from one base64 string (a missing field is an empty list when the
/// field has `#[serde(default)]`).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    decode(&text).ok_or_else(|| {
        serde::de::Error::custom("block_hashes must be base64 of little-endian 64-bit hashes")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_length() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in 0usize..40 {
            let hashes: Vec<u64> = (0..n)
                .map(|_| {
                    x = x.rotate_left(17).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    x
                })
                .collect();
            let text = encode(&hashes);
            assert_eq!(text.len(), (n * 8 * 4).div_ceil(3));
            assert_eq!(decode(&text), Some(hashes));
        }
    }

    #[test]
    fn refuses_a_bad_character_anywhere() {
        let text = encode(&[1, 2, 3, 4, 5, 6, 7]);
        for i in 0..text.len() {
            let mut bad = text.clone().into_bytes();
            bad[i] = b'!';
            assert_eq!(decode(std::str::from_utf8(&bad).unwrap()), None, "at {i}");
        }
    }

    #[test]
    fn known_value() {
        // 1 as little-endian bytes: 01 00 00 00 00 00 00 00.
        assert_eq!(encode(&[1]), "AQAAAAAAAAA");
        assert_eq!(decode("AQAAAAAAAAA"), Some(vec![1]));
        assert_eq!(encode(&[u64::MAX]), "//////////8");
    }

    #[test]
    fn refuses_what_it_did_not_write() {
        assert_eq!(decode("AQAAAAAAAA"), None, "seven bytes");
        assert_eq!(decode("AQAAAAAAAA!"), None, "bad character");
        assert_eq!(decode("A"), None);
        assert_eq!(decode(""), Some(vec![]));
    }
}
