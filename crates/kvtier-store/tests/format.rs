//! The sealed value format against a value the old encoder wrote (fixtures/sealed-v2.txt) and
//! against every kind of damage: what `kvtier.stores.format`'s tests check, without Python.

use kvtier_store::checksum::{digest, Checksum};
use kvtier_store::format::{
    self, check, pack_texts, read_key, Expected, HeaderSpec, CHECKSUM_BYTES, FIXED_BYTES,
    FORMAT_VERSION, MAGIC, OVERHEAD,
};
use kvtier_store::{Error, Refusal};

/// fixtures/sealed-v2.txt: a value kvtier sealed before the format moved into this crate.
struct Fixture {
    digest: u64,
    key: String,
    texts: Vec<u8>,
    payload: Vec<u8>,
    sealed: Vec<u8>,
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

fn fixture() -> Fixture {
    let text = include_str!("fixtures/sealed-v2.txt");
    let (mut digest, mut key) = (None, None);
    let mut sections: Vec<(&str, Vec<u8>)> = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        if let Some(name) = line.strip_prefix('[') {
            sections.push((name.trim_end_matches(']'), Vec::new()));
        } else if let Some((_, bytes)) = sections.last_mut() {
            bytes.extend(hex(line));
        } else if let Some(d) = line.strip_prefix("digest 0x") {
            digest = Some(u64::from_str_radix(d, 16).expect("digest"));
        } else if let Some(k) = line.strip_prefix("key ") {
            key = Some(k.to_owned());
        }
    }
    let section = |name: &str| {
        let found = sections.iter().find(|(n, _)| *n == name);
        found.expect("section").1.clone()
    };
    Fixture {
        digest: digest.expect("digest line"),
        key: key.expect("key line"),
        texts: section("texts"),
        payload: section("payload"),
        sealed: section("sealed"),
    }
}

const SHAPE: &str = "BlockShape(layers=2, heads=4, head_dim=64, tokens=16)";

#[test]
fn a_value_the_old_encoder_wrote_reads_back_and_seals_to_the_same_bytes() {
    let old = fixture();
    // The namespace digest and texts as `Namespace` derives them.
    let fields = ["fixture-model", "tenant-a", "int4", "float16", SHAPE];
    let version = format!("format {FORMAT_VERSION}");
    let name = [&["kvtier-namespace", version.as_str()][..], &fields[..]]
        .concat()
        .join("\0");
    assert_eq!(digest(&[name.as_bytes()], 0), old.digest);
    assert_eq!(pack_texts(&fields[2..]).unwrap(), old.texts);
    assert_eq!(
        old.key,
        format!("kvtier:{:016x}:0123456789abcdef", old.digest)
    );

    let spec = HeaderSpec::new(old.digest, old.texts.clone());
    let span = spec.check(&old.key, &old.sealed, true).unwrap();
    assert_eq!(&old.sealed[span], &old.payload[..]);
    assert_eq!(spec.seal(&old.key, &old.payload).unwrap(), old.sealed);
    assert_eq!(read_key(&old.sealed).as_deref(), Some(old.key.as_str()));
    assert_eq!(
        old.sealed.len(),
        spec.sealed_len(&old.key, old.payload.len())
    );
    assert_eq!(
        old.sealed.len(),
        old.payload.len() + OVERHEAD + old.key.len() + old.texts.len() - 3 * 2
    );

    // The host store's seal: the same bytes with a zero checksum field, checked but never
    // verified.
    let mut unchecked = old.sealed.clone();
    let n = unchecked.len();
    unchecked[n - CHECKSUM_BYTES..].fill(0);
    assert_eq!(
        spec.seal_unchecked(&old.key, &old.payload).unwrap(),
        unchecked
    );
    let mut into = vec![0xAA; n + 5];
    assert_eq!(
        spec.seal_unchecked_into(&old.key, &old.payload, &mut into),
        Ok(n)
    );
    assert_eq!(&into[..n], &unchecked[..]);
    assert!(spec.check(&old.key, &unchecked, false).is_ok());
    assert_eq!(
        spec.check(&old.key, &unchecked, true),
        Err(Refusal::Checksum)
    );
    assert_eq!(
        spec.seal_unchecked_into(&old.key, &old.payload, &mut into[..n - 1]),
        Err(Error::ShortBuffer {
            len: n - 1,
            need: n
        })
    );
}

