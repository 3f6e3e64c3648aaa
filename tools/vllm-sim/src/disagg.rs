//! Prefill/decode disaggregation through `kv_transfer_params`, shaped like vLLM's NixlConnector.
//!
//! A proxy sends a request with `"kv_transfer_params": {"do_remote_decode": true}` to a prefill
//! server (`--role prefill` or `mixed`). That server prefills, generates one token (the proxy's
//! `max_tokens: 1`; the sim forces it) and answers with top-level `kv_transfer_params`:
//! `do_remote_prefill: true`, `remote_engine_id`, `remote_block_ids` (its blocks holding the prompt),
//! `remote_host`, `remote_port`, `tp_size`, plus two sim fields: `sim_expires_at_ms` (unix ms) and
//! `sim_tag`. The proxy forwards those params with the original request to a decode server
//! (`--role decode` or `mixed`), which skips the prompt's prefill (only the last prompt token is
//! computed locally) and caches the received blocks.
//!
//! A decode server cannot see the prefill server's memory, so the params verify themselves: `sim_tag`
//! is an xxh3-128 keyed hash (HMAC-like, not cryptographic) of the shared `--kv-transfer-secret`, the
//! engine id, host, port, expiry, block ids and a digest of the prompt bytes. As vLLM 0.34 (whose
//! decode servers never answer 400 for transfer parameters), params that carry no tag, whose tag
//! does not match (never issued with this secret, or for another prompt), or whose expiry
//! (`--kv-transfer-ttl-s` after issue, wall-clock; 30 s, NIXL's `kv_lease_duration` default in
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py`) has passed fail the
//! request inside its stream ([`TransferError::fails_the_load`]); params that are incomplete,
//! contradictory or for the other role are ignored and the prompt is computed locally. Unlike
//! vLLM, the prefill server does not pin the blocks until the decode side reads them (reading is
//! instantaneous here); they stay in its prefix cache like any finished request's blocks.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::config::Role;
use crate::kv_cache::BlockId;

/// `kv_transfer_params` as a request carries them (vLLM's fields plus the sim's tag and expiry).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default)]
pub struct KvTransferParams {
    /// Asks this (prefill) server to hand the KV to a remote decode.
    pub do_remote_decode: bool,
    /// Says the KV was computed remotely (decode server).
    pub do_remote_prefill: bool,
    /// The prefill engine.
    pub remote_engine_id: Option<String>,
    /// The prefill engine's blocks holding the prompt.
    pub remote_block_ids: Option<Vec<BlockId>>,
    /// Where the prefill engine is.
    pub remote_host: Option<String>,
    /// See `remote_host`.
    pub remote_port: Option<u16>,
    /// Tensor parallelism of the prefill engine.
    pub tp_size: Option<u32>,
    /// Expiry of the params, unix milliseconds (sim only).
    pub sim_expires_at_ms: Option<u64>,
    /// Keyed hash proving the params were issued for this prompt (sim only).
    pub sim_tag: Option<String>,
}

/// What a request's `kv_transfer_params` ask of this server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvIntent {
    /// No disaggregation: serve normally.
    Local,
    /// Prefill and hand the KV off to a remote decode.
    HandOff,
    /// The prompt's KV was computed by a prefill server: skip the prefill.
    RemotePrefill,
}

/// Why `kv_transfer_params` were rejected (400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferError {
    /// Both `do_remote_decode` and `do_remote_prefill`.
    Contradictory,
    /// The request asks for a role this server does not have.
    WrongRole(&'static str),
    /// A field needed to verify the params is missing.
    Missing(&'static str),
    /// The params were not issued for this prompt with this secret.
    NotIssued,
    /// The params' expiry has passed.
    Expired,
}

impl TransferError {
    /// Whether the error is a failed KV load (expired, or params no prefill server issued for
    /// this prompt): vLLM 0.34's default `kv_load_failure_policy: "fail"`
    /// (`vllm/config/kv_transfer.py`) ends the request with `finish_reason: "error"`, i.e. an
    /// error event inside the stream. Other errors (contradictory, incomplete, for the other
    /// role) are not failures: the request is served with its prompt computed locally.
    pub fn fails_the_load(&self) -> bool {
        matches!(self, TransferError::NotIssued | TransferError::Expired)
    }
}

impl std::fmt::Display for TransferError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransferError::Contradictory => {
                f.write_str("kv_transfer_params cannot set both do_remote_decode and do_remote_prefill")
            }
            TransferError::WrongRole(msg) => f.write_str(msg),
            TransferError::Missing(field) => {
                write!(f, "kv_transfer_params.{field} is required with do_remote_prefill")
            }
            TransferError::NotIssued => f.write_str(
                "kv_transfer_params were not issued by a prefill server for this prompt (unknown engine, blocks or tag)",
            ),
            TransferError::Expired => f.write_str("kv_transfer_params have expired"),
        }
    }
}

/// This server's identity and secret for issuing and verifying params.
#[derive(Debug, Clone)]
pub struct TransferAuthority {
    /// Shared by every server of a deployment (`--kv-transfer-secret`).
    pub secret: String,
    /// This engine's id.
    pub engine_id: String,
    /// Advertised host.
    pub host: String,
    /// Advertised port.
    pub port: u16,
    /// How long issued params stay valid, in milliseconds.
    pub ttl_ms: u64,
    /// This server's role.
    pub role: Role,
}

/// Digest of a prompt, bound into the tag so params only work for the prompt they were issued for.
pub fn prompt_digest(prompt: &[u8]) -> u64 {
    xxh3_64(prompt)
}

impl TransferAuthority {
    /// Classifies a request's params for this server's role, verifying remote-prefill params.
    pub fn classify(
        &self,
        params: Option<&KvTransferParams>,
        prompt_digest: u64,
        now_ms: u64,
    ) -> Result<KvIntent, TransferError> {
        let Some(p) = params else {
            return Ok(KvIntent::Local);
        };
        match (p.do_remote_decode, p.do_remote_prefill) {
            (false, false) => Ok(KvIntent::Local),
            (true, true) => Err(TransferError::Contradictory),
            (true, false) => {
                if self.role == Role::Decode {
                    return Err(TransferError::WrongRole(
                        "this server is a decode instance (--role decode) and cannot prefill for a remote decode",
                    ));
                }
                Ok(KvIntent::HandOff)
            }
            (false, true) => {
                if self.role == Role::Prefill {
                    return Err(TransferError::WrongRole(
                        "this server is a prefill instance (--role prefill) and cannot decode remote KV",
                    ));
                }
                self.verify(p, prompt_digest, now_ms)?;
                Ok(KvIntent::RemotePrefill)
            }
        }
    }

    /// The params a prefill server returns for `block_ids` of a prompt with `prompt_digest`.
    pub fn issue(
        &self,
        block_ids: Vec<BlockId>,
        prompt_digest: u64,
        now_ms: u64,
    ) -> KvTransferParams {
        let expires = now_ms.saturating_add(self.ttl_ms);
        let tag = tag(
            &self.secret,
            &self.engine_id,
            &self.host,
            self.port,
            expires,
            prompt_digest,
            &block_ids,
        );
        KvTransferParams {
            do_remote_decode: false,
            do_remote_prefill: true,
            remote_engine_id: Some(self.engine_id.clone()),
            remote_block_ids: Some(block_ids),
            remote_host: Some(self.host.clone()),
            remote_port: Some(self.port),
            tp_size: Some(1),
            sim_expires_at_ms: Some(expires),
            sim_tag: Some(tag),
        }
    }

    fn verify(
        &self,
        p: &KvTransferParams,
        prompt_digest: u64,
        now_ms: u64,
    ) -> Result<(), TransferError> {
        let engine = p
            .remote_engine_id
            .as_deref()
            .ok_or(TransferError::Missing("remote_engine_id"))?;
        let blocks = p
            .remote_block_ids
            .as_deref()
            .ok_or(TransferError::Missing("remote_block_ids"))?;
        let host = p
            .remote_host
            .as_deref()
            .ok_or(TransferError::Missing("remote_host"))?;
        let port = p.remote_port.ok_or(TransferError::Missing("remote_port"))?;
        let expires = p.sim_expires_at_ms.ok_or(TransferError::NotIssued)?;
        let given = p.sim_tag.as_deref().ok_or(TransferError::NotIssued)?;
        let expected = tag(
            &self.secret,
            engine,
            host,
            port,
            expires,
            prompt_digest,
            blocks,
        );
        if given != expected {
            return Err(TransferError::NotIssued);
        }
        if now_ms > expires {
            return Err(TransferError::Expired);
        }
        Ok(())
    }
}

/// The keyed hash over everything the params assert, as 32 hex digits.
fn tag(
    secret: &str,
    engine_id: &str,
    host: &str,
    port: u16,
    expires_ms: u64,
    prompt_digest: u64,
    blocks: &[BlockId],
) -> String {
    let mut h = Xxh3::new();
    for field in [secret, engine_id, host] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.update(&port.to_le_bytes());
    h.update(&expires_ms.to_le_bytes());
    h.update(&prompt_digest.to_le_bytes());
    h.update(&(blocks.len() as u64).to_le_bytes());
    for b in blocks {
        h.update(&b.to_le_bytes());
    }
    format!("{:032x}", h.digest128())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn authority(role: Role, secret: &str) -> TransferAuthority {
        TransferAuthority {
            secret: secret.into(),
            engine_id: "engine-a".into(),
            host: "127.0.0.1".into(),
            port: 8101,
            ttl_ms: 1000,
            role,
        }
    }

    fn remote_decode() -> KvTransferParams {
        KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        }
    }

    #[test]
    fn issued_params_verify_on_a_decode_server_with_the_same_secret() {
        let prefill = authority(Role::Prefill, "s");
        let decode = authority(Role::Decode, "s");
        assert_eq!(
            prefill.classify(Some(&remote_decode()), 1, 0),
            Ok(KvIntent::HandOff)
        );
        let params = prefill.issue(vec![3, 4, 5], 42, 10_000);
        assert!(params.do_remote_prefill);
        assert_eq!(
            decode.classify(Some(&params), 42, 10_500),
            Ok(KvIntent::RemotePrefill)
        );
        // Round-trips through JSON the way a proxy forwards them.
        let forwarded: KvTransferParams =
            serde_json::from_str(&serde_json::to_string(&params).unwrap()).unwrap();
        assert_eq!(
            decode.classify(Some(&forwarded), 42, 10_500),
            Ok(KvIntent::RemotePrefill)
        );
    }

    #[test]
    fn rejects_forged_foreign_expired_and_mismatched_params() {
        let prefill = authority(Role::Mixed, "s");
        let decode = authority(Role::Decode, "s");
        let params = prefill.issue(vec![1, 2], 42, 10_000);
        assert_eq!(
            decode.classify(Some(&params), 43, 10_001),
            Err(TransferError::NotIssued)
        );
        assert_eq!(
            decode.classify(Some(&params), 42, 11_001),
            Err(TransferError::Expired)
        );
        let mut forged = params.clone();
        forged.remote_block_ids = Some(vec![1, 3]);
        assert_eq!(
            decode.classify(Some(&forged), 42, 10_001),
            Err(TransferError::NotIssued)
        );
        let mut extended = params.clone();
        extended.sim_expires_at_ms = Some(99_999);
        assert_eq!(
            decode.classify(Some(&extended), 42, 10_001),
            Err(TransferError::NotIssued)
        );
        let other_secret = authority(Role::Decode, "t");
        assert_eq!(
            other_secret.classify(Some(&params), 42, 10_001),
            Err(TransferError::NotIssued)
        );
        let vllm_shaped = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("x".into()),
            remote_block_ids: Some(vec![1]),
            remote_host: Some("h".into()),
            remote_port: Some(1),
            ..Default::default()
        };
        assert_eq!(
            decode.classify(Some(&vllm_shaped), 42, 0),
            Err(TransferError::NotIssued)
        );
        let incomplete = KvTransferParams {
            do_remote_prefill: true,
            ..Default::default()
        };
        assert_eq!(
            decode.classify(Some(&incomplete), 42, 0),
            Err(TransferError::Missing("remote_engine_id"))
        );
    }

    #[test]
    fn roles_refuse_the_other_half() {
        let params = authority(Role::Mixed, "s").issue(vec![1], 7, 0);
        assert!(matches!(
            authority(Role::Prefill, "s").classify(Some(&params), 7, 0),
            Err(TransferError::WrongRole(_))
        ));
        assert!(matches!(
            authority(Role::Decode, "s").classify(Some(&remote_decode()), 7, 0),
            Err(TransferError::WrongRole(_))
        ));
        let both = KvTransferParams {
            do_remote_decode: true,
            do_remote_prefill: true,
            ..Default::default()
        };
        assert_eq!(
            authority(Role::Mixed, "s").classify(Some(&both), 7, 0),
            Err(TransferError::Contradictory)
        );
        assert_eq!(
            authority(Role::Decode, "s").classify(None, 7, 0),
            Ok(KvIntent::Local)
        );
    }
}
