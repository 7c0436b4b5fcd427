//! The checks a stored value passes before its payload is served, for every store: the layout
//! is `kvtier.stores.format`'s (magic, format version, header length, payload length, namespace
//! digest, four length-prefixed texts, payload, xxh3-64 of everything before it).

use std::hash::Hasher as _;

use pyo3::prelude::*;
use twox_hash::XxHash3_64;

const MAGIC: &[u8] = b"KVTR";
const FORMAT_VERSION: u16 = 1;
/// Magic, version, header length, payload length, namespace digest.
const FIXED: usize = 24;
/// The trailing checksum.
const SUM: usize = 8;
const TEXTS: [&str; 4] = ["key", "codec", "dtype", "shape"];

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(word)
}

/// What a value must match: the namespace digest and the header texts (key, codec, dtype,
/// shape, each a u16 length and UTF-8), as `format.header` writes them, given as pieces that
/// join into them (so a caller holding the key and the namespace's texts apart need not join
/// them).
pub(crate) struct Expected<'a> {
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

/// The payload's byte range in `value` once every check passed, else which check failed.
/// `hashed` is the xxh3-64 of all but the last 8 bytes when the reader computed it while
/// reading; `verify = false` skips only the checksum (values that never left this process).
pub(crate) fn check(
    value: &[u8],
    hashed: Option<u64>,
    want: &Expected<'_>,
    verify: bool,
) -> Result<(usize, usize), String> {
    let n = value.len();
    if n < FIXED + SUM {
        return Err(format!("{n} bytes: shorter than any header"));
    }
    if &value[..4] != MAGIC {
        return Err(format!(
            "magic {:?} is not \"KVTR\": not a kvtier value",
            String::from_utf8_lossy(&value[..4])
        ));
    }
    let version = u16_at(value, 4);
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version}, this kvtier reads {FORMAT_VERSION}"
        ));
    }
    let (size, length) = (usize::from(u16_at(value, 6)), u64_at(value, 8));
    if (size as u64)
        .checked_add(length)
        .and_then(|s| s.checked_add(SUM as u64))
        != Some(n as u64)
    {
        return Err(format!(
            "{n} bytes, the header says {size} + {length} + {SUM}: truncated or padded"
        ));
    }
    if u64_at(value, 16) != want.digest {
        return Err("written under another namespace (model, tenant, codec or shape)".into());
    }
    if size < FIXED {
        return Err("header length does not match its texts".into());
    }
    let texts = &value[FIXED..size];
    if !want.texts_are(texts) {
        return Err(explain_texts(texts, &want.texts.concat()));
    }
    if verify {
        let stored = u64_at(value, n - SUM);
        let got = hashed.unwrap_or_else(|| {
            let mut h = XxHash3_64::with_seed(0);
            h.write(&value[..n - SUM]);
            h.finish()
        });
        if got != stored {
            return Err("checksum mismatch: the value is corrupt".into());
        }
    }
    Ok((size, n - SUM))
}

/// The four texts of a header, or why they cannot be read.
fn parse_texts(mut b: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut texts = Vec::with_capacity(TEXTS.len());
    for _ in TEXTS {
        if b.len() < 2 {
            return Err("header texts run past the header".into());
        }
        let len = usize::from(u16_at(b, 0));
        if b.len() < 2 + len {
            return Err("header texts run past the header".into());
        }
        texts.push(&b[2..2 + len]);
        b = &b[2 + len..];
    }
    if !b.is_empty() {
        return Err("header length does not match its texts".into());
    }
    Ok(texts)
}

/// Which header text differs from the expected one (the texts differ somewhere).
fn explain_texts(got: &[u8], want: &[u8]) -> String {
    let (got, want) = match (parse_texts(got), parse_texts(want)) {
        (Ok(g), Ok(w)) => (g, w),
        (Err(e), _) | (_, Err(e)) => return e,
    };
    for ((name, g), w) in TEXTS.iter().zip(got).zip(want) {
        if g != w {
            return format!(
                "written as {name} {:?}, read as {:?}",
                String::from_utf8_lossy(g),
                String::from_utf8_lossy(w)
            );
        }
    }
    "header texts differ".into()
}

/// `kvtier.errors.PayloadError(reason)`, to raise or to hand back in a batch's results.
pub(crate) fn payload_error(py: Python<'_>, reason: String) -> PyErr {
    match py
        .import("kvtier.errors")
        .and_then(|m| m.getattr("PayloadError"))
        .and_then(|class| class.call1((reason,)))
    {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// The payload's `(start, stop)` in a stored value (a uint8 array) after every check of
/// `format.unseal`: raises `PayloadError` naming the check that failed. `received` is the
/// checksum of all but the last 8 bytes when the reader already computed it.
#[pyfunction]
#[pyo3(signature = (value, digest, texts, *, received = None, verify = true))]
pub fn unseal_span(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    digest: u64,
    texts: &[u8],
    received: Option<u64>,
    verify: bool,
) -> PyResult<(usize, usize)> {
    let value = crate::arrays::bytes_array(value, "value")?;
    let bytes = value.as_slice()?;
    let want = Expected {
        digest,
        texts: &[texts],
    };
    py.detach(|| check(bytes, received, &want, verify))
        .map_err(|reason| payload_error(py, reason))
}
