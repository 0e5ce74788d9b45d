//! Key names and value framing on the server.
//!
//! A block's key is `<prefix>:<tenant tag hex>:{<group>}:<block id hex>`,
//! where `group` is the first 16 hex digits of the id of the chain's block at
//! index `i - i % GROUP` ([`GROUP`] consecutive blocks share one hash tag, so
//! one slot and one pipeline; different chains spread over the cluster). A
//! session's key is `<prefix>:<tenant tag hex>:session:<blake3(name) hex>`.
//!
//! A value is a payload (a block's record exactly as in a segment, or a
//! session's frame) followed by a 32-byte MAC: BLAKE3 keyed by a key derived
//! from the store's keyer (model fingerprint, layout and salt) over the key
//! name and the payload. With a salt, nobody without it can forge a value;
//! without one it still binds the value to its key, model and layout.

use crate::id::{hex, BlockId};

/// Consecutive blocks of a chain that share one hash tag.
pub(crate) const GROUP: usize = 16;
/// Bytes of the MAC after each value's payload.
pub(crate) const MAC_LEN: usize = 32;
/// The longest session value sent or read (about 16M token ids): a read
/// takes no more than this from the server, whatever a key holds.
pub(crate) const SESSION_VALUE_MAX: usize = 64 << 20;
/// A versioned session frame.
const SESSION_MAGIC: &[u8; 4] = b"KVSV";
/// A session frame of the older format: tokens only (version 0).
const SESSION_MAGIC_V0: &[u8; 4] = b"KVSS";

/// Names keys for one tenant under one prefix and seals values.
#[derive(Clone)]
pub(crate) struct Keys {
    base: String,
    mac_key: [u8; 32],
}

impl Keys {
    pub(crate) fn new(prefix: &str, tag: &[u8; 16], mac_key: [u8; 32]) -> Keys {
        Keys {
            base: format!("{prefix}:{}", hex(tag)),
            mac_key,
        }
    }

    /// The key of block `ids[index]`.
    pub(crate) fn block(&self, ids: &[BlockId], index: usize) -> String {
        self.block_under(&ids[index - index % GROUP], &ids[index])
    }

    /// The key of block `id` whose group starts at block `head` of its chain.
    pub(crate) fn block_under(&self, head: &BlockId, id: &BlockId) -> String {
        format!("{}:{{{}}}:{}", self.base, hex(&head[..8]), hex(id))
    }

    /// The key of a session.
    pub(crate) fn session(&self, name: &str) -> String {
        format!(
            "{}:session:{}",
            self.base,
            blake3::hash(name.as_bytes()).to_hex()
        )
    }

    fn mac(&self, key: &str, payload: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        h.update(payload);
        h.finalize()
    }

    /// `payload` + its MAC under `key`.
    pub(crate) fn seal(&self, key: &str, mut payload: Vec<u8>) -> Vec<u8> {
        let mac = self.mac(key, &payload);
        payload.extend_from_slice(mac.as_bytes());
        payload
    }

    /// The payload of a value read under `key`, if its MAC is right.
    pub(crate) fn open<'v>(&self, key: &str, value: &'v [u8]) -> Option<&'v [u8]> {
        let cut = value.len().checked_sub(MAC_LEN)?;
        let (payload, mac) = value.split_at(cut);
        // blake3::Hash compares in constant time.
        (self.mac(key, payload) == blake3::Hash::from_bytes(mac.try_into().ok()?))
            .then_some(payload)
    }
}

/// A session's state as a frame on the server says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SessionFrame {
    /// The save's or delete's version (see `store::session`); 0 for a frame
    /// of the older, unversioned format.
    pub(crate) version: u64,
    /// The tokens; `None`: deleted at `version` (a tombstone).
    pub(crate) tokens: Option<Vec<u32>>,
}

/// A session's payload: magic `KVSV`, version (u64 LE), state (1 live, 0
/// deleted), name length (u32 LE), name, token count (u32 LE; 0 for a
/// deletion), tokens (u32 LE each).
///
/// The older format (magic `KVSS`, no version or state) still reads, as
/// version 0; binaries that wrote it read this one as an invalid value
/// (a miss: they use their local copy).
pub(crate) fn encode_session(name: &str, version: u64, tokens: Option<&[u32]>) -> Vec<u8> {
    let body = tokens.unwrap_or_default();
    let mut v = Vec::with_capacity(21 + name.len() + 4 * body.len());
    v.extend_from_slice(SESSION_MAGIC);
    v.extend_from_slice(&version.to_le_bytes());
    v.push(u8::from(tokens.is_some()));
    v.extend_from_slice(&(name.len() as u32).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    for t in body {
        v.extend_from_slice(&t.to_le_bytes());
    }
    v
}

/// Bytes of a session payload that hold its version (magic and version):
/// what is read of the server's copy before deciding whether to read it all.
pub(crate) const SESSION_HEAD: usize = 12;

/// The version a payload's first [`SESSION_HEAD`] bytes name; 0 for the
/// older format, `None` if they are not a session's. Unchecked: only a
/// cheap "may be newer" before the whole value is read and checked.
pub(crate) fn session_head_version(head: &[u8]) -> Option<u64> {
    match head.get(..4)? {
        m if m == SESSION_MAGIC => Some(u64::from_le_bytes(head.get(4..12)?.try_into().ok()?)),
        m if m == SESSION_MAGIC_V0 => Some(0),
        _ => None,
    }
}

/// The version of a whole session payload (either format, any name), if it
/// is one.
pub(crate) fn session_version(p: &[u8]) -> Option<u64> {
    parse_session(p).map(|(_, f)| f.version)
}

/// Session `name`'s frame from its payload (either format); `None` if it
/// is not one.
pub(crate) fn decode_session(name: &str, p: &[u8]) -> Option<SessionFrame> {
    let (n, frame) = parse_session(p)?;
    (n == name.as_bytes()).then_some(frame)
}

/// A session payload's name and frame.
fn parse_session(p: &[u8]) -> Option<(&[u8], SessionFrame)> {
    let version = session_head_version(p)?;
    let (live, rest) = if p.get(..4)? == SESSION_MAGIC {
        let live = match *p.get(12)? {
            0 => false,
            1 => true,
            _ => return None,
        };
        (live, &p[13..])
    } else {
        (true, &p[4..])
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(rest.get(at..at + 4)?.try_into().ok()?))
    };
    let n = u32_at(0)? as usize;
    let name = rest.get(4..4 + n)?;
    let count = u32_at(4 + n)? as usize;
    let body = rest.get(8 + n..)?;
    if body.len() != count.checked_mul(4)? || (!live && count != 0) {
        return None;
    }
    let tokens = body
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Some((
        name,
        SessionFrame {
            version,
            tokens: live.then_some(tokens),
        },
    ))
}

