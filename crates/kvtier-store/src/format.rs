//! The sealed value format, defined here once: every store (host memory, files, Redis) keeps a
//! value as a small versioned header, the payload and a checksum, and checks all of it before a
//! payload is served. `kvtier.stores.format` (Python) seals values for the stores that live in
//! Python (Redis) with this module's header encoder and constants, through the bindings.
//!
//! Layout of a value (integers little-endian):
//!
//! ```text
//! magic    4 bytes  b"KVTR"                                   MAGIC
//! version  u16      FORMAT_VERSION
//! hdrlen   u16      bytes of the header, magic included
//! length   u64      bytes of the payload
//! ns       u64      digest of the namespace (model, tenant, codec, dtype, shape; format version)
//!          -------  FIXED_BYTES so far
//! key, codec, dtype, shape   each a u16 length (TEXT_LEN_BYTES) and UTF-8 text
//! payload
//! checksum u64      CRC-64/NVME of everything before it (CHECKSUM_BYTES; 0 in the host
//!                   store, whose values never leave the process and are never verified)
//! ```
//!
//! The header names the key it was written under, so a value copied or renamed to another key
//! is a miss too. [`check`] refuses a value from another namespace, codec, shape or format
//! version, a truncated or padded one, or one with a flipped bit ([`Refusal`] says which).
//!
//! Version 2 checksums with CRC-64/NVME, version 1 did with xxh3-64: a change to the layout or
//! the checksum changes [`FORMAT_VERSION`]. The namespace digest covers the version (Python's
//! `Namespace.digest`), so values of another version live under other keys and are never read;
//! one found under this version's key anyway is refused for its version.

use std::ops::Range;

use crate::checksum::Checksum;
use crate::error::{Error, Refusal, Result};

pub const MAGIC: &[u8; 4] = b"KVTR";
/// 2: the checksum became CRC-64/NVME (1: xxh3-64); a value of another version is a miss.
pub const FORMAT_VERSION: u16 = 2;
/// Magic, version, header length, payload length, namespace digest.
pub const FIXED_BYTES: usize = 24;
/// The length before each header text.
pub const TEXT_LEN_BYTES: usize = 2;
/// The trailing checksum.
pub const CHECKSUM_BYTES: usize = 8;
/// The header texts, in order.
pub const TEXTS: [&str; 4] = ["key", "codec", "dtype", "shape"];
/// Bytes a value adds to its payload beyond the texts of its header.
pub const OVERHEAD: usize = FIXED_BYTES + TEXTS.len() * TEXT_LEN_BYTES + CHECKSUM_BYTES;

