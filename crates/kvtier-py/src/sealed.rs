//! The checks a stored value passes before its payload is served, for every store: the layout
//! is `kvtier.stores.format`'s (magic, format version, header length, payload length, namespace
//! digest, four length-prefixed texts, payload, CRC-64/NVME of everything before it).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyMemoryView, PySlice};

use crate::arrays::Bytes;
use crate::checksum::Checksum;

pub(crate) const MAGIC: &[u8; 4] = b"KVTR";
/// 2: the checksum became CRC-64/NVME (1: xxh3-64); a value of another version is a miss.
pub(crate) const FORMAT_VERSION: u16 = 2;
/// Magic, version, header length, payload length, namespace digest.
pub(crate) const FIXED: usize = 24;
/// The trailing checksum.
pub(crate) const SUM: usize = 8;
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
/// `hashed` is the checksum of all but the last 8 bytes when the reader computed it while
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
        let got = hashed.unwrap_or_else(|| Checksum::of(&value[..n - SUM]));
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

/// The payload of a stored value (a `bytes` or any contiguous buffer) as a read-only
/// memoryview, after every check of `format.unseal`, the checksum computed here without the
/// GIL (`verify = false` skips only it); raises `PayloadError` naming the check that failed.
#[pyfunction]
#[pyo3(signature = (value, digest, texts, *, verify = true))]
pub fn unseal<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    digest: u64,
    texts: &[u8],
    verify: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let bytes = Bytes::of(value).ok_or_else(|| {
        crate::errors::to_py(kvtier::Error::InvalidArgument {
            what: "value",
            reason: format!(
                "expected bytes or a contiguous buffer, got {}",
                value
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ),
        })
    })?;
    let want = Expected {
        digest,
        texts: &[texts],
    };
    let sealed = bytes.as_slice();
    let (start, stop) = py
        .detach(|| check(sealed, None, &want, verify))
        .map_err(|reason| payload_error(py, reason))?;
    let (readonly, bytewise) = match &bytes {
        Bytes::Bytes(_) => (true, true),
        Bytes::Buffer(b) => (b.readonly(), b.dimensions() == 1 && b.format() == c"B"),
    };
    read_only_span(value, start, stop, bytewise, readonly)
}

/// Bytes `start..stop` of `value`'s buffer as a read-only memoryview (`bytewise`: its buffer
/// is already 1-D bytes; `readonly`: it is already read-only).
pub(crate) fn read_only_span<'py>(
    value: &Bound<'py, PyAny>,
    start: usize,
    stop: usize,
    bytewise: bool,
    readonly: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    let mut view = PyMemoryView::from(value)?.into_any();
    if !bytewise {
        view = view.call_method1(intern!(py, "cast"), ("B",))?; // slices count bytes
    }
    // Spans within one allocation, so within isize.
    let view = view.get_item(PySlice::new(py, start as isize, stop as isize, 1))?;
    if readonly {
        Ok(view)
    } else {
        view.call_method0(intern!(py, "toreadonly"))
    }
}