/// The cluster slot of a key: CRC16 (XMODEM) of its hash tag, mod 16384.
/// (Only the client, of the `remote` feature, asks; the tests check it always.)
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % 16384
}

#[cfg_attr(not(feature = "remote"), allow(dead_code))]
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), slot(b"foo{}{bar}"));
        assert_eq!(slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
    }

    #[test]
    fn keys_group_chains_and_values_are_sealed() {
        let ids: Vec<BlockId> = (0..40u8).map(|i| [i; 32]).collect();
        let k = Keys::new("kv", &[7; 16], [1; 32]);
        let slots: Vec<u16> = (0..40).map(|i| slot(k.block(&ids, i).as_bytes())).collect();
        assert!(slots[..16].iter().all(|&s| s == slots[0]));
        assert!(slots[16..32].iter().all(|&s| s == slots[16]));
        assert_ne!(slots[0], slots[16]);
        let key = k.block(&ids, 3);
        assert!(key.starts_with("kv:07070707070707070707070707070707:{0000000000000000}:0303"));
        let v = k.seal(&key, b"record".to_vec());
        assert_eq!(k.open(&key, &v), Some(&b"record"[..]));
        assert_eq!(k.open(&k.block(&ids, 4), &v), None, "another key");
        let other = Keys::new("kv", &[7; 16], [2; 32]);
        assert_eq!(other.open(&key, &v), None, "another MAC key (salt)");
        for cut in 0..v.len() {
            assert_eq!(k.open(&key, &v[..cut]), None, "truncated to {cut}");
        }
    }

    #[test]
    fn sessions_round_trip() {
        let live = |version, t: &[u32]| {
            Some(SessionFrame {
                version,
                tokens: Some(t.to_vec()),
            })
        };
        let p = encode_session("a", 7, Some(&[1, 2, 3]));
        assert_eq!(decode_session("a", &p), live(7, &[1, 2, 3]));
        assert_eq!(decode_session("b", &p), None);
        assert_eq!(decode_session("a", &p[..p.len() - 1]), None);
        let gone = encode_session("a", 9, None);
        assert_eq!(
            decode_session("a", &gone),
            Some(SessionFrame {
                version: 9,
                tokens: None
            })
        );
        // A tombstone with tokens, or a state other than 0 or 1, is no frame.
        let mut bad = encode_session("a", 9, Some(&[1]));
        bad[12] = 0;
        assert_eq!(decode_session("a", &bad), None);
        bad[12] = 2;
        assert_eq!(decode_session("a", &bad), None);
    }

    #[test]
    fn session_frame_bytes() {
        // The contract with other hosts (and other versions) on the server.
        let p = encode_session("ab", 0x0102_0304_0506_0708, Some(&[5, 0x0100]));
        assert_eq!(
            hex(&p),
            "4b565356080706050403020101020000006162020000000500000000010000"
        );
        assert_eq!(
            hex(&encode_session("ab", 1, None)),
            "4b56535601000000000000000002000000616200000000"
        );
        // The older format, as binaries before versions wrote it: version 0.
        let old = [
            b"KVSS".as_slice(),
            &[2, 0, 0, 0],
            b"ab",
            &[2, 0, 0, 0],
            &[5, 0, 0, 0],
            &[0, 1, 0, 0],
        ]
        .concat();
        assert_eq!(
            decode_session("ab", &old),
            Some(SessionFrame {
                version: 0,
                tokens: Some(vec![5, 0x0100])
            })
        );
        assert_eq!(decode_session("ab", &old[..old.len() - 1]), None);
        assert_eq!(decode_session("ac", &old), None);
        // The version alone, as the conditional upload compares it: from the
        // head (unchecked), and from the whole frame (any name; checked).
        assert_eq!(
            session_head_version(&p[..SESSION_HEAD]),
            Some(0x0102_0304_0506_0708)
        );
        assert_eq!(session_head_version(&old[..SESSION_HEAD]), Some(0));
        assert_eq!(session_head_version(&p[..11]), None);
        assert_eq!(session_head_version(b"KVSX\x01\0\0\0\0\0\0\0"), None);
        assert_eq!(session_version(&p), Some(0x0102_0304_0506_0708));
        assert_eq!(session_version(&encode_session("ab", 1, None)), Some(1));
        assert_eq!(session_version(&old), Some(0));
        // A head that names a version over a body that is no frame: none.
        assert_eq!(session_version(&p[..p.len() - 1]), None);
        assert_eq!(session_version(&p[..SESSION_HEAD]), None);
    }
}