const VERSION_AT: usize = 4;
const HEADER_LEN_AT: usize = 6;
const PAYLOAD_LEN_AT: usize = 8;
const DIGEST_AT: usize = 16;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Appends `text` with its length before it, as a header stores it (`what` names it in the
/// error for a text longer than 65535 bytes).
pub fn pack_text(out: &mut Vec<u8>, what: &'static str, text: &[u8]) -> Result<()> {
    let len = u16::try_from(text.len()).map_err(|_| Error::TextTooLong {
        what,
        len: text.len(),
    })?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(text);
    Ok(())
}

/// `texts`, each with its length before it: a namespace's header texts after the key (codec,
/// dtype, shape), or any run of header texts.
pub fn pack_texts(texts: &[&str]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(texts.iter().map(|t| TEXT_LEN_BYTES + t.len()).sum());
    for text in texts {
        pack_text(&mut out, "text", text.as_bytes())?;
    }
    Ok(out)
}

/// Appends the header of a value of `length` payload bytes stored under `key` in the namespace
/// `digest`, whose packed texts after the key are `texts` ([`pack_texts`] of codec, dtype,
/// shape). Nothing is appended when the key or the header is too long for its length field.
pub fn write_header(
    out: &mut Vec<u8>,
    digest: u64,
    key: &[u8],
    texts: &[u8],
    length: u64,
) -> Result<()> {
    let size = FIXED_BYTES + TEXT_LEN_BYTES + key.len() + texts.len();
    let header_len = u16::try_from(size).map_err(|_| Error::HeaderTooLong { len: size })?;
    // Within the header's 65535 bytes, so the key's u16 length cannot overflow either.
    let key_len = key.len() as u16;
    out.reserve(size);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(&digest.to_le_bytes());
    out.extend_from_slice(&key_len.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(texts);
    Ok(())
}

/// What one namespace writes into a value's header and checks on reading it: its digest and its
/// packed texts after the key (codec, dtype, shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSpec {
    pub digest: u64,
    pub texts: Vec<u8>,
}

impl HeaderSpec {
    pub fn new(digest: u64, texts: Vec<u8>) -> Self {
        HeaderSpec { digest, texts }
    }

    /// The length of the header of a value stored under `key`.
    pub fn header_len(&self, key: &str) -> usize {
        FIXED_BYTES + TEXT_LEN_BYTES + key.len() + self.texts.len()
    }

    /// The length of a value of `payload` bytes sealed under `key`.
    pub fn sealed_len(&self, key: &str, payload: usize) -> usize {
        self.header_len(key) + payload + CHECKSUM_BYTES
    }

    /// Appends the header of a value of `length` payload bytes stored under `key`.
    pub fn write_header(&self, out: &mut Vec<u8>, key: &str, length: u64) -> Result<()> {
        write_header(out, self.digest, key.as_bytes(), &self.texts, length)
    }

    /// `payload` sealed under `key` with a zero checksum field: a value that never leaves this
    /// process, whose checksum is never verified (the host store's). One copy of the payload.
    pub fn seal_unchecked(&self, key: &str, payload: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.sealed_len(key, payload.len()));
        self.write_header(&mut out, key, payload.len() as u64)?;
        out.extend_from_slice(payload);
        out.extend_from_slice(&[0; CHECKSUM_BYTES]);
        Ok(out)
    }

    /// [`Self::seal_unchecked`] into the first [`Self::sealed_len`] bytes of `out` (memory the
    /// caller owns, say pinned); returns that length.
    pub fn seal_unchecked_into(&self, key: &str, payload: &[u8], out: &mut [u8]) -> Result<usize> {
        let size = self.sealed_len(key, payload.len());
        let mut head = Vec::with_capacity(self.header_len(key));
        self.write_header(&mut head, key, payload.len() as u64)?;
        let len = out.len();
        let out = out
            .get_mut(..size)
            .ok_or(Error::ShortBuffer { len, need: size })?;
        let (start, body) = out.split_at_mut(head.len());
        start.copy_from_slice(&head);
        let (body, sum) = body.split_at_mut(payload.len());
        body.copy_from_slice(payload);
        sum.fill(0);
        Ok(size)
    }

    /// `payload` sealed under `key`, checksummed: the bytes a file or a remote store holds.
    pub fn seal(&self, key: &str, payload: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.sealed_len(key, payload.len()));
        self.write_header(&mut out, key, payload.len() as u64)?;
        out.extend_from_slice(payload);
        let sum = Checksum::of(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// The payload's range in `sealed`, a value read under `key`, once every check passes
    /// (`verify = false` skips only the checksum); else why not.
    pub fn check(&self, key: &str, sealed: &[u8], verify: bool) -> Result<Range<usize>, Refusal> {
        // The key as the header packs it; a key too long to pack never matches.
        let key_len = u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes();
        let want = Expected {
            digest: self.digest,
            texts: &[&key_len, key.as_bytes(), &self.texts],
        };
        check(sealed, None, &want, verify)
    }
}

/// What a value must match: the namespace digest and the header texts (key, codec, dtype,
/// shape, each packed), given as pieces that join into them (so a caller holding the key and
/// the namespace's texts apart need not join them).
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    pub digest: u64,
    pub texts: &'a [&'a [u8]],
}

impl Expected<'_> {
    /// Whether `got` is the expected texts, piece by piece.
    fn texts_are(&self, mut got: &[u8]) -> bool {
        for piece in self.texts {
            match got.split_at_checked(piece.len()) {
                Some((head, rest)) if head == *piece => got = rest,
                _ => return false,
            }
        }
        got.is_empty()
    }
}

