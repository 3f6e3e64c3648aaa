// The Worker <-> pool Durable Object wire format, as the overhead benchmark speaks it: the ONE place
// to update when the protocol changes (block hashes are to become a compact binary encoding).
// Plain JavaScript with no Node imports: it runs both in Node and inside workerd (bench/do-driver.mjs).
//
// As of 2026-12-01 (protocol/src/acquire.rs, protocol/src/messages.rs): POST /acquire takes
// {"features": routing_core::request::prompt::RequestFeatures} as JSON, the block hashes as base64 (no
// padding) of little-endian u64s (routing_core::request::block_hash_encoding), and answers a
// routing_core::pool::Grant as JSON; POST /release takes a ReleaseRequest and answers
// {"released": bool}. A call by fetch carries the pool's name in the `x-gateway-pool` header; a call
// by RPC (`gatewayCall(method, url, pool, shard, body)`, protocol/src/call.rs) passes it as an
// argument and gets `[status, body, retry-after]` back.

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** Block hashes as the pool reads them: base64 without padding of their little-endian bytes. */
function encodeHashes(hashes) {
  let bytes;
  if (hashes instanceof BigUint64Array && LITTLE_ENDIAN) {
    // Already the bytes to send: no BigInt per hash (that loop cost the in-workerd driver about
    // 65 us of the object's thread per 1,024 hashes, counted in the object's pairs/s).
    bytes = new Uint8Array(hashes.buffer, hashes.byteOffset, hashes.byteLength);
  } else {
    bytes = new Uint8Array(hashes.length * 8);
    const view = new DataView(bytes.buffer);
    for (let i = 0; i < hashes.length; i++) {
      view.setBigUint64(i * 8, BigInt.asUintN(64, BigInt(hashes[i])), true);
    }
  }
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary).replace(/=+$/, "");
}

/** Tokens per prefix block (the pool's default `block_tokens`). */
export const BLOCK_TOKENS = 16;

export const PROTOCOL = {
  poolHeader: "x-gateway-pool",
  /** The pool coordinator's RPC method (coordinator_protocol::call::RPC_METHOD). */
  rpcMethod: "gatewayCall",
  acquirePath: "/acquire",
  releasePath: "/release",
  /**
   * Request init for POST /acquire of features `f`:
   * { request_id, model, prompt_tokens, max_tokens, block_hashes: BigUint64Array }.
   */
  acquire(f) {
    const body =
      `{"features":{"request_id":"${f.request_id}","kind":"chat","model":${JSON.stringify(f.model)},"stream":true,` +
      `"prompt_tokens":${f.prompt_tokens},"max_tokens":${f.max_tokens},"routing_key":null,` +
      `"block_tokens":${BLOCK_TOKENS},"block_hashes":"${encodeHashes(f.block_hashes)}","role_hint":null}}`;
    return { method: "POST", headers: { "content-type": "application/json" }, body };
  },
  /** The lease in a granted (200) acquire's response. */
  async grant(resp) {
    const g = await resp.json();
    return { lease_id: g.lease_id, backend: g.backend, cached_blocks: g.cached_blocks };
  },
  /** Request init for POST /release of grant `g` of request `f`, ended successfully. */
  release(g, f) {
    const cached = Math.min(f.prompt_tokens, g.cached_blocks * BLOCK_TOKENS);
    const body =
      `{"lease_id":${g.lease_id},"outcome":{"status":200,"kind":"success","ttfb_ms":20,` +
      `"prompt_tokens":${f.prompt_tokens},"cached_tokens":${cached},"completion_tokens":${f.max_tokens}},` +
      `"backend":${JSON.stringify(g.backend)}}`;
    return { method: "POST", headers: { "content-type": "application/json" }, body };
  },
  /** Whether a release's response says the lease was released. */
  async released(resp) {
    return resp.status === 200 && (await resp.json()).released === true;
  },
};