#[test]
fn the_header_is_the_documented_layout() {
    let spec = HeaderSpec::new(
        0x1122_3344_5566_7788,
        pack_texts(&["raw", "uint8", ""]).unwrap(),
    );
    let mut head = Vec::new();
    spec.write_header(&mut head, "kvtier:k:x", 5).unwrap();
    assert_eq!(&head[..4], MAGIC);
    assert_eq!(head[4..6], FORMAT_VERSION.to_le_bytes());
    assert_eq!(head[6..8], (head.len() as u16).to_le_bytes());
    assert_eq!(head[8..16], 5u64.to_le_bytes());
    assert_eq!(head[16..24], 0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(
        &head[FIXED_BYTES..],
        b"\x0a\x00kvtier:k:x\x03\x00raw\x05\x00uint8\x00\x00"
    );
    assert_eq!(head.len(), spec.header_len("kvtier:k:x"));
}

fn spec() -> HeaderSpec {
    HeaderSpec::new(
        7,
        pack_texts(&["int4", "float16", "L30xH3xB16xD64"]).unwrap(),
    )
}

fn sealed() -> Vec<u8> {
    spec()
        .seal("kvtier:0000000000000007:5", &b"payload".repeat(100))
        .unwrap()
}

fn refusal(value: &[u8], spec: &HeaderSpec, key: &str) -> String {
    spec.check(key, value, true).unwrap_err().to_string()
}

#[test]
fn foreign_or_damaged_values_are_refused_saying_why() {
    let key = "kvtier:0000000000000007:5";
    let good = sealed();
    let n = good.len();
    let cases: Vec<(Vec<u8>, HeaderSpec, &str, &str)> =
        vec![
        (good[..n - 1].to_vec(), spec(), key, "truncated or padded"),
        ([&good[..], b"\0"].concat(), spec(), key, "truncated or padded"),
        (good[..10].to_vec(), spec(), key, "10 bytes: shorter than any header"),
        (
            b"NOTKVTIER".repeat(10),
            spec(),
            key,
            "magic \"NOTK\" is not \"KVTR\": not a kvtier value",
        ),
        (
            good.clone(),
            HeaderSpec::new(8, spec().texts),
            key,
            "written under another namespace (model, tenant, codec or shape)",
        ),
        (
            good.clone(),
            HeaderSpec::new(7, pack_texts(&["int8", "float16", "L30xH3xB16xD64"]).unwrap()),
            key,
            "written as codec \"int4\", read as \"int8\"",
        ),
        (
            good.clone(),
            spec(),
            "kvtier:0000000000000007:6",
            "written as key \"kvtier:0000000000000007:5\", read as \"kvtier:0000000000000007:6\"",
        ),
    ];
    for (value, reader, key, message) in cases {
        let got = refusal(&value, &reader, key);
        assert!(got.contains(message), "{got:?} does not say {message:?}");
    }
    assert_eq!(
        refusal(&good[..n - 1], &spec(), key),
        format!(
            "{} bytes, the header says {} + 700 + 8: truncated or padded",
            n - 1,
            n - 708
        )
    );
}

#[test]
fn another_format_version_is_refused_for_its_version() {
    let mut value = sealed();
    value[4..6].copy_from_slice(&1u16.to_le_bytes());
    let n = value.len();
    let sum = Checksum::of(&value[..n - 8]);
    value[n - 8..].copy_from_slice(&sum.to_le_bytes());
    assert_eq!(
        refusal(&value, &spec(), "kvtier:0000000000000007:5"),
        "format version 1, this kvtier reads 2"
    );
}

#[test]
fn every_flipped_bit_is_caught() {
    let key = "kvtier:0000000000000007:5";
    let good = spec().seal(key, b"a small payload").unwrap();
    for bit in 0..good.len() * 8 {
        let mut bad = good.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        assert!(
            spec().check(key, &bad, true).is_err(),
            "bit {bit} flipped was not caught"
        );
    }
}

#[test]
fn a_checksum_computed_while_reading_is_the_one_checked() {
    let key = "kvtier:0000000000000007:5";
    let good = sealed();
    let n = good.len();
    let texts = [
        &(key.len() as u16).to_le_bytes()[..],
        key.as_bytes(),
        &spec().texts,
    ]
    .concat();
    let want = Expected {
        digest: 7,
        texts: &[&texts],
    };
    let hashed = Checksum::of(&good[..n - 8]);
    assert!(check(&good, Some(hashed), &want, true).is_ok());
    assert_eq!(
        check(&good, Some(hashed ^ 1), &want, true),
        Err(Refusal::Checksum)
    );
}

#[test]
fn a_key_is_read_from_a_header_only_when_it_is_there() {
    let good = sealed();
    assert_eq!(
        read_key(&good).as_deref(),
        Some("kvtier:0000000000000007:5")
    );
    assert_eq!(read_key(&good[..FIXED_BYTES + 2 + 5]), None); // the key runs past the bytes
    assert_eq!(read_key(&good[..FIXED_BYTES]), None);
    assert_eq!(read_key(b"NOTKVTIER NOTKVTIER NOTKVTIER"), None);
}

#[test]
fn a_header_that_cannot_be_written_is_refused() {
    let spec = spec();
    let key = "k".repeat(70_000);
    assert!(matches!(
        spec.seal(&key, b""),
        Err(Error::HeaderTooLong { .. })
    ));
    let mut out = Vec::new();
    assert!(format::write_header(&mut out, 0, key.as_bytes(), b"", 0).is_err());
    assert!(out.is_empty());
}