/// The payload's byte range in `value` once every check passes, else which check failed.
/// `hashed` is the checksum of all but the last 8 bytes when the reader computed it while
/// reading; `verify = false` skips only the checksum (values that never left this process).
pub fn check(
    value: &[u8],
    hashed: Option<u64>,
    want: &Expected<'_>,
    verify: bool,
) -> Result<Range<usize>, Refusal> {
    let n = value.len();
    if n < FIXED_BYTES + CHECKSUM_BYTES {
        return Err(Refusal::TooShort { len: n });
    }
    if &value[..MAGIC.len()] != MAGIC {
        return Err(Refusal::NotKvtier {
            magic: String::from_utf8_lossy(&value[..MAGIC.len()]).into_owned(),
        });
    }
    let version = u16_at(value, VERSION_AT);
    if version != FORMAT_VERSION {
        return Err(Refusal::Version { version });
    }
    let size = usize::from(u16_at(value, HEADER_LEN_AT));
    let length = u64_at(value, PAYLOAD_LEN_AT);
    if (size as u64)
        .checked_add(length)
        .and_then(|s| s.checked_add(CHECKSUM_BYTES as u64))
        != Some(n as u64)
    {
        return Err(Refusal::Length {
            len: n,
            header: size,
            payload: length,
        });
    }
    if u64_at(value, DIGEST_AT) != want.digest {
        return Err(Refusal::Namespace);
    }
    if size < FIXED_BYTES {
        return Err(Refusal::HeaderLength);
    }
    let texts = &value[FIXED_BYTES..size];
    if !want.texts_are(texts) {
        return Err(explain_texts(texts, &want.texts.concat()));
    }
    if verify {
        let stored = u64_at(value, n - CHECKSUM_BYTES);
        let got = hashed.unwrap_or_else(|| Checksum::of(&value[..n - CHECKSUM_BYTES]));
        if got != stored {
            return Err(Refusal::Checksum);
        }
    }
    Ok(size..n - CHECKSUM_BYTES)
}

/// The four texts of a header, or why they cannot be read.
fn parse_texts(mut b: &[u8]) -> Result<Vec<&[u8]>, Refusal> {
    let mut texts = Vec::with_capacity(TEXTS.len());
    for _ in TEXTS {
        if b.len() < TEXT_LEN_BYTES {
            return Err(Refusal::TextsOverrun);
        }
        let len = usize::from(u16_at(b, 0));
        let (text, rest) = b[TEXT_LEN_BYTES..]
            .split_at_checked(len)
            .ok_or(Refusal::TextsOverrun)?;
        texts.push(text);
        b = rest;
    }
    if !b.is_empty() {
        return Err(Refusal::HeaderLength);
    }
    Ok(texts)
}

/// Which header text differs from the expected one (the texts differ somewhere).
fn explain_texts(got: &[u8], want: &[u8]) -> Refusal {
    let (got, want) = match (parse_texts(got), parse_texts(want)) {
        (Ok(g), Ok(w)) => (g, w),
        (Err(e), _) | (_, Err(e)) => return e,
    };
    for ((name, g), w) in TEXTS.iter().zip(got).zip(want) {
        if g != w {
            return Refusal::Text {
                name,
                written: String::from_utf8_lossy(g).into_owned(),
                read: String::from_utf8_lossy(w).into_owned(),
            };
        }
    }
    Refusal::Texts
}

/// The key a value says it was written under, or None when its header is unreadable (too
/// short, not a kvtier value, or a key that runs past the header). Bytes that are not UTF-8
/// read as U+FFFD.
pub fn read_key(value: &[u8]) -> Option<String> {
    let start = FIXED_BYTES + TEXT_LEN_BYTES;
    if value.len() < start || &value[..MAGIC.len()] != MAGIC {
        return None;
    }
    let size = usize::from(u16_at(value, HEADER_LEN_AT));
    let n = usize::from(u16_at(value, FIXED_BYTES));
    if start + n > size.min(value.len()) {
        return None;
    }
    Some(String::from_utf8_lossy(&value[start..start + n]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_adds_up() {
        assert_eq!(FIXED_BYTES, MAGIC.len() + 2 + 2 + 8 + 8);
        assert_eq!(DIGEST_AT + 8, FIXED_BYTES);
        assert_eq!(OVERHEAD, 40);
    }

    #[test]
    fn a_header_too_long_for_its_length_field_is_refused_and_nothing_is_written() {
        let mut out = Vec::new();
        let key = vec![b'k'; 70_000];
        assert_eq!(
            write_header(&mut out, 1, &key, b"", 0),
            Err(Error::HeaderTooLong {
                len: FIXED_BYTES + TEXT_LEN_BYTES + 70_000
            })
        );
        assert!(out.is_empty());
        let long = "x".repeat(65_536);
        assert!(matches!(
            pack_texts(&[&long]),
            Err(Error::TextTooLong { len: 65_536, .. })
        ));
    }
}
